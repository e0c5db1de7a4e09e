"""The account ledger: how much of every shared resource each tenant holds, in one place.

The lease ledger (:mod:`kvpool.store.leases`) says how long anything may hold the node's
memory; this one says how much each tenant holds now, of everything a tenant can cost the
node beside its arena pages, and refuses what would take a tenant past its limit.  Every
operation that spends a shared resource charges it here, and ``kvpool status`` and
``/metrics`` read it from here (:meth:`Accounts.usage`).

Resources (:class:`Resource`):

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

The arena is the store's :class:`~kvpool.store.quotas.Quotas` (eviction decides by it):
the ledger does not keep a second count, status reads both.

Rules (each has a test in tests/store/test_accounts.py):

1. An account is a tenant's tag (the first bytes of its keys, :mod:`kvpool.tenants`);
   everything else (no tenants, the cluster's own identity, the node's own work) is the
   node's account, ``NODE``, which has no limits.
2. :meth:`Accounts.charge` charges the whole amount within the limit, or nothing (False):
   the caller refuses, waits or answers at once, as its operation says.
3. Whoever charged credits it back, exactly once, when what it held is gone.
4. Limits come from the tenants file and the node's :class:`~kvpool.limits.Budgets`
   (:meth:`Accounts.set_tenants`, again on every reload); what is held survives a reload.

Synchronous, touched from one thread (the daemon's event loop), as the store is.
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


# What is charged and credited back; LABEL_CHANGES is a rate, JOURNAL_BYTES a count.
HELD = tuple(r for r in Resource if r not in (Resource.LABEL_CHANGES, Resource.JOURNAL_BYTES))


@dataclass
class _Account:
    name: str
    limits: Mapping[Resource, int]
    used: dict[Resource, int] = field(default_factory=lambda: dict.fromkeys(Resource, 0))
    refused: dict[Resource, int] = field(default_factory=lambda: dict.fromkeys(Resource, 0))
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

    def set_tenants(
        self,
        tenants: Iterable[Tenant] | None,
        held_bytes: int,
        prefetch_bytes: int,
        staged_bytes: int = 0,
    ) -> None:
        """The tenants (None: none), and the node's budgets they share: ``held_bytes`` of
        prefetch holds, ``prefetch_bytes`` in flight and ``staged_bytes`` of stages, each
        tenant the share its quota is of all quotas.  What each holds is kept (rule 4); a
        tenant that left the file keeps its account, limited no more, until what it holds
        is credited back."""
        tenants = list(tenants or ())
        total_quota = sum(t.quota_bytes for t in tenants) or 1
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
        tags = {t.tag for t in tenants}
        for tag, account in list(self._accounts.items()):
            if tag != NODE and tag not in tags:
                account.limits = {}
                if account.holds_nothing():
                    del self._accounts[tag]

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
        return self._entry(account).limits.get(resource)

    def used(self, account: bytes, resource: Resource) -> int:
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
            if Resource.LABEL_CHANGES in entry.limits:
                self._refill(entry)
                used[Resource.LABEL_CHANGES.value] = int(LABEL_BURST - entry.tokens)
            rows.append(
                AccountStats(
                    tenant=entry.name,
                    used=used,
                    limits={r.value: n for r, n in entry.limits.items()},
                    refused={r.value: n for r, n in entry.refused.items() if n},
                )
            )
        return rows
