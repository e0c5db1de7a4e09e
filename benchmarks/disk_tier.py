"""The local disk tier: throughput beside the file system's own, and a vLLM multi-turn chat
whose working set is four times the DRAM arena.

1. ``throughput``: the disk tier's write-back (``DiskTier.write``, what the writer thread
   runs) and reads (``DiskTier.read_into`` with its verification, what a promotion runs) of
   the same bytes as a plain sequential file write and read in one Python thread on the
   same file system, alternating over several rounds.  Both go through the page cache;
   writes are timed up to an fsync (the bytes on the device: what a tier under steady
   eviction sustains), and reads start from a dropped page cache (cold, from the device)
   when the process may drop it (root), else from a warm one (said in the output).
2. ``vllm``: the demo's chat workload, sized so that its history is about four times the
   node's arena, on three engines one after the other: no pool, the pool without a disk
   tier, the pool with one.  Reports median TTFT, the pool's hit rate, and the share of
   the blocks saved in earlier turns that were loaded (or found in the engine's own cache)
   instead of recomputed.
3. ``burst``: issue 29's burst larger than DRAM: 256 blocks of 1 MiB put 16 at a time, as
   fast as the SDK goes, into a node with a 64 MiB arena and a 1 GiB disk tier; every block
   read back (8 at a time), then SIGKILL, the run directory wiped, and every block read
   again from a new daemon.  Reports how many came back (and none wrong), what the disk's
   write-back refused or dropped, and what the writer was told it lost
   (``PutResult.num_not_kept``), which must be the same.

    .venv/bin/python -m benchmarks.disk_tier [throughput|vllm|burst|all] [--batch N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from kvpool.harness.process import NodeProcess
from kvpool.tiers.disk import DiskTier

TOTAL_BYTES = 1 << 30
ROUNDS = 3


def _blocks(block_bytes: int) -> list[tuple[bytes, memoryview, int]]:
    rng = np.random.default_rng(block_bytes)
    out = []
    for i in range(TOTAL_BYTES // block_bytes):
        data = memoryview(rng.integers(0, 256, block_bytes, dtype=np.uint8).tobytes())
        out.append((b"k" * 16 + i.to_bytes(8, "little"), data, xxhash.xxh3_64_intdigest(data)))
    return out


def _drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _plain(directory: Path, blocks: list[tuple[bytes, memoryview, int]]) -> tuple[float, float]:
    """Seconds to write the blocks to one file sequentially, and to read them back."""
    path = directory / "plain.bin"
    started = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _, data, _ in blocks:
            f.write(data)
        os.fsync(f.fileno())
    written = time.perf_counter() - started
    _drop_caches()
    buffer = memoryview(bytearray(len(blocks[0][1])))
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for _ in blocks:
            f.readinto(buffer)
    read = time.perf_counter() - started
    path.unlink()
    return written, read


def _tier(directory: Path, blocks: list[tuple[bytes, memoryview, int]]) -> tuple[float, float]:
    tier_dir = directory / "tier"
    disk = DiskTier(tier_dir, 2 * TOTAL_BYTES + (1 << 30))
    started = time.perf_counter()
    batch = max(1, (64 << 20) // len(blocks[0][1]))  # the write-back thread's batches
    for start in range(0, len(blocks), batch):
        disk.write(blocks[start : start + batch])
    disk.sync()
    written = time.perf_counter() - started
    _drop_caches()
    buffer = memoryview(bytearray(len(blocks[0][1])))
    started = time.perf_counter()
    for key, _, _ in blocks:
        if disk.read_into(key, buffer) is None:
            raise RuntimeError("a block did not read back")
    read = time.perf_counter() - started
    disk.close()
    shutil.rmtree(tier_dir)
    return written, read


def throughput(directory: str | None = None) -> list[dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="kvpool-disk-bench-", dir=directory))
    results = []
    try:
        for block_bytes in (512 << 10, 2 << 20):
            blocks = _blocks(block_bytes)
            runs: dict[str, list[float]] = {
                k: [] for k in ("plain_w", "plain_r", "tier_w", "tier_r")
            }
            for round_ in range(ROUNDS):
                order = (_plain, _tier) if round_ % 2 == 0 else (_tier, _plain)
                for fn in order:
                    w, r = fn(base, blocks)
                    prefix = "plain" if fn is _plain else "tier"
                    runs[f"{prefix}_w"].append(TOTAL_BYTES / w / 1e9)
                    runs[f"{prefix}_r"].append(TOTAL_BYTES / r / 1e9)
            med = {k: statistics.median(v) for k, v in runs.items()}
            results.append(
                {
                    "block_bytes": block_bytes,
                    "write_gbps": round(med["tier_w"], 2),
                    "write_ceiling_gbps": round(med["plain_w"], 2),
                    "write_ratio": round(med["tier_w"] / med["plain_w"], 2),
                    "read_gbps": round(med["tier_r"], 2),
                    "read_ceiling_gbps": round(med["plain_r"], 2),
                    "read_ratio": round(med["tier_r"] / med["plain_r"], 2),
                    "file_system": _fs_of(base),
                    "reads": "cold (page cache dropped)" if _drop_caches() else "warm",
                }
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return results


def _fs_of(path: Path) -> str:
    best = ("", "?")
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount, fs = line.split()[:3]
            if str(path).startswith(mount) and len(mount) > len(best[0]):
                best = (mount, fs)
    return best[1]


# -- vLLM -----------------------------------------------------------------------------------


def _reused_share(turns: list[dict[str, Any]], block: int) -> float:
    """Of the full blocks each prompt shares with its conversation's previous prompt (saved
    then), the share the engine did not recompute (loaded, or in its own cache)."""
    previous: dict[int, list[int]] = {}
    reusable = served = 0
    for turn in turns:
        tokens = turn["prompt_token_ids"]
        before = previous.get(turn["conversation"])
        if before is not None:
            common = 0
            for a, b in zip(before, tokens, strict=False):
                if a != b:
                    break
                common += 1
            blocks = min(common, len(tokens) - 1) // block
            reusable += blocks
            served += min(turn["cached_tokens"] // block, blocks)
        previous[turn["conversation"]] = tokens
    return served / reusable if reusable else 0.0


def vllm(arena: str = "14MiB", disk: str = "256MiB") -> dict[str, Any]:
    from kvpool.harness.tiny_model import build_tiny_model
    from kvpool.harness.workload import BLOCK_SIZE, Workload, kvpool_connector, run_workload

    model = str(build_tiny_model(None))
    workload = Workload(num_conversations=12, num_turns=4)
    run_dir = tempfile.mkdtemp(prefix="kvpool-disk-vllm-", dir="/dev/shm")
    disk_dir = tempfile.mkdtemp(prefix="kvpool-disk-vllm-")
    out: dict[str, Any] = {"arena": arena, "disk": disk, "conversations": 12, "turns": 4}
    try:
        nodes = {
            "dram_only": NodeProcess.private("dram", arena, run_dir=run_dir),
            "with_disk": NodeProcess.private(
                "tiered", arena, run_dir=run_dir, extra=["--disk", disk_dir, "--disk-size", disk]
            ),
        }
        for name in ("nopool", "dram_only", "with_disk"):
            node = nodes.get(name)
            connector = None
            if node is not None:
                node.start()
                connector = kvpool_connector(node.unix_address)
            result = run_workload(name, model, workload, connector)
            ttfts = result.ttfts()
            out[name] = {
                "ttft_ms_median": round(statistics.median(ttfts), 2),
                "ttft_ms_p90": round(sorted(ttfts)[int(0.9 * len(ttfts))], 2),
                "pool_hit_rate": round(result.hit_rate, 4),
                "reused_blocks_not_recomputed": round(_reused_share(result.turns, BLOCK_SIZE), 4),
            }
            # The history at the last turn: what the pool would hold to serve every turn.
            last = [t["prompt_tokens"] for t in result.turns if t["turn"] == workload.num_turns - 1]
            out["history_blocks"] = sum(n // BLOCK_SIZE for n in last)
            if node is not None:
                from kvpool import Client

                with Client(node.unix_address) as client:
                    out[name]["tiers"] = [
                        {
                            "name": t.name,
                            "blocks": t.num_blocks,
                            "hits": t.hits,
                            "promotions": t.promotions,
                        }
                        for t in client.stats().tiers
                    ]
                node.stop()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
    return out


BURST_BLOCK = 1 << 20


def burst(
    num_blocks: int = 256, batch: int = 16, arena: str = "64MiB", disk: str = "1GiB"
) -> dict[str, Any]:
    from kvpool import Client, Namespace

    namespace = Namespace(model="burst")
    keys = namespace.keys([i.to_bytes(8, "little") for i in range(num_blocks)])
    rng = np.random.default_rng(29)
    values = {k: rng.integers(0, 256, BURST_BLOCK, dtype=np.uint8) for k in keys}
    run_dir = tempfile.mkdtemp(prefix="kvpool-burst-", dir="/dev/shm")
    disk_dir = tempfile.mkdtemp(prefix="kvpool-burst-")
    extra = ["--disk", disk_dir, "--disk-size", disk]
    out: dict[str, Any] = {"blocks": num_blocks, "batch": batch, "arena": arena, "disk": disk}

    def read_back(client: Client) -> tuple[int, int]:
        found = wrong = 0
        for start in range(0, num_blocks, 8):
            got = client.get(keys[start : start + 8])
            for k, value in zip(keys[start : start + 8], got.values, strict=True):
                if value is not None:
                    found += 1
                    wrong += bytes(value) != values[k].tobytes()
        return found, wrong

    try:
        node = NodeProcess.private("burst", arena, run_dir=run_dir, extra=extra).start()
        with Client(node.unix_address, timeout=30) as client:
            told, slowest = 0, 0.0
            started = time.perf_counter()
            for start in range(0, num_blocks, batch):
                chunk = keys[start : start + batch]
                put_started = time.perf_counter()
                result = client.put(chunk, [values[k] for k in chunk])
                slowest = max(slowest, time.perf_counter() - put_started)
                told += result.num_not_kept
            out["burst_s"] = round(time.perf_counter() - started, 3)
            out["worst_put_ms"] = round(slowest * 1000, 1)
            time.sleep(2)  # the write-back catches up
            disk_tier = next(t for t in client.stats().tiers if t.name == "disk")
            out["refused_and_dropped"] = disk_tier.refused + disk_tier.dropped
            out["writer_told_not_kept"] = told
            out["slowed"] = disk_tier.slowed
            out["read_back"], out["wrong"] = read_back(client)
        node.kill()
        shutil.rmtree(run_dir)  # a reboot: /dev/shm is empty, the disk is not
        os.mkdir(run_dir, 0o770)
        again = NodeProcess.private("burst", arena, run_dir=run_dir, extra=extra).start()
        with Client(again.unix_address, timeout=30) as client:
            out["after_sigkill"], wrong = read_back(client)
            out["wrong"] += wrong
        again.stop()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(disk_dir, ignore_errors=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what", nargs="?", default="all", choices=["throughput", "vllm", "burst", "all"]
    )
    parser.add_argument("--dir", default=None, help="where the throughput files go (default: /tmp)")
    parser.add_argument("--batch", type=int, default=16, help="blocks a put in the burst")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {"machine": {"cores": os.cpu_count()}}
    if args.what in ("throughput", "all"):
        result["throughput"] = throughput(args.dir)
    if args.what in ("vllm", "all"):
        result["vllm"] = vllm()
    if args.what in ("burst", "all"):
        result["burst"] = burst(batch=args.batch)
    sys.stdout.write(json.dumps(result, indent=None if args.json else 2) + "\n")


if __name__ == "__main__":
    main()
