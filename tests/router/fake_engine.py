"""A stand-in for a vLLM OpenAI server, for router tests that need no model (the load
test, failure injection).  It answers completions with a configurable number of SSE chunks,
serves /health and vLLM-style /metrics, and records what it received.

    python -m tests.router.fake_engine --port 9000

``POST /_config`` changes its behaviour: ``{"fail": n}`` fails the next n requests with 500,
``{"drop": n}`` drops the next n streams after their headers, before any chunk,
``{"hang": true}`` never answers, ``{"running": r, "waiting": w}`` sets the reported load,
``{"healthy": false}`` fails /health, ``{"health_delay": s}`` answers it s seconds late,
``{"chunks": n, "delay": s}`` shapes the stream.  ``POST /_reset`` restores the defaults and
empties the log (a stand-in shared by several tests is handed to each as new).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from aiohttp import web

DEFAULTS = {
    "fail": 0,
    "drop": 0,
    "hang": False,
    "running": 0.0,
    "waiting": 0.0,
    "healthy": True,
    "health_delay": 0.0,
    "chunks": 5,
    "delay": 0.0,
    "first_delay": 0.0,
    "name": "fake",
}
STATE = dict(DEFAULTS)
LOG: list[dict] = []


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    entry = {
        "path": request.path,
        "body": body,
        "headers": dict(request.headers),
        "at": time.time(),
        "cancelled": False,
        "done": False,
    }
    LOG.append(entry)
    if STATE["hang"]:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            entry["cancelled"] = True
            raise
    if STATE["fail"] > 0:
        STATE["fail"] -= 1
        return web.json_response({"error": "injected"}, status=500)
    if STATE["first_delay"]:
        await asyncio.sleep(STATE["first_delay"])
    text_of = lambda i: f"{STATE['name']}-{i} "  # noqa: E731
    max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or STATE["chunks"])
    chunks = min(STATE["chunks"], max_tokens)
    chat = request.path.endswith("/chat/completions")
    if not body.get("stream"):
        text = "".join(text_of(i) for i in range(chunks))
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text}
        )
        entry["done"] = True
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion" if chat else "text_completion",
                "model": body.get("model", "m"),
                "choices": [choice],
            }
        )
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    if STATE["drop"] > 0:  # dies during prefill: headers went out, no chunk ever will
        STATE["drop"] -= 1
        assert request.transport is not None
        request.transport.close()
        return response
    try:
        for i in range(chunks):
            delta = {"delta": {"content": text_of(i)}} if chat else {"text": text_of(i)}
            await response.write(
                f"data: {json.dumps({'choices': [{'index': 0, **delta}]})}\n\n".encode()
            )
            if STATE["delay"]:
                await asyncio.sleep(STATE["delay"])
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        entry["done"] = True
    except (asyncio.CancelledError, ConnectionResetError):
        entry["cancelled"] = True
        raise
    return response


async def health(request: web.Request) -> web.Response:
    if STATE["health_delay"]:
        await asyncio.sleep(STATE["health_delay"])
    return web.Response(status=200 if STATE["healthy"] else 503, text="ok")


async def metrics(request: web.Request) -> web.Response:
    return web.Response(
        text=(
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {STATE["running"]}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {STATE["waiting"]}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{model_name="m"} 0.1\n'
        )
    )


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})


async def configure(request: web.Request) -> web.Response:
    STATE.update(await request.json())
    return web.json_response(STATE)


async def reset(request: web.Request) -> web.Response:
    STATE.update({**DEFAULTS, "name": STATE["name"]})
    LOG.clear()
    return web.json_response(STATE)


async def log(request: web.Request) -> web.Response:
    return web.json_response(LOG)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="fake")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()
    STATE["name"] = args.name
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/_config", configure)
    app.router.add_post("/_reset", reset)
    app.router.add_get("/_log", log)
    web.run_app(
        app,
        host=args.host,
        port=args.port,
        print=lambda *_: print("FAKE_READY", flush=True),
        handler_cancellation=True,
        backlog=4096,
        access_log=None,
    )


if __name__ == "__main__":
    main()
