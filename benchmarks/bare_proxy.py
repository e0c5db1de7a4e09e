"""The peer of ``benchmarks/router_load.py``: the least an aiohttp proxy does for a streamed
completion (read the body, post it to the next engine in turn, relay each chunk as it
comes), on the same library and event loop as ``kvpool router``, with no routing, checks or
metrics.  What the router costs beyond this is its own.

    .venv/bin/python -m benchmarks.bare_proxy --port PORT --engine URL [--engine URL ...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools

import aiohttp
import uvloop
from aiohttp import web


async def serve(port: int, engines: list[str]) -> None:
    turn = itertools.cycle(engines)
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300)
    )

    async def completions(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {"Content-Type": "application/json"}
        async with session.post(next(turn) + request.path, data=raw, headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
    print("BARE_PROXY_READY", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await session.close()
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--engine", action="append", required=True)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.engine))


if __name__ == "__main__":
    main()
