"""A restart's bookkeeping, in process: replaying the block journal and adopting its extents.

For each ``--blocks`` count: write a journal of that many COMMIT records (48-byte keys, as a
vLLM block hash under a namespace, 4 KiB blocks side by side), plus ``--churn`` of them
removed and committed again (a re-commit moves a key to the newest place), then time, in
a fresh process each time (``--repeat``; best and median), ``Journal(path, ...)`` (open
and replay) and the allocator's ``adopt`` of every extent; and the heap the allocator
takes per extent it holds (tracemalloc), with its allocate and free times.

    .venv/bin/python -m benchmarks.journal_replay [--blocks 1000000,2000000] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from kvpool import Namespace
from kvpool.config import PAGE_BYTES
from kvpool.store.allocator import SegregatedFitAllocator
from kvpool.store.journal import Entry, Journal

BATCH = 4096
IDENTITY = (1, 2)


def write_journal(path: Path, num_blocks: int, num_churn: int) -> None:
    ns = Namespace(model="journal-replay")
    arena_bytes = num_blocks * PAGE_BYTES
    journal = Journal(path, *IDENTITY, arena_bytes, fresh=True)
    for start in range(0, num_blocks, BATCH):
        stop = min(start + BATCH, num_blocks)
        keys = ns.keys(b"%032d" % i for i in range(start, stop))
        places = range(start, stop)
        journal.committed(
            Entry(k, i * PAGE_BYTES, PAGE_BYTES, i) for i, k in zip(places, keys, strict=True)
        )
    churned = ns.keys(b"%032d" % i for i in range(0, num_churn))
    journal.removed(churned)
    journal.committed(Entry(k, i * PAGE_BYTES, PAGE_BYTES, i) for i, k in enumerate(churned))
    journal.close()


def replay_and_adopt(path: Path, num_blocks: int) -> dict[str, Any]:
    """Open the journal at ``path`` and adopt its extents, timed, as a restarted daemon
    does (run in a fresh process: a restart's allocations are all first touches)."""
    arena_bytes = num_blocks * PAGE_BYTES
    start, start_cpu = time.perf_counter(), time.process_time()
    journal = Journal(path, *IDENTITY, arena_bytes)
    replay_s = time.perf_counter() - start
    replay_cpu_s = time.process_time() - start_cpu  # what a loaded machine does not inflate
    replayed = journal.replayed
    journal.close()
    extents: Any
    if hasattr(replayed, "offsets"):  # columns: the allocator adopts them as an array
        extents = np.stack([replayed.offsets, replayed.sizes], axis=1)
        live = len(replayed.keys)
    else:
        extents = [(e.offset, e.size) for e in replayed.entries]
        live = len(replayed.entries)
    allocator = SegregatedFitAllocator(arena_bytes)
    start = time.perf_counter()
    taken = allocator.adopt(extents)
    adopt_s = time.perf_counter() - start
    assert live == num_blocks and all(taken), (live, num_blocks)
    return {
        "records": replayed.num_records,
        "replay_s": replay_s,
        "replay_cpu_s": replay_cpu_s,
        "adopt_s": adopt_s,
    }


def run(num_blocks: int, num_churn: int, repeat: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvpool-jr-", dir="/dev/shm") as tmp:
        path = Path(tmp) / "journal"
        write_journal(path, num_blocks, num_churn)
        context = mp.get_context("spawn")
        runs = []
        for _ in range(repeat):
            with context.Pool(1) as pool:
                runs.append(pool.apply(replay_and_adopt, (path, num_blocks)))
    records = runs[0]["records"]
    replay_s = sorted(r["replay_s"] for r in runs)
    replay_cpu_s = min(r["replay_cpu_s"] for r in runs)
    adopt_s = sorted(r["adopt_s"] for r in runs)
    return {
        "blocks": num_blocks,
        "records": records,
        "replay_s_best": round(replay_s[0], 3),
        "replay_s_median": round(replay_s[len(runs) // 2], 3),
        "replay_s_per_1M_records": round(replay_s[0] / records * 1e6, 3),
        "replay_cpu_s_best": round(replay_cpu_s, 3),
        "adopt_s_best": round(adopt_s[0], 3),
    }


def allocator_heap(num_extents: int) -> dict[str, Any]:
    """The heap the allocator grows by per extent it hands out (its own tables only)."""
    allocator = SegregatedFitAllocator(num_extents * PAGE_BYTES)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        offsets = [allocator.allocate(PAGE_BYTES) for _ in range(num_extents)]
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # The offsets list and its ints are the caller's, not the allocator's.
    callers = sys.getsizeof(offsets) + sum(sys.getsizeof(o) for o in offsets)
    start = time.perf_counter()
    for offset in offsets:
        allocator.free(offset)
    free_us = (time.perf_counter() - start) / num_extents * 1e6
    start = time.perf_counter()
    for _ in range(num_extents):
        allocator.allocate(PAGE_BYTES)
    allocate_us = (time.perf_counter() - start) / num_extents * 1e6
    return {
        "extents": num_extents,
        "heap_bytes_per_extent": round((grown - callers) / num_extents, 1),
        "sizeof_bytes": sys.getsizeof(allocator),
        "allocate_us": round(allocate_us, 2),
        "free_us": round(free_us, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="1000000,2000000")
    parser.add_argument("--churn", type=int, default=10_000)
    parser.add_argument("--heap-extents", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3, help="replays per size, each fresh")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "replay": [run(int(n), args.churn, args.repeat) for n in args.blocks.split(",")],
        "allocator": allocator_heap(args.heap_extents),
    }
    if args.json:
        print(json.dumps(results))
        return
    for row in results["replay"]:
        print(
            f"{row['blocks']:>9,} blocks ({row['records']:,} records): replay best "
            f"{row['replay_s_best']:.3f} s, median {row['replay_s_median']:.3f} s "
            f"({row['replay_s_per_1M_records']:.3f} s per 1M records; CPU "
            f"{row['replay_cpu_s_best']:.3f} s), allocator adopt "
            f"{row['adopt_s_best']:.3f} s"
        )
    heap = results["allocator"]
    print(
        f"allocator: {heap['heap_bytes_per_extent']} B of heap per extent held "
        f"({heap['extents']:,} extents), sizeof {heap['sizeof_bytes']:,} B, "
        f"allocate {heap['allocate_us']} us, free {heap['free_us']} us"
    )


if __name__ == "__main__":
    main()
