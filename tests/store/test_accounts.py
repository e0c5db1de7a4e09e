"""The account ledger's rules (kvpool.store.accounts), one test each."""

from kvpool.config import PAGE_BYTES
from kvpool.errors import Status
from kvpool.limits import Budgets
from kvpool.store.accounts import LABEL_BURST, NODE, Accounts, Resource
from kvpool.store.block_store import BlockStore
from kvpool.tenants import Tenant

ALPHA = Tenant("alpha", b"salt-alpha-0123456789", 4 << 20, max_connections=2)
BETA = Tenant("beta", b"salt-beta-0123456789", 12 << 20, max_connections=8)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ledger(clock: Clock | None = None, **budgets: float) -> Accounts:
    accounts = Accounts(Budgets(**budgets), clock or Clock())  # type: ignore[arg-type]
    accounts.set_tenants([ALPHA, BETA], held_bytes=8 << 20, prefetch_bytes=512 << 20)
    return accounts


def test_rule1_a_tenants_keys_are_its_account_everything_else_the_nodes():
    accounts = ledger()
    assert accounts.account_of(ALPHA.tag + b"rest of the key") == ALPHA.tag
    assert accounts.account_of(b"\x00\x01\x02\x03 someone's namespace") == NODE
    for _ in range(1000):  # the node's account has no limits
        assert accounts.charge(NODE, Resource.CONNECTIONS)
    assert accounts.usage() and all(row.tenant != "" for row in accounts.usage())


def test_rule2_a_charge_is_whole_or_nothing_and_refusals_are_counted():
    accounts = ledger(parked_keys=100)
    assert accounts.charge(ALPHA.tag, Resource.PARKED_KEYS, 60)
    assert not accounts.charge(ALPHA.tag, Resource.PARKED_KEYS, 41)  # 101: refused whole
    assert accounts.used(ALPHA.tag, Resource.PARKED_KEYS) == 60
    assert accounts.charge(ALPHA.tag, Resource.PARKED_KEYS, 40)
    assert accounts.charge(BETA.tag, Resource.PARKED_KEYS, 100)  # beta's budget is its own
    [alpha] = accounts.usage(ALPHA.tag)
    assert alpha.used["parked_keys"] == 100 and alpha.limits["parked_keys"] == 100
    assert alpha.refused == {"parked_keys": 1}


def test_rule2_shares_of_the_node_budgets_follow_the_quotas_within_each_quota():
    accounts = ledger()
    # Holds: 8 MiB shared 1:3, and never past a quota.
    assert accounts.limit(ALPHA.tag, Resource.HELD_BYTES) == 2 << 20
    assert accounts.limit(BETA.tag, Resource.HELD_BYTES) == 6 << 20
    assert accounts.limit(ALPHA.tag, Resource.CONNECTIONS) == 2
    accounts.set_tenants([ALPHA], held_bytes=64 << 20, prefetch_bytes=512 << 20)
    assert accounts.limit(ALPHA.tag, Resource.HELD_BYTES) == 4 << 20  # its quota


def test_rule3_credits_give_back_and_a_removed_tenant_goes_once_it_holds_nothing():
    accounts = ledger()
    assert accounts.charge(ALPHA.tag, Resource.CONNECTIONS)
    assert accounts.charge(ALPHA.tag, Resource.CONNECTIONS)
    assert not accounts.charge(ALPHA.tag, Resource.CONNECTIONS)
    accounts.credit(ALPHA.tag, Resource.CONNECTIONS)
    assert accounts.charge(ALPHA.tag, Resource.CONNECTIONS)
    accounts.set_tenants([BETA], held_bytes=8 << 20, prefetch_bytes=512 << 20)
    assert [row.tenant for row in accounts.usage()] == ["alpha", "beta"]  # still holds two
    accounts.credit(ALPHA.tag, Resource.CONNECTIONS)
    accounts.credit(ALPHA.tag, Resource.CONNECTIONS)
    assert [row.tenant for row in accounts.usage()] == ["beta"]
    assert accounts.account_of(ALPHA.tag) == NODE


def test_rule3_label_changes_are_a_rate_in_bursts():
    clock = Clock()
    accounts = ledger(clock, label_changes_per_s=2.0)
    taken = sum(accounts.charge(ALPHA.tag, Resource.LABEL_CHANGES) for _ in range(1000))
    assert taken == LABEL_BURST
    clock.now += 1.0  # two more a second
    assert accounts.charge(ALPHA.tag, Resource.LABEL_CHANGES)
    assert accounts.charge(ALPHA.tag, Resource.LABEL_CHANGES)
    assert not accounts.charge(ALPHA.tag, Resource.LABEL_CHANGES)
    [alpha] = accounts.usage(ALPHA.tag)
    assert alpha.used["label_changes"] == LABEL_BURST
    assert alpha.refused["label_changes"] == 1000 - LABEL_BURST + 1


def test_rule4_a_reload_keeps_what_is_held():
    accounts = ledger(buffer_bytes=16 << 20)
    assert accounts.charge(BETA.tag, Resource.BUFFER_BYTES, 10 << 20)
    accounts.set_tenants([ALPHA, BETA], held_bytes=8 << 20, prefetch_bytes=512 << 20)
    assert accounts.used(BETA.tag, Resource.BUFFER_BYTES) == 10 << 20
    assert not accounts.has_room(BETA.tag, Resource.BUFFER_BYTES, 7 << 20)


def test_journal_bytes_are_counted_and_reset_by_a_compaction():
    accounts = ledger()
    accounts.count(ALPHA.tag, Resource.JOURNAL_BYTES, 1000)
    accounts.count(ALPHA.tag, Resource.JOURNAL_BYTES, 24)
    assert accounts.used(ALPHA.tag, Resource.JOURNAL_BYTES) == 1024
    accounts.reset(Resource.JOURNAL_BYTES)
    assert accounts.used(ALPHA.tag, Resource.JOURNAL_BYTES) == 0


def test_rule4_the_arena_and_the_lower_tiers_are_limited_by_quota_in_one_place():
    accounts = Accounts()
    tiers = {Resource.DISK_BYTES: 64 << 20, Resource.OBJECT_BYTES: 1 << 30}
    accounts.set_tenants([ALPHA, BETA], 8 << 20, 512 << 20, tier_bytes=tiers)
    [alpha] = accounts.usage(ALPHA.tag)
    assert alpha.limits["arena_bytes"] == ALPHA.quota_bytes  # its quota, whole
    assert alpha.limits["disk_bytes"] == 16 << 20  # 4 of 16 MiB of quotas: a quarter
    assert alpha.limits["object_bytes"] == 256 << 20
    assert alpha.used["arena_bytes"] == alpha.used["disk_bytes"] == 0
    accounts.set_tenants([ALPHA, BETA], 8 << 20, 512 << 20)  # a node with no lower tier
    [alpha] = accounts.usage(ALPHA.tag)
    assert "disk_bytes" not in alpha.limits and "object_bytes" not in alpha.limits


def tenant_key(tenant: Tenant, i: int) -> bytes:
    return tenant.tag + b"n" * 12 + i.to_bytes(16, "big")


def write(store: BlockStore, keys: list[bytes], size: int = PAGE_BYTES) -> list[Status]:
    reserved = store.reserve(keys, [size] * len(keys), owner=1)
    if reserved.reservation_id:
        store.commit(reserved.reservation_id, [0] * len(keys), 1)
    return reserved.statuses


def test_metered_a_stores_blocks_are_their_tenants_arena_bytes_recounted_at_a_reload():
    store = BlockStore(64 * PAGE_BYTES, high_watermark=1.0, low_watermark=1.0)
    accounts = store.accounts
    accounts.set_tenants([BETA], held_bytes=0, prefetch_bytes=0)
    store.recount_quotas()
    alpha_keys = [tenant_key(ALPHA, i) for i in range(3)]
    beta_keys = [tenant_key(BETA, i) for i in range(2)]
    assert write(store, alpha_keys, size=100) == [Status.OK] * 3  # alpha's: nobody's yet
    assert write(store, beta_keys, size=PAGE_BYTES + 1) == [Status.OK] * 2  # two pages each
    assert accounts.used(BETA.tag, Resource.ARENA_BYTES) == 4 * PAGE_BYTES
    accounts.set_tenants([ALPHA, BETA], held_bytes=0, prefetch_bytes=0)  # a reload adds alpha
    store.recount_quotas()
    rows = {row.tenant: row for row in accounts.usage()}
    assert rows["alpha"].used["arena_bytes"] == 3 * PAGE_BYTES  # a whole page each
    assert rows["alpha"].limits["arena_bytes"] == ALPHA.quota_bytes
    assert rows["beta"].used["arena_bytes"] == 4 * PAGE_BYTES
    # Beta leaves: its blocks count for nobody, and do not keep its account.
    accounts.set_tenants([ALPHA], held_bytes=0, prefetch_bytes=0)
    store.recount_quotas()
    assert [row.tenant for row in accounts.usage()] == ["alpha"]
    store.delete(beta_keys)
    store.delete(alpha_keys[:1])
    assert accounts.used(ALPHA.tag, Resource.ARENA_BYTES) == 2 * PAGE_BYTES


def test_metered_a_write_past_the_arena_quota_is_refused_and_counts_nothing():
    small = Tenant("small", b"salt-small-0123456789", 4 * PAGE_BYTES)
    store = BlockStore(64 * PAGE_BYTES, high_watermark=1.0, low_watermark=1.0)
    store.accounts.set_tenants([small], held_bytes=0, prefetch_bytes=0)
    store.recount_quotas()
    held = store.reserve([tenant_key(small, i) for i in range(4)], [PAGE_BYTES] * 4, owner=1)
    assert held.statuses == [Status.OK] * 4  # its whole quota, pending: nothing to evict
    assert write(store, [tenant_key(small, 4)]) == [Status.OVER_QUOTA]
    assert store.accounts.used(small.tag, Resource.ARENA_BYTES) == 4 * PAGE_BYTES
    store.commit(held.reservation_id, [0] * 4, 1)
    assert write(store, [tenant_key(small, 5)]) == [Status.OK]  # its own LRU block went
    assert store.lookup([tenant_key(small, 0)]) == (0, False)
    assert store.accounts.used(small.tag, Resource.ARENA_BYTES) == 4 * PAGE_BYTES
