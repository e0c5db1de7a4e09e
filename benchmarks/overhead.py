"""What the connector costs when there is nothing to gain: engines with and without it,
A/B interleaved, through vLLM's OpenAI server with streaming, time to first token measured
by the client.

    .venv/bin/python -m benchmarks.overhead [--rounds 3] [--requests 16] [--json]

Each round starts a fresh node and draws fresh prompts; the two engines run one after the
other on the same prompts, in alternating order from round to round, one request at a time.
Each request is compared with its twin on the other engine (the same prompt), and the
figures are the median of those differences and their interquartile range:

- ``no_reuse``: every prompt is new (nothing in the engine's cache or the pool);
- ``engine_cached``: every prompt is sent twice in a row and the second is measured (the
  engine's own prefix cache holds it; the pool has nothing to add).

Goal (the issue "the data path at the speed of the hardware"): at most 2% or 2 ms,
whichever is larger, on both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from typing import Any

import aiohttp

from kvpool.harness.process import NodeProcess
from kvpool.harness.tiny_model import build_tiny_model

BLOCK_SIZE = 64
PROMPT_WORDS = 320  # about 1,500 tokens with the tiny model's tokenizer
MAX_TOKENS = 2


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


async def _ttft(session: aiohttp.ClientSession, url: str, model: str, prompt: str) -> float:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            data = line.removeprefix(b"data: ").strip()
            # The first chunk that carries a choice: the first token (whose text may be
            # empty with the tiny model's random vocabulary).
            if data and data != b"[DONE]" and json.loads(data).get("choices"):
                return 1e3 * (time.perf_counter() - start)
    raise RuntimeError("the stream ended before a token")


def _prompts(seed: int, num: int) -> list[str]:
    rng = random.Random(seed)
    words = [f"w{rng.randrange(10_000)}" for _ in range(2_000)]
    return [
        f"Request {seed}-{i}: " + " ".join(rng.choice(words) for _ in range(PROMPT_WORDS))
        for i in range(num)
    ]


async def _measure(url: str, model: str, prompts: list[str], warmup: list[str]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        for prompt in warmup:
            await _ttft(session, url, model, prompt)
        no_reuse = [await _ttft(session, url, model, p) for p in prompts]
        cached = []
        for prompt in prompts:
            await _ttft(session, url, model, "again " + prompt)
            cached.append(await _ttft(session, url, model, "again " + prompt))
    return {"no_reuse": no_reuse, "engine_cached": cached}


def _engine(model: str, kv_config: str | None, env: dict[str, str]) -> Any:
    from tests.integrations.vllm_server import ENGINE_ARGS, VllmServer

    args = list(ENGINE_ARGS)
    args[args.index("--block-size") + 1] = str(BLOCK_SIZE)
    return VllmServer(model, kv_transfer_config=kv_config, env=env, engine_args=args)


def run(rounds: int, num_requests: int, role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    from tests.integrations.vllm_server import connector_config

    model = str(build_tiny_model())
    pairs: dict[str, list[tuple[float, float]]] = {"no_reuse": [], "engine_cached": []}
    for r in range(rounds):
        prompts = _prompts(1000 + r, num_requests)
        warmup = _prompts(2000 + r, 2)
        run_dir = tempfile.mkdtemp(prefix="kvpool-overhead-", dir="/dev/shm")
        with NodeProcess.private(f"overhead-{r}", "1GiB", run_dir=run_dir, ephemeral=True) as node:
            configs = {"without": None, "with": connector_config(node.unix_address, role, **extra)}
            order = ["without", "with"] if r % 2 == 0 else ["with", "without"]
            got: dict[str, dict[str, Any]] = {}
            for name in order:
                server = _engine(model, configs[name], {})
                try:
                    got[name] = asyncio.run(_measure(server.url, model, prompts, warmup))
                finally:
                    server.stop()
        for workload, values in pairs.items():
            values.extend(zip(got["without"][workload], got["with"][workload], strict=True))
    out: dict[str, Any] = {"rounds": rounds, "requests_per_round": num_requests}
    for workload, values in pairs.items():
        without = [a for a, _ in values]
        diffs = [b - a for a, b in values]
        q1, median, q3 = _quartiles(diffs)
        base = statistics.median(without)
        out[workload] = {
            "ttft_ms_without": round(base, 2),
            "ttft_ms_with": round(statistics.median(b for _, b in values), 2),
            "diff_ms_median": round(median, 2),
            "diff_ms_iqr": [round(q1, 2), round(q3, 2)],
            "diff_share": round(median / base, 4),
            "pairs": len(values),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--transfer", choices=("layerwise", "whole"), default="layerwise")
    parser.add_argument(
        "--role", choices=("kv_both", "kv_producer", "kv_consumer"), default="kv_both"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.rounds, args.requests, args.role, transfer=args.transfer)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'workload':15} {'without ms':>11} {'with ms':>9} {'diff ms':>8}  {'IQR':>15}  share")
    for workload in ("no_reuse", "engine_cached"):
        r = result[workload]
        iqr = f"{r['diff_ms_iqr'][0]:+.1f}..{r['diff_ms_iqr'][1]:+.1f}"
        print(
            f"{workload:15} {r['ttft_ms_without']:11.1f} {r['ttft_ms_with']:9.1f} "
            f"{r['diff_ms_median']:+8.2f}  {iqr:>15}  {r['diff_share']:+.2%}"
        )


if __name__ == "__main__":
    main()
