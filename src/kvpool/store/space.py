"""Room in the arena for new blocks: allocation that evicts the least recently used blocks
on demand, and down to the low watermark once usage passes the high one, within tenants'
quotas (rules 6 and 11 of :mod:`kvpool.store.block_store`, which owns the blocks it evicts).

It asks the store, through :class:`Evictee`, whether the block of a slot of its index may be
evicted now, and has the store evict it; it never sees the store's index.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from kvpool.config import PAGE_BYTES, pages_of
from kvpool.store.allocator import Allocator
from kvpool.store.eviction import Allowed, EvictionPolicy, Group
from kvpool.store.quotas import Quotas

# Blocks a watermark trim evicts per call at most (a few milliseconds of work).
TRIM_STEP = 512


class Evictee(Protocol):
    """The owner of the blocks (the store), as eviction sees it."""

    def evictable(self, slot: int) -> bool:
        """Whether the block of ``slot`` may be evicted now (committed and unpinned)."""

    def evict(self, slot: int) -> None:
        """Remove the slot's block, as evicted (offered to a lower tier first)."""


class Space:
    def __init__(
        self,
        allocator: Allocator,
        eviction: EvictionPolicy,
        blocks: Evictee,
        high_watermark: float,
        low_watermark: float,
    ):
        self.allocator = allocator
        self.eviction = eviction
        self.blocks = blocks
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.quotas: Quotas | None = None  # the store's, when it has tenants
        self._trimming = False  # past the high watermark, not yet back to the low one

    def allocate_batch(self, keys: Sequence[bytes], sizes: Sequence[int]) -> list[int | None]:
        """One contiguous extent for the whole batch if there is one, else block by block
        (evicting for each as needed); None where a block found no room."""
        if not sizes:
            return []
        if len(sizes) > 1:
            num_pages = int(pages_of(np.asarray(sizes, dtype=np.int64)).sum())
            extent = self.allocator.allocate(num_pages * PAGE_BYTES)
            if extent is not None:
                return list(self.allocator.carve(extent, list(sizes)))
        return [self._allocate(key, size) for key, size in zip(keys, sizes, strict=True)]

    def fit_quota(self, key: bytes, size: int) -> bool:
        """Whether ``size`` more bytes fit the tenant's quota, after evicting its own LRU blocks."""
        quotas = self.quotas
        if quotas is None or not quotas.room(key, size):
            return True
        own = quotas.group_of(key)
        return self._evict(lambda group: group == own, lambda: not quotas.room(key, size))[0]

    def trim(self) -> None:
        """Past the high watermark, evict down to the low one, at most ``TRIM_STEP`` blocks
        a call: the gap between the watermarks is a share of the whole arena (100,000
        blocks of 4 KiB in 8 GiB), too many for one request; later calls go on until the
        low watermark is reached (allocation still evicts on demand meanwhile)."""
        capacity = self.allocator.capacity
        if not self._trimming and self.allocator.used <= self.high_watermark * capacity:
            return
        target = self.low_watermark * capacity
        quotas = self.quotas

        def allowed(group: Group) -> bool:
            return quotas is None or quotas.may_evict_group(group, None)

        def low_enough() -> bool:
            return self.allocator.used <= target

        reached, num_evicted = self._evict(allowed, low_enough, TRIM_STEP)
        self._trimming = not reached and num_evicted == TRIM_STEP  # else: nothing more to take

    def _allocate(self, key: bytes, num_bytes: int) -> int | None:
        """Room for one block, evicting what this key's writer may evict until it fits."""
        offsets: list[int] = []
        quotas = self.quotas

        def allowed(group: Group) -> bool:
            # Another tenant's block, within its share, stays.
            return quotas is None or quotas.may_evict_group(group, key)

        def allocated() -> bool:
            if not offsets:
                offset = self.allocator.allocate(num_bytes)
                if offset is not None:
                    offsets.append(offset)
            return bool(offsets)

        self._evict(allowed, allocated)
        if not offsets:
            return None
        return offsets[0]

    def _evict(
        self, allowed: Allowed, done: Callable[[], bool], limit: int | None = None
    ) -> tuple[bool, int]:
        """Evict LRU blocks of the groups (tenants) ``allowed`` admits until ``done()`` (or
        ``limit`` blocks are evicted); whether it got there, and how many it evicted.  The
        policy lists only evictable blocks (pinned ones leave it while pinned) and only the
        groups allowed, so this visits O(blocks evicted)."""
        num_evicted = 0
        if done():
            return True, 0
        for victim in self.eviction.victims(allowed):
            if self.blocks.evictable(victim):
                self.blocks.evict(victim)
                num_evicted += 1
            if done():
                return True, num_evicted
            if num_evicted == limit:
                break
        return False, num_evicted
