"""The account ledger: how much of every shared resource each tenant holds, in one place.

The lease ledger (:mod:`kvpool.store.leases`) says how long anything may hold the node's
memory; this one says how much each tenant holds now, of everything a tenant can cost the
node, and refuses what would take a tenant past its limit.  Every operation that spends a
shared resource charges it here, every limit is set here (:meth:`Accounts.set_tenants`),
and ``kvpool status`` and ``/metrics`` read it from here alone (:meth:`Accounts.usage`).

Resources (:class:`Resource`):

- ``ARENA_BYTES``: the arena memory of its blocks, reserved or committed, in whole pages
  (limit: the tenant's ``quota_bytes``);
- ``DISK_BYTES``, ``OBJECT_BYTES``: the bytes its blocks take on the disk tier and in the
  object store (limit: the tier's capacity times the share its quota is of all quotas).
  One resource per kind of lower tier, not per tier name: a node has one tier of each kind
  at most, and a fixed set keeps the status and metric names the same on every node;
- ``CONNECTIONS``: its connections open (limit: the tenant's ``max_connections``);
- ``BUFFER_BYTES``: the receive buffers of its connections: each one's read-ahead, and the
  metadata of each frame being served that is larger than that (held in a buffer of its
  own, returned once the request is served);
- ``PARKED_KEYS``: keys named by its lookups that wait for blocks (a parked lookup keeps
  its keys in the heap until it answers);
- ``HELD_BYTES``: DRAM held for its queued requests (prefetch holds): its share of the
  node's hold budget (the share its quota is of all quotas), and never more than its quota;
- ``PREFETCH_BYTES``: bytes its prefetches are bringing up at once: its share of the
  node's in-flight budget (at least one fetch's worth);
- ``REMOTE_KEYS``: keys its prefetches are asking of other nodes at once (limit:
  ``REMOTE_KEYS_PER_TENANT``, beside the node's own bound on them all);
- ``STAGED_BYTES``: the stages its reads larger than DRAM hold, served from below DRAM a
  stage at a time: its share of the node's staging budget (at least one stage), so that
  another tenant's reads keep theirs however many reads it opens;
- ``RETAINED_BYTES``: the bytes of its blocks that retention hints hold above the default
  priority (:mod:`kvpool.store.retention`; limit: the tenant's ``retained``, by default a
  quarter of its quota), so that no tenant's hints keep the node's memory from the others;
- ``JOURNAL_BYTES``: journal bytes appended for it since the journal was last compacted
  (counted, not limited: the journal is compacted by its bytes, and what a tenant appends
  is bounded by its quota and its label changes);
- ``LABEL_CHANGES``: a rate: namespace label changes, each a journal record (a token
  bucket: ``label_changes_per_s``, in bursts of one per namespace a tenant may have).

The first three are *metered*: their holders (the store, the disk, the object store) count
them a block at a time through a :class:`~kvpool.store.quotas.Quotas`, the view of one
resource of this ledger that their eviction decides by; the number itself is here, once,
in that resource's columns by tag (:class:`Metered`), not in the accounts' rows, so that a
block costs its meter one dict lookup.  They are counted, never charged (no
:meth:`Accounts.charge` of them), and only :meth:`Accounts.usage`, :meth:`Accounts.used`
and :meth:`Accounts.limit` read them beside the rows.
A metered resource is counted by key, for a current tenant only: keys with no known tag
(no tenants, a tenant since removed) count for nobody, so a removed tenant's metered counts
go at once and never keep its account.  Its holder counts what it holds again after every
:meth:`Accounts.set_tenants` (``Quotas.recount``: a reloaded file may name a tenant that
holds blocks already).

Rules (each has a test in tests/store/test_accounts.py):

1. An account is a tenant's tag (the first bytes of its keys, :mod:`kvpool.tenants`);
   everything else (no tenants, the cluster's own identity, the node's own work) is the
   node's account, ``NODE``, which has no limits.
2. :meth:`Accounts.charge` charges the whole amount within the limit, or nothing (False):
   the caller refuses, waits or answers at once, as its operation says.
3. Whoever charged credits it back, exactly once, when what it held is gone.
4. Limits come from the tenants file and the node's :class:`~kvpool.limits.Budgets`
   (:meth:`Accounts.set_tenants`, again on every reload); what is held survives a reload.

Synchronous, touched from one thread (the daemon's event loop), as the store is; except
that the lower tiers' meters count ``DISK_BYTES`` and ``OBJECT_BYTES`` from their I/O
threads, under their tier's lock (as their recounts do).  They only change values of
columns whose tags are fixed when :meth:`Accounts.set_tenants` makes them (it replaces
them whole, on the event loop), so a reader never sees a column change size.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from kvpool.limits import Budgets
from kvpool.stats import AccountStats
from kvpool.store.namespaces import MAX_NAMESPACES_PER_TAG
from kvpool.tenants import TAG_BYTES, Tenant

NODE = b""  # the node's own account: no tenants, the cluster's identity, the node's work
# A tenant's share of the prefetches in flight is at least one fetch from other nodes.
MIN_PREFETCH_SHARE = 64 << 20
# A tenant's share of the stages of reads larger than DRAM is at least one read's stage.
MIN_STAGED_SHARE = 8 << 20
# A tenant's prefetches ask other nodes for at most this many keys at once.
REMOTE_KEYS_PER_TENANT = 256
# A tenant's label changes come in bursts of up to one per namespace it may have.
LABEL_BURST = MAX_NAMESPACES_PER_TAG


class Resource(enum.Enum):
    ARENA_BYTES = "arena_bytes"
    DISK_BYTES = "disk_bytes"
    OBJECT_BYTES = "object_bytes"
    CONNECTIONS = "connections"
    BUFFER_BYTES = "buffer_bytes"
    PARKED_KEYS = "parked_keys"
    HELD_BYTES = "held_bytes"
    PREFETCH_BYTES = "prefetch_bytes"
    REMOTE_KEYS = "remote_keys"
    STAGED_BYTES = "staged_bytes"
    RETAINED_BYTES = "retained_bytes"
    JOURNAL_BYTES = "journal_bytes"
    LABEL_CHANGES = "label_changes"


# Counted by their holders' meters, for current tenants only (see above).
METERED = (Resource.ARENA_BYTES, Resource.DISK_BYTES, Resource.OBJECT_BYTES)
# Charged to an account's row (the metered ones are columns of their own: Metered).
CHARGED = tuple(r for r in Resource if r not in METERED)
# What is charged and credited back; LABEL_CHANGES is a rate, JOURNAL_BYTES a count.
HELD = tuple(r for r in CHARGED if r not in (Resource.LABEL_CHANGES, Resource.JOURNAL_BYTES))


@dataclass(frozen=True)
class Metered:
    """A metered resource of every current tenant, by tag: its limit, and what it holds
    (the same tags).  Columns, not rows: its meter (:class:`~kvpool.store.quotas.Quotas`)
    counts into ``used`` a block at a time, one dict lookup by tag.  ``set_tenants``
    replaces both whole; a count only changes a value, never the tags."""

    limits: dict[bytes, int] = field(default_factory=dict)
    used: dict[bytes, int] = field(default_factory=dict)


@dataclass
class _Account:
    name: str
    limits: Mapping[Resource, int]
    used: dict[Resource, int] = field(default_factory=lambda: dict.fromkeys(CHARGED, 0))
    refused: dict[Resource, int] = field(default_factory=lambda: dict.fromkeys(CHARGED, 0))
    tokens: float = LABEL_BURST  # label changes left in the bucket
    filled_at: float = 0.0

    def holds_nothing(self) -> bool:
        return not any(self.used[r] for r in HELD)


class Accounts:
    """Every tenant's use of every shared resource, under its limits."""

    def __init__(
        self, budgets: Budgets | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.budgets = budgets or Budgets()
        self.clock = clock
        self._accounts: dict[bytes, _Account] = {NODE: _Account("", {})}
        self._metered: dict[Resource, Metered] = {r: Metered() for r in METERED}

    def set_tenants(
        self,
        tenants: Iterable[Tenant] | None,
        held_bytes: int,
        prefetch_bytes: int,
        staged_bytes: int = 0,
        tier_bytes: Mapping[Resource, int] | None = None,
    ) -> None:
        """The tenants (None: none), and what they share: ``held_bytes`` of prefetch holds,
        ``prefetch_bytes`` in flight, ``staged_bytes`` of stages and the lower tiers'
        capacities (``tier_bytes``: ``DISK_BYTES`` and ``OBJECT_BYTES``, those the node
        has), each tenant the share its quota is of all quotas; the arena, its quota.  The
        one place every tenant's limits are set.  What each holds is kept (rule 4); a
        tenant that left the file keeps its account, limited no more, until what it holds
        is credited back, and its metered resources count for nobody.  The meters'
        holders count what they hold again next, into the new columns
        (``Quotas.recount``; the node's tiers: ``Tiers.recount_quotas``)."""
        tenants = list(tenants or ())
        all_quotas = sum(t.quota_bytes for t in tenants)
        total_quota = all_quotas or 1
        for tenant in tenants:
            share = tenant.quota_bytes / total_quota
            limits = {
                Resource.CONNECTIONS: tenant.max_connections,
                Resource.BUFFER_BYTES: self.budgets.buffer_bytes,
                Resource.PARKED_KEYS: self.budgets.parked_keys,
                Resource.HELD_BYTES: min(tenant.quota_bytes, int(held_bytes * share)),
                Resource.PREFETCH_BYTES: max(MIN_PREFETCH_SHARE, int(prefetch_bytes * share)),
                Resource.REMOTE_KEYS: REMOTE_KEYS_PER_TENANT,
                Resource.STAGED_BYTES: max(MIN_STAGED_SHARE, int(staged_bytes * share)),
                Resource.RETAINED_BYTES: tenant.retained_bytes,
                Resource.LABEL_CHANGES: LABEL_BURST,
            }
            account = self._accounts.get(tenant.tag)
            if account is None:
                self._accounts[tenant.tag] = _Account(tenant.name, limits, filled_at=self.clock())
            else:
                account.name, account.limits = tenant.name, limits
        metered_limits = {Resource.ARENA_BYTES: {t.tag: t.quota_bytes for t in tenants}}
        if all_quotas > 0:  # no quotas at all: no shares of the lower tiers either
            for tier, capacity in (tier_bytes or {}).items():
                metered_limits[tier] = {
                    t.tag: capacity * t.quota_bytes // all_quotas for t in tenants
                }
        for resource, metered in self._metered.items():
            tag_to_limit = metered_limits.get(resource, {})
            self._metered[resource] = Metered(
                tag_to_limit, {tag: metered.used.get(tag, 0) for tag in tag_to_limit}
            )
        tags = {t.tag for t in tenants}
        for tag, account in list(self._accounts.items()):
            if tag != NODE and tag not in tags:
                account.limits = {}
                if account.holds_nothing():
                    del self._accounts[tag]

    def metered(self, resource: Resource) -> Metered:
        """The columns of a metered resource, as the last :meth:`set_tenants` made them
        (for its meter, :class:`~kvpool.store.quotas.Quotas`, at each recount)."""
        return self._metered[resource]

    def account_of(self, key_or_tag: bytes) -> bytes:
        """The account a key (or a tag) is charged to: its tenant's tag, or ``NODE``."""
        tag = key_or_tag[:TAG_BYTES]
        return tag if tag != NODE and tag in self._accounts else NODE

    def _entry(self, account: bytes) -> _Account:
        return self._accounts.get(account) or self._accounts[NODE]

    def charge(self, account: bytes, resource: Resource, amount: int = 1) -> bool:
        """Charge ``amount`` of ``resource`` to ``account`` if it stays within its limit
        (rule 2); whether it did.  A refusal is counted."""
        entry = self._entry(account)
        if resource is Resource.LABEL_CHANGES:
            return self._take_tokens(entry, amount)
        limit = entry.limits.get(resource)
        if limit is not None and entry.used[resource] + amount > limit:
            entry.refused[resource] += 1
            return False
        entry.used[resource] += amount
        return True

    def credit(self, account: bytes, resource: Resource, amount: int = 1) -> None:
        """Give back what a charge took (rule 3)."""
        entry = self._entry(account)
        entry.used[resource] -= amount
        if account != NODE and not entry.limits and entry.holds_nothing():
            self._accounts.pop(account, None)  # left the tenants file, holds nothing now

    def count(self, account: bytes, resource: Resource, amount: int) -> None:
        """Count ``amount`` of a resource that is counted, not limited (``JOURNAL_BYTES``)."""
        self._entry(account).used[resource] += amount

    def reset(self, resource: Resource) -> None:
        """Count a counted resource from zero again (a compacted journal)."""
        for entry in self._accounts.values():
            entry.used[resource] = 0

    def has_room(self, account: bytes, resource: Resource, amount: int) -> bool:
        """Whether a charge of ``amount`` would fit now (nothing is charged)."""
        entry = self._entry(account)
        limit = entry.limits.get(resource)
        return limit is None or entry.used[resource] + amount <= limit

    def limit(self, account: bytes, resource: Resource) -> int | None:
        """The account's limit of ``resource`` (None: none)."""
        if resource in METERED:
            return self._metered[resource].limits.get(account)
        return self._entry(account).limits.get(resource)

    def used(self, account: bytes, resource: Resource) -> int:
        if resource in METERED:
            return self._metered[resource].used.get(account, 0)
        return self._entry(account).used[resource]

    def _refill(self, entry: _Account) -> None:
        now = self.clock()
        refilled = entry.tokens + (now - entry.filled_at) * self.budgets.label_changes_per_s
        entry.tokens = min(LABEL_BURST, refilled)
        entry.filled_at = now

    def _take_tokens(self, entry: _Account, amount: int) -> bool:
        if Resource.LABEL_CHANGES not in entry.limits:
            return True
        self._refill(entry)
        if entry.tokens < amount:
            entry.refused[Resource.LABEL_CHANGES] += 1
            return False
        entry.tokens -= amount
        return True

    def usage(self, account: bytes | None = None) -> list[AccountStats]:
        """Every tenant's account (``account``: that one only), for status and metrics:
        what it holds, its limits and its refusals, by resource name.  For a rate
        (``label_changes``) what it holds is what its bucket is short of full."""
        rows = []
        for tag, entry in self._accounts.items():
            if tag == NODE or (account is not None and tag != account):
                continue
            used = {r.value: n for r, n in entry.used.items()}
            limits = {r.value: n for r, n in entry.limits.items()}
            if Resource.LABEL_CHANGES in entry.limits:
                self._refill(entry)
                used[Resource.LABEL_CHANGES.value] = int(LABEL_BURST - entry.tokens)
            for resource, metered in self._metered.items():
                if tag in metered.limits:
                    used[resource.value] = metered.used[tag]
                    limits[resource.value] = metered.limits[tag]
            rows.append(
                AccountStats(
                    tenant=entry.name,
                    used=used,
                    limits=limits,
                    refused={r.value: n for r, n in entry.refused.items() if n},
                )
            )
        return rows
