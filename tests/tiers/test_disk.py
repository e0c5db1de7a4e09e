"""The disk tier with real files: records, footers, restarts, corruption and a full disk."""

import os

import numpy as np
import pytest
import xxhash

from kvpool.errors import ConfigError
from kvpool.tiers.disk import DiskTier
from tests.helpers import content, key

SEGMENT = 4 << 20


def blocks(tag, n, size=256 << 10):
    out = []
    for i in range(n):
        k = key(f"{tag}-{i}")
        data = memoryview(content(k, size).tobytes())
        out.append((k, data, xxhash.xxh3_64_intdigest(data)))
    return out


def tier(path, capacity=64 << 20):
    return DiskTier(path, capacity, segment_bytes=SEGMENT)


def crash(disk):
    """What a daemon that dies leaves: its files as they are, its directory unlocked."""
    disk._dir_lock.release()


def read(disk, k, size=256 << 10):
    dst = memoryview(bytearray(size))
    checksum = disk.read_into(k, dst)
    return None if checksum is None else bytes(dst)


def test_blocks_round_trip_and_survive_a_restart(tmp_path):
    disk = tier(tmp_path)
    written = blocks("a", 40)  # 10 MiB over 4 MiB segments: some sealed, one open
    assert disk.write(written) == 40
    assert all(read(disk, k) == bytes(d) for k, d, _ in written)
    assert disk.contains([written[0][0], key("absent")]) == [True, False]
    # A crash: nothing closed, the open segment has no footer.  It is scanned.
    crash(disk)
    again = tier(tmp_path)
    assert len(again) == 40 and again.counters.recovered == 40
    assert all(read(again, k) == bytes(d) for k, d, _ in written)
    again.close()  # a clean stop seals the open segment
    third = tier(tmp_path)
    assert len(third) == 40 and third.counters.torn_records == 0


def test_a_torn_tail_is_never_served(tmp_path):
    disk = tier(tmp_path)
    written = blocks("t", 10)
    disk.write(written)
    newest = max(tmp_path.glob("seg-*.kvs"))
    size = newest.stat().st_size
    with open(newest, "r+b") as f:  # power lost mid-write: the last record is cut short
        f.truncate(size - 1000)
    crash(disk)
    again = tier(tmp_path)
    assert again.counters.torn_records == 1
    found = [k for k, _, _ in written if again.contains([k])[0]]
    assert written[-1][0] not in found and len(found) == 9
    assert all(read(again, k) == bytes(d) for k, d, _ in written if k in found)


def test_garbled_bytes_are_detected_counted_and_dropped(tmp_path):
    disk = tier(tmp_path)
    written = blocks("g", 6)
    disk.write(written)
    location = disk.location(written[2][0])
    path = tmp_path / f"seg-{location.segment_id:08d}.kvs"
    with open(path, "r+b") as f:
        f.seek(location.offset + 1234)
        byte = f.read(1)
        f.seek(location.offset + 1234)
        f.write(bytes([byte[0] ^ 0x5A]))
    assert read(disk, written[2][0]) is None
    assert disk.counters.corrupt == 1 and not disk.contains([written[2][0]])[0]
    assert read(disk, written[3][0]) == bytes(written[3][1])  # its neighbours are fine


def test_a_full_disk_evicts_its_least_recently_used_segments(tmp_path):
    disk = tier(tmp_path, capacity=16 << 20)  # four segments of 4 MiB, ~15 blocks each
    first = blocks("old", 14)
    later = blocks("new", 60)
    disk.write(first)
    disk.write(later[:30])  # segments 1 (the old blocks), 2 and 3
    for k, _, _ in first[:3]:
        read(disk, k)  # segment 1 is now the most recently used
    disk.write(later[30:])  # needs room: the least recently used segment (2) goes
    assert disk.used_bytes <= 16 << 20
    assert disk.counters.evicted_segments >= 1 and disk.counters.evicted_blocks > 0
    assert all(read(disk, k) == bytes(d) for k, d, _ in later[-10:])  # the newest are there
    assert all(read(disk, k) == bytes(d) for k, d, _ in first[:3])  # read lately: kept
    assert not disk.contains([later[5][0]])[0]  # in segment 2
    files = sorted(tmp_path.glob("seg-*.kvs"))
    assert sum(f.stat().st_size for f in files) <= 16 << 20


def test_refuses_a_directory_of_someone_else(tmp_path):
    (tmp_path / "seg-00000001.kvs").write_bytes(b"not ours")
    with pytest.raises(ConfigError, match=r"no kvpool-disk\.id"):
        tier(tmp_path)
    with pytest.raises(ConfigError, match="at least"):
        DiskTier(tmp_path / "small", 4 << 20, segment_bytes=SEGMENT)


def test_reads_into_arena_sized_buffers_and_refuse_small_ones(tmp_path):
    disk = tier(tmp_path)
    (k, data, checksum) = blocks("b", 1)[0]
    disk.write([(k, data, checksum)])
    big = memoryview(bytearray(1 << 20))
    assert disk.read_into(k, big) == checksum and bytes(big[: len(data)]) == bytes(data)
    assert disk.read_into(k, memoryview(bytearray(10))) is None
    assert np.frombuffer(big, np.uint8)[len(data) :].sum() == 0
    assert os.path.exists(tmp_path / "kvpool-disk.id")


def test_a_footer_read_a_chunk_at_a_time_finds_every_record(tmp_path, monkeypatch):
    """A sealed segment's footer is parsed in chunks (a start allocates what was written,
    never what a trailer claims): entries cut by a chunk's end are read whole, and a footer
    that does not check out is scanned instead."""
    import kvpool.tiers.disk as disk_module

    monkeypatch.setattr(disk_module, "FOOTER_CHUNK_BYTES", 1000)  # entries straddle chunks
    disk = tier(tmp_path)
    written = blocks("c", 300, size=512)
    assert disk.write(written) == 300
    disk.close()  # sealed: one footer of 300 entries, over many chunks
    again = tier(tmp_path)
    assert len(again) == 300 and again.counters.torn_records == 0
    assert all(read(again, k, 512) == bytes(d) for k, d, _ in written)
    again.close()
    (segment,) = tmp_path.glob("seg-*.kvs")
    with open(segment, "r+b") as f:  # one byte of the footer's last entry
        f.seek(segment.stat().st_size - disk_module.TRAILER.size - 20)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    third = tier(tmp_path)
    assert len(third) == 300  # the records, header by header
    assert all(read(third, k, 512) == bytes(d) for k, d, _ in written)
