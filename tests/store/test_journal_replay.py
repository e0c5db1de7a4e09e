"""Replay as columns (kvpool.store.journal's ``Replay``), against a model of its rules, with
real journal files: the order of the live blocks, removals, re-commits, FILLED blocks not
hashed yet, a torn or garbled record inside a long run, keys of several lengths, and
keys whose fingerprints collide."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool import checksum as ck
from kvpool.config import PAGE_BYTES
from kvpool.node.sealing import seal_replayed
from kvpool.store import journal as journal_module
from kvpool.store.arena import Arena
from kvpool.store.journal import Entry, Journal, read_journal
from tests.helpers import key

IDENTITY = (11, 22, 1 << 30)


def open_journal(path, **kw):
    return Journal(path, *IDENTITY, **kw)


def columns(replay):
    """The replay's live blocks, one tuple per block, from its columns."""
    hashed = zip(replay.checksums.tolist(), replay.hashed.tolist(), strict=True)
    checksums = [c if h else None for c, h in hashed]
    return list(
        zip(replay.keys, replay.offsets.tolist(), replay.sizes.tolist(), checksums, strict=True)
    )


def check_columns(replay):
    assert replay.offsets.dtype == np.int64 and replay.sizes.dtype == np.int64
    assert replay.checksums.dtype == np.uint64 and replay.hashed.dtype == np.bool_
    assert len(replay.keys) == len(replay) == len(replay.offsets) == len(replay.hashed)
    assert all(type(k) is bytes for k in replay.keys)
    assert columns(replay) == [tuple(e) for e in replay.entries]  # the compatibility view


def test_live_blocks_in_commit_order_with_removals_and_recommits(tmp_path):
    journal = open_journal(tmp_path / "j")
    journal.committed(Entry(key(i), i * PAGE_BYTES, PAGE_BYTES, 100 + i) for i in range(6))
    journal.removed([key(1), key(4)])
    journal.committed([Entry(key(0), 40 * PAGE_BYTES, 2 * PAGE_BYTES, 7)])  # moves to newest
    journal.committed([Entry(key(4), 44 * PAGE_BYTES, PAGE_BYTES, 8)])  # back after removal
    journal.removed([key("never")])  # a removal of what was never there changes nothing
    journal.close()
    replay = open_journal(tmp_path / "j").replayed
    check_columns(replay)
    assert columns(replay) == [
        (key(2), 2 * PAGE_BYTES, PAGE_BYTES, 102),
        (key(3), 3 * PAGE_BYTES, PAGE_BYTES, 103),
        (key(5), 5 * PAGE_BYTES, PAGE_BYTES, 105),
        (key(0), 40 * PAGE_BYTES, 2 * PAGE_BYTES, 7),
        (key(4), 44 * PAGE_BYTES, PAGE_BYTES, 8),
    ]
    # The block records, and the STAMP that names the release that wrote them.
    assert replay.num_records == 1 + 6 + 2 + 1 + 1 + 1 and replay.num_torn_bytes == 0


def test_filled_blocks_are_not_hashed_until_committed(tmp_path):
    journal = open_journal(tmp_path / "j")
    journal.committed([Entry(key("a"), 0, PAGE_BYTES, 5)])
    journal.filled([Entry(key("b"), PAGE_BYTES, PAGE_BYTES, None)])
    journal.filled([Entry(key("c"), 2 * PAGE_BYTES, PAGE_BYTES, None)])
    journal.committed([Entry(key("c"), 2 * PAGE_BYTES, PAGE_BYTES, 9)])  # its seal ended
    replay = read_journal(tmp_path / "j")
    check_columns(replay)
    assert replay.keys == [key("a"), key("b"), key("c")]
    assert replay.hashed.tolist() == [True, False, True]
    assert replay.checksums.tolist() == [5, 0, 9]


def test_a_garbled_record_inside_a_long_run_ends_the_replay_there(tmp_path):
    """Rule 4 on the bulk path: every record of a run has its checksum verified."""
    path = tmp_path / "j"
    journal = open_journal(path)
    journal.committed(Entry(key(f"{i:04d}"), i * PAGE_BYTES, PAGE_BYTES, i) for i in range(1000))
    journal.close()
    # The records begin after the header and the STAMP naming the release that wrote them.
    start = journal_module.FILE_HEADER_BYTES + len(journal_module._stamp_record())
    record_bytes = (path.stat().st_size - start) // 1000
    with open(path, "r+b") as f:  # flip a byte of record 700's offset
        f.seek(start + 700 * record_bytes + 10)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 1]))
    replay = read_journal(path)
    check_columns(replay)
    assert replay.keys == [key(f"{i:04d}") for i in range(700)] and replay.num_records == 701
    assert replay.num_torn_bytes == 300 * record_bytes
    journal = open_journal(path)  # the journal goes on after the last intact record
    journal.committed([Entry(key("after"), 0, PAGE_BYTES, 1)])
    assert read_journal(path).keys == [*(key(f"{i:04d}") for i in range(700)), key("after")]


def test_a_torn_tail_is_cut_off(tmp_path):
    path = tmp_path / "j"
    journal = open_journal(path)
    journal.committed(Entry(key(i), i * PAGE_BYTES, PAGE_BYTES, i) for i in range(10))
    journal.close()
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 3)
    replay = open_journal(path).replayed
    assert replay.keys == [key(i) for i in range(9)] and replay.num_torn_bytes > 0


def test_seal_replayed_hashes_filled_blocks_inside_the_arena(tmp_path):
    arena = Arena(tmp_path / "arena", 8 * PAGE_BYTES)
    try:
        arena.view[PAGE_BYTES : 2 * PAGE_BYTES] = bytes(range(256)) * (PAGE_BYTES // 256)
        journal = open_journal(tmp_path / "j")
        journal.committed([Entry(key("sealed"), 0, PAGE_BYTES, 1)])
        journal.filled(
            [
                Entry(key("filled"), PAGE_BYTES, PAGE_BYTES, None),
                Entry(key("outside"), 8 * PAGE_BYTES, PAGE_BYTES, None),
            ]
        )
        replay = read_journal(tmp_path / "j")
        assert seal_replayed(replay, arena) == 1
        assert replay.hashed.tolist() == [True, True, False]
        expected = ck.checksum(arena.slice(PAGE_BYTES, PAGE_BYTES))
        assert replay.checksums.tolist() == [1, expected, 0]
    finally:
        arena.close()


def model(ops):
    """What the journal's rules say is live after ``ops``: (key, offset, size, checksum or
    None), oldest commit first."""
    live: dict[bytes, tuple[bytes, int, int, int | None]] = {}
    for kind, k, offset, size, checksum in ops:
        live.pop(k, None)
        if kind == "commit":
            live[k] = (k, offset, size, checksum)
        elif kind == "filled":
            live[k] = (k, offset, size, None)
    return list(live.values())


# Keys of one length (the bulk path) or of several (the dict path), a few, so that they recur.
same_length_keys = st.sampled_from([key(f"k{i:02d}") for i in range(12)])
any_length_keys = st.sampled_from([key("x" * n) for n in (1, 2, 7, 8, 9, 40)] + [key("k00")])


def ops_of(keys):
    return st.lists(
        st.tuples(
            st.sampled_from(["commit", "commit", "filled", "remove"]),
            keys,
            st.integers(0, 1 << 40),
            st.integers(0, 1 << 30),
            st.integers(0, (1 << 64) - 1),
        ),
        max_size=120,
    )


def write(path, ops):
    journal = open_journal(path, fresh=True)
    # Batches as the store writes them: consecutive records of a kind in one write.
    for kind, k, offset, size, checksum in ops:
        if kind == "commit":
            journal.committed([Entry(k, offset, size, checksum)])
        elif kind == "filled":
            journal.filled([Entry(k, offset, size, None)])
        else:
            journal.removed([k])
    journal.labelled(b"n" * 16, "model")
    journal.close()


def colliding(num_groups):
    """A fingerprint that puts keys in ``num_groups`` groups (0: the real one)."""
    if not num_groups:
        return journal_module._fingerprints

    def fingerprints(matrix):
        group = matrix.astype(np.uint64).sum(axis=1) % np.uint64(num_groups)
        return group << np.uint64(60)  # above the bits that carry the record's index

    return fingerprints


@pytest.mark.parametrize(
    ("keys", "num_groups"),
    [(same_length_keys, 0), (same_length_keys, 1), (same_length_keys, 3), (any_length_keys, 0)],
    ids=["one-length", "all-collide", "some-collide", "several-lengths"],
)
def test_replay_follows_the_rules_for_any_sequence(tmp_path_factory, monkeypatch, keys, num_groups):
    """Keys are the clients' to choose: keys that share a fingerprint replay as if they
    did not."""
    monkeypatch.setattr(journal_module, "_fingerprints", colliding(num_groups))

    @settings(max_examples=150, deadline=None)
    @given(ops_of(keys))
    def check(ops):
        path = tmp_path_factory.mktemp("model") / "j"
        write(path, ops)
        replay = read_journal(path)
        check_columns(replay)
        assert columns(replay) == model(ops)
        # Its records, the label, and the STAMP that names the release that wrote them.
        assert replay.num_records == len(ops) + 2 and replay.labels == {b"n" * 16: "model"}

    check()


def test_the_journal_is_mapped_only_while_it_is_replayed(tmp_path):
    """The daemon maps its journal to replay it (no copy of ~90 MB per million records),
    and unmaps it before it truncates a torn tail and appends."""
    path = tmp_path / "j"
    journal = open_journal(path)
    journal.committed(Entry(key(f"{i:04d}"), i * PAGE_BYTES, PAGE_BYTES, i) for i in range(100))
    journal.close()
    with open(path, "ab") as f:
        f.write(b"torn")
    journal = open_journal(path)
    with open("/proc/self/maps") as maps:
        assert str(path) not in maps.read()
    assert len(journal.replayed) == 100 and journal.replayed.num_torn_bytes == 4
    journal.committed([Entry(key("next"), 0, PAGE_BYTES, 1)])
    assert len(read_journal(path)) == 101
