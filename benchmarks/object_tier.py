"""The object-store tier's throughput beside obstore alone, against one real S3 server.

The server is Ceph's radosgw on a one-OSD memstore cluster (tests/s3server.py), on this
host.  Blocks are 2 MiB; each round alternates the tier and the bare client on the same
bytes:

- **put**: the disk tier evicts segments of 16 blocks (32 MiB); the object tier links
  each one and uploads it as a pack plus its index (``ObjectTier.offer_segment``, what a
  node runs), timed until the last index is written.  Bare: ``obstore.put`` of the same
  segment files, with the same multipart settings, one after the other.
- **get**: every uploaded block read back by ``ObjectTier.read_many`` (ranged GETs in
  parallel runs, copied into destination buffers, each verified with xxh3) in prefixes of
  8 blocks (16 MiB); bare: ``obstore.get_ranges`` of the same ranges (obstore's own
  coalescing and parallelism), bytes left where obstore put them.

    .venv/bin/python -m benchmarks.object_tier [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import obstore
import xxhash
from tests.s3server import S3Server

from kvpool.tiers.bucket import PACKS, ObjectStoreConfig, open_store
from kvpool.tiers.disk import DiskTier
from kvpool.tiers.objects import MAX_STAGED_SEGMENTS, UPLOAD_CHUNK_BYTES, ObjectTier

MiB = 1 << 20
BLOCK = 2 * MiB
SEGMENT_BLOCKS = 16
SEGMENTS = 4  # per round: 128 MiB put, the first segment's blocks read back


def _blocks(seed: int, n: int) -> list[tuple[bytes, bytes]]:
    payload = os.urandom(BLOCK)
    return [(b"bench-ns-0123456" + f"{seed}-{i}".encode(), payload) for i in range(n)]


def one_round(server: S3Server, seed: int, work: Path) -> dict[str, float]:
    bucket = server.make_bucket(f"kvpool-bench-{seed}-{os.getpid()}")
    config = ObjectStoreConfig(
        f"s3://{bucket}/pool", 1 << 40, endpoint=server.endpoint, refresh_s=3600
    )
    segment_bytes = SEGMENT_BLOCKS * (BLOCK + 256)
    tier = ObjectTier(config, work / f"disk-{seed}" / "outgoing", "bench")
    tier.start()
    staged: list[Path] = []

    class KeepCopy:
        """The object tier's intake, keeping a link to each segment for the bare client."""

        def offer_segment(self, path: Path, blocks: list[tuple[bytes, int, int, int]]) -> bool:
            copy = work / f"bare-{seed}-{path.name}"
            os.link(path, copy)  # the same file, for the bare client afterwards
            staged.append(copy)
            accepted = tier.offer_segment(path, blocks)
            assert accepted, "the upload queue was full"
            return accepted

    disk = DiskTier(
        work / f"disk-{seed}", 2 * segment_bytes, segment_bytes=segment_bytes, below=KeepCopy()
    )
    first = _blocks(seed, SEGMENT_BLOCKS)
    rest = _blocks(seed + 1000, SEGMENT_BLOCKS * (SEGMENTS + 1))
    items = first + rest
    # Fill the disk first (not timed): evictions start once it holds two segments.
    filled = 2 * SEGMENT_BLOCKS
    disk.write([(k, memoryview(v), xxhash.xxh3_64_intdigest(v)) for k, v in items[:filled]])
    started = time.perf_counter()
    for at in range(filled, len(items), SEGMENT_BLOCKS):
        batch = items[at : at + SEGMENT_BLOCKS]
        disk.write([(k, memoryview(v), xxhash.xxh3_64_intdigest(v)) for k, v in batch])
        while len(tier._queue) >= MAX_STAGED_SEGMENTS - 1:  # the uploads set the pace
            time.sleep(0.002)
    while tier._queue or tier.counters.uploads < len(staged):
        time.sleep(0.002)
    tier_put_s = time.perf_counter() - started
    uploaded = sum(p.stat().st_size for p in staged)

    store = open_store(config, timeout_s=30, retries=3)
    started = time.perf_counter()
    for i, path in enumerate(staged):
        obstore.put(store, f"bare/{i}.kvs", path, chunk_size=UPLOAD_CHUNK_BYTES, max_concurrency=4)
    bare_put_s = time.perf_counter() - started

    keys = [k for k, _ in items if tier.contains([k])[0]]  # every block uploaded
    assert len(keys) >= SEGMENTS * SEGMENT_BLOCKS, "segments missing from the bucket"
    dsts = [bytearray(BLOCK) for _ in keys]
    locations = [tier.location(k) for k in keys]
    tier_get_s = bare_get_s = 0.0
    paired: list[float] = []  # tier time / bare time, batch by batch
    for n, at in enumerate(range(0, len(keys), 8)):  # the two alternate, batch by batch

        def by_tier(at: int = at) -> None:
            jobs = [(k, memoryview(d)) for k, d in zip(keys[at : at + 8], dsts, strict=False)]
            assert all(c is not None for c in tier.read_many(jobs))

        def by_bare(at: int = at) -> None:
            batch = [loc for loc in locations[at : at + 8] if loc is not None]
            assert len({loc.pack for loc in batch}) == 1
            obstore.get_ranges(
                store,
                PACKS + batch[0].pack,
                starts=[loc.offset for loc in batch],
                lengths=[loc.size for loc in batch],
            )

        times = {}
        for run in (by_tier, by_bare) if n % 2 == 0 else (by_bare, by_tier):
            started = time.perf_counter()
            run()
            times[run] = time.perf_counter() - started
        tier_get_s += times[by_tier]
        bare_get_s += times[by_bare]
        paired.append(times[by_bare] / times[by_tier])
    read = len(keys) * BLOCK

    tier.close()
    disk.close()
    for path in staged:
        path.unlink()
    return {
        "get_paired_ratio": statistics.median(paired),
        "put_tier_gbps": uploaded / tier_put_s / 1e9,
        "put_bare_gbps": uploaded / bare_put_s / 1e9,
        "get_tier_gbps": read / tier_get_s / 1e9,
        "get_bare_gbps": read / bare_get_s / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rounds = []
    with S3Server() as server, tempfile.TemporaryDirectory() as tmp:
        os.environ.update(
            AWS_ACCESS_KEY_ID=server.access_key,
            AWS_SECRET_ACCESS_KEY=server.secret_key,
            AWS_REGION=server.region,
        )
        for seed in range(args.rounds):
            rounds.append(one_round(server, seed, Path(tmp)))
    summary = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    summary["put_ratio"] = statistics.median(
        r["put_tier_gbps"] / r["put_bare_gbps"] for r in rounds
    )
    summary["get_ratio"] = statistics.median(
        r["get_tier_gbps"] / r["get_bare_gbps"] for r in rounds
    )
    summary["get_paired_ratio"] = statistics.median(r["get_paired_ratio"] for r in rounds)
    if args.json:
        print(json.dumps({"rounds": rounds, "median": summary}, indent=2))
        return
    print(f"2 MiB blocks, {args.rounds} rounds, medians (GB/s):")
    for op in ("put", "get"):
        print(
            f"  {op}: tier {summary[f'{op}_tier_gbps']:.3f}  bare obstore "
            f"{summary[f'{op}_bare_gbps']:.3f}  ratio {summary[f'{op}_ratio']:.2f}"
        )
    print(f"  get, batch by batch (16 MiB each, paired): ratio {summary['get_paired_ratio']:.2f}")


if __name__ == "__main__":
    main()
