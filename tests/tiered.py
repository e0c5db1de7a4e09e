"""Nodes with a disk tier, as the tests of the tiers below DRAM drive them: start one, fill
it through a small arena, wait for the write-back, read everything back."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from kvpool import Client
from kvpool.harness.process import NodeProcess
from kvpool.protocol.messages import NodeStats
from kvpool.stats import TierStats
from tests.conftest import NodeFactory
from tests.helpers import content, key

BLOCK = 256 << 10


def disk_node(
    start_node: NodeFactory,
    disk_dir: Path,
    name: str = "tiered",
    memory: str = "8MiB",
    disk: str = "64MiB",
    extra: Sequence[str] = (),
) -> NodeProcess:
    """A daemon with a ``disk``-sized disk tier in ``disk_dir`` under a ``memory`` arena."""
    return start_node(
        name=name, memory=memory, extra=["--disk", str(disk_dir), "--disk-size", disk, *extra]
    )


def fill(
    client: Client, tag: str, num_blocks: int, size: int = BLOCK, pause: float = 0.01
) -> list[bytes]:
    """Put blocks in small batches, ``pause`` apart, giving the disk writer time to keep up."""
    keys = [key(f"{tag}-{i}") for i in range(num_blocks)]
    for start in range(0, num_blocks, 4):
        batch = keys[start : start + 4]
        assert client.put(batch, [content(k, size) for k in batch]).all_stored
        time.sleep(pause)
    return keys


def tier(stats: NodeStats, name: str) -> TierStats:
    return next(t for t in stats.tiers if t.name == name)


def wait_written(client: Client, expected: int, timeout: float = 20) -> TierStats:
    """Until the disk's write-back has taken or turned away ``expected`` evicted blocks."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        disk = tier(client.stats(), "disk")
        if disk.writes + disk.dropped + disk.refused >= expected:
            return disk
        time.sleep(0.02)
    return tier(client.stats(), "disk")


def check_all(client: Client, keys: Sequence[bytes], size: int = BLOCK) -> int:
    """Every block that is found has exactly its bytes; how many were found.  Read 8 at a
    time, as an engine loads a request's blocks (a read is promoted into DRAM first, and a
    read of most of a small arena at once would evict its own first blocks)."""
    num_found = 0
    for start in range(0, len(keys), 8):
        batch = keys[start : start + 8]
        got = client.get(batch)
        for k, value in zip(batch, got.values, strict=True):
            if value is not None:
                assert bytes(value) == content(k, size).tobytes(), "a wrong block was served"
        num_found += got.num_found
    return num_found
