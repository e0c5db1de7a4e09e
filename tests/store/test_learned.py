"""``--eviction learned`` (kvpool.store.learned): its invariants under any sequence of
writes, reads, pins and holds (hypothesis), and what it learns."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.config import PAGE_BYTES
from kvpool.keys import BlockOrigin
from kvpool.store.block_store import BlockStore
from kvpool.store.holds import Holds, QueueAwareEviction
from kvpool.store.learned import NUM_CLASSES, LearnedPolicy
from kvpool.store.leases import LeaseLedger
from kvpool.tenants import Tenant

NAMESPACE_REST = b"n" * 12  # a tenant's key: its tag, the rest of a namespace id, a hash
CAPACITY = 40  # blocks of one page
QUOTA = 20 * PAGE_BYTES
TENANTS = (Tenant("a", b"salt-a-0123456789", QUOTA), Tenant("b", b"salt-b-0123456789", QUOTA))
TAGS = tuple(t.tag for t in TENANTS)


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def key(tenant: int, block_hash: bytes) -> bytes:
    return TAGS[tenant] + NAMESPACE_REST + block_hash


class World:
    """A store under the learned policy (with prefetch holds in front of it), two tenants
    within quotas, and what the test knows of it: each tenant's chains, each block's parent,
    the pins and holds outstanding."""

    def __init__(self) -> None:
        clock = Clock()
        ledger = LeaseLedger(clock=clock)
        self.holds = Holds(CAPACITY * PAGE_BYTES // 4, ledger)
        self.policy = LearnedPolicy()
        self.store = BlockStore(
            CAPACITY * PAGE_BYTES,
            eviction=QueueAwareEviction(self.policy, self.holds),
            high_watermark=1.0,
            low_watermark=1.0,
            ledger=ledger,
        )
        self.store.accounts.set_tenants(TENANTS, held_bytes=0, prefetch_bytes=0)
        self.store.recount_quotas()
        self.chains: list[list[list[bytes]]] = [[], []]  # per tenant: chains of hashes
        self.parent_of: dict[bytes, bytes] = {}  # child key -> parent key, when linked
        self.pins: list[tuple[int, list[bytes]]] = []
        self.held: list[bytes] = []
        self.fresh = 0

    def present(self, keys: list[bytes]) -> int:
        return self.store.lookup(keys, count=False)[0]

    def chain(self, tenant: int, pick: int) -> list[bytes]:
        chains = self.chains[tenant]
        if not chains:
            chains.append([])
        return chains[pick % len(chains)]

    def write(self, tenant: int, pick: int, length: int, branch: bool) -> None:
        """The blocks after the longest held prefix of a chain (or a new chain), as an
        engine saves them: with their parents named."""
        hashes = [] if branch else self.chain(tenant, pick)
        keys = [key(tenant, h) for h in hashes]
        held = self.present(keys)
        new = [b"%07d" % (self.fresh + i) + b"h" for i in range(length)]
        self.fresh += length
        chain = hashes[:held] + new
        self.chains[tenant].append(chain)
        new_keys = [key(tenant, h) for h in new]
        origins = [
            BlockOrigin(token_ids=[], parent=chain[held + i - 1] if held + i else b"")
            for i in range(length)
        ]
        before = self._others_within_quota(tenant)
        result = self.store.reserve(new_keys, [PAGE_BYTES] * length, owner=1)
        if result.reservation_id:
            committed = self.store.commit(result.reservation_id, [7] * length, 1, origins)
            for committed_key in committed.committed:
                position = chain.index(committed_key[len(TAGS[0]) + len(NAMESPACE_REST) :])
                if position:
                    parent = key(tenant, chain[position - 1])
                    if self.present([parent]):
                        self.parent_of[committed_key] = parent
        for other_key in before:  # a tenant within its quota lost nothing to this write
            assert self.present([other_key]) == 1, "another tenant's write evicted a block"

    def _others_within_quota(self, tenant: int) -> list[bytes]:
        quotas = self.store.quotas
        other = TAGS[1 - tenant]
        if quotas is None or quotas.used[other] > quotas.limits[other]:
            return []
        return [k for k in self.every_key() if k.startswith(other) and self.present([k])]

    def every_key(self) -> list[bytes]:
        return [key(t, h) for t in range(2) for chain in self.chains[t] for h in chain]

    def read(self, tenant: int, pick: int, keep: bool) -> None:
        keys = [key(tenant, h) for h in self.chain(tenant, pick)]
        result = self.store.pin(keys, owner=2, lease_s=3600, prefix=True)
        pinned = [k for k, b in zip(keys, result.blocks, strict=True) if b is not None]
        if keep and result.pin_id:
            self.pins.append((result.pin_id, pinned))
        elif result.pin_id:
            self.store.unpin(result.pin_id)

    def unpin(self) -> None:
        if self.pins:
            pin_id, _ = self.pins.pop(0)
            self.store.unpin(pin_id)

    def hold(self, tenant: int, pick: int) -> None:
        keys = [key(tenant, h) for h in self.chain(tenant, pick)]
        for k in keys[: self.present(keys)][-2:]:
            if self.holds.hold(k, PAGE_BYTES, 3600, fetched=False):
                self.held.append(k)

    def check(self) -> None:
        for child, parent in self.parent_of.items():
            if self.present([child]):
                assert self.present([parent]) == 1, "a prefix left before its extension"
        for _, keys in self.pins:
            assert self.present(keys) == len(keys), "a pinned block left"
        for k in self.held:
            assert self.present([k]) == 1, "a held block left"
        assert self.store.used_bytes <= self.store.capacity


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("write"),
            st.integers(0, 1),
            st.integers(0, 50),
            st.integers(1, 9),
            st.booleans(),
        ),
        st.tuples(st.just("read"), st.integers(0, 1), st.integers(0, 50), st.booleans()),
        st.tuples(st.just("unpin")),
        st.tuples(st.just("hold"), st.integers(0, 1), st.integers(0, 50)),
    ),
    min_size=1,
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_prefixes_pins_holds_and_shares_hold_under_any_sequence(ops):
    world = World()
    for op in ops:
        if op[0] == "write":
            world.write(*op[1:])
        elif op[0] == "read":
            world.read(*op[1:])
        elif op[0] == "unpin":
            world.unpin()
        else:
            world.hold(*op[1:])
        world.check()


def test_a_chain_leaves_from_its_end_and_a_new_branch_keeps_the_shared_prefix():
    world = World()
    world.store.accounts.set_tenants(None, held_bytes=0, prefetch_bytes=0)
    world.store.recount_quotas()
    world.write(0, 0, 10, branch=True)  # a prefix of 10
    world.write(0, 0, 5, branch=False)  # extended by 5
    first = world.chains[0][-1]
    world.read(0, len(world.chains[0]) - 1, keep=False)
    for _ in range(6):  # new chains push the old one out, leaves first
        world.write(0, 0, 5, branch=True)
        world.check()
    keys = [key(0, h) for h in first]
    held = world.present(keys)
    assert 0 < held < len(keys) or held == 0
    assert all(world.present([k]) == 0 for k in keys[held:])


def test_a_class_read_again_more_often_is_kept_longer():
    """Blocks read several times come back more often on this workload (as on the trace):
    the tuner learns it, and they outlive blocks written once and never read."""
    rng = random.Random(4)
    policy = LearnedPolicy()
    store = BlockStore(2000 * PAGE_BYTES, eviction=policy, high_watermark=1.0, low_watermark=1.0)
    hot = [b"h" * 16 + b"%06d" % i for i in range(300)]
    put(store, hot)
    for n in range(60_000):
        if rng.random() < 0.3:
            k = rng.choice(hot)
            found = store.pin([k], owner=1)
            if found.pin_id:
                store.unpin(found.pin_id)
            else:
                put(store, [k])
        else:
            put(store, [b"c" * 16 + b"%07d" % n])
    weights = policy.tuner.weights
    assert weights[NUM_CLASSES - 1] > weights[0]
    assert sum(store.lookup_mask(hot, count=False)) >= 250  # nearly all the hot blocks stay


def put(store: BlockStore, keys: list[bytes]) -> None:
    result = store.reserve(keys, [PAGE_BYTES] * len(keys), owner=1)
    if result.reservation_id:
        store.commit(result.reservation_id, [7] * len(keys), owner=1)


def test_evicting_k_blocks_of_chains_visits_o_k_entries():
    """Chains of 40 blocks, their parents named; the oldest chains' last blocks pinned (so
    their prefixes stay): evicting one block at a time visits each chain once on the way
    down, not once per block, and never walks a pinned chain again and again."""
    num_chains, depth, k = 60, 40, 200
    policy = LearnedPolicy()
    store = BlockStore(
        num_chains * depth * PAGE_BYTES, eviction=policy, high_watermark=1.0, low_watermark=1.0
    )
    chains = []
    for c in range(num_chains):
        hashes = [b"%03d-%04d" % (c, i) for i in range(depth)]
        keys = [TAGS[0] + NAMESPACE_REST + h for h in hashes]
        origins = [
            BlockOrigin(token_ids=[], parent=hashes[i - 1] if i else b"") for i in range(depth)
        ]
        result = store.reserve(keys, [PAGE_BYTES] * depth, owner=1)
        store.commit(result.reservation_id, [7] * depth, 1, origins)
        chains.append(keys)
    for keys in chains[:10]:
        assert store.pin(keys[-1:], owner=2, lease_s=3600).pin_id
    policy.num_visited = 0
    for n in range(k):
        put(store, [b"x" * 16 + b"%06d" % n])
    assert store.counters.evictions == k
    assert policy.num_visited <= 3 * k + 2 * depth * 10, policy.num_visited
    for keys in chains[:10]:  # a pinned block's prefix stays whole
        assert store.lookup(keys, count=False)[0] == depth
