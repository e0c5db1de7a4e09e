"""The shared directory: the node lists and withdraws blocks, readers in other mappings find
them and learn whether a copy held (the rules in kvpool.directory)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import directory as d
from kvpool.directory import DirectoryReader, DirectoryWriter

pytestmark = pytest.mark.skipif(not d.SUPPORTED, reason="readers use the directory on x86-64")

ARENA_BYTES = 64 << 20


def make(tmp_path: Path, num_slots: int | None = None) -> tuple[DirectoryWriter, DirectoryReader]:
    arena_id = secrets.token_bytes(16)
    writer = DirectoryWriter(tmp_path / "directory", ARENA_BYTES, arena_id, num_slots=num_slots)
    reader = DirectoryReader.open(str(writer.path), arena_id, ARENA_BYTES)
    assert reader is not None
    return writer, reader


def key(i: int) -> bytes:
    return b"n" * 16 + i.to_bytes(32, "big")


def test_listed_blocks_are_found_where_they_lie(tmp_path):
    writer, reader = make(tmp_path)
    for i in range(500):
        assert writer.list(key(i), i * 8192, 4096 + i)
    for i in range(500):
        found = reader.find(key(i))
        assert found is not None and found[2:] == (i * 8192, 4096 + i)
    assert reader.find(key(500)) is None
    assert reader.find_all([key(1), key(2)]) is not None
    assert reader.find_all([key(1), key(500)]) is None


def test_rule2_a_withdrawn_block_changes_its_generation(tmp_path):
    writer, reader = make(tmp_path)
    writer.list(key(1), 0, 4096)
    writer.list(key(2), 4096, 4096)
    locations = reader.find_all([key(1), key(2)])
    assert locations is not None and reader.unchanged(locations)
    writer.withdraw(key(2))
    assert not reader.unchanged(locations)  # a copy taken meanwhile is refused
    assert reader.find(key(2)) is None
    # Listed again at the same place, it is a new generation: the old copy stays refused.
    writer.list(key(2), 4096, 4096)
    assert not reader.unchanged(locations)
    again = reader.find_all([key(1), key(2)])
    assert again is not None and reader.unchanged(again)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 23)), max_size=200))
def test_removals_keep_every_other_block_findable(tmp_path_factory, operations):
    # A 16-slot table for 24 keys: long probe runs that wrap, and removals that shift
    # entries back towards their homes.
    writer, reader = make(tmp_path_factory.mktemp("dir"), num_slots=16)
    listed: dict[bytes, int] = {}
    for add, i in operations:
        k = key(i)
        if add:
            if writer.list(k, i * 4096, 100 + i):
                listed[k] = i
            else:
                listed.pop(k, None)
        else:
            writer.withdraw(k)
            listed.pop(k, None)
        for k, j in listed.items():
            found = reader.find(k)
            assert found is not None and found[2:] == (j * 4096, 100 + j)
    assert len(writer) == len(listed)
    for i in range(24):
        if key(i) not in listed:
            assert reader.find(key(i)) is None


def test_a_full_table_lists_nothing_more(tmp_path):
    writer, reader = make(tmp_path, num_slots=64)
    results = [writer.list(key(i), i * 4096, 4096) for i in range(100)]
    assert all(results[: d.MAX_PROBE]) and 0 < results.count(False) <= 100 - d.MAX_PROBE
    assert results.count(True) <= 64 and writer.num_unlisted == results.count(False)
    for i, listed in enumerate(results):
        assert (reader.find(key(i)) is not None) == listed  # not listed: readers ask the node
    # Nearly full, it stops probing at once: never more than all but an eighth of its slots.
    assert results.count(True) <= 64 - 64 // d.FULL_SHARE


def test_offsets_and_sizes_the_format_cannot_hold_are_not_listed(tmp_path):
    writer, _ = make(tmp_path)
    assert not writer.list(key(1), 100, 4096)  # not page-aligned
    assert not writer.list(key(2), 4096, 1 << 33)
    assert writer.num_unlisted == 2


def test_rule3_a_retired_directory_refuses_every_copy(tmp_path):
    writer, reader = make(tmp_path)
    writer.list(key(1), 0, 4096)
    locations = reader.find_all([key(1)])
    assert locations is not None and reader.unchanged(locations)
    # A new daemon starts: it retires the file its predecessor left, then makes its own.
    successor = DirectoryWriter(writer.path, ARENA_BYTES, secrets.token_bytes(16))
    assert reader.is_retired and not reader.unchanged(locations)
    assert successor.path.exists() and len(successor) == 0
    successor.close(remove=True)
    assert not successor.path.exists()


def test_a_reader_maps_only_the_directory_of_its_arena(tmp_path):
    arena_id = secrets.token_bytes(16)
    writer = DirectoryWriter(tmp_path / "directory", ARENA_BYTES, arena_id)
    path = str(writer.path)
    assert DirectoryReader.open(path, arena_id, ARENA_BYTES) is not None
    assert DirectoryReader.open(path, secrets.token_bytes(16), ARENA_BYTES) is None
    assert DirectoryReader.open(path, arena_id, 2 * ARENA_BYTES) is None
    assert DirectoryReader.open("", arena_id, ARENA_BYTES) is None
    assert DirectoryReader.open(str(tmp_path / "nothing"), arena_id, ARENA_BYTES) is None
    (tmp_path / "short").write_bytes(b"x" * 100)
    assert DirectoryReader.open(str(tmp_path / "short"), arena_id, ARENA_BYTES) is None
    writer.close()  # retired on close: nobody maps it any more
    assert DirectoryReader.open(path, arena_id, ARENA_BYTES) is None


def test_table_size_follows_the_arena():
    assert d.num_slots_for(1 << 20) == d.MIN_SLOTS
    assert d.num_slots_for(1 << 30) == 1 << 16
    assert d.num_slots_for(1 << 50) == d.MAX_SLOTS
    with pytest.raises(ValueError):
        DirectoryWriter(Path("/nonexistent/dir"), ARENA_BYTES, b"x" * 16, num_slots=100)
