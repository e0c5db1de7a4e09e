"""The lease ledger: one per node, every kind of hold in it (one test per rule of
kvpool.store.leases' docstring, and the owners)."""

from dataclasses import dataclass

import pytest

from kvpool.config import PAGE_BYTES
from kvpool.errors import ConfigError, LeaseExpired
from kvpool.limits import LeaseLimits
from kvpool.protocol.messages import Limits
from kvpool.store.block_store import BlockStore
from kvpool.store.eviction import LRUPolicy
from kvpool.store.holds import Holds, QueueAwareEviction
from kvpool.store.leases import LeaseKind, LeaseLedger, Owner
from tests.helpers import key

LIMITS = LeaseLimits(pin_s=2.0, reserve_s=3.0, hold_s=5.0, default_hold_s=4.0, wait_s=1.0)


@dataclass
class Node:
    ledger: LeaseLedger
    store: BlockStore
    holds: Holds


@pytest.fixture
def node(clock):
    """A store and the prefetch holds on one ledger, as the node builds them."""
    ledger = LeaseLedger(LIMITS, clock)
    holds = Holds(16 * PAGE_BYTES, ledger)
    store = BlockStore(
        64 * PAGE_BYTES,
        ledger=ledger,
        eviction=QueueAwareEviction(LRUPolicy(), holds),
        high_watermark=1.0,
        low_watermark=1.0,
    )
    return Node(ledger, store, holds)


def put(store, keys, owner=1):
    result = store.reserve(keys, [PAGE_BYTES] * len(keys), owner)
    store.commit(result.reservation_id, [7] * len(keys), owner)


def test_rule1_every_kind_is_clamped_to_its_limit(node):
    ledger, store = node.ledger, node.store
    assert ledger.grant(LeaseKind.PIN, 600) == 2.0
    assert ledger.grant(LeaseKind.RESERVATION, 600) == 3.0
    assert ledger.grant(LeaseKind.AREA, 600) == 3.0
    assert ledger.grant(LeaseKind.HOLD, 600) == 5.0
    assert ledger.grant(LeaseKind.HOLD, 0) == 4.0  # no time named: the default hold
    assert ledger.grant(LeaseKind.PIN, 0) == 2.0  # no time named: the bound
    assert ledger.grant(LeaseKind.PIN, 0.5) == 0.5  # less than the bound: as asked
    assert store.reserve([key(1)], [100], 1, 600).lease_s == 3.0
    put(store, [key(2)])
    assert store.pin([key(2)], 1, 600).lease_s == 2.0
    area = store.reserve_area(PAGE_BYTES, 1, 600)
    assert area is not None and area.lease_s == 3.0
    assert LIMITS.wait(600) == 1.0 and LIMITS.wait(-1) == 0.0


def test_rule2_one_expire_ends_every_kind(node, clock):
    ledger, store, holds = node.ledger, node.store, node.holds
    reserved = store.reserve([key(1)], [PAGE_BYTES], 1)
    put(store, [key(2)])
    pinned = store.pin([key(2)], 1)
    area = store.reserve_area(PAGE_BYTES, 1)
    assert area is not None
    assert holds.hold(key(2), PAGE_BYTES, 0, fetched=True)
    assert store.expire() == 0
    clock.now += 3.5  # past the pin and the reservation and the area; the hold (4 s) stays
    assert store.expire() == 3
    with pytest.raises(LeaseExpired):
        store.take(reserved.reservation_id, 1)
    assert not store.unpin(pinned.pin_id, 1)
    assert len(store.areas) == 0 and store.areas.num_bytes == 0
    assert holds.is_held(key(2))
    clock.now += 1
    assert ledger.expire() == 1  # the hold
    assert not holds.is_held(key(2)) and holds.held_bytes == 0
    assert holds.counters.wasted == 1  # a prefetched block that lapsed unread
    assert ledger.num_expired == {
        LeaseKind.RESERVATION: 1,
        LeaseKind.PIN: 1,
        LeaseKind.AREA: 1,
        LeaseKind.HOLD: 1,
    }
    assert store.counters.expired_reservations == 1 and store.counters.expired_pins == 1
    assert store.used_bytes == PAGE_BYTES  # only the committed block


def test_rule3_an_owner_that_leaves_ends_all_its_leases(node):
    ledger, store = node.ledger, node.store
    store.reserve([key(1)], [PAGE_BYTES], 1)
    put(store, [key(2)], owner=2)
    store.pin([key(2)], 1)
    store.reserve_area(PAGE_BYTES, 1)
    other = store.reserve([key(3)], [PAGE_BYTES], 2)
    assert ledger.release(1) == 3
    assert ledger.count(LeaseKind.RESERVATION) == 1
    assert ledger.count(LeaseKind.PIN) == ledger.count(LeaseKind.AREA) == 0
    store.commit(other.reservation_id, [1], 2)  # another owner's lease is untouched


def test_rule4_one_id_names_one_lease(node):
    store = node.store
    put(store, [key(1)])
    reservation = store.reserve([key(2)], [PAGE_BYTES], 1)
    pin = store.pin([key(1)], 1)
    area = store.reserve_area(PAGE_BYTES, 1)
    assert area is not None
    ids = {reservation.reservation_id, pin.pin_id, area.area_id}
    assert len(ids) == 3
    assert not store.unpin(reservation.reservation_id, 1)  # a reservation id is no pin id


def test_owners_of_the_node_never_collide_with_connections(node):
    ledger, store = node.ledger, node.store
    assert {int(o) for o in Owner} == {-1, -2, -3}
    put(store, [key(1)])
    replicating = store.pin([key(1)], Owner.REPLICATOR)
    promoting = store.reserve([key(2)], [PAGE_BYTES], Owner.PROMOTER, held=True)
    assert promoting.lease_s == float("inf")  # the node's own copy: no lease
    ledger.release(1)  # a connection leaving ends nothing of the node's
    assert store.unpin(replicating.pin_id, Owner.REPLICATOR)
    store.commit(promoting.reservation_id, [1], Owner.PROMOTER)
    assert store.get_block(key(2)) is not None


def test_a_held_block_is_not_evicted_and_a_read_ends_its_hold(node):
    ledger, store, holds = node.ledger, node.store, node.holds
    put(store, [key(1)])
    assert holds.hold(key(1), PAGE_BYTES, 0, fetched=False)
    assert store.evictable(store.index.find(key(1)))  # the store would; the holds stop it
    assert list(store.eviction.victims()) == []
    holds.read([key(1)])
    assert ledger.count(LeaseKind.HOLD) == 0 and holds.held_bytes == 0
    assert [store.index.key(slot) for slot in store.eviction.victims()] == [key(1)]


def test_a_ledger_has_one_book_per_kind():
    ledger = LeaseLedger()
    ledger.open_book(LeaseKind.PIN, lambda i, h: None)
    with pytest.raises(ValueError):
        ledger.open_book(LeaseKind.PIN, lambda i, h: None)


def test_limits_validate_and_travel_in_the_welcome():
    assert Limits.of(LIMITS).lease_limits() == LIMITS
    with pytest.raises(ConfigError):
        LeaseLimits(pin_s=0.1).validate()
    with pytest.raises(ConfigError):
        LeaseLimits(hold_s=10, default_hold_s=20).validate()
