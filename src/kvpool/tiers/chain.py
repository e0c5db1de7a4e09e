"""The node's tier chain: DRAM (the store and its arena), then the lower tiers in order
(:class:`~kvpool.tiers.tier.Tier`: the local disk, then the object store that the whole
cluster shares), with other nodes (:class:`~kvpool.tiers.tier.RemoteSource`) as one more
source that only prefetches ask.  :class:`Tiers` is the facade the node uses; each job has
a module of its own:

- **Lookups** (:mod:`kvpool.tiers.lookup`): a block on disk or in the object store counts
  as present, and the answer says which tier holds each block of the prefix; in-memory
  indexes only, never a request to the object store.
- **Promotion** (:mod:`kvpool.tiers.promotion`): one path (reserve under the node's own
  owner, fill on an I/O thread, commit), for reads, prefetches from the lower tiers and
  prefetches from other nodes; concurrent reads of one block share one promotion.
- **Reads** (:mod:`kvpool.tiers.reads`): a PIN's or GET's promotion and pin, and a GET
  larger than DRAM served from below a bounded stage at a time, as one :class:`Read`.
- **Prefetch** (:mod:`kvpool.tiers.prefetch`): the same promotion, ahead of a queued
  request, within the node's and the tenant's bytes in flight, holding what came up.
- **Write-back**: DRAM evictions go to disk (:mod:`kvpool.tiers.writeback`), and the disk's
  evicted segments go to the object store (:mod:`kvpool.tiers.objects`).
- Here: deletes on every lower tier, every tier's count of what each tenant holds there
  (into the tenant ledger, :mod:`kvpool.store.accounts`, after it set their limits), what
  the object store lost, and the statistics (with each tier's hit-rate estimates).

All disk and object-store I/O runs on threads, never on the event loop: reads and their
promotions on ``READ_THREADS``, prefetches on one thread of their own (below the priority
of real reads).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager

from kvpool.protocol.messages import PrefetchResponse
from kvpool.stats import ESTIMATE_SCALES, TIER_DRAM, HitRateEstimate, PrefetchStats, TierStats
from kvpool.store.accounts import Resource
from kvpool.store.arena import Arena
from kvpool.store.block import PinResult
from kvpool.store.block_store import BlockStore
from kvpool.store.holds import Holds
from kvpool.tiers.lookup import Lookups
from kvpool.tiers.lower import LowerTiers
from kvpool.tiers.prefetch import PREFETCH_MAX_BYTES, Prefetches
from kvpool.tiers.promotion import Promotions
from kvpool.tiers.reads import MAX_STAGED_BYTES, STAGE_BYTES, STAGE_SEND_S, Below, Read, Reads
from kvpool.tiers.tier import RemoteSource

__all__ = [
    "MAX_STAGED_BYTES",
    "PREFETCH_MAX_BYTES",
    "READ_THREADS",
    "STAGE_BYTES",
    "STAGE_SEND_S",
    "Below",
    "LowerTiers",
    "Read",
    "Tiers",
]

READ_THREADS = 4


class Tiers:
    """Lookups, promotions, reads, prefetches and statistics across the node's tiers.
    Lifecycle: ``start`` (the write-back's thread), then lookups, reads and prefetches on
    the event loop, then ``stop`` (waits for promotions, writes back what is queued,
    closes the tiers)."""

    def __init__(
        self,
        store: BlockStore,
        arena: Arena,
        lower: LowerTiers | None = None,
        holds: Holds | None = None,
        remote: RemoteSource | None = None,
    ) -> None:
        self.store = store
        self.arena = arena
        self.lower = lower if lower is not None else LowerTiers()
        self.chain = self.lower.chain
        self.remote = remote  # other nodes of the cluster (prefetch only)
        self.holds = (
            holds
            if holds is not None
            else Holds(arena.num_bytes // 2, store.ledger, store.accounts)
        )
        self._io = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvpool-tier-read")
        self._prefetch_io = ThreadPoolExecutor(1, thread_name_prefix="kvpool-prefetch")
        self.promotions = Promotions(store, arena, self.lower, self._io)
        self.lookups = Lookups(store, self.lower, self.promotions)
        self.prefetches = Prefetches(
            store, self.lower, self.promotions, self.holds, remote, self._prefetch_io
        )
        self.reads = Reads(store, arena, self.lower, self.promotions, self.prefetches, self._io)
        self._lost: dict[bytes, int] = {}  # by account: dropped below, not yet reported
        self._dropped_seen = 0

    @property
    def has_lower(self) -> bool:
        return bool(self.chain)

    @property
    def can_prefetch(self) -> bool:
        return self.has_lower or self.remote is not None

    def start(self) -> None:
        if self.lower.writeback is not None:
            self.lower.writeback.start()

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        await self.promotions.wait_all()
        await loop.run_in_executor(None, self._stop_threads)

    def _stop_threads(self) -> None:
        if self.lower.writeback is not None:
            self.lower.writeback.stop()
        self._io.shutdown(wait=True)
        self._prefetch_io.shutdown(wait=True)
        for tier in self.chain:
            tier.close()

    # -- lookups (kvpool.tiers.lookup) --------------------------------------------------

    def lookup(self, keys: Sequence[bytes], start: int = 0) -> tuple[int, bool, bytes]:
        """:meth:`Lookups.lookup`: the longest prefix held in any tier, whether the key
        after it is being written, and the tier of each block of the prefix."""
        return self.lookups.lookup(keys, start)

    def record_lookup(self, keys: Sequence[bytes], num_prefix: int, tiers: bytes) -> None:
        self.lookups.record(keys, num_prefix, tiers)

    def presence(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bool], bytes]:
        """Per key: held in some tier, being written, and the tier (DRAM if absent)."""
        return self.lookups.presence(keys)

    # -- reads (kvpool.tiers.promotion, kvpool.tiers.reads) -----------------------------

    async def promote(self, keys: Sequence[bytes], prefix: bool, wait_s: float = 0.0) -> bool:
        """A read's promotion (:meth:`Promotions.on_read`), without the read."""
        return await self.promotions.on_read(keys, prefix, wait_s)

    async def pin(
        self, keys: Sequence[bytes], prefix: bool, owner: int, lease_s: float, wait_s: float
    ) -> tuple[PinResult, list[Below]]:
        """A PIN (:meth:`Reads.pin`): promoted, then pinned for ``owner``; the blocks a
        lower tier serves instead."""
        return await self.reads.pin(keys, prefix, owner, lease_s, wait_s)

    def read(
        self, keys: Sequence[bytes], prefix: bool, owner: int, wait_s: float
    ) -> AbstractAsyncContextManager[Read]:
        """A GET (:meth:`Reads.open`): ``async with tiers.read(...) as read`` owns the pin
        and the stage, and yields the payload in order."""
        return self.reads.open(keys, prefix, owner, wait_s)

    def note_read(self, keys: Sequence[bytes]) -> None:
        """The blocks of these keys were sent without a pin (TOUCH): the requests that held
        them ran."""
        self.prefetches.note_read(keys)

    # -- prefetch (kvpool.tiers.prefetch) -----------------------------------------------

    def prefetch(
        self, keys: Sequence[bytes], hold_s: float, cancel: bool = False
    ) -> PrefetchResponse:
        """:meth:`Prefetches.prefetch`: start bringing ``keys`` into DRAM for a queued
        request, and hold them there."""
        return self.prefetches.prefetch(keys, hold_s, cancel)

    # -- the rest ------------------------------------------------------------------------

    def capacities(self) -> dict[Resource, int]:
        """Each lower tier's capacity, by its resource of the tenant ledger: what
        :meth:`~kvpool.store.accounts.Accounts.set_tenants` shares among the tenants."""
        return {tier.resource: tier.capacity for tier in self.chain}

    def recount_quotas(self) -> None:
        """The ledger's tenants changed (:meth:`~kvpool.store.accounts.Accounts.set_tenants`,
        a reload): every tier, DRAM first, counts what each tenant holds there again."""
        self.store.recount_quotas()
        for tier in self.chain:
            tier.recount_quotas(self.store.accounts)

    async def delete(self, keys: Sequence[bytes]) -> int:
        """Delete the keys from the tiers below DRAM, for good (the disk writes tombstones,
        the object store is told: on a thread); how many were there."""
        if not self.chain:
            return 0
        if self.lower.writeback is not None:
            self.lower.writeback.discard(keys)  # on its way to disk: it must not land there
        if not any(tier.may_hold(keys) for tier in self.chain):
            return 0  # held by no lower tier, nor on its way into one: no thread
        loop = asyncio.get_running_loop()
        counts = await loop.run_in_executor(
            self._io, lambda: [tier.delete(keys) for tier in self.chain]
        )
        return sum(counts)

    def take_lost(self, account: bytes) -> int:
        """Blocks of ``account``'s (a tenant's, or the node's) that the object store dropped
        on their way into it since the last call (their disk segment found its upload
        queue full, or failed to upload): they are gone, and the account's next put reply
        says so.  O(1) unless something was dropped."""
        objects = self.lower.objects
        if objects is not None and objects.counters.dropped_blocks != self._dropped_seen:
            self._dropped_seen = objects.counters.dropped_blocks
            accounts = self.store.accounts
            for first_key, num in objects.take_dropped().items():
                owner = accounts.account_of(first_key)
                self._lost[owner] = self._lost.get(owner, 0) + num
        return self._lost.pop(account, 0) if self._lost else 0

    @property
    def num_not_kept(self) -> int:
        """Blocks evicted from DRAM that no lower tier took, since the node started: they
        are gone.  Counted on the event loop only, as the store evicts, so what it grows by
        over a synchronous store call is that call's doing.  A node without lower tiers
        counts none: there, eviction is all the cache does."""
        writeback = self.lower.writeback
        return writeback.num_not_kept if writeback is not None else 0

    # -- status ---------------------------------------------------------------------------

    def stats(self) -> list[TierStats]:
        """One entry per tier, DRAM first; each lower tier's own counters, with what only
        the chain sees: its lookup hits, its promotions, the write-back's refusals."""
        store, counters = self.store, self.store.counters
        tiers = [
            TierStats(
                name="dram",
                capacity_bytes=store.capacity,
                used_bytes=store.used_bytes,
                num_blocks=len(store),
                hits=self.lookups.hits[TIER_DRAM],
                reads=counters.get_hits,
                writes=counters.puts,
                evictions=counters.evictions,
                corrupt=counters.corrupt_reports,
                recovered=counters.adopted,
            )
        ]
        writeback = self.lower.writeback
        for tier in self.chain:
            stats = tier.stats()
            stats.hits = self.lookups.hits[tier.tier_id]
            stats.promotions = self.promotions.promoted[tier.tier_id]
            stats.served = self.reads.served[tier.tier_id]
            if writeback is not None and tier is writeback.disk:
                stats.refused = writeback.num_refused
                stats.dropped = writeback.num_dropped
                stats.slowed = writeback.num_waits
            tiers.append(stats)
        self._estimate(tiers)
        return tiers

    def _estimate(self, tiers: list[TierStats]) -> None:
        """Each tier's :class:`HitRateEstimate`: the hit rate with the tier at each of
        ESTIMATE_SCALES times its capacity and the tiers above it as they are, read off the
        store's sampled curve, anchored at the hit rate the node really had with all its
        tiers (nothing while a tier holds nothing to say how large its blocks are)."""
        reuse = self.store.reuse
        if not all(stats.num_blocks for stats in tiers):
            return
        # In blocks of the room each tier's blocks take on average; the reads the node
        # served came from all of them together.
        sizes = [s.capacity_bytes * s.num_blocks / max(s.used_bytes, 1) for s in tiers]
        above = 0.0  # blocks the faster tiers hold at capacity
        for stats, blocks in zip(tiers, sizes, strict=True):
            capacities = [above + scale * blocks for scale in ESTIMATE_SCALES]
            reuse.cover(capacities[-1])
            rates = reuse.hit_rates(capacities, anchor=sum(sizes))
            stats.estimates = [
                HitRateEstimate(scale=scale, hit_rate=round(rate, 4))
                for scale, rate in zip(ESTIMATE_SCALES, rates, strict=True)
                if rate is not None
            ]
            above += blocks

    def prefetch_stats(self) -> PrefetchStats:
        return self.prefetches.stats()
