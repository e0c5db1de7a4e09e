"""Retention priorities (kvpool.store.retention, the store's rule 20), one test per rule, on
both eviction policies a node can run."""

import pytest

from kvpool.config import PAGE_BYTES
from kvpool.retention import DEFAULT_PRIORITY
from kvpool.store.accounts import Accounts, Resource
from kvpool.store.block_store import BlockStore
from kvpool.store.policies import NAME_TO_POLICY, new_policy
from kvpool.store.retention import Retention
from kvpool.tenants import Tenant

CAPACITY = 16  # blocks


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def new_store(policy: str, clock: Clock, accounts: Accounts | None = None) -> BlockStore:
    retention = Retention(new_policy(policy), clock=clock)
    return BlockStore(
        CAPACITY * PAGE_BYTES,
        eviction=retention,
        retention=retention,
        high_watermark=1.0,
        low_watermark=1.0,
        accounts=accounts,
        clock=clock,
    )


def key(i: int, prefix: bytes = b"\x00" * 16) -> bytes:
    return prefix + i.to_bytes(8, "big")


def put(store: BlockStore, keys: list[bytes]) -> None:
    for k in keys:
        reserved = store.reserve([k], [PAGE_BYTES], owner=1)
        assert reserved.reservation_id, "the store refused a block"
        store.commit(reserved.reservation_id, [0], 1)


def held(store: BlockStore, keys: list[bytes]) -> list[bool]:
    return store.lookup_mask(keys, count=False)


POLICIES = sorted(NAME_TO_POLICY)


@pytest.mark.parametrize("policy", POLICIES)
def test_rule1_a_high_priority_prefix_outlives_a_flood_until_its_deadline(policy):
    clock = Clock()
    store = new_store(policy, clock)
    prefix = [key(i) for i in range(4)]
    put(store, prefix)
    assert store.retain(prefix, 90, duration_s=60).num_retained == 4
    put(store, [key(100 + i) for i in range(3 * CAPACITY)])  # three times the store
    assert held(store, prefix) == [True] * 4
    clock.now += 61  # the deadline passed: default priority, as if last used then
    put(store, [key(200 + i) for i in range(CAPACITY)])
    assert held(store, prefix) == [False] * 4
    assert store.retention.num_retained == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_rule1_lower_priorities_go_first_and_leaves_before_roots(policy):
    clock = Clock()
    store = new_store(policy, clock)
    low = [key(i) for i in range(4)]
    put(store, low)
    put(store, [key(10 + i) for i in range(CAPACITY - 4)])  # full, the low ones oldest
    store.retain(low, 10, duration_s=0)
    put(store, [key(50)])  # one block of room: the low prefix's leaf goes
    assert held(store, low) == [True, True, True, False]
    put(store, [key(51), key(52)])
    assert held(store, low) == [True, False, False, False]


@pytest.mark.parametrize("policy", POLICIES)
def test_rule1_pressure_evicts_when_every_block_is_retained(policy):
    clock = Clock()
    store = new_store(policy, clock)
    first = [key(i) for i in range(CAPACITY)]
    put(store, first)
    store.retain(first, 95, duration_s=0)
    put(store, [key(100 + i) for i in range(4)])  # still written: the retained go, lowest first
    assert held(store, [key(100 + i) for i in range(4)]) == [True] * 4
    assert sum(held(store, first)) == CAPACITY - 4


def test_rule2_a_tenants_retained_bytes_are_its_account_and_refusals_are_counted():
    clock = Clock()
    tenant = Tenant(
        "alpha", b"salt-alpha-0123456789", 8 * PAGE_BYTES, retained_bytes=2 * PAGE_BYTES
    )
    accounts = Accounts()
    accounts.set_tenants([tenant], held_bytes=0, prefetch_bytes=0)
    store = new_store("lru", clock, accounts)
    store.recount_quotas()
    mine = [key(i, tenant.tag + b"\x00" * 12) for i in range(4)]
    put(store, mine)
    retained = store.retain(mine, 80, duration_s=0)
    assert (retained.num_retained, retained.num_refused) == (2, 2)  # leaves first, then none
    assert accounts.used(tenant.tag, Resource.RETAINED_BYTES) == 2 * PAGE_BYTES
    [row] = accounts.usage(tenant.tag)
    assert row.refused == {"retained_bytes": 2} and store.counters.retention_refused == 2
    # Giving blocks back (the default priority, or leaving the store) credits the account.
    store.retain(mine[2:], DEFAULT_PRIORITY, duration_s=0)
    assert accounts.used(tenant.tag, Resource.RETAINED_BYTES) == 0
    assert store.retain(mine[:2], 80, duration_s=0).num_retained == 2
    store.delete(mine[:1])
    assert accounts.used(tenant.tag, Resource.RETAINED_BYTES) == PAGE_BYTES


def test_rule2_the_nodes_own_hints_hold_at_most_half_the_arena():
    clock = Clock()
    store = new_store("lru", clock)
    blocks = [key(i) for i in range(CAPACITY)]
    put(store, blocks)
    retained = store.retain(blocks, 80, duration_s=0)
    assert retained.num_retained == CAPACITY // 2 and retained.num_refused == CAPACITY // 2


def test_rule3_a_slot_reused_after_its_block_left_is_at_the_default():
    clock = Clock()
    store = new_store("lru", clock)
    blocks = [key(i) for i in range(2)]
    put(store, blocks)
    store.retain(blocks, 90, duration_s=30)
    store.delete(blocks)
    assert store.retention.num_retained == 0
    put(store, [key(7)])
    slot = store.index.find_all([key(7)])[0]
    assert store.retention.priority_of(int(slot)) == DEFAULT_PRIORITY
    clock.now += 31  # the old deadline names the slot: it must not move the new block
    assert store.retention.expire() == 0


def test_a_pinned_block_retained_is_never_a_victim_and_rejoins_its_list_when_unpinned():
    clock = Clock()
    store = new_store("lru", clock)
    blocks = [key(i) for i in range(CAPACITY)]
    put(store, blocks)
    pinned = store.pin(blocks[:1], owner=2, prefix=True)
    store.retain(blocks[:1], 10, duration_s=0)  # lowest priority, but pinned
    put(store, [key(100)])
    assert held(store, blocks[:1]) == [True]
    store.unpin(pinned.pin_id)
    put(store, [key(101)])
    assert held(store, blocks[:1]) == [False]  # now the first to go
