"""The object-store tier against a real S3 server (radosgw, tests/s3server.py): segments the
disk evicts become packs any other node reads, verified; corrupt and missing objects are
never served; the bucket stays within its capacity; a frozen server only makes misses."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import obstore
import pytest
import xxhash

from kvpool.errors import ConfigError
from kvpool.formats import DELETE_OBJECT, DISK_SEGMENT, OBJECT_INDEX, RELEASE
from kvpool.tiers.bucket import (
    DELETES,
    INDEXES,
    PACKS,
    DeleteList,
    ObjectStoreConfig,
    decode_deletes,
    decode_index,
    index_name,
    open_store,
)
from kvpool.tiers.disk import DiskTier
from kvpool.tiers.objects import ObjectTier
from tests.proxy import GateProxy
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
    values: dict[str, object] = {
        "capacity": 256 * MiB,
        "refresh_s": 0.2,
        "read_timeout_s": 1.0,
        "endpoint": server.endpoint,
    }
    values.update(kw)
    return ObjectStoreConfig(f"s3://{bucket}/pool", **values)  # type: ignore[arg-type]


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


# -- formats (kvpool.formats): what each node reads of another release's objects -----------


def _uploaded(tiers: tuple, seed: int) -> list[tuple[bytes, bytes]]:
    disk, _writer, reader = tiers
    first = blocks(14, seed)
    write(disk, first)
    write(disk, blocks(30, seed + 1))
    wait_for(lambda: all(reader.contains([k for k, _ in first])))
    return first


def test_objects_carry_their_format_and_writer(
    tiers: tuple, s3_server: S3Server, s3_bucket: str
) -> None:
    """An index names its format, its pack's (a segment's) and the release that wrote it;
    a delete object its format and writer; and an index of the previous release (no such
    fields) is read as format 1."""
    first = _uploaded(tiers, 20)
    _disk, writer, reader = tiers
    store = open_store(config(s3_server, s3_bucket), timeout_s=5, retries=0)
    location = reader.location(first[0][0])
    assert location is not None
    raw = obstore.get(store, INDEXES + index_name(location.pack)).bytes()
    index = decode_index(memoryview(raw))
    assert (index.version, index.pack_format, index.kvpool_version) == (
        OBJECT_INDEX.version,
        DISK_SEGMENT.version,
        RELEASE,
    )
    previous = msgspec.msgpack.decode(raw)
    del previous["kvpool_version"], previous["pack_format"]
    assert decode_index(msgspec.msgpack.encode(previous)).pack_format == 1  # 0.1.0's
    writer.delete([first[1][0]])
    wait_for(lambda: writer.counters.deletes_sent == 1)
    (listed,) = [m for c in obstore.list(store, DELETES) for m in c]
    deletes = decode_deletes(memoryview(obstore.get(store, listed["path"]).bytes()))
    assert (deletes.version, deletes.kvpool_version) == (DELETE_OBJECT.version, RELEASE)


@pytest.mark.parametrize("field", ["version", "pack_format"])
def test_an_index_of_a_format_it_does_not_read_is_not_read(
    tiers: tuple, s3_server: S3Server, s3_bucket: str, field: str, tmp_path: Path
) -> None:
    first = _uploaded(tiers, 22)
    _disk, _writer, reader = tiers
    store = open_store(config(s3_server, s3_bucket), timeout_s=5, retries=0)
    location = reader.location(first[0][0])
    assert location is not None
    index = msgspec.msgpack.decode(obstore.get(store, INDEXES + index_name(location.pack)).bytes())
    index[field] = 9  # a later release's
    index["pack"] = "zz-later.kvs"
    obstore.put(store, PACKS + "zz-later.kvs", obstore.get(store, PACKS + location.pack).bytes())
    obstore.put(store, INDEXES + "zz-later.idx", msgspec.msgpack.encode(index))
    fresh = ObjectTier(config(s3_server, s3_bucket), tmp_path / "c-outgoing", "c")
    try:
        fresh.refresh()
        assert fresh.counters.unreadable == 1
        assert fresh.location(first[0][0]).pack == location.pack  # never the later one's
    finally:
        fresh.close()


@pytest.mark.parametrize("damage", ["version", "garbled"])
def test_a_delete_object_it_cannot_read_hides_the_packs_before_it(
    tiers: tuple, s3_server: S3Server, s3_bucket: str, damage: str
) -> None:
    """It may name any key: no block of a pack written before it is served."""
    first = _uploaded(tiers, 24)
    _disk, _writer, reader = tiers
    store = open_store(config(s3_server, s3_bucket), timeout_s=5, retries=0)
    later = DeleteList(version=9, written_at=time.time(), writer="zz", keys=[b"k" * 20])
    data = msgspec.msgpack.encode(later) if damage == "version" else b"\x93garbage"
    obstore.put(store, DELETES + "zz-later-00000001.del", data)
    wait_for(lambda: reader.counters.unreadable >= 1)  # its refresher reads the listing
    assert not any(reader.contains([k for k, _ in first]))
    assert read(reader, first[:1]) == [None]


@pytest.fixture
def gated(
    s3_server: S3Server, s3_bucket: str, aws_env: None, tmp_path: Path
) -> Iterator[tuple[DiskTier, ObjectTier, GateProxy]]:
    """A writer's disk and object tier that reach the S3 server through a proxy that can
    hold one kind of request on the wire (tests/proxy.py)."""
    proxy = GateProxy(int(s3_server.endpoint.rsplit(":", 1)[1]))
    writer = ObjectTier(
        config(s3_server, s3_bucket, endpoint=proxy.endpoint), tmp_path / "disk" / "out", "a"
    )
    disk = DiskTier(tmp_path / "disk", 8 * MiB, segment_bytes=4 * MiB, below=writer)
    writer.start()
    yield disk, writer, proxy
    proxy.release()
    writer.close()
    disk.close()
    proxy.close()


@pytest.mark.parametrize("held", ["pack", "index"])
def test_a_block_deleted_while_its_segment_uploads_never_comes_back(
    gated: tuple, held: str, s3_server: S3Server, s3_bucket: str, tmp_path: Path
) -> None:
    """The fault's side: a delete of a block whose disk segment is on the wire to the bucket,
    its pack's PUT held (so its index is not written yet) or its index's PUT held (the pack
    is there, the index on its way).  The delete finds the block (never NOT_FOUND for a
    block that would reappear); once the upload lands, neither the writer, nor another
    node, nor a node started afterwards serves it; the segment's other blocks are served."""
    disk, writer, proxy = gated
    bucket_path = f"PUT /{s3_bucket}/pool/{PACKS if held == 'pack' else INDEXES}".encode()
    proxy.hold(bucket_path)
    first = blocks(14, 60)
    write(disk, first)
    write(disk, blocks(30, 61))  # the first segment leaves the disk for the bucket
    assert proxy.held.wait(15), "the upload never reached the held request"
    assert writer.may_hold([first[0][0]])
    deleted = first[0][0]
    assert writer.delete([deleted]) == 1
    proxy.release()
    wait_for(lambda: writer.counters.uploads >= 1)
    others = [k for k, _ in first[1:]]
    assert all(writer.contains(others))  # the upload landed
    assert writer.contains([deleted]) == [False]
    assert read(writer, first[:1]) == [None]
    for name in ("b", "restarted"):  # another node; one started after it all
        reader = ObjectTier(config(s3_server, s3_bucket), tmp_path / f"{name}-out", name)
        reader.start()
        try:
            wait_for(lambda: all(reader.contains(others)))  # noqa: B023
            assert reader.contains([deleted]) == [False]
            assert read(reader, first[:1]) == [None]
            assert read(reader, first[1:]) == [v for _, v in first[1:]]
        finally:
            reader.close()
