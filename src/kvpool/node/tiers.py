"""The node's tiers: DRAM (the store and its arena) and the local disk below it.

- **Lookups** count a block on disk as present; the answer says which tier holds each block
  of the prefix.  They only read in-memory indexes, on the event loop.
- **Write-back on eviction**: a block evicted from DRAM is offered to the
  :class:`WriteBack` queue; if the admission policy takes it and the queue has room, it is
  copied into a staging buffer (one memcpy; its arena memory is freed at once, so an
  allocation that evicts never waits) and one writer thread appends it to disk in large
  batches.  A full queue drops the block: DRAM never waits for the disk.
- **Promotion on read**: a PIN or GET of a block that is on disk but not in DRAM first
  copies it back, straight from disk into a slot the node reserves for itself, verifies
  it, and commits it; the read then proceeds from DRAM.  Concurrent reads of one block
  share one promotion.  A promotion runs as a task of its own, so a reader that goes away
  cannot cut it short while its thread still writes into the arena.

All disk I/O runs on threads, never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from kvpool.keys import BlockOrigin
from kvpool.node.events import MEDIUM_STORAGE, KVEventPublisher
from kvpool.stats import TIER_DISK, TIER_DRAM, TierStats
from kvpool.store.admission import AdmissionPolicy, ReusedFirst
from kvpool.store.arena import Arena
from kvpool.store.block import Block
from kvpool.store.disk import DiskTier
from kvpool.store.pool import BlockStore

log = logging.getLogger("kvpool.node")

PROMOTER_OWNER = -2  # the node's own reservations, apart from every connection's
WRITE_BATCH_BYTES = 64 << 20
MAX_WRITEBACK_BYTES = 1 << 30
READ_THREADS = 4


class WriteBack:
    """Evicted blocks on their way to disk: staged copies bounded in bytes, one writer."""

    def __init__(
        self, disk: DiskTier, arena: Arena, admission: AdmissionPolicy | None = None
    ) -> None:
        self.disk = disk
        self.arena = arena
        self.admission = admission or ReusedFirst()
        self.budget_bytes = min(MAX_WRITEBACK_BYTES, max(arena.num_bytes // 4, 16 << 20))
        self.num_queued = 0
        self.num_refused = 0
        self.num_dropped = 0
        self.num_present = 0  # already on disk: nothing to write
        self._queue: deque[tuple[bytes, memoryview, int]] = deque()
        self._unwritten_bytes = 0  # staged and not written yet (the disk's backlog)
        self._spare: dict[int, list[bytearray]] = {}  # staging buffers to reuse, by size
        self._spare_bytes = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # What queued blocks were computed from, until they are written (KV events).
        self._origins: dict[bytes, BlockOrigin] = {}
        self.events: KVEventPublisher | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvpool-writeback", daemon=True)
        self._thread.start()

    def offer(self, block: Block) -> bool:
        """The store's spill target (on the event loop): copy the block out, or refuse."""
        if self._thread is None or self._stopping:
            return False
        if self.disk.location(block.key) is not None:
            self.num_present += 1
            return False
        with self._cond:
            fill = self._unwritten_bytes / self.budget_bytes
            if not self.admission.admit(block, fill):
                self.num_refused += 1
                return False
            if self._unwritten_bytes + block.size > self.budget_bytes:
                self.num_dropped += 1
                return False
            buffer = self._take_buffer(block.size)
            self._unwritten_bytes += block.size
        view = memoryview(buffer)[: block.size]
        view[:] = self.arena.slice(block.offset, block.size)
        if block.origin is not None:
            self._origins[block.key] = block.origin
        with self._cond:
            self._queue.append((block.key, view, block.checksum))
            self.num_queued += 1
            self._cond.notify()
        return True

    def _take_buffer(self, size: int) -> bytearray:
        spare = self._spare.get(size)
        if spare:
            self._spare_bytes -= size
            return spare.pop()
        return bytearray(size)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                batch: list[tuple[bytes, memoryview, int]] = []
                num_bytes = 0
                while self._queue and num_bytes < WRITE_BATCH_BYTES:
                    item = self._queue.popleft()
                    batch.append(item)
                    num_bytes += len(item[1])
            try:
                self.disk.write(batch)
            except OSError as exc:  # a full or failing disk: the blocks are simply not kept
                log.warning("disk write-back of %d blocks failed: %s", len(batch), exc)
            for key, _, _ in batch:
                origin = self._origins.pop(key, None)
                if self.events is not None and self.disk.location(key) is not None:
                    self.events.stored_key(key, origin, MEDIUM_STORAGE)
            with self._cond:
                self._unwritten_bytes -= num_bytes
                for _, view, _ in batch:  # keep buffers for reuse, up to the budget
                    buffer = view.obj
                    if (
                        isinstance(buffer, bytearray)
                        and self._spare_bytes + len(buffer) <= self.budget_bytes
                    ):
                        self._spare.setdefault(len(buffer), []).append(buffer)
                        self._spare_bytes += len(buffer)

    def stop(self) -> None:
        """Write what is queued, then stop the writer."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class Tiers:
    """Lookups, promotions and statistics across the node's tiers."""

    def __init__(
        self,
        store: BlockStore,
        arena: Arena,
        disk: DiskTier | None = None,
        writeback: WriteBack | None = None,
    ) -> None:
        self.store = store
        self.arena = arena
        self.disk = disk
        self.writeback = writeback
        self.dram_hits = 0
        self.disk_hits = 0
        self.num_promoted = 0
        self._promoting: dict[bytes, asyncio.Future[None]] = {}
        self._io = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvpool-disk-read")

    def start(self) -> None:
        if self.writeback is not None:
            self.writeback.start()

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._promoting:
            await asyncio.wait(list(self._promoting.values()))
        await loop.run_in_executor(None, self._stop_threads)

    def _stop_threads(self) -> None:
        if self.writeback is not None:
            self.writeback.stop()
        self._io.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()

    # -- lookups --------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> tuple[int, bool, bytes]:
        """The longest prefix held in any tier, whether the key after it is being written,
        and the tier of each block of the prefix."""
        num_prefix, pending = self.store.lookup(keys, count=False)
        tiers = bytearray([TIER_DRAM]) * num_prefix
        if self.disk is None or num_prefix == len(keys) or pending:
            return num_prefix, pending, bytes(tiers)
        rest = keys[num_prefix:]
        for in_dram, on_disk in zip(
            self.store.lookup_mask(rest, count=False), self.disk.contains(rest), strict=True
        ):
            if not (in_dram or on_disk):
                break
            tiers.append(TIER_DRAM if in_dram else TIER_DISK)
        num_prefix = len(tiers)
        if num_prefix < len(keys):
            pending = self.store.pending_mask(keys[num_prefix : num_prefix + 1])[0]
        return num_prefix, pending, bytes(tiers)

    def record_lookup(self, keys: Sequence[bytes], num_prefix: int, tiers: bytes) -> None:
        self.store.record_lookup(keys, num_prefix)
        num_disk = tiers.count(TIER_DISK)
        self.disk_hits += num_disk
        self.dram_hits += num_prefix - num_disk

    def presence(self, keys: Sequence[bytes]) -> tuple[list[bool], list[bool], bytes]:
        """Per key: held in some tier, being written, and the tier (DRAM if absent)."""
        present = self.store.lookup_mask(keys)
        pending = self.store.pending_mask(keys)
        tiers = bytearray(len(keys))
        if self.disk is not None:
            missing = [i for i, p in enumerate(present) if not p]
            for i, on_disk in zip(
                missing, self.disk.contains([keys[i] for i in missing]), strict=True
            ):
                if on_disk:
                    present[i] = True
                    tiers[i] = TIER_DISK
        return present, pending, bytes(tiers)

    # -- promotion ------------------------------------------------------------------------

    async def promote(self, keys: Sequence[bytes], prefix: bool) -> None:
        """Bring the blocks among ``keys`` that are on disk but not in DRAM back into DRAM
        (with ``prefix``, only up to the first block held nowhere)."""
        if self.disk is None:
            return
        in_dram = self.store.lookup_mask(keys, count=False)
        if all(in_dram):
            return
        waits: list[asyncio.Future[None]] = []
        wanted: list[tuple[bytes, int]] = []
        for key, held in zip(keys, in_dram, strict=True):
            if held:
                continue
            if key in self._promoting:
                waits.append(self._promoting[key])
                continue
            location = self.disk.location(key)
            if location is None:
                if prefix:
                    break
                continue
            wanted.append((key, location.size))
        if wanted:
            task = asyncio.ensure_future(self._promote(wanted))
            for key, _ in wanted:
                self._promoting[key] = task
            waits.append(task)
        if waits:
            await asyncio.shield(asyncio.gather(*waits, return_exceptions=True))

    async def _promote(self, wanted: list[tuple[bytes, int]]) -> None:
        store = self.store
        keys = [k for k, _ in wanted]
        result = store.reserve(keys, [s for _, s in wanted], PROMOTER_OWNER, held=True)
        try:
            jobs = [(i, b) for i, b in enumerate(result.blocks) if b is not None]
            checksums: list[int | None] = [None] * len(keys)
            if jobs:
                loop = asyncio.get_running_loop()
                # Not cancellable: this task outlives the readers that wait on it.
                for i, checksum in await loop.run_in_executor(self._io, self._read, jobs):
                    checksums[i] = checksum
            if result.reservation_id:
                store.commit(result.reservation_id, checksums, PROMOTER_OWNER)
            self.num_promoted += sum(c is not None for c in checksums)
        except Exception:  # a bug must not leave a reservation held for good
            log.exception("promotion of %d blocks from disk failed", len(keys))
            store.abort(result.reservation_id, PROMOTER_OWNER)
        finally:
            for key in keys:
                self._promoting.pop(key, None)

    def _read(self, jobs: list[tuple[int, Block]]) -> list[tuple[int, int | None]]:
        assert self.disk is not None
        return [
            (i, self.disk.read_into(b.key, self.arena.slice(b.offset, b.size))) for i, b in jobs
        ]

    def delete(self, keys: Sequence[bytes]) -> int:
        """Forget the keys in the tiers below DRAM; how many were there."""
        return self.disk.delete(keys) if self.disk is not None else 0

    # -- status ---------------------------------------------------------------------------

    def stats(self) -> list[TierStats]:
        store, counters = self.store, self.store.counters
        writeback = self.writeback
        dram = TierStats(
            name="dram",
            capacity_bytes=store.capacity,
            used_bytes=store.used_bytes,
            num_blocks=len(store),
            hits=self.dram_hits,
            reads=counters.get_hits,
            writes=counters.puts,
            evictions=counters.evictions,
            corrupt=counters.corrupt_reports,
            recovered=counters.adopted,
        )
        tiers = [dram]
        if self.disk is not None:
            disk = self.disk.counters
            tiers.append(
                TierStats(
                    name="disk",
                    capacity_bytes=self.disk.capacity,
                    used_bytes=self.disk.used_bytes,
                    num_blocks=len(self.disk),
                    hits=self.disk_hits,
                    reads=disk.hits,
                    writes=disk.writes,
                    refused=writeback.num_refused if writeback is not None else 0,
                    dropped=writeback.num_dropped if writeback is not None else 0,
                    promotions=self.num_promoted,
                    evictions=disk.evicted_blocks,
                    corrupt=disk.corrupt,
                    recovered=disk.recovered,
                )
            )
        return tiers
