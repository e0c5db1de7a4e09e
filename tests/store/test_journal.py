"""One test per rule in kvpool.store.journal's docstring, with real files."""

from kvpool.config import PAGE_BYTES
from kvpool.errors import Status
from kvpool.store.allocator import SegregatedFitAllocator
from kvpool.store.block_store import BlockStore
from kvpool.store.journal import COMPACT_MIN_BYTES, COMPACT_MIN_RECORDS, Entry, Journal
from tests.helpers import key

ARENA = 64 * PAGE_BYTES
IDENTITY = (11, 22, ARENA)


def journal(tmp_path, **kw):
    return Journal(tmp_path / "index", *IDENTITY, **kw)


def store_on(tmp_path, **kw):
    return BlockStore(ARENA, journal=journal(tmp_path, **kw), high_watermark=1, low_watermark=1)


def small_store(path):
    return BlockStore(
        4 * PAGE_BYTES,
        journal=Journal(path, 1, 2, 4 * PAGE_BYTES),
        high_watermark=1,
        low_watermark=1,
    )


def put(store, keys, size=PAGE_BYTES, checksum=7):
    result = store.reserve(keys, [size] * len(keys), owner=1)
    store.commit(result.reservation_id, [checksum] * len(keys), owner=1)
    return result


def test_rule1_commits_are_journaled_before_they_are_acknowledged(tmp_path):
    store = store_on(tmp_path)
    result = put(store, [key(1), key(2)], checksum=99)
    # No close, no flush: what a kill -9 right after the commit returned leaves behind.
    again = store_on(tmp_path)
    assert again.lookup([key(1), key(2)]) == (2, False)
    block = again.get_block(key(2))
    assert block.offset == result.blocks[1].offset and block.checksum == 99
    assert again.counters.adopted == 2


def test_rule2_removals_are_journaled_before_the_memory_is_reused(tmp_path):
    store = store_on(tmp_path)
    put(store, [key(1)])
    assert store.delete([key(1)]) == [Status.OK]
    put(store, [key(2)])  # may reuse key 1's memory: the journal already said it is gone
    again = store_on(tmp_path)
    assert again.lookup([key(1)]) == (0, False) and again.lookup([key(2)]) == (1, False)
    # Evictions, too: a full arena evicts, and only what is live is adopted.
    small = BlockStore(4 * PAGE_BYTES, journal=Journal(tmp_path / "small", 1, 2, 4 * PAGE_BYTES))
    for i in range(10):
        put(small, [key(f"e{i}")])
    adopted = BlockStore(4 * PAGE_BYTES, journal=Journal(tmp_path / "small", 1, 2, 4 * PAGE_BYTES))
    live = [i for i in range(10) if adopted.lookup([key(f"e{i}")])[0]]
    assert live == [i for i in range(10) if small.lookup([key(f"e{i}")])[0]] and len(live) >= 3
    offsets = sorted(adopted.get_block(key(f"e{i}")).offset for i in live)
    assert len(set(offsets)) == len(live)  # no two adopted blocks share memory


def test_rule3_reservations_are_never_adopted(tmp_path):
    store = store_on(tmp_path)
    store.reserve([key("half")], [PAGE_BYTES], owner=1)  # being filled when the daemon died
    again = store_on(tmp_path)
    assert again.lookup([key("half")]) == (0, False) and again.used_bytes == 0


def test_rule4_a_torn_tail_is_cut_off_and_the_journal_goes_on(tmp_path):
    store = store_on(tmp_path)
    put(store, [key(1)])
    put(store, [key(2)])
    path = tmp_path / "index"
    size = path.stat().st_size
    with open(path, "r+b") as f:  # the last record half-written, as a crash would leave it
        f.truncate(size - 10)
    again = store_on(tmp_path)
    assert again.lookup([key(1)]) == (1, False) and again.lookup([key(2)]) == (0, False)
    assert again.journal.replayed.num_torn_bytes > 0
    put(again, [key(3)])  # appended after the cut, readable next time
    assert store_on(tmp_path).lookup([key(1), key(3)]) == (2, False)
    with open(path, "r+b") as f:  # a garbled byte in the middle ends the replay there
        f.seek(60)
        byte = f.read(1)
        f.seek(60)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert store_on(tmp_path).lookup([key(1)]) == (0, False)


def test_rule5_replay_restores_the_lru_order(tmp_path):
    store = small_store(tmp_path / "lru")
    put(store, [key("a"), key("b"), key("c"), key("d")])
    store.delete([key("a")])
    put(store, [key("a")])  # now the newest
    again = small_store(tmp_path / "lru")
    put(again, [key("e")])  # evicts the oldest adopted block: b
    assert again.lookup([key("b")]) == (0, False)
    assert all(again.lookup([key(k)])[0] for k in "acde")


def test_rule6_compaction_keeps_what_is_live(tmp_path):
    store = store_on(tmp_path)
    store.describe(b"n" * 16, "model-x")
    for i in range(COMPACT_MIN_RECORDS + 10):  # churn: the journal grows, the live set not
        put(store, [key(f"c{i % 3}")])
        store.delete([key(f"c{i % 3}")])
    put(store, [key("kept")])
    assert store.journal.num_records < COMPACT_MIN_RECORDS  # it was compacted
    assert not (tmp_path / "index.new").exists()
    again = store_on(tmp_path)
    assert again.lookup([key("kept")]) == (1, False) and len(again) == 1
    assert again.namespaces.labels() == {b"n" * 16: "model-x"}  # labels survive too


def test_rule6_label_changes_are_compacted_by_the_bytes_they_take(tmp_path):
    """A label's record is ten times a block's: a journal that grows by label changes alone
    (4 MB of them here, with no commit in between) is compacted from the labels' own
    appends, by its bytes, and keeps one record per labelled namespace."""
    store = store_on(tmp_path)
    put(store, [key("kept")])
    labels = ["a" * 1000, "b" * 1000]
    for i in range(4000):
        store.describe(b"n" * 16, labels[i % 2])
    assert (tmp_path / "index").stat().st_size <= 2 * COMPACT_MIN_BYTES
    again = store_on(tmp_path)
    assert again.namespaces.labels() == {b"n" * 16: labels[1]}
    assert again.lookup([key("kept")]) == (1, False)


def test_rule6_a_compaction_keeps_blocks_still_being_sealed(tmp_path):
    """A block filled and acknowledged, whose seal is still running when other commits
    compact the journal, is still named after it: a crash then finds it (to hash and
    adopt); once sealed and committed, it is named once, as a commit."""
    store = store_on(tmp_path)
    sealing = store.reserve([key("sealing")], [PAGE_BYTES], owner=1)
    [block] = store.take(sealing.reservation_id, owner=1)
    store.journal.filled([Entry(block.key, block.offset, block.size, None)])
    for i in range(COMPACT_MIN_RECORDS + 10):
        put(store, [key(f"c{i % 3}")])
        store.delete([key(f"c{i % 3}")])
    assert store.journal.num_records < COMPACT_MIN_RECORDS  # it was compacted
    replayed = journal(tmp_path).replayed.entries
    assert Entry(block.key, block.offset, block.size, None) in replayed
    store.publish([block], [1234])
    for i in range(COMPACT_MIN_RECORDS + 10):
        put(store, [key(f"d{i % 3}")])
        store.delete([key(f"d{i % 3}")])
    replayed = journal(tmp_path).replayed.entries
    assert [e for e in replayed if e.key == block.key] == [
        Entry(block.key, block.offset, block.size, 1234)
    ]


def test_rule7_a_journal_of_another_arena_is_discarded(tmp_path):
    store = store_on(tmp_path)
    put(store, [key(1)])
    other = BlockStore(ARENA, journal=Journal(tmp_path / "index", 11, 23, ARENA))  # new inode
    assert len(other) == 0
    fresh = store_on(tmp_path, fresh=True)
    assert len(fresh) == 0


def test_allocator_adopts_extents_and_refuses_overlaps():
    allocator = SegregatedFitAllocator(16 * PAGE_BYTES)
    taken = allocator.adopt(
        [(4 * PAGE_BYTES, PAGE_BYTES), (0, 2 * PAGE_BYTES), (PAGE_BYTES, PAGE_BYTES), (100, 10)]
    )
    assert taken.tolist() == [True, True, False, False]  # overlapping, misaligned: refused
    assert allocator.used == 3 * PAGE_BYTES
    got = {allocator.allocate(PAGE_BYTES) for _ in range(13)}
    assert len(got) == 13 and not got & {0, PAGE_BYTES, 4 * PAGE_BYTES}
    assert allocator.allocate(PAGE_BYTES) is None


def test_a_journal_naming_keys_longer_than_the_index_holds_is_adopted_without_them(tmp_path):
    """A damaged journal may name keys of up to 255 bytes (its own bound): those blocks are
    not adopted (the index holds keys of at most the protocol's 80 bytes), the rest are, and
    no other block's key is overwritten; a store refuses such a key from any other path."""
    too_long = b"k" * 200
    store = store_on(tmp_path)
    put(store, [key(1)])
    store.journal.committed([Entry(too_long, 8 * PAGE_BYTES, PAGE_BYTES, 5)])
    put(store, [key(2)])
    again = store_on(tmp_path)
    assert again.lookup([key(1), key(2)]) == (2, False) and again.lookup([too_long]) == (0, False)
    assert again.get_block(key(1)).key == key(1) and again.get_block(key(2)).key == key(2)
    assert again.reserve([too_long], [PAGE_BYTES], owner=1).statuses == [Status.REFUSED]
