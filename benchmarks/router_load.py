"""Router load test: many concurrent streaming requests through ``kvpool router`` to
stand-in engines (tests/router/fake_engine.py), beside the same requests sent straight to
the engines; the difference is the latency the router adds.  Its peer: the same requests
through the least an aiohttp proxy does (``benchmarks/bare_proxy.py``, same library and event
loop); each proxy's CPU time per request is read from /proc over its burst.

    .venv/bin/python -m benchmarks.router_load [--requests 1000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from typing import Any

import aiohttp


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _fire(urls: list[str], num_requests: int, chunks: int) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    first_byte: list[float] = []
    total: list[float] = []
    errors: list[str] = []

    async def one(i: int, session: aiohttp.ClientSession) -> None:
        url = urls[i % len(urls)] + "/v1/completions"
        body = {"model": "m", "prompt": f"request {i}", "max_tokens": chunks, "stream": True}
        start = time.perf_counter()
        try:
            async with session.post(url, json=body) as response:
                if response.status != 200:
                    errors.append(f"status {response.status}")
                    return
                seen = b""
                got_first = False
                async for chunk in response.content.iter_any():
                    if not got_first:
                        first_byte.append(time.perf_counter() - start)
                        got_first = True
                    seen += chunk
                if seen.count(b"data: ") != chunks + 1 or not seen.rstrip().endswith(b"[DONE]"):
                    errors.append("incomplete stream")
                    return
                total.append(time.perf_counter() - start)
        except (aiohttp.ClientError, TimeoutError) as exc:
            errors.append(type(exc).__name__)

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        await asyncio.gather(*(one(i, session) for i in range(num_requests)))
        wall = time.perf_counter() - started
    return {
        "requests": num_requests,
        "completed": len(total),
        "errors": len(errors),
        "error_kinds": sorted(set(errors)),
        "wall_s": round(wall, 3),
        "first_byte_p50_ms": round(1e3 * _percentile(first_byte, 0.5), 2) if first_byte else None,
        "first_byte_p99_ms": round(1e3 * _percentile(first_byte, 0.99), 2) if first_byte else None,
        "total_p50_ms": round(1e3 * statistics.median(total), 2) if total else None,
    }


async def _sequential(urls: list[str], num_requests: int, chunks: int) -> dict[str, float]:
    """One request at a time: the router's own cost, without queueing."""
    times = []
    async with aiohttp.ClientSession() as session:
        for i in range(num_requests):
            body = {"model": "m", "prompt": f"q {i}", "max_tokens": chunks, "stream": True}
            start = time.perf_counter()
            async with session.post(urls[i % len(urls)] + "/v1/completions", json=body) as response:
                await response.content.readany()
                times.append(time.perf_counter() - start)
                await response.read()
    return {
        "p50": round(1e3 * _percentile(times, 0.5), 3),
        "p99": round(1e3 * _percentile(times, 0.99), 3),
    }


def _cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _burst(pid: int, url: str, num_requests: int, chunks: int) -> dict[str, Any]:
    """``num_requests`` at once through the proxy at ``url`` (process ``pid``), with the
    proxy's CPU time per request."""
    asyncio.run(_fire([url], 50, chunks))  # warm up connections
    before = _cpu_s(pid)
    result = asyncio.run(_fire([url], num_requests, chunks))
    result["proxy_cpu_us_per_request"] = round(1e6 * (_cpu_s(pid) - before) / num_requests, 1)
    return result


def _added(direct: dict[str, Any], routed: dict[str, Any]) -> dict[str, float]:
    added = {}
    for q in ("p50", "p99"):
        if direct[f"first_byte_{q}_ms"] is not None and routed[f"first_byte_{q}_ms"] is not None:
            added[q] = round(routed[f"first_byte_{q}_ms"] - direct[f"first_byte_{q}_ms"], 2)
    return added


def run(
    num_requests: int = 1000,
    num_engines: int = 2,
    chunks: int = 8,
    delay: float = 0.01,
    num_quiet: int = 200,
) -> dict[str, Any]:
    """``num_quiet``: the requests sent one at a time, each way, after the burst (each
    takes its whole stream: ``chunks`` chunks ``delay`` apart)."""
    from tests.cluster.fabric import free_port
    from tests.router.servers import FakeEngine, Proc, RouterProc

    engines = [FakeEngine(name=f"e{i}") for i in range(num_engines)]
    urls = [e.url for e in engines]
    router = bare = None
    try:
        for engine in engines:
            engine.configure(chunks=chunks, delay=delay)
        router = RouterProc(urls, "--policy", "round_robin", "--log-level", "warning")
        port = free_port()
        bare = Proc(
            [sys.executable, "-m", "benchmarks.bare_proxy", "--port", str(port)]
            + [arg for url in urls for arg in ("--engine", url)],
            "BARE_PROXY_READY",
        )
        bare_url = f"http://127.0.0.1:{port}"
        asyncio.run(_fire(urls, 50, chunks))
        direct = asyncio.run(_fire(urls, num_requests, chunks))
        routed = _burst(router.proc.pid, router.url, num_requests, chunks)
        peer = _burst(bare.proc.pid, bare_url, num_requests, chunks)
        quiet_direct = asyncio.run(_sequential(urls, num_quiet, chunks))
        quiet_routed = asyncio.run(_sequential([router.url], num_quiet, chunks))
    finally:
        for proc in (router, bare, *engines):
            if proc is not None:
                proc.stop()
    added = _added(direct, routed)
    peer_added = _added(direct, peer)
    quiet = {
        f"quiet_added_first_byte_{q}_ms": round(quiet_routed[q] - quiet_direct[q], 3)
        for q in ("p50", "p99")
    }
    return {
        "direct": direct,
        "router": routed,
        "bare_proxy": peer,
        **{f"added_first_byte_{q}_ms": v for q, v in added.items()},
        **{f"bare_proxy_added_first_byte_{q}_ms": v for q, v in peer_added.items()},
        "router_cpu_per_request_to_bare": round(
            routed["proxy_cpu_us_per_request"] / peer["proxy_cpu_us_per_request"], 2
        ),
        "quiet_direct": quiet_direct,
        "quiet_router": quiet_routed,
        **quiet,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.requests, args.engines)
    sys.stdout.write((json.dumps(result) if args.json else json.dumps(result, indent=2)) + "\n")


if __name__ == "__main__":
    main()
