"""Room in the arena for new blocks: allocation that evicts the least recently used blocks
on demand, and down to the low watermark once usage passes the high one, within tenants'
quotas (rules 6 and 11 of :mod:`kvpool.store.pool`, which owns the blocks it evicts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvpool.config import page_bytes
from kvpool.store.allocator import Allocator
from kvpool.store.block import Block
from kvpool.store.eviction import EvictionPolicy
from kvpool.store.quotas import Quotas


class Space:
    def __init__(
        self,
        allocator: Allocator,
        eviction: EvictionPolicy,
        index: Mapping[bytes, Block],
        evict: Callable[[Block], None],
        high_watermark: float,
        low_watermark: float,
    ):
        self.allocator = allocator
        self.eviction = eviction
        self._index = index  # the store's: every block, by key
        self._evict_block = evict  # removes a block from the store, as evicted
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.quotas: Quotas | None = None  # the store's, when it has tenants

    def allocate_batch(self, keys: Sequence[bytes], sizes: Sequence[int]) -> list[int | None]:
        """One contiguous extent for the whole batch if there is one, else block by block
        (evicting for each as needed); None where a block found no room."""
        if not sizes:
            return []
        if len(sizes) > 1:
            extent = self.allocator.allocate(sum(page_bytes(s) for s in sizes))
            if extent is not None:
                return list(self.allocator.carve(extent, list(sizes)))
        return [self._allocate(key, size) for key, size in zip(keys, sizes, strict=True)]

    def fit_quota(self, key: bytes, size: int) -> bool:
        """Whether ``size`` more bytes fit the tenant's quota, after evicting its own LRU blocks."""
        quotas = self.quotas
        if quotas is None or not quotas.room(key, size):
            return True
        return self._evict(
            lambda victim: quotas.same_tenant(victim, key), lambda: not quotas.room(key, size)
        )

    def trim(self) -> None:
        """Past the high watermark, evict down to the low one."""
        capacity = self.allocator.capacity
        if self.allocator.used > self.high_watermark * capacity:
            target, quotas = self.low_watermark * capacity, self.quotas
            self._evict(
                lambda victim: quotas is None or quotas.may_evict(victim, None),
                lambda: self.allocator.used <= target,
            )

    def _allocate(self, key: bytes, num_bytes: int) -> int | None:
        offsets: list[int] = []

        def allocated() -> bool:
            if not offsets and (offset := self.allocator.allocate(num_bytes)) is not None:
                offsets.append(offset)
            return bool(offsets)

        quotas = self.quotas  # another tenant's block, within its share, stays
        self._evict(lambda victim: quotas is None or quotas.may_evict(victim, key), allocated)
        return offsets[0] if offsets else None

    def _evict(self, allowed: Callable[[bytes], bool], done: Callable[[], bool]) -> bool:
        """Evict LRU blocks that ``allowed`` admits until ``done()``; whether it got there."""
        for victim in self.eviction.victims():
            if done():
                return True
            block = self._index.get(victim)
            if block is not None and block.is_evictable and allowed(victim):
                self._evict_block(block)
        return done()
