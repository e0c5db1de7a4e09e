"""kvpool beside Mooncake Store in one run: same-node and TCP put/get of 8 MiB and 32 MiB
batches of 2 MiB blocks, with the memcpy and socket-stream ceilings of kvpool's bench.

    .venv/bin/python -m benchmarks.vs_mooncake --mooncake-python /path/to/mooncake-venv/bin/python

Mooncake lives in its own virtual environment (``pip install
mooncake-transfer-engine-non-cuda numpy``); ``benchmarks/mooncake_peer.py`` runs it inside a
loopback-only network namespace.  The systems take turns, ``--rounds`` times each (default
2, alternating who goes first), and each figure is the median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path
from typing import Any

from kvpool.cli.bench import BenchOptions, run_cases
from kvpool.config import MiB

BLOCK = 2 * MiB
BATCHES = (8 * MiB, 32 * MiB)
PEER = Path(__file__).with_name("mooncake_peer.py")


def _kvpool(total: int) -> dict[tuple[str, str, int], tuple[float, float]]:
    """(path, op, batch) -> (GB/s, ceiling GB/s)."""
    out = {}
    for batch in BATCHES:
        report = run_cases(
            BenchOptions(
                block_sizes=[BLOCK], total_bytes=total, batch_bytes=batch, with_redis=False
            )
        )
        for case in report.cases:
            out[(case.path, case.op, batch)] = (case.gbps, case.ceiling_gbps)
    return out


def _mooncake(python: str, total: int) -> dict[tuple[str, str, int], float]:
    done = subprocess.run(
        [python, str(PEER), "--json", "--total-mib", str(total // MiB)],
        capture_output=True,
        text=True,
        check=True,
        timeout=1200,
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    path_of = {"same_node": "shm", "tcp": "tcp"}
    return {(path_of[c["path"]], c["op"], c["batch_bytes"]): c["gbps"] for c in result["cases"]}


def run(python: str, rounds: int, total: int) -> list[dict[str, Any]]:
    ours: list[dict[tuple[str, str, int], tuple[float, float]]] = []
    theirs: list[dict[tuple[str, str, int], float]] = []
    for r in range(rounds):
        if r % 2 == 0:
            ours.append(_kvpool(total))
            theirs.append(_mooncake(python, total))
        else:
            theirs.append(_mooncake(python, total))
            ours.append(_kvpool(total))
    rows = []
    for key in sorted(ours[0]):
        path, op, batch = key
        gbps = statistics.median(o[key][0] for o in ours)
        ceiling = statistics.median(o[key][1] for o in ours)
        # kvpool's pipelined puts (a writer) beside Mooncake's same-node puts.
        peer_key = ("shm" if path.startswith("shm") else path, op, batch)
        peer = statistics.median(t[peer_key] for t in theirs if peer_key in t)
        rows.append(
            {
                "path": path,
                "op": op,
                "batch_mib": batch // MiB,
                "kvpool_gbps": round(gbps, 2),
                "ceiling_gbps": round(ceiling, 2),
                "kvpool_vs_ceiling": round(gbps / ceiling, 2),
                "mooncake_gbps": round(peer, 2),
                "kvpool_vs_mooncake": round(gbps / peer, 2),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mooncake-python", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--total", type=int, default=256, help="MiB per case")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = run(args.mooncake_python, args.rounds, args.total * MiB)
    if args.json:
        print(json.dumps(rows))
        return
    print(
        "| path | op | batch | kvpool GB/s | ceiling GB/s | ratio | Mooncake GB/s | vs Mooncake |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['path']} | {r['op']} | {r['batch_mib']} MiB | {r['kvpool_gbps']} | "
            f"{r['ceiling_gbps']} | {r['kvpool_vs_ceiling']} | {r['mooncake_gbps']} | "
            f"{r['kvpool_vs_mooncake']} |"
        )


if __name__ == "__main__":
    main()
