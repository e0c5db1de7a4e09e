"""One test per rule in kvpool.store.block_store's docstring."""

import pytest

from kvpool import directory as d
from kvpool.config import PAGE_BYTES
from kvpool.errors import BadRequest, LeaseExpired, Status
from kvpool.limits import LeaseLimits
from kvpool.store.block_store import BlockStore
from kvpool.store.eviction import LRUPolicy, NoEviction
from kvpool.store.journal import Journal
from kvpool.store.leases import Owner
from tests.helpers import key


@pytest.fixture
def store(clock):
    return BlockStore(32 * PAGE_BYTES, clock=clock, high_watermark=1.0, low_watermark=1.0)


def put(store, keys, owner=1, size=PAGE_BYTES):
    result = store.reserve(keys, [size] * len(keys), owner, 30)
    store.commit(result.reservation_id, [7] * len(keys), owner)


def test_rule1_reserved_keys_are_pending_not_readable(store):
    result = store.reserve([key(1)], [100], owner=1, lease_s=30)
    assert result.statuses == [Status.OK]
    assert store.lookup([key(1)]) == (0, True)
    pinned = store.pin([key(1)], 2, 10)
    assert (pinned.pin_id, pinned.blocks) == (0, [None])
    assert store.reserve([key(1)], [100], owner=2, lease_s=30).statuses == [Status.PENDING]


def test_rule2_commit_is_atomic_and_refused_after_abort(store):
    first = store.reserve([key(1), key(2)], [100, 100], owner=1, lease_s=30)
    assert store.commit(first.reservation_id, [11, 22], owner=1).statuses == [Status.OK] * 2
    assert store.lookup([key(1), key(2)]) == (2, False)
    assert store.get_block(key(2)).checksum == 22
    second = store.reserve([key(3)], [100], owner=1, lease_s=30)
    store.abort(second.reservation_id, owner=1)
    with pytest.raises(LeaseExpired):
        store.commit(second.reservation_id, [1], owner=1)
    assert store.lookup([key(3)]) == (0, False)
    third = store.reserve([key(4)], [100], owner=1, lease_s=30)
    with pytest.raises(LeaseExpired):
        store.commit(third.reservation_id, [1], owner=99)  # not the owner


def test_rule3_expired_reservations_and_gone_owners_return_memory(store, clock):
    store.reserve([key(1)], [PAGE_BYTES * 4], owner=1, lease_s=5)
    store.reserve([key(2)], [PAGE_BYTES * 4], owner=2, lease_s=500)
    assert store.used_bytes == 8 * PAGE_BYTES
    clock.now += 6
    assert store.expire() == 1
    assert store.used_bytes == 4 * PAGE_BYTES and store.lookup([key(1)]) == (0, False)
    store.release_owner(2)
    assert store.used_bytes == 0 and store.reserved_bytes == 0


def test_rule4_pins_block_eviction_until_unpinned_or_expired(clock):
    store = BlockStore(4 * PAGE_BYTES, clock=clock, high_watermark=1.0, low_watermark=1.0)
    put(store, [key(1), key(2), key(3), key(4)])
    blocks = store.pin([key(1)], owner=9, lease_s=10).blocks
    assert blocks[0] is not None and blocks[0].num_pins == 1
    put(store, [key(5)])  # needs one victim: key 1 is oldest but pinned, so key 2 goes
    assert store.lookup([key(1)]) == (1, False) and store.lookup([key(2)]) == (0, False)
    # Deleting a pinned block hides it at once, but its memory stays until the pin drops.
    used = store.used_bytes
    assert store.delete([key(1)]) == [Status.OK]
    assert store.lookup([key(1)]) == (0, False) and store.used_bytes == used
    assert not store.is_current(blocks[0])  # the reader's copy is of a block that left
    clock.now += 11
    store.expire()
    assert store.used_bytes == used - PAGE_BYTES


def test_rule5_leases_are_clamped_to_the_policy(clock):
    store = BlockStore(32 * PAGE_BYTES, clock=clock, leases=LeaseLimits(pin_s=2.0, reserve_s=3.0))
    asked = store.reserve([key(1)], [100], owner=1, lease_s=600)
    assert asked.lease_s == 3.0
    assert store.reserve([key(2)], [100], owner=1).lease_s == 3.0  # 0: the bound
    assert store.reserve([key(3)], [100], owner=1, lease_s=1).lease_s == 1.0  # less is fine
    store.commit(store.reserve([key(4)], [100], owner=1).reservation_id, [7], owner=1)
    assert store.pin([key(4)], owner=2, lease_s=600).lease_s == 2.0
    clock.now += 2.5
    assert store.expire() == 2  # the pin and key 3's reservation
    assert store.num_pinned == 0
    clock.now += 1
    assert store.expire() == 2  # keys 1 and 2, asked for 600 s and 30 s
    assert store.reserved_bytes == 0 and store.lookup([key(1)]) == (0, False)


def test_rule6_lru_eviction_on_demand_and_past_the_high_watermark(clock):
    store = BlockStore(10 * PAGE_BYTES, clock=clock, high_watermark=0.8, low_watermark=0.5)
    for i in range(8):
        put(store, [key(i)])
    store.pin([key(0)], owner=3, lease_s=10)  # touching makes key 0 most recent
    assert store.used_bytes <= 8 * PAGE_BYTES
    put(store, [key(8)])  # passes 80%: evict down to 50%
    assert store.used_bytes <= 5 * PAGE_BYTES
    assert store.lookup([key(0)]) == (1, False)  # pinned and recent: kept
    assert store.lookup([key(1)]) == (0, False)  # oldest: gone
    assert store.counters.evictions >= 4


def test_rule6_a_promotion_leaves_the_trim_to_the_next_clients_write(clock):
    store = BlockStore(10 * PAGE_BYTES, clock=clock, high_watermark=0.5, low_watermark=0.5)
    put(store, [key(i) for i in range(5)])
    promoted = store.reserve([key(9)], [PAGE_BYTES], Owner.PROMOTER, held=True)
    store.commit(promoted.reservation_id, [7], Owner.PROMOTER)
    assert store.counters.evictions == 0 and store.lookup([key(9)]) == (1, False)
    put(store, [key(10)])  # past the high watermark: trimmed back to the low one
    assert store.counters.evictions == 2 and store.used_bytes == 5 * PAGE_BYTES


def test_rule6_nothing_evictable_means_no_space(clock):
    store = BlockStore(2 * PAGE_BYTES, clock=clock, eviction=NoEviction())
    put(store, [key(1), key(2)])
    result = store.reserve([key(3)], [PAGE_BYTES], owner=1, lease_s=30)
    assert result.statuses == [Status.NO_SPACE] and result.reservation_id == 0
    too_big = store.reserve([key(4)], [3 * PAGE_BYTES], owner=1, lease_s=30)
    assert too_big.statuses == [Status.REFUSED]


def test_rule7_existing_keys_are_never_overwritten(store):
    put(store, [key(1)])
    result = store.reserve([key(1), key(2), key(2)], [1, 1, 1], owner=1, lease_s=30)
    assert result.statuses == [Status.EXISTS, Status.OK, Status.PENDING]


def shared_directory(tmp_path, arena_bytes):
    writer = d.DirectoryWriter(tmp_path / "directory", arena_bytes, b"a" * 16)
    reader = d.DirectoryReader(memoryview(writer._mmap).cast("Q"), writer.num_slots, arena_bytes)
    return writer, reader


def test_rule12_sealed_blocks_are_listed_and_withdrawn_before_their_memory_is_reused(
    tmp_path, clock
):
    arena_bytes = 4 * PAGE_BYTES
    writer, reader = shared_directory(tmp_path, arena_bytes)
    store = BlockStore(
        arena_bytes, clock=clock, directory=writer, high_watermark=1.0, low_watermark=1.0
    )
    result = store.reserve([key(1)], [PAGE_BYTES], owner=1, lease_s=30)
    assert reader.find(key(1)) is None  # reserved: not listed
    store.commit(result.reservation_id, [7], owner=1)
    found = reader.find(key(1))
    assert found is not None and found[2:] == (result.blocks[0].offset, PAGE_BYTES)
    located = reader.find_all([key(1)])
    assert located is not None and reader.unchanged(located)
    store.delete([key(1)])
    assert reader.find(key(1)) is None and not reader.unchanged(located)
    # Eviction: the oldest block's memory goes to a newer one only after it is withdrawn.
    for i in range(2, 6):
        put(store, [key(i)])
    oldest = reader.find_all([key(2)])
    assert oldest is not None
    put(store, [key(6)])  # the arena is full: key 2 is evicted, its memory reused
    assert store.get_block(key(6)).offset == int(oldest.offsets[0])
    assert reader.find(key(2)) is None and not reader.unchanged(oldest)
    assert reader.find(key(6)) is not None


def test_rule12_adopted_blocks_are_listed_once_the_node_verified_them(tmp_path):
    arena_bytes = 8 * PAGE_BYTES
    first = BlockStore(arena_bytes, journal=Journal(tmp_path / "index", 1, 2, arena_bytes))
    put(first, [key(1)])
    writer, reader = shared_directory(tmp_path, arena_bytes)
    again = BlockStore(
        arena_bytes, journal=Journal(tmp_path / "index", 1, 2, arena_bytes), directory=writer
    )
    block = again.get_block(key(1))
    assert block is not None and not block.sealed
    assert reader.find(key(1)) is None  # readers hash it through a pin until then
    again.seal(block)
    assert reader.find(key(1)) is not None


def test_rule13_touched_blocks_stay_recently_used(clock):
    store = BlockStore(10 * PAGE_BYTES, clock=clock, high_watermark=0.8, low_watermark=0.5)
    for i in range(8):
        put(store, [key(i)])
    assert len(store.touch([key(0), key("absent")])[0]) == 1  # read through the directory
    assert store.counters.get_hits == 1
    put(store, [key(8)])  # passes 80%: evict down to 50%
    assert store.lookup([key(0)]) == (1, False)  # touched: kept
    assert store.lookup([key(1)]) == (0, False)  # oldest: gone


def test_rule14_a_write_area_becomes_blocks_front_first_and_returns_its_memory(clock):
    store = BlockStore(64 * PAGE_BYTES, clock=clock, high_watermark=1.0, low_watermark=1.0)
    area = store.reserve_area(8 * PAGE_BYTES, owner=1, lease_s=10)
    assert area is not None and store.used_bytes == 8 * PAGE_BYTES
    start = area.offset
    put(store, [key(9)])  # stored already: its place in the area is freed at once
    placed = store.place(
        area.area_id, [key(1), key(9), key(2)], [100, 100, 2 * PAGE_BYTES], 1, False
    )
    assert placed.statuses == [Status.OK, Status.EXISTS, Status.OK]
    assert [b and b.offset for b in placed.blocks] == [start, None, start + 2 * PAGE_BYTES]
    assert store.lookup([key(1), key(2)]) == (0, True)  # pending, as reserved blocks are
    assert (area.offset, area.num_bytes) == (start + 4 * PAGE_BYTES, 4 * PAGE_BYTES)
    assert store.used_bytes == 8 * PAGE_BYTES  # 3 pages of blocks, 4 of area, key 9's
    store.publish(placed.blocks, [1, None, 2])
    assert store.lookup([key(1), key(2)]) == (2, False)
    clock.now += 9  # within the lease: this use renews it
    more = store.place(area.area_id, [key(3)], [PAGE_BYTES], owner=1, keep=False)
    assert more.blocks[0] is not None and more.blocks[0].offset == start + 4 * PAGE_BYTES
    with pytest.raises(LeaseExpired):
        store.place(area.area_id, [key(4)], [PAGE_BYTES], owner=2, keep=False)  # not the owner
    with pytest.raises(BadRequest):
        store.place(area.area_id, [key(4)], [4 * PAGE_BYTES], owner=1, keep=False)  # past its end
    assert area.num_bytes == 3 * PAGE_BYTES and store.lookup([key(4)]) == (0, False)
    store.publish(more.blocks, [3])
    clock.now += 9.5
    assert store.expire() == 0
    clock.now += 1
    assert store.expire() == 1  # the area: its rest returns
    assert store.used_bytes == 5 * PAGE_BYTES and store.reserved_bytes == 0
    with pytest.raises(LeaseExpired):
        store.place(area.area_id, [key(5)], [PAGE_BYTES], owner=1, keep=False)
    # One area per owner: a new one replaces the old; an owner that leaves returns it.
    assert store.reserve_area(4 * PAGE_BYTES, owner=1) is not None
    assert store.reserve_area(4 * PAGE_BYTES, owner=1) is not None
    assert store.used_bytes == 9 * PAGE_BYTES
    store.release_owner(1)
    assert store.used_bytes == 5 * PAGE_BYTES and len(store.areas) == 0


def test_rule14_an_area_running_short_is_swapped_for_a_fresh_one(clock):
    store = BlockStore(64 * PAGE_BYTES, clock=clock, high_watermark=1.0, low_watermark=1.0)
    area = store.reserve_area(8 * PAGE_BYTES, owner=1)
    assert area is not None
    store.place(area.area_id, [key(1)], [5 * PAGE_BYTES], owner=1, keep=False)  # 3 pages left
    fresh = store.areas.held_by(1)
    assert fresh is not None and fresh.area_id != area.area_id
    assert fresh.num_bytes == 8 * PAGE_BYTES and len(store.areas) == 1
    assert store.used_bytes == 13 * PAGE_BYTES  # the block and the fresh area: the rest went
    with pytest.raises(LeaseExpired):
        store.place(area.area_id, [key(2)], [PAGE_BYTES], owner=1, keep=False)
    # With no fresh one free, the rest stays.
    put(store, [key(f"fill-{i}") for i in range(48)])  # 3 pages free
    store.place(fresh.area_id, [key(3)], [5 * PAGE_BYTES], owner=1, keep=False)
    assert store.areas.held_by(1) is fresh and fresh.num_bytes == 3 * PAGE_BYTES


def test_rule14_an_area_its_writer_keeps_stays_where_it_is_even_short(clock):
    """A pipelined writer copies its next blocks into the rest before the node reads the
    COMMIT that names the blocks before them: that rest must not move, nor be freed."""
    store = BlockStore(64 * PAGE_BYTES, clock=clock, high_watermark=1.0, low_watermark=1.0)
    area = store.reserve_area(8 * PAGE_BYTES, owner=1)
    assert area is not None
    start = area.offset
    store.place(area.area_id, [key(1)], [5 * PAGE_BYTES], owner=1, keep=True)  # 3 pages left
    assert store.areas.held_by(1) is area and len(store.areas) == 1
    assert (area.offset, area.num_bytes) == (start + 5 * PAGE_BYTES, 3 * PAGE_BYTES)
    assert store.used_bytes == 8 * PAGE_BYTES  # no fresh area beside it
    placed = store.place(area.area_id, [key(2)], [3 * PAGE_BYTES], owner=1, keep=True)
    assert placed.blocks[0] is not None and placed.blocks[0].offset == start + 5 * PAGE_BYTES
    assert store.areas.held_by(1) is None  # all taken: nothing left to keep


def test_rule14_a_write_area_is_bounded_and_never_evicts(clock):
    store = BlockStore(64 * PAGE_BYTES, clock=clock, high_watermark=1.0, low_watermark=1.0)
    assert store.reserve_area(9 * PAGE_BYTES, owner=1) is None  # past an eighth of the arena
    put(store, [key(i) for i in range(60)])
    assert store.reserve_area(8 * PAGE_BYTES, owner=1) is None  # only 4 pages are free
    assert len(store) == 60  # and nothing was evicted for it
    assert store.reserve_area(4 * PAGE_BYTES, owner=1) is not None


def test_rule18_clients_reads_and_writes_are_sampled_the_nodes_own_are_not(store):
    seen: list[int] = []
    # The sampler's accesses, one at a time (a few keys) or a request's together.
    store.reuse.access = lambda h, hit: seen.append(h)  # type: ignore[method-assign]
    store.reuse.access_many = lambda hashes, hit: seen.extend(hashes)  # type: ignore[method-assign]
    put(store, [key(1), key(2)])
    assert len(seen) == 2  # a client's commit
    store.pin([key(1)], owner=1, lease_s=5)
    store.touch([key(2)])  # a read through the shared directory
    assert len(seen) == 4
    store.pin([key(1), key(2)], Owner.REPLICATOR, lease_s=5)  # the node's own pin
    store.pin([key(2)], owner=1, lease_s=5, count=False)  # a guard while making room
    promoted = store.reserve([key(3)], [PAGE_BYTES], Owner.PROMOTER, held=True)
    store.commit(promoted.reservation_id, [7], Owner.PROMOTER)  # a promotion
    assert len(seen) == 4
    assert store.lookup([key(3)]) == (1, False)


def test_rule19_a_leaving_store_admits_no_clients_block_and_its_own_go_on(store):
    put(store, [key("before")])
    store.leave()
    result = store.reserve([key("late"), key("before")], [PAGE_BYTES, PAGE_BYTES], owner=1)
    assert result.statuses == [Status.REFUSED, Status.REFUSED] and result.reservation_id == 0
    assert store.reserve_area(4 * PAGE_BYTES, owner=1) is None
    promoted = store.reserve([key("up")], [PAGE_BYTES], owner=0, held=True)  # a promotion
    assert promoted.statuses == [Status.OK]
    store.abort(promoted.reservation_id, 0)
    assert store.lookup([key("before")])[0] == 1  # what it held, it still serves
    store.leave(False)
    assert store.reserve([key("late")], [PAGE_BYTES], owner=1).statuses == [Status.OK]


def test_batches_land_contiguously(store):
    result = store.reserve([key(i) for i in range(4)], [PAGE_BYTES] * 4, owner=1, lease_s=30)
    offsets = [b.offset for b in result.blocks]
    assert offsets == [offsets[0] + i * PAGE_BYTES for i in range(4)]


def test_lookup_prefix_and_mask(store):
    put(store, [key(1), key(2), key(4)])
    assert store.lookup([key(1), key(2), key(3), key(4)]) == (2, False)
    assert store.lookup_mask([key(1), key(3), key(4)]) == [True, False, True]
    assert store.lookup([]) == (0, False)
    assert store.counters.lookup_hits >= 2


def test_prefix_pin_stops_at_first_miss(store):
    put(store, [key(1), key(3)])
    pinned = store.pin([key(1), key(2), key(3)], owner=1, lease_s=5, prefix=True)
    pin_id, blocks = pinned.pin_id, pinned.blocks
    assert [b is not None for b in blocks] == [True, False, False]
    assert store.unpin(pin_id) and not store.unpin(pin_id)


def test_lru_policy_yields_each_key_once():
    lru = LRUPolicy()
    lru.bind(600, bytes)
    for slot in range(600):
        lru.touch(slot)
    lru.touch(0)
    victims = list(lru.victims())
    assert len(victims) == len(set(victims)) == 600
    assert victims[0] == 1 and victims[-1] == 0
