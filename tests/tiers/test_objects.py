"""The object-store tier against a real S3 server (radosgw, tests/s3server.py): segments the
disk evicts become packs any other node reads, verified; corrupt and missing objects are
never served; the bucket stays within its capacity; a frozen server only makes misses."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest
import xxhash

from kvpool.errors import ConfigError
from kvpool.tiers.bucket import INDEXES, PACKS, ObjectStoreConfig, open_store
from kvpool.tiers.disk import DiskTier
from kvpool.tiers.objects import ObjectTier
from tests.s3server import S3Server

MiB = 1 << 20
BLOCK = 256 << 10


@pytest.fixture
def aws_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials as a node finds them: the standard AWS variables."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_REGION", s3_server.region)


def config(server: S3Server, bucket: str, **kw: object) -> ObjectStoreConfig:
    values: dict[str, object] = {"capacity": 256 * MiB, "refresh_s": 0.2, "read_timeout_s": 1.0}
    values.update(kw)
    return ObjectStoreConfig(f"s3://{bucket}/pool", endpoint=server.endpoint, **values)  # type: ignore[arg-type]


@pytest.fixture
def tiers(
    s3_server: S3Server, s3_bucket: str, aws_env: None, tmp_path: Path
) -> Iterator[tuple[DiskTier, ObjectTier, ObjectTier]]:
    """A writer node's disk (4 MiB segments) feeding its object tier, and a second node's
    object tier on the same bucket."""
    writer = ObjectTier(config(s3_server, s3_bucket), tmp_path / "disk" / "outgoing", "a")
    reader = ObjectTier(config(s3_server, s3_bucket), tmp_path / "b-outgoing", "b")
    disk = DiskTier(tmp_path / "disk", 8 * MiB, segment_bytes=4 * MiB, below=writer)
    writer.start()
    reader.start()
    yield disk, writer, reader
    writer.close()
    reader.close()
    disk.close()


def blocks(n: int, seed: int) -> list[tuple[bytes, bytes]]:
    return [
        (b"ns" * 8 + f"{seed}-{i}".encode(), os.urandom(BLOCK - 64) + bytes(64)) for i in range(n)
    ]


def write(disk: DiskTier, items: list[tuple[bytes, bytes]]) -> None:
    disk.write([(k, memoryview(v), xxhash.xxh3_64_intdigest(v)) for k, v in items])


def wait_for(predicate: object, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def read(tier: ObjectTier, items: list[tuple[bytes, bytes]]) -> list[bytes | None]:
    dsts = [bytearray(BLOCK) for _ in items]
    checksums = tier.read_many([(k, memoryview(d)) for (k, _), d in zip(items, dsts, strict=True)])
    return [
        bytes(d[: len(v)]) if c is not None else None
        for (_, v), d, c in zip(items, dsts, checksums, strict=True)
    ]


def test_evicted_segments_are_read_by_another_node(tiers: tuple) -> None:
    disk, writer, reader = tiers
    first = blocks(14, 1)  # a bit under one 4 MiB segment
    write(disk, first)
    write(disk, blocks(30, 2))  # fills the disk: the first segment is evicted
    assert not any(disk.contains([k for k, _ in first]))
    wait_for(lambda: all(reader.contains([k for k, _ in first])))
    assert writer.counters.uploads >= 1
    assert read(reader, first) == [v for _, v in first]
    assert reader.counters.reads == len(first) and reader.counters.corrupt == 0
    # The writer, and then every node, keep nothing that left no disk.
    assert not any(reader.contains([k for k, _ in blocks(3, 9)]))


def test_a_corrupt_pack_is_never_served(tiers: tuple, s3_server: S3Server, s3_bucket: str) -> None:
    disk, _writer, reader = tiers
    first = blocks(14, 3)
    write(disk, first)
    write(disk, blocks(30, 4))
    wait_for(lambda: all(reader.contains([k for k, _ in first])))
    location = reader.location(first[0][0])
    assert location is not None
    store = open_store(config(s3_server, s3_bucket), timeout_s=5, retries=0)
    pack = bytearray(obstore.get(store, PACKS + location.pack).bytes())
    pack[location.offset + 100] ^= 0xFF  # one bit of rot in the first block
    obstore.put(store, PACKS + location.pack, bytes(pack))
    got = read(reader, first)
    assert got[0] is None  # detected, not served
    assert got[1:] == [v for _, v in first[1:]]
    assert reader.counters.corrupt == 1
    assert not reader.contains([first[0][0]])[0]  # and forgotten
    # A garbled index is ignored, and the rest of the bucket still reads.
    obstore.put(store, INDEXES + "zz-garbage.idx", b"\x93not an index")
    reader.refresh()
    assert read(reader, first[1:2]) == [first[1][1]]


def test_a_pack_deleted_elsewhere_is_a_miss(
    tiers: tuple, s3_server: S3Server, s3_bucket: str
) -> None:
    disk, _writer, reader = tiers
    first = blocks(14, 5)
    write(disk, first)
    write(disk, blocks(30, 6))
    wait_for(lambda: all(reader.contains([k for k, _ in first])))
    location = reader.location(first[0][0])
    assert location is not None
    store = open_store(config(s3_server, s3_bucket), timeout_s=5, retries=0)
    obstore.delete(store, PACKS + location.pack)
    assert read(reader, first) == [None] * len(first)
    assert not any(reader.contains([k for k, _ in first]))


def test_the_bucket_stays_within_its_capacity(
    s3_server: S3Server, s3_bucket: str, aws_env: None, tmp_path: Path
) -> None:
    tier = ObjectTier(config(s3_server, s3_bucket, capacity=10 * MiB), tmp_path / "out", "a")
    disk = DiskTier(tmp_path / "disk", 8 * MiB, segment_bytes=4 * MiB, below=tier)
    tier.start()
    try:
        for seed in range(6):  # six segments evicted: about 24 MiB offered
            write(disk, blocks(14, 100 + seed))
            wait_for(lambda: not tier._queue)
        wait_for(lambda: tier.counters.uploads + tier.counters.dropped_segments >= 4)
        tier.refresh()
        store = open_store(config(s3_server, s3_bucket), timeout_s=5, retries=0)
        listed = [m for chunk in obstore.list(store, PACKS) for m in chunk]
        assert sum(m["size"] for m in listed) <= 10 * MiB
        assert tier.counters.deleted_packs >= 1
        assert tier.used_bytes <= 10 * MiB
    finally:
        tier.close()
        disk.close()


def test_a_frozen_server_makes_misses_in_time(tiers: tuple, s3_server: S3Server) -> None:
    disk, _writer, reader = tiers
    first = blocks(14, 7)
    write(disk, first)
    write(disk, blocks(30, 8))
    wait_for(lambda: all(reader.contains([k for k, _ in first])))
    s3_server.freeze()
    try:
        started = time.monotonic()
        assert read(reader, first) == [None] * len(first)
        assert time.monotonic() - started < 3.0  # the read timeout (1 s), no retry
        assert reader.counters.read_errors == len(first)
        assert all(reader.contains([k for k, _ in first]))  # a timeout forgets nothing
        assert all(reader.contains([k for k, _ in first]))  # lookups never wait
    finally:
        s3_server.thaw()
    assert read(reader, first) == [v for _, v in first]


def test_a_bucket_that_refuses_us_is_a_config_error(
    s3_server: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    tier = ObjectTier(config(s3_server, s3_bucket), tmp_path / "out", "a")
    with pytest.raises(ConfigError, match="refused"):
        tier.start()
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    tier = ObjectTier(config(s3_server, "no-such-bucket"), tmp_path / "out", "a")
    with pytest.raises(ConfigError, match="no such bucket"):
        tier.start()
