"""Per-tenant DRAM quotas of a store, reservations included.

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
  more of the arena than their tenant's quota.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from kvpool.config import page_bytes
from kvpool.tenants import TAG_BYTES


class Quotas:
    """Per-tenant limits and usage, keyed by tag.  ``cost``: what ``size`` bytes of a block
    take where it is counted (the arena's pages by default; a lower tier counts the bytes
    it stores)."""

    def __init__(
        self, limits: Mapping[bytes, int] | None = None, cost: Callable[[int], int] = page_bytes
    ):
        self.limits: dict[bytes, int] = dict(limits or {})
        self.used: dict[bytes, int] = dict.fromkeys(self.limits, 0)
        self.cost = cost

    def recount(self, limits: Mapping[bytes, int], blocks: Iterable[tuple[bytes, int]]) -> None:
        """New limits (a reloaded tenants file), and the usage of the blocks held now."""
        self.limits = dict(limits)
        self.used = dict.fromkeys(self.limits, 0)
        for key, size in blocks:
            self.added(key, size)

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
        fits), in arena memory."""
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
