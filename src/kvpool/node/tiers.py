"""The node's tiers: DRAM (the store and its arena), the local disk below it, and the
object store that the whole cluster shares below that.

- **Lookups** count a block on disk or in the object store as present; the answer says
  which tier holds each block of the prefix.  They only read in-memory indexes, on the
  event loop: never a request to the object store.
- **Write-back**: DRAM evictions go to disk (:mod:`kvpool.node.writeback`), and the disk's
  evicted segments go to the object store (:mod:`kvpool.store.objects`).
- **Promotion on read**: a PIN or GET of a block that is in a lower tier but not in DRAM
  first copies it back, straight into a slot the node reserves for itself, verifies it,
  and commits it; the read then proceeds from DRAM.  Concurrent reads of one block share
  one promotion.  A promotion runs as a task of its own, so a reader that goes away (or
  stops waiting at its deadline) cannot cut it short while its thread still writes into
  the arena; the reader waits at most ``wait_s`` and then finds what has arrived.
- **Prefetch**: the same promotion, started ahead of the read for a request that is still
  queued, and below the priority of real reads: it has one I/O thread of its own where
  reads have ``READ_THREADS``, and at most ``PREFETCH_MAX_BYTES`` in flight (the rest is
  refused).  Its blocks are *held* (:mod:`kvpool.store.holds`) until read or until the
  hold lapses.  A prefetch of blocks already in DRAM or already coming up only holds them;
  a cancelled one releases its holds.

All disk and object-store I/O runs on threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvpool.checksum import copy_with_checksum
from kvpool.node.writeback import WriteBack
from kvpool.protocol.messages import PrefetchResponse
from kvpool.stats import TIER_DISK, TIER_DRAM, TIER_OBJECT, PrefetchStats, TierStats
from kvpool.store.arena import Arena
from kvpool.store.block import Block
from kvpool.store.disk import DiskTier
from kvpool.store.holds import Holds
from kvpool.store.objects import ObjectTier
from kvpool.store.pool import BlockStore

log = logging.getLogger("kvpool.node")

PROMOTER_OWNER = -2  # the node's own reservations, apart from every connection's
READ_THREADS = 4
DEFAULT_WAIT_S = 2.0  # a read that names no deadline waits this long for lower tiers
DEFAULT_HOLD_S = 30.0
MAX_HOLD_S = 120.0
PREFETCH_MAX_BYTES = 512 << 20
MAX_REMOTE_PREFETCH_KEYS = 1024

# Reads blocks from other nodes of the cluster: per key, its bytes or None.
RemoteFetch = Callable[[list[bytes]], Awaitable[list[bytes | None]]]


class Tiers:
    """Lookups, promotions, prefetches and statistics across the node's tiers."""

    def __init__(
        self,
        store: BlockStore,
        arena: Arena,
        disk: DiskTier | None = None,
        writeback: WriteBack | None = None,
        objects: ObjectTier | None = None,
        holds: Holds | None = None,
        remote: RemoteFetch | None = None,
    ) -> None:
        self.store = store
        self.arena = arena
        self.disk = disk
        self.writeback = writeback
        self.objects = objects
        self.remote = remote  # other nodes of the cluster (prefetch only)
        self.holds = holds if holds is not None else Holds(arena.num_bytes // 2)
        self.hits = {TIER_DRAM: 0, TIER_DISK: 0, TIER_OBJECT: 0}
        self.promoted = {TIER_DISK: 0, TIER_OBJECT: 0}
        self.promoted_remote = 0  # blocks a prefetch copied from other nodes
        self.num_late = 0  # reads that stopped waiting for a promotion at their deadline
        self.prefetched = PrefetchStats()
        self._prefetch_bytes = 0  # in flight
        self._promoting: dict[bytes, asyncio.Future[int]] = {}
        self._io = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvpool-tier-read")
        self._prefetch_io = ThreadPoolExecutor(1, thread_name_prefix="kvpool-prefetch")

    @property
    def has_lower(self) -> bool:
        return self.disk is not None or self.objects is not None

    @property
    def can_prefetch(self) -> bool:
        return self.has_lower or self.remote is not None

    def start(self) -> None:
        if self.writeback is not None:
            self.writeback.start()

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._promoting:
            await asyncio.wait(list(set(self._promoting.values())))
        await loop.run_in_executor(None, self._stop_threads)

    def _stop_threads(self) -> None:
        if self.writeback is not None:
            self.writeback.stop()
        self._io.shutdown(wait=True)
        self._prefetch_io.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()
        if self.objects is not None:
            self.objects.stop()

    # -- lookups --------------------------------------------------------------------------

    def _lower_tiers(self, keys: Sequence[bytes]) -> list[int | None]:
        """Per key, the fastest lower tier that holds it (``None``: none does)."""
        found: list[int | None] = [None] * len(keys)
        for tier, holder in ((TIER_DISK, self.disk), (TIER_OBJECT, self.objects)):
            if holder is None:
                continue
            for i, held in enumerate(holder.contains(keys)):
                if held and found[i] is None:
                    found[i] = tier
        return found

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, bool, bytes]:
        """The longest prefix held in any tier, whether the key after it is being written,
        and the tier of each block of the prefix."""
        num_prefix, pending = self.store.lookup(keys, count=False)
        tiers = bytearray([TIER_DRAM]) * num_prefix
        # A block coming up from a lower tier is reserved in DRAM, but nobody is writing
        # it: it counts as held where it comes from, not as pending.
        pending = pending and keys[num_prefix] not in self._promoting
        if not self.has_lower or num_prefix == len(keys) or pending:
            return num_prefix, pending, bytes(tiers)
        rest = keys[num_prefix:]
        for in_dram, lower in zip(
            self.store.lookup_mask(rest, count=False), self._lower_tiers(rest), strict=True
        ):
            if not in_dram and lower is None:
                break
            tiers.append(TIER_DRAM if in_dram else lower)  # type: ignore[arg-type]
        num_prefix = len(tiers)
        if num_prefix < len(keys):
            after = keys[num_prefix]
            pending = self.store.pending_mask([after])[0] and after not in self._promoting
        return num_prefix, pending, bytes(tiers)

    def record_lookup(self, keys: Sequence[bytes], num_prefix: int, tiers: bytes) -> None:
        self.store.record_lookup(keys, num_prefix)
        for tier in self.hits:
            self.hits[tier] += tiers.count(tier)

    def presence(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bool], bytes]:
        """Per key: held in some tier, being written, and the tier (DRAM if absent)."""
        present = self.store.lookup_mask(keys)
        pending = [
            p and k not in self._promoting
            for k, p in zip(keys, self.store.pending_mask(keys), strict=True)
        ]
        tiers = bytearray(len(keys))
        if self.has_lower:
            missing = [i for i, p in enumerate(present) if not p]
            for i, lower in zip(
                missing, self._lower_tiers([keys[i] for i in missing]), strict=True
            ):
                if lower is not None:
                    present[i] = True
                    tiers[i] = lower
        return present, pending, bytes(tiers)

    # -- promotion ------------------------------------------------------------------------

    async def promote(self, keys: Sequence[bytes], prefix: bool, wait_s: float = 0.0) -> None:
        """Bring the blocks among ``keys`` that are in a lower tier but not in DRAM back
        into DRAM (with ``prefix``, only up to the first block held nowhere), waiting at
        most ``wait_s`` (0: ``DEFAULT_WAIT_S``) for them."""
        if not self.has_lower:
            return
        waits, wanted = self._plan(keys, prefix)
        if wanted:
            waits.append(self._start(wanted, self._io))
        if not waits:
            return
        try:
            async with asyncio.timeout(wait_s or DEFAULT_WAIT_S):
                await asyncio.shield(asyncio.gather(*waits, return_exceptions=True))
        except TimeoutError:
            self.num_late += 1  # what is not up yet is a miss for this read

    def _plan(
        self, keys: Sequence[bytes], prefix: bool
    ) -> tuple[list[asyncio.Future[int]], list[tuple[bytes, int, int]]]:
        """Promotions to join, and ``(key, size, tier)`` to start."""
        waits: list[asyncio.Future[int]] = []
        wanted: list[tuple[bytes, int, int]] = []
        in_dram = self.store.lookup_mask(keys, count=False)
        if all(in_dram):
            return waits, wanted
        for key, held in zip(keys, in_dram, strict=True):
            if held:
                continue
            if key in self._promoting:
                waits.append(self._promoting[key])
                continue
            source = self._source(key)
            if source is None:
                if prefix:
                    break
                continue
            wanted.append((key, *source))
        return waits, wanted

    def _source(self, key: bytes) -> tuple[int, int] | None:
        """The size of the block and the lower tier to read it from."""
        if self.disk is not None:
            location = self.disk.location(key)
            if location is not None:
                return location.size, TIER_DISK
        if self.objects is not None:
            found = self.objects.location(key)
            if found is not None:
                return found.size, TIER_OBJECT
        return None

    def _start(
        self, wanted: list[tuple[bytes, int, int]], lane: ThreadPoolExecutor
    ) -> asyncio.Future[int]:
        task = asyncio.ensure_future(self._promote(wanted, lane))
        for key, _, _ in wanted:
            self._promoting[key] = task
        return task

    async def _promote(self, wanted: list[tuple[bytes, int, int]], lane: ThreadPoolExecutor) -> int:
        store = self.store
        keys = [k for k, _, _ in wanted]
        result = store.reserve(keys, [s for _, s, _ in wanted], PROMOTER_OWNER, held=True)
        num_promoted = 0
        try:
            jobs = [(b, wanted[i][2], i) for i, b in enumerate(result.blocks) if b is not None]
            checksums: list[int | None] = [None] * len(keys)
            if jobs:
                loop = asyncio.get_running_loop()
                # Not cancellable: this task outlives the readers that wait on it.
                for i, tier, checksum in await loop.run_in_executor(lane, self._read, jobs):
                    checksums[i] = checksum
                    if checksum is not None:
                        self.promoted[tier] += 1
                        num_promoted += 1
            if result.reservation_id:
                store.commit(result.reservation_id, checksums, PROMOTER_OWNER)
        except Exception:  # a bug must not leave a reservation held for good
            log.exception("promotion of %d blocks from a lower tier failed", len(keys))
            store.abort(result.reservation_id, PROMOTER_OWNER)
        finally:
            for key in keys:
                self._promoting.pop(key, None)
        return num_promoted

    def _read(self, jobs: list[tuple[Block, int, int]]) -> list[tuple[int, int, int | None]]:
        """Read each block from its tier into its slot: ``(index, tier, checksum)``."""
        done: list[tuple[int, int, int | None]] = []
        from_objects = []
        for block, tier, i in jobs:
            dst = self.arena.slice(block.offset, block.size)
            if tier == TIER_DISK and self.disk is not None:
                checksum = self.disk.read_into(block.key, dst)
                if checksum is not None or self.objects is None:
                    done.append((i, tier, checksum))
                    continue
            from_objects.append((block, i, dst))  # also a disk block lost meanwhile
        if from_objects and self.objects is not None:
            checksums = self.objects.read_many([(b.key, dst) for b, _, dst in from_objects])
            done += [
                (i, TIER_OBJECT, c) for (_, i, _), c in zip(from_objects, checksums, strict=True)
            ]
        return done

    # -- prefetch -------------------------------------------------------------------------

    def prefetch(
        self, keys: Sequence[bytes], hold_s: float, cancel: bool = False
    ) -> PrefetchResponse:
        """Start bringing ``keys`` into DRAM for a queued request, and hold them there."""
        answer = PrefetchResponse()
        if cancel:
            self.holds.release(keys)
            return answer
        hold_s = min(hold_s or DEFAULT_HOLD_S, MAX_HOLD_S)
        wanted: list[tuple[bytes, int, int]] = []
        elsewhere: list[bytes] = []
        in_dram = self.store.lookup_mask(keys, count=False)
        for key, held in zip(keys, in_dram, strict=True):
            block = self.store.get_block(key) if held else None
            if block is not None:
                answer.num_in_dram += self.holds.hold(key, block.size, hold_s, fetched=False)
                continue
            source = self._source(key)
            if source is None:
                if self.remote is not None and key not in self._promoting:
                    elsewhere.append(key)
                else:
                    answer.num_absent += 1
                continue
            size = source[0]
            if key in self._promoting:
                answer.num_started += self.holds.hold(key, size, hold_s, fetched=True)
            elif self._prefetch_bytes + size > PREFETCH_MAX_BYTES or not self.holds.hold(
                key, size, hold_s, fetched=True
            ):
                answer.num_refused += 1
            else:
                wanted.append((key, *source))
                self._prefetch_bytes += size
        if elsewhere:  # other nodes may hold them: asked in the background
            elsewhere = elsewhere[:MAX_REMOTE_PREFETCH_KEYS]
            answer.num_started += len(elsewhere)
            self._spawn_remote(elsewhere, hold_s)
        if wanted:
            answer.num_started += len(wanted)
            num_bytes = sum(size for _, size, _ in wanted)
            task = self._start(wanted, self._prefetch_io)
            task.add_done_callback(lambda done: self._prefetch_done(done, num_bytes))
        stats = self.prefetched
        stats.issued += len(keys)
        stats.in_dram += answer.num_in_dram
        stats.started += answer.num_started
        stats.refused += answer.num_refused
        stats.absent += answer.num_absent
        return answer

    def _spawn_remote(self, keys: list[bytes], hold_s: float) -> None:
        task = asyncio.ensure_future(self._prefetch_remote(keys, hold_s))
        for key in keys:
            self._promoting[key] = task

    async def _prefetch_remote(self, keys: list[bytes], hold_s: float) -> int:
        """Copy blocks that other nodes hold into this node's DRAM, and hold them."""
        assert self.remote is not None
        try:
            values = await self.remote(keys)
            found = [
                (k, v)
                for k, v in zip(keys, values, strict=True)
                if v is not None and self._prefetch_bytes + len(v) <= PREFETCH_MAX_BYTES
            ]
            if not found:
                return 0
            store = self.store
            sizes = [len(v) for _, v in found]
            result = store.reserve([k for k, _ in found], sizes, PROMOTER_OWNER, held=True)

            def copy_in() -> list[int | None]:
                sums: list[int | None] = [None] * len(found)
                for i, block in enumerate(result.blocks):
                    if block is not None:
                        dst = self.arena.slice(block.offset, block.size)
                        sums[i] = copy_with_checksum(dst, memoryview(found[i][1]))
                return sums

            loop = asyncio.get_running_loop()
            checksums = await loop.run_in_executor(self._prefetch_io, copy_in)
            if result.reservation_id:
                store.commit(result.reservation_id, checksums, PROMOTER_OWNER)
            num = 0
            for (key, value), checksum in zip(found, checksums, strict=True):
                if checksum is not None and self.holds.hold(key, len(value), hold_s, fetched=True):
                    num += 1
            self.prefetched.completed += num
            self.promoted_remote += num
            return num
        except Exception:  # a hint: a failure only means the read goes elsewhere
            log.exception("prefetch of %d blocks from other nodes failed", len(keys))
            return 0
        finally:
            for key in keys:
                self._promoting.pop(key, None)

    def _prefetch_done(self, task: asyncio.Future[int], num_bytes: int) -> None:
        self._prefetch_bytes -= num_bytes
        if not task.cancelled() and task.exception() is None:
            self.prefetched.completed += task.result()

    def note_read(self, blocks: Sequence[Block | None]) -> None:
        """These blocks were pinned or sent: the requests that held them ran."""
        if len(self.holds):
            self.holds.read([b.key for b in blocks if b is not None])

    def delete(self, keys: Sequence[bytes]) -> int:
        """Forget the keys in the tiers below DRAM; how many were there."""
        num = self.disk.delete(keys) if self.disk is not None else 0
        if self.objects is not None:
            num += self.objects.forget(keys)
        return num

    # -- status ---------------------------------------------------------------------------

    def stats(self) -> list[TierStats]:
        store, counters = self.store, self.store.counters
        writeback = self.writeback
        tiers = [
            TierStats(
                name="dram",
                capacity_bytes=store.capacity,
                used_bytes=store.used_bytes,
                num_blocks=len(store),
                hits=self.hits[TIER_DRAM],
                reads=counters.get_hits,
                writes=counters.puts,
                evictions=counters.evictions,
                corrupt=counters.corrupt_reports,
                recovered=counters.adopted,
            )
        ]
        if self.disk is not None:
            disk = self.disk.counters
            tiers.append(
                TierStats(
                    name="disk",
                    capacity_bytes=self.disk.capacity,
                    used_bytes=self.disk.used_bytes,
                    num_blocks=len(self.disk),
                    hits=self.hits[TIER_DISK],
                    reads=disk.hits,
                    writes=disk.writes,
                    refused=writeback.num_refused if writeback is not None else 0,
                    dropped=writeback.num_dropped if writeback is not None else 0,
                    promotions=self.promoted[TIER_DISK],
                    evictions=disk.evicted_blocks,
                    corrupt=disk.corrupt,
                    recovered=disk.recovered,
                )
            )
        if self.objects is not None:
            objects = self.objects.counters
            tiers.append(
                TierStats(
                    name="object",
                    capacity_bytes=self.objects.capacity,
                    used_bytes=self.objects.used_bytes,
                    num_blocks=len(self.objects),
                    hits=self.hits[TIER_OBJECT],
                    reads=objects.reads,
                    writes=objects.uploaded_blocks,
                    dropped=objects.dropped_segments,
                    promotions=self.promoted[TIER_OBJECT],
                    evictions=objects.deleted_packs,
                    corrupt=objects.corrupt,
                    errors=objects.read_errors + objects.refresh_errors,
                )
            )
        return tiers

    def prefetch_stats(self) -> PrefetchStats:
        stats = self.prefetched
        holds = self.holds
        stats.useful = holds.counters.useful
        stats.wasted = holds.counters.wasted
        stats.held_blocks = len(holds)
        stats.held_bytes = holds.held_bytes
        return stats
