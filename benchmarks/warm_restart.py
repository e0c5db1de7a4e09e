"""Warm restart: how long a node takes to serve again after ``kill -9``, and how much of
what it held it finds.

For each arena size: start a node, fill its arena with 2 MiB blocks, ``kill -9`` it, start
it again on the same arena, and measure the time from launching the process to its ready
line, to the first verified read, and the share of the committed blocks it adopted.

    .venv/bin/python -m benchmarks.warm_restart [--sizes 1GiB,8GiB] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

from kvpool import Client, Namespace, Status
from kvpool.config import parse_size
from kvpool.harness.process import NodeProcess

BLOCK = 2 << 20
BATCH = 16
STORED = (Status.OK, Status.EXISTS)


def run_size(arena_bytes: int) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(prefix="kvpool-warm-", dir="/dev/shm")
    ns = Namespace(model="warm-restart")
    try:
        node = NodeProcess.private("warm", arena_bytes, run_dir=run_dir).start()
        stored: list[bytes] = []
        block = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8)
        with Client(node.unix_address, timeout=30) as client:
            # Fill to just under the high watermark (nothing evicted: every block counts).
            target = int(0.9 * arena_bytes) // BLOCK
            while len(stored) < target:
                keys = ns.keys(str(len(stored) + i).encode() for i in range(BATCH))
                result = client.put(keys, [block] * BATCH)
                stored += [k for k, s in zip(keys, result.statuses, strict=True) if s in STORED]
            committed = client.stats().num_blocks
        node.kill()
        launched = time.perf_counter()
        again = NodeProcess.private("warm", arena_bytes, run_dir=run_dir).start()
        ready_s = time.perf_counter() - launched
        with Client(again.unix_address, timeout=30) as client:
            got = client.get(stored[:1], [np.empty(BLOCK, np.uint8)])
            first_read_s = time.perf_counter() - launched
            assert got.num_found == 1
            found = sum(
                client.exists(stored[i : i + 4096]).count(True) for i in range(0, len(stored), 4096)
            )
        again.stop()
        return {
            "arena_bytes": arena_bytes,
            "blocks_committed": committed,
            "blocks_adopted": again.info["adopted_blocks"],
            "found_share": round(found / len(stored), 4),
            "daemon_start_s": again.info["started_in_s"],
            "launch_to_ready_s": round(ready_s, 3),
            "launch_to_first_read_s": round(first_read_s, 3),
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1GiB,8GiB")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = [run_size(parse_size(s)) for s in args.sizes.split(",")]
    sys.stdout.write(json.dumps(results, indent=None if args.json else 2) + "\n")


if __name__ == "__main__":
    main()
