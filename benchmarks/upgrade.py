"""An upgrade in place at scale (issue 38): a node of the previous release (built from git,
:mod:`kvpool.harness.releases`) holding ``--blocks`` 4 KiB blocks is stopped (SIGTERM, as a
DaemonSet's rolling update does) and this release started on its files.

Reported, each beside its peer measured in the same run on the same files:

- ``previous_restart``: the previous release restarted on its own files (the ceiling: what
  a restart costs without an upgrade);
- ``upgrade``: this release started on them (the files migrated in place);
- ``restart_after``: this release restarted on what it migrated;

each with the time from launch to the ready line, the share of a 10,000-key sample of the
held blocks found after it, and the first request's latency (connect, then a get of 256
sampled blocks, verified, as an engine's first load would be).

    .venv/bin/python -m benchmarks.upgrade [--blocks 1000000] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvpool import Client, Namespace, Status
from kvpool.harness.process import NodeProcess
from kvpool.harness.releases import PREVIOUS, build_release, release_env

BLOCK = 4096
BATCH = 256
SAMPLE = 10_000
FIRST_KEYS = 256
STORED = (Status.OK, Status.EXISTS)


def block_id(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


def _start(run_dir: str, memory: int, env: dict[str, str] | None) -> tuple[NodeProcess, float]:
    launched = time.perf_counter()
    node = NodeProcess.private("upgrade", memory, run_dir=run_dir, env=env)
    node.ready_timeout = 120.0
    node.start()
    return node, time.perf_counter() - launched


def _measure(node: NodeProcess, ready_s: float, sample: list[bytes], payload: bytes) -> dict:
    started = time.perf_counter()
    with Client(node.unix_address, timeout=60, verify_reads=True) as client:
        got = client.get(sample[:FIRST_KEYS])
        first_ms = (time.perf_counter() - started) * 1000
        assert all(bytes(v) == payload for v in got.values if v is not None)
        found = client.exists(sample).count(True)
        stats = client.stats()
    return {
        "ready_s": round(ready_s, 3),
        "daemon_started_in_s": node.info.get("started_in_s", 0.0),  # less the interpreter's
        "found_share": round(found / len(sample), 4),
        "first_request_ms": round(first_ms, 1),
        "release": stats.release or "0.1.0",
        "formats_found": {row.name: row.found for row in stats.formats},
        "adopted_blocks": node.info.get("adopted_blocks", 0),
    }


def run(blocks: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvpool-upgrade-"))
    run_dir = tempfile.mkdtemp(prefix="kvpool-upgrade-", dir="/dev/shm")
    previous = release_env(build_release(PREVIOUS, work))
    memory = int(blocks * BLOCK * 1.08)
    ns = Namespace(model="upgrade")
    payload = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
    try:
        node, _ = _start(run_dir, memory, previous)
        with Client(node.unix_address, timeout=60) as client:
            filled = time.perf_counter()
            for start in range(0, blocks, BATCH):
                keys = ns.keys(block_id(i) for i in range(start, min(start + BATCH, blocks)))
                result = client.put(keys, [payload] * len(keys))
                assert all(s in STORED for s in result.statuses), result.statuses[:3]
            fill_s = time.perf_counter() - filled
            held = client.stats().num_blocks
        rng = np.random.default_rng(1)
        sample = ns.keys(block_id(int(i)) for i in rng.choice(blocks, SAMPLE, replace=False))
        assert node.stop(60) == 0
        runs: dict[str, Any] = {}
        for name, env in (
            ("previous_restart", previous),
            ("upgrade", None),
            ("restart_after", None),
        ):
            node, ready_s = _start(run_dir, memory, env)
            try:
                runs[name] = _measure(node, ready_s, sample, payload)
            finally:
                assert node.stop(60) == 0
        ceiling = runs["previous_restart"]["ready_s"]
        return {
            "blocks": blocks,
            "held": held,
            "fill_s": round(fill_s, 1),
            **runs,
            "upgrade_ready_vs_previous_restart": round(runs["upgrade"]["ready_s"] / ceiling, 2),
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args.blocks)
    print(json.dumps(result, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
