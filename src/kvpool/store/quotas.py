"""A tenant's quota where its blocks are: the meter of one resource of the tenant ledger.

The numbers are the ledger's (:mod:`kvpool.store.accounts`): each tenant's limit of the
arena (``ARENA_BYTES``), the disk (``DISK_BYTES``) and the object store (``OBJECT_BYTES``),
set by :meth:`~kvpool.store.accounts.Accounts.set_tenants` alone, and what it holds there.
A :class:`Quotas` owns no number: it is how the holder of that resource (the store, the disk
tier, the object tier) counts its blocks into the ledger and asks it, on its eviction's hot
path, whether a block fits.  It holds the ledger's own columns of its resource
(:class:`~kvpool.store.accounts.Metered`: limits and use by tag), taken again at each
recount, so a block costs a dict lookup or two, as when the numbers were its own.

Whose a block is comes from its key: a tenant's keys start with its tag (see
:mod:`kvpool.tenants`), so the accounting needs nothing stored per block and holds for
blocks written through from other nodes, promoted from lower tiers or adopted at a warm
restart.  Keys with no known tag (no tenants, or a tenant since removed) count for nobody.

- A write that would take its tenant past its quota first evicts that tenant's own blocks;
  if they cannot make room, the key is refused (``OVER_QUOTA``).
- Eviction for a write never takes a block of another tenant that is within its quota:
  one tenant's traffic never evicts another's blocks beyond its share.
- A block counts the arena memory it takes (whole pages, at least one, whatever its size:
  :func:`kvpool.config.page_bytes`), not its payload: empty or tiny blocks cannot hold
  more of the arena than their tenant's quota.  A lower tier counts the bytes it stores
  (:func:`stored_bytes`).
- After every :meth:`~kvpool.store.accounts.Accounts.set_tenants` the holder counts what it
  holds again (:meth:`Quotas.recount`, which also takes the ledger's new columns): a
  reloaded tenants file may add a tenant that holds blocks already.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvpool.config import page_bytes
from kvpool.store.accounts import Accounts, Resource
from kvpool.tenants import TAG_BYTES


def stored_bytes(size: int) -> int:
    """What ``size`` bytes of a block take on a lower tier: the bytes it stores."""
    return size


class Quotas:
    """The meter of one metered resource of ``accounts`` (``ARENA_BYTES``, ``DISK_BYTES``,
    ``OBJECT_BYTES``): ``limits`` and ``used`` by tag are the ledger's columns of it.
    ``cost``: what ``size`` bytes of a block take where it is counted (the arena's pages by
    default; a lower tier counts the bytes it stores)."""

    def __init__(
        self,
        accounts: Accounts,
        resource: Resource,
        cost: Callable[[int], int] = page_bytes,
    ) -> None:
        self.accounts = accounts
        self.resource = resource
        self.cost = cost
        columns = accounts.metered(resource)
        self.limits: Mapping[bytes, int] = columns.limits
        self.used: dict[bytes, int] = columns.used

    def recount(
        self, blocks: Iterable[tuple[bytes, int]], costs: Mapping[bytes, int] | None = None
    ) -> None:
        """Take the ledger's columns as its last ``set_tenants`` made them, and count what
        is held now into them: ``blocks`` as ``(key, size)``, and ``costs`` already
        summed by tag (a bulk count)."""
        columns = self.accounts.metered(self.resource)
        counted = dict.fromkeys(columns.limits, 0)
        for tag, cost in (costs or {}).items():
            if tag in counted:
                counted[tag] += cost
        for key, size in blocks:
            tag = key[:TAG_BYTES]
            if tag in counted:
                counted[tag] += self.cost(size)
        columns.used.update(counted)  # the same tags: values change, never the keys
        self.limits, self.used = columns.limits, columns.used

    def added(self, key: bytes, size: int) -> None:
        tag = key[:TAG_BYTES]
        if tag in self.used:
            self.used[tag] += self.cost(size)

    def add_all(self, tag: bytes, cost: int) -> bool:
        """Count blocks of one tenant that together take ``cost`` if that fits its quota
        as it is (a write's keys at once); whether it did (else nothing is counted)."""
        limit = self.limits.get(tag)
        if limit is None:
            return True  # counted for nobody
        if self.used[tag] + cost > limit:
            return False
        self.used[tag] += cost
        return True

    def removed(self, key: bytes, size: int) -> None:
        tag = key[:TAG_BYTES]
        if tag in self.used:
            self.used[tag] -= self.cost(size)

    def room(self, key: bytes, size: int) -> int:
        """How many bytes the key's tenant is short of for a block of ``size`` more (0: it
        fits), as this resource counts them."""
        tag = key[:TAG_BYTES]
        limit = self.limits.get(tag)
        return 0 if limit is None else max(0, self.used[tag] + self.cost(size) - limit)

    def group_of(self, key: bytes) -> bytes | None:
        """The eviction group of a key: its tenant's tag, None for nobody's (the store keeps
        one LRU list per group, so a tenant's eviction never walks another's blocks)."""
        tag = key[:TAG_BYTES]
        return tag if tag in self.limits else None

    def may_evict(self, victim: bytes, for_key: bytes | None) -> bool:
        """Whether a write of ``for_key`` (None: the store's own watermark) may evict
        ``victim``: the writer's own blocks, nobody's, or a tenant's past its quota."""
        return self.may_evict_group(self.group_of(victim), for_key)

    def may_evict_group(self, group: object, for_key: bytes | None) -> bool:
        """:meth:`may_evict` for every block of an eviction group (:meth:`group_of`)."""
        if group is None or (for_key is not None and self.group_of(for_key) == group):
            return True
        assert isinstance(group, bytes)
        return self.used[group] > self.limits[group]
