"""Saving on eviction end to end: the demo's multi-turn chat on a real vLLM engine whose own
KV cache is a few times smaller than the pool, with ``save: eager`` and ``save: evicting``
(:mod:`kvpool.integrations.vllm.saving`), each on a fresh node of the same arena.

Per mode: the pool's hit rate (prompt tokens the pool served over those the engine's own
cache missed), median and p90 time to first token past the first turn, the blocks the node
holds at the end, and whether every answer is the reference's (the engine alone with a
cache that keeps every history).  Beside them the engine alone with its small cache (no
pool): the TTFT baseline.

    .venv/bin/python -m benchmarks.retention [--arena 28MiB] [--conversations 12] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from typing import Any

from kvpool import Client
from kvpool.harness.process import NodeProcess
from kvpool.harness.workload import (
    ENGINE_KV_CACHE_BYTES,
    NO_POOL,
    OWN,
    OWN_KV_CACHE_BYTES,
    Comparison,
    Workload,
    kvpool_connector,
    run_workload,
)

MODES = ("eager", "evicting")


def e2e(arena: str, workload: Workload) -> dict[str, Any]:
    from kvpool.harness.tiny_model import build_tiny_model

    model = str(build_tiny_model(None))
    comparison = Comparison(workload)
    held: dict[str, int] = {}
    run_dir = tempfile.mkdtemp(prefix="kvpool-retention-", dir="/dev/shm")
    try:
        comparison.runs[NO_POOL] = run_workload(NO_POOL, model, workload, None)
        own = {"kv_cache_memory_bytes": OWN_KV_CACHE_BYTES}
        comparison.runs[OWN] = run_workload(OWN, model, workload, None, engine=own)
        for mode in MODES:
            with NodeProcess.private(f"retention-{mode}", arena, run_dir=run_dir) as node:
                connector = kvpool_connector(node.unix_address, save=mode)
                comparison.runs[mode] = run_workload(mode, model, workload, connector)
                with Client(node.unix_address) as client:
                    held[mode] = client.stats().num_blocks
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        "arena": arena,
        "engine_kv_cache_bytes": ENGINE_KV_CACHE_BYTES,
        "summary": comparison.summary(),
        "held_blocks": held,
        "per_turn": comparison.per_turn(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arena", default="28MiB", help="the node's DRAM (the pool)")
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    workload = Workload(num_conversations=args.conversations, num_turns=args.turns)
    result = e2e(args.arena, workload)
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    summary = result["summary"]
    for name in (NO_POOL, *MODES):
        cells = [
            f"{name}: TTFT median {summary[f'ttft_ms_median_{name}']} ms",
            f"p90 {summary[f'ttft_ms_p90_{name}']} ms",
        ]
        if name in MODES:
            cells.append(f"pool hit rate {summary[f'hit_rate_{name}']}")
            cells.append(f"identical {summary[f'outputs_identical_{name}']}")
            cells.append(f"held {result['held_blocks'][name]} blocks")
        print(" | ".join(cells))
    print(json.dumps(result["per_turn"]))


if __name__ == "__main__":
    main()
