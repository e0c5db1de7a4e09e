"""The store's cost grows with the work a request does, never with the blocks it holds.

Counted, not timed: an eviction of k blocks must visit O(k) entries of the eviction order,
however many blocks are held, pinned, or owned by other tenants; a journal compaction is
written a bounded step per commit, never the whole index at once."""

from __future__ import annotations

import multiprocessing
import os
import random
from concurrent.futures import ProcessPoolExecutor

import pytest

from kvpool.config import PAGE_BYTES
from kvpool.errors import Status
from kvpool.store.allocator import SegregatedFitAllocator
from kvpool.store.block_store import BlockStore
from kvpool.store.journal import COMPACT_STEP, RECORD, Journal
from kvpool.store.policies import NAME_TO_POLICY, new_policy
from kvpool.store.space import TRIM_STEP
from kvpool.tenants import Tenant
from tests.helpers import rss_anon_kib

NUM_BLOCKS = 100_000
BATCH = 256
K = 10  # blocks each eviction below must make room for
C = 4  # entries an eviction may visit per block it evicts (plus a small constant)


class CountingPolicy:
    """A policy of the store's, counting the candidates an eviction pass visits."""

    def __init__(self, name: str = "lru") -> None:
        self.inner = new_policy(name)
        self.visited = 0

    def victims(self, *args):
        for key in self.inner.victims(*args):
            self.visited += 1
            yield key

    def __getattr__(self, name):
        return getattr(self.inner, name)


def key_of(i: int, tag: bytes = b"\0\0\0\0") -> bytes:
    return tag + i.to_bytes(28, "big")


def put(store: BlockStore, keys: list[bytes]) -> list[Status]:
    result = store.reserve(keys, [PAGE_BYTES] * len(keys), owner=1)
    if result.reservation_id:
        store.commit(result.reservation_id, [7] * len(keys), owner=1)
    return result.statuses


def fill(store: BlockStore, keys: list[bytes]) -> None:
    for start in range(0, len(keys), BATCH):
        put(store, keys[start : start + BATCH])


def pin_the_oldest_half(store: BlockStore) -> None:
    """Pin the oldest half of a full store's blocks, then let writes replace the rest: the
    pinned blocks are the least recently used ones (long-running reads)."""
    half = NUM_BLOCKS // 2
    keys = [key_of(i) for i in range(half)]
    for start in range(0, half, BATCH):
        assert store.pin(keys[start : start + BATCH], owner=2, lease_s=600).pin_id
    fill(store, [key_of(NUM_BLOCKS + i) for i in range(half)])
    assert store.lookup(keys) == (half, False)


def full_store(policy: CountingPolicy, **kw) -> BlockStore:
    store = BlockStore(
        NUM_BLOCKS * PAGE_BYTES, eviction=policy, high_watermark=1.0, low_watermark=1.0, **kw
    )
    fill(store, [key_of(i) for i in range(NUM_BLOCKS)])
    assert len(store) == NUM_BLOCKS and store.used_bytes == store.capacity
    return store


POLICIES = pytest.mark.parametrize("policy_name", sorted(NAME_TO_POLICY))


@POLICIES
def test_evicting_k_blocks_skips_pinned_ones_without_visiting_them(policy_name):
    policy = CountingPolicy(policy_name)
    store = full_store(policy)
    pin_the_oldest_half(store)
    for round in range(3):  # not just once: what one pass skipped is not rescanned either
        policy.visited = 0
        evictions = store.counters.evictions
        fresh = [key_of(2 * NUM_BLOCKS + round * K + i) for i in range(K)]
        for k in fresh:  # one at a time: no batch extent, an eviction per block
            assert put(store, [k]) == [Status.OK]
        assert store.counters.evictions - evictions == K
        assert policy.visited <= C * K + 8, policy.visited
    assert store.lookup([key_of(0)]) == (1, False)  # pinned: kept
    assert store.lookup([key_of(NUM_BLOCKS)]) == (0, False)  # oldest unpinned: gone


@POLICIES
def test_the_watermark_trim_visits_what_it_evicts(policy_name):
    policy = CountingPolicy(policy_name)
    store = full_store(policy)
    pin_the_oldest_half(store)
    store.space.high_watermark = (NUM_BLOCKS - 1) / NUM_BLOCKS
    store.space.low_watermark = (NUM_BLOCKS - 1 - K) / NUM_BLOCKS
    policy.visited = 0
    evictions = store.counters.evictions
    assert put(store, [key_of(2 * NUM_BLOCKS)]) == [Status.OK]  # past the high watermark
    evicted = store.counters.evictions - evictions
    assert K <= evicted <= K + 2
    assert policy.visited <= C * evicted + 8, policy.visited


@POLICIES
def test_a_tenants_eviction_never_walks_another_tenants_blocks(policy_name):
    policy = CountingPolicy(policy_name)
    num_b = NUM_BLOCKS - 1000
    alpha = Tenant("a", b"salt-a-0123456789", 1000 * PAGE_BYTES)
    beta = Tenant("b", b"salt-b-0123456789", num_b * PAGE_BYTES)
    a, b = alpha.tag, beta.tag
    store = BlockStore(
        NUM_BLOCKS * PAGE_BYTES, eviction=policy, high_watermark=1.0, low_watermark=1.0
    )
    store.accounts.set_tenants([alpha, beta], held_bytes=0, prefetch_bytes=0)
    store.recount_quotas()
    fill(store, [key_of(i, b) for i in range(num_b)])  # the oldest: all of tenant B
    fill(store, [key_of(i, a) for i in range(1000)])  # tenant A at its quota
    assert store.quotas is not None and store.quotas.room(key_of(0, a), PAGE_BYTES)
    policy.visited = 0
    for i in range(K):  # A's own LRU blocks make room, one put at a time
        assert put(store, [key_of(1000 + i, a)]) == [Status.OK]
    assert store.counters.evictions == K
    assert policy.visited <= C * K + 8, policy.visited
    assert store.lookup([key_of(0, b)]) == (1, False)  # B is within its quota: untouched
    assert store.lookup([key_of(0, a)]) == (0, False)


@pytest.mark.parametrize("crash", [False, True])
def test_a_compaction_is_written_a_step_per_commit_and_stays_crash_safe(tmp_path, crash):
    """A large journal is compacted a bounded step per call that appends (a commit, a
    delete); blocks removed or added while it runs are described right, and a crash mid-way
    keeps the old journal whole."""
    num_live = 5 * COMPACT_STEP
    arena = 2 * num_live * PAGE_BYTES

    def open_store() -> BlockStore:
        journal = Journal(tmp_path / "index", 1, 2, arena)
        return BlockStore(arena, journal=journal, high_watermark=1, low_watermark=1)

    store = open_store()
    live = [key_of(i) for i in range(num_live)]
    fill(store, live)
    churn = 0
    deleted: list[bytes] = []  # a key the call that started the compaction deleted
    while not store.journal.compacting:  # deletes and re-puts grow the journal, not the index
        k = live[churn % num_live]
        store.delete([k])
        deleted = [k]
        if not store.journal.compacting:
            put(store, deleted)
            deleted = []
        churn += 1
    new = tmp_path / "index.new"
    record_bytes = RECORD.size + 32 + 8
    assert new.stat().st_size <= (COMPACT_STEP + 64) * record_bytes  # one step, not all
    if deleted:
        put(store, deleted)
    # While it runs: some blocks leave, some come; a few steps pass.
    gone = live[: 3 * BATCH]
    store.delete(gone)
    came = [key_of(num_live + i) for i in range(BATCH)]
    put(store, came)
    assert store.journal.compacting
    expected = set(live[3 * BATCH :]) | set(came)
    if crash:  # killed mid-way: the next daemon replays the old journal, drops the snapshot
        again = open_store()
        assert not new.exists()
    else:
        while store.journal.compacting:
            put(store, [key_of(10 * num_live + churn)])
            expected.add(key_of(10 * num_live + churn))
            churn += 1
        assert not new.exists()
        assert store.journal.num_records < 2 * len(expected)  # the churn is gone
        again = open_store()
    assert {b.key for b in again.committed_blocks()} == expected


def test_a_trim_evicts_a_bounded_step_per_call_until_the_low_watermark():
    """The gap between the watermarks is a share of the whole arena: one request must not
    evict all of it; each call takes a bounded step, and later calls go on until done."""
    store = BlockStore(NUM_BLOCKS * PAGE_BYTES, high_watermark=0.95, low_watermark=0.90)
    fill(store, [key_of(i) for i in range(int(0.95 * NUM_BLOCKS))])
    assert store.counters.evictions == 0
    calls = 0
    while store.used_bytes > 0.90 * store.capacity:
        evictions = store.counters.evictions
        assert put(store, [key_of(NUM_BLOCKS + calls)]) == [Status.OK]
        assert store.counters.evictions - evictions <= TRIM_STEP
        calls += 1
    assert calls > 1 and store.counters.evictions >= 0.05 * NUM_BLOCKS
    evictions = store.counters.evictions
    put(store, [key_of(2 * NUM_BLOCKS)])  # back under the low watermark: no more trimming
    assert store.counters.evictions == evictions


def test_adopting_in_bulk_takes_what_one_extent_at_a_time_takes():
    """A restart adopts millions of extents at once; a damaged journal's (overlapping,
    misaligned, outside the arena) are refused as one by one, in offset order."""
    rng = random.Random(7)
    total_pages = 4096
    extents = [
        (rng.randrange(0, total_pages + 8) * PAGE_BYTES, rng.randrange(1, 5 * PAGE_BYTES))
        for _ in range(3000)
    ]
    extents += [(PAGE_BYTES + 1, 10), (0, 0)]  # misaligned; empty (one page)
    rng.shuffle(extents)
    expected = [False] * len(extents)
    cursor = 0
    for i in sorted(range(len(extents)), key=lambda i: extents[i][0]):
        offset, size = extents[i]
        start, num_pages = offset // PAGE_BYTES, max(1, -(-size // PAGE_BYTES))
        if offset % PAGE_BYTES == 0 and start >= cursor and start + num_pages <= total_pages:
            expected[i], cursor = True, start + num_pages
    allocator = SegregatedFitAllocator(total_pages * PAGE_BYTES)
    assert allocator.adopt(extents).tolist() == expected
    adopted = [size for (_, size), ok in zip(extents, expected, strict=True) if ok]
    held = sum(max(1, -(-size // PAGE_BYTES)) for size in adopted)
    assert allocator.used == held * PAGE_BYTES
    # What was not adopted is free, and only that: allocation fills exactly the rest.
    while allocator.allocate(PAGE_BYTES) is not None:
        pass
    assert allocator.used == allocator.capacity
    for offset, ok in zip(extents, expected, strict=True):
        if ok:
            allocator.free(offset[0])
    assert allocator.used == (total_pages - held) * PAGE_BYTES


def test_the_index_says_what_memory_it_takes_and_keeps_within_200_bytes_a_block():
    """``metadata_bytes`` (for status and metrics) follows what the process's resident heap
    really grew by (the index's columns are mapped memory, outside Python's allocator, so
    measured as RssAnon), and a block held costs at most 200 bytes of it (issue 29).  Slots
    freed by deletes are reused: refilling takes no more.

    Measured in a process of its own (a fresh one is the point): in a pytest worker, what
    earlier tests left (their threads, their garbage) may free memory during the fill and
    make the heap's growth look smaller than it is, or negative."""
    num_blocks = 50_000
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn) as process:
        m = process.submit(_heap_of_an_index, num_blocks).result(timeout=120)
    assert 0.7 * m["grown"] <= m["estimated"] <= 1.3 * m["grown"], m
    assert m["grown"] / num_blocks <= 200, m
    assert m["refilled_metadata"] <= 1.01 * (m["empty"] + m["estimated"]), m  # the same slots
    assert m["refilled_grown"] <= 1.1 * m["grown"], m


def _heap_of_an_index(num_blocks: int) -> dict[str, int]:
    store = BlockStore(NUM_BLOCKS * PAGE_BYTES)
    empty = store.metadata_bytes()
    keys = [key_of(i) for i in range(2 * num_blocks)]  # made before measuring: the caller's
    before = rss_anon_kib(os.getpid()) * 1024
    fill(store, keys[:num_blocks])
    grown = rss_anon_kib(os.getpid()) * 1024 - before
    estimated = store.metadata_bytes() - empty
    store.delete(keys[:num_blocks])
    fill(store, keys[num_blocks:])
    return {
        "empty": empty,
        "grown": grown,
        "estimated": estimated,
        "refilled_metadata": store.metadata_bytes(),
        "refilled_grown": rss_anon_kib(os.getpid()) * 1024 - before,
    }
