"""Version stamps (kvpool.formats): each persistent format of a node, written with real
files, read back; a file of the previous format is adopted and migrated in place; one of a
format this release does not read, or whose stamp is damaged, is refused at start with a
message naming both versions and how to empty the node.  The bucket's objects are tested in
tests/tiers/test_objects.py, a whole 0.1.0 node in tests/node/test_upgrade.py."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
import xxhash

from kvpool.config import PAGE_BYTES
from kvpool.errors import FormatError
from kvpool.formats import (
    ARENA,
    DISK_SEGMENT,
    DISK_TIER,
    JOURNAL,
    RELEASE,
    STAMP_BYTES,
    Stamp,
    pack_stamp,
    unpack_stamp,
)
from kvpool.store import arena as arena_module
from kvpool.store import journal as journal_module
from kvpool.store.arena import Arena
from kvpool.store.block_store import BlockStore
from kvpool.store.journal import Journal, read_journal
from kvpool.tiers import disk as disk_module
from kvpool.tiers.disk import DiskTier
from tests.helpers import key

ARENA_BYTES = 16 * PAGE_BYTES


def _refused(excinfo: pytest.ExceptionInfo[FormatError], *names: str) -> None:
    message = str(excinfo.value)
    assert "--fresh" in message, message
    for name in names:
        assert name in message, message


# -- the stamp ----------------------------------------------------------------------------


def test_a_stamp_names_its_version_and_writer() -> None:
    data = pack_stamp(b"KVTEST\0\0", 2)
    assert len(data) == STAMP_BYTES
    assert unpack_stamp(data, b"KVTEST\0\0", ARENA, "f") == Stamp(2, RELEASE)


def test_a_stamp_of_a_version_outside_the_window_is_refused() -> None:
    with pytest.raises(FormatError) as excinfo:
        unpack_stamp(pack_stamp(b"KVTEST\0\0", 7, "9.1.0"), b"KVTEST\0\0", ARENA, "f")
    _refused(excinfo, "format 7", "9.1.0", RELEASE, "formats 1 to 2")


@pytest.mark.parametrize("at", [0, 8, 12, STAMP_BYTES - 1])
def test_a_damaged_stamp_is_refused(at: int) -> None:
    data = bytearray(pack_stamp(b"KVTEST\0\0", 2))
    data[at] ^= 0x04  # the magic, the version, the writer, the checksum
    with pytest.raises(FormatError) as excinfo:
        unpack_stamp(data, b"KVTEST\0\0", ARENA, "f")
    _refused(excinfo, "damaged")


# -- the arena ----------------------------------------------------------------------------


def _arena(path: Path) -> Arena:
    arena = Arena(path, ARENA_BYTES)
    arena.close()
    return arena


def test_a_new_arena_carries_a_header_page_past_its_blocks(tmp_path: Path) -> None:
    path = tmp_path / "arena"
    arena = _arena(path)
    assert arena.found is None
    assert path.stat().st_size == ARENA_BYTES + PAGE_BYTES
    again = _arena(path)
    assert again.is_kept and again.found == Stamp(ARENA.version, RELEASE)


def test_an_arena_of_the_previous_format_is_kept_and_migrated(tmp_path: Path) -> None:
    path = tmp_path / "arena"
    path.write_bytes(b"\xab" * ARENA_BYTES)  # 0.1.0's: the blocks alone
    arena = Arena(path, ARENA_BYTES)
    try:
        assert arena.is_kept and arena.found == Stamp(1, "")
        assert _arena_found(path) == Stamp(1, "")  # nothing written before commit()
        assert path.stat().st_size == ARENA_BYTES  # nor grown: an earlier release adopts it
        arena.commit()
        assert bytes(arena.slice(0, 4)) == b"\xab" * 4  # the blocks did not move
    finally:
        arena.close()
    assert path.stat().st_size == ARENA_BYTES + PAGE_BYTES
    assert _arena(path).found == Stamp(ARENA.version, RELEASE)


def _arena_found(path: Path) -> Stamp:
    fd = os.open(path, os.O_RDONLY)
    try:
        return arena_module._read_stamp(fd, ARENA_BYTES, path)
    finally:
        os.close(fd)


def test_an_arena_whose_header_page_was_added_but_not_written_is_the_previous_format(
    tmp_path: Path,
) -> None:
    path = tmp_path / "arena"
    path.write_bytes(b"\xab" * ARENA_BYTES + bytes(PAGE_BYTES))  # a migration cut short
    assert _arena(path).found == Stamp(1, "")


def test_an_arena_of_a_newer_format_is_refused_and_left_whole(tmp_path: Path) -> None:
    path = tmp_path / "arena"
    header = pack_stamp(arena_module.HEADER_MAGIC, 3, "0.9.0") + struct.pack("<Q", ARENA_BYTES)
    original = b"\xab" * ARENA_BYTES + header + bytes(PAGE_BYTES - len(header))
    path.write_bytes(original)
    with pytest.raises(FormatError) as excinfo:
        Arena(path, ARENA_BYTES)
    _refused(excinfo, "arena format 3", "0.9.0", RELEASE)
    assert path.read_bytes() == original  # refused, not replaced


def test_an_arena_with_a_damaged_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "arena"
    _arena(path)
    with open(path, "r+b") as f:
        f.seek(ARENA_BYTES + 8)  # the version field
        f.write(b"\x09")
    with pytest.raises(FormatError) as excinfo:
        Arena(path, ARENA_BYTES)
    _refused(excinfo, "damaged")


def test_fresh_replaces_an_arena_it_would_refuse(tmp_path: Path) -> None:
    path = tmp_path / "arena"
    path.write_bytes(b"\xab" * ARENA_BYTES + b"\xff" * PAGE_BYTES)
    with pytest.raises(FormatError):
        Arena(path, ARENA_BYTES)
    arena = Arena(path, ARENA_BYTES, fresh=True)
    arena.close()
    assert arena.found is None


# -- the journal --------------------------------------------------------------------------

IDENTITY = (11, 22, 64 * PAGE_BYTES)


def _previous_journal(path: Path, records: list[bytes]) -> None:
    """A journal as 0.1.0 wrote it: the KVPOOLJ1 header, then records (no STAMP)."""
    path.write_bytes(journal_module._header(*IDENTITY, version=1) + b"".join(records))


def _commit(i: int, offset: int) -> bytes:
    return journal_module._record(journal_module.COMMIT, key(i), offset, PAGE_BYTES, 77)


def test_a_journal_of_the_previous_format_is_replayed_and_migrated_in_place(
    tmp_path: Path,
) -> None:
    path = tmp_path / "index"
    _previous_journal(path, [_commit(1, 0), _commit(2, PAGE_BYTES)])
    store = BlockStore(IDENTITY[2], journal=Journal(path, *IDENTITY))
    assert store.counters.adopted == 2
    assert store.journal.found == Stamp(1, "")
    assert path.read_bytes()[:8] == b"KVPOOLJ1"  # nothing written before stamp()
    store.journal.stamp()
    data = path.read_bytes()
    assert data[:8] == b"KVPOOLJ2"  # the header rewritten, the records where they were
    assert read_journal(path).writer == RELEASE
    again = Journal(path, *IDENTITY)
    assert again.found == Stamp(JOURNAL.version, RELEASE)
    assert len(again.replayed) == 2
    size = path.stat().st_size
    again.stamp()
    again.close()
    Journal(path, *IDENTITY).close()
    assert path.stat().st_size == size  # a start of the same release appends nothing


def test_a_migration_cut_short_is_read_as_well(tmp_path: Path) -> None:
    """The STAMP appended, the header not yet rewritten: format 1 with a STAMP."""
    path = tmp_path / "index"
    _previous_journal(path, [_commit(1, 0), journal_module._stamp_record()])
    journal = Journal(path, *IDENTITY)
    assert journal.found == Stamp(1, RELEASE) and len(journal.replayed) == 1


def test_a_journal_of_a_newer_format_is_refused_and_left_whole(tmp_path: Path) -> None:
    path = tmp_path / "index"
    path.write_bytes(journal_module._header(*IDENTITY, version=3) + _commit(1, 0))
    original = path.read_bytes()
    with pytest.raises(FormatError) as excinfo:
        Journal(path, *IDENTITY)
    _refused(excinfo, "journal format 3", RELEASE)
    assert path.read_bytes() == original


@pytest.mark.parametrize("at", [0, 7, 12, 39])
def test_a_journal_with_a_damaged_header_is_refused_not_emptied(tmp_path: Path, at: int) -> None:
    path = tmp_path / "index"
    _previous_journal(path, [_commit(1, 0)])
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01  # the magic, its version byte, the identity, the checksum
    path.write_bytes(data)
    with pytest.raises(FormatError) as excinfo:
        Journal(path, *IDENTITY)
    _refused(excinfo, "damaged")
    assert path.read_bytes() == data


def test_a_compaction_keeps_the_format_and_names_its_writer(tmp_path: Path) -> None:
    path = tmp_path / "index"
    journal = Journal(path, *IDENTITY)
    journal.start_compaction([], {})
    journal.compact_step(lambda _: None)
    journal.close()
    assert path.read_bytes()[:8] == b"KVPOOLJ2"
    assert read_journal(path).writer == RELEASE


def test_fresh_replaces_a_journal_it_would_refuse(tmp_path: Path) -> None:
    path = tmp_path / "index"
    path.write_bytes(b"garbage" * 10)
    with pytest.raises(FormatError):
        Journal(path, *IDENTITY)
    Journal(path, *IDENTITY, fresh=True).close()
    assert Journal(path, *IDENTITY).found == Stamp(JOURNAL.version, RELEASE)
    assert os.path.getsize(path) > 0


# -- the disk tier ------------------------------------------------------------------------

SEGMENT = 4 << 20


def _disk(path: Path) -> DiskTier:
    return DiskTier(path, 16 << 20, segment_bytes=SEGMENT)


def _block(i: int, size: int = 8192) -> tuple[bytes, memoryview, int]:
    k = key(f"disk-{i}")
    data = memoryview(bytes([i % 251]) * size)
    return k, data, xxhash.xxh3_64_intdigest(data)


def _previous_disk(path: Path, blocks: list[tuple[bytes, memoryview, int]]) -> None:
    """A disk tier as 0.1.0 left it after a crash: its bare id, one unsealed segment of
    records without a stamp."""
    path.mkdir(mode=0o700)
    (path / disk_module.ID_FILE).write_text("ab" * 16 + "\n")
    records = b"".join(disk_module._header(k, len(d), c) + bytes(d) for k, d, c in blocks)
    (path / "seg-00000001.kvs").write_bytes(records)


def _read(disk: DiskTier, k: bytes, size: int = 8192) -> bytes | None:
    dst = memoryview(bytearray(size))
    return None if disk.read_into(k, dst) is None else bytes(dst)


def test_a_disk_tier_of_the_previous_format_is_adopted_and_migrated(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    old = [_block(i) for i in range(3)]
    _previous_disk(path, old)
    disk = _disk(path)
    try:
        assert disk.found == Stamp(1, "")
        disk.stamp()
        assert all(_read(disk, k) == bytes(d) for k, d, _ in old)
        assert disk.segment_versions() == {1: 1}
        new = [_block(i) for i in range(3, 6)]
        assert disk.write(new) == 3  # written in this release's format, beside the old
        assert disk.segment_versions() == {1: 1, DISK_SEGMENT.version: 1}
    finally:
        disk.close()
    line = (path / disk_module.ID_FILE).read_text()
    assert line.startswith(
        f"kvpool-disk format={DISK_TIER.version} kvpool={RELEASE} id={'ab' * 16}"
    )
    new_segment = path / "seg-00000002.kvs"
    assert new_segment.read_bytes()[:8] == disk_module.SEGMENT_MAGIC
    again = _disk(path)
    try:
        assert again.found == Stamp(DISK_TIER.version, RELEASE)
        assert all(_read(again, k) == bytes(d) for k, d, _ in old + new)
    finally:
        again.close()


def test_a_disk_tier_of_a_newer_format_is_refused_and_left_whole(tmp_path: Path) -> None:
    path = tmp_path / "disk"
    disk = _disk(path)
    disk.write([_block(1)])
    disk.close()
    marker = path / disk_module.ID_FILE
    body = f"kvpool-disk format=3 kvpool=0.9.0 id={'cd' * 16}"
    marker.write_text(f"{body} check={xxhash.xxh3_64_intdigest(body.encode()):016x}\n")
    names = sorted(p.name for p in path.iterdir())
    with pytest.raises(FormatError) as excinfo:
        _disk(path)
    _refused(excinfo, "disk tier format 3", "0.9.0", RELEASE)
    assert sorted(p.name for p in path.iterdir()) == names  # nothing deleted


@pytest.mark.parametrize("damage", ["format=2", "kvpool=", "check="])
def test_a_disk_tier_with_a_damaged_identity_is_refused(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "disk"
    _disk(path).close()
    marker = path / disk_module.ID_FILE
    text = marker.read_text()
    at = text.index(damage) + len(damage)
    marker.write_text(text[:at] + ("7" if text[at] != "7" else "8") + text[at + 1 :])
    with pytest.raises(FormatError) as excinfo:
        _disk(path)
    _refused(excinfo, "damaged")


@pytest.mark.parametrize("version", [3, None])  # a newer format, a damaged stamp
def test_a_segment_it_cannot_read_is_not_adopted(tmp_path: Path, version: int | None) -> None:
    path = tmp_path / "disk"
    disk = _disk(path)
    disk.write([_block(1)])
    disk.close()
    segment = path / "seg-00000001.kvs"
    data = bytearray(segment.read_bytes())
    if version is None:
        data[8] ^= 0x01
    else:
        data[:STAMP_BYTES] = pack_stamp(disk_module.SEGMENT_MAGIC, version)
    segment.write_bytes(data)
    again = _disk(path)
    try:
        assert len(again) == 0 and again.counters.unreadable_segments == 1
        assert not segment.exists()
        again.write([_block(2)])  # a new segment never takes the old one's number
        assert (path / "seg-00000002.kvs").exists()
    finally:
        again.close()
