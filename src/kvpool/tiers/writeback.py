"""Write-back on eviction: a block evicted from DRAM is offered to the :class:`WriteBack`
queue; if the admission policy takes it and the queue has room, it is copied into a staging
buffer (one memcpy; its arena memory is freed at once, so an allocation that evicts never
waits) and one writer thread appends it to disk in large batches.  A full queue drops the
block: DRAM never waits for the disk.  The disk reports the blocks it writes as stored
(KV events), with the origins the write-back keeps for them until then.

A DELETE of a block on its way (:meth:`WriteBack.discard`) takes it out of the queue, or,
when the writer already took it in a batch, marks it so that the disk skips it once the
write holds the disk's one writer: the block never lands on disk after its delete's
tombstone, whichever comes first.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Sequence

from kvpool.keys import BlockOrigin
from kvpool.store.arena import Arena
from kvpool.store.block import Block
from kvpool.tiers.admission import PRESSURE_FILL, AdmissionPolicy, ReusedFirst
from kvpool.tiers.disk import DiskTier

log = logging.getLogger("kvpool.node")

WRITE_BATCH_BYTES = 64 << 20
MAX_WRITEBACK_BYTES = 1 << 30
# The staging floor: a burst of writes of up to half of it is staged whole once the writers
# wait for the disk (see ``wait_for_room``), however small the arena.
MIN_WRITEBACK_BYTES = 64 << 20
# The longest a writer waits for the disk before its write evicts anyway (and what the queue
# cannot take is refused and counted): under the clients' usual timeouts.
MAX_BACKPRESSURE_S = 2.0
BACKPRESSURE_POLL_S = 0.005


class WriteBack:
    """Evicted blocks on their way to disk: staged copies bounded in bytes, one writer."""

    def __init__(
        self, disk: DiskTier, arena: Arena, admission: AdmissionPolicy | None = None
    ) -> None:
        self.disk = disk
        self.arena = arena
        self.admission = admission or ReusedFirst()
        self.budget_bytes = min(MAX_WRITEBACK_BYTES, max(arena.num_bytes // 4, MIN_WRITEBACK_BYTES))
        self.num_queued = 0
        self.num_refused = 0
        self.num_dropped = 0
        self.num_present = 0  # already on disk: nothing to write
        self.num_waits = 0  # writes slowed until the disk caught up (backpressure)
        self._queue: deque[tuple[bytes, memoryview, int]] = deque()
        self._unwritten_bytes = 0  # staged and not written yet (the disk's backlog)
        self._spare: dict[int, list[bytearray]] = {}  # staging buffers to reuse, by size
        self._spare_bytes = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # What queued blocks were computed from, until they are written (KV events).
        self._origins: dict[bytes, BlockOrigin] = {}
        self._writing: set[bytes] = set()  # the keys of the batch being written
        self._deleted: set[bytes] = set()  # of those, the ones deleted since (not written)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvpool-writeback", daemon=True)
        self._thread.start()

    def offer(self, block: Block) -> bool:
        """The store's spill target (on the event loop): copy the block out, or refuse."""
        if self._thread is None or self._stopping:
            return False
        if self.disk.size_of(block.key) is not None:
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

    @property
    def num_not_kept(self) -> int:
        """Evicted blocks it turned away (refused or dropped): gone, since no tier holds them."""
        return self.num_refused + self.num_dropped

    def has_room(self, num_bytes: int) -> bool:
        """Whether the blocks a write of ``num_bytes`` may evict would all be admitted: the
        backlog stays under the admission's pressure point, or there is none."""
        unwritten = self._unwritten_bytes
        return unwritten == 0 or unwritten + num_bytes <= PRESSURE_FILL * self.budget_bytes

    async def wait_for_room(self, num_bytes: int, loop_time_deadline: float) -> None:
        """Backpressure (on the event loop, before a write reserves memory): while the disk
        is behind, hold the writer, up to the deadline, instead of evicting blocks the
        queue would refuse.  Costs nothing when the disk keeps up."""
        if self._thread is None or self.has_room(num_bytes):
            return
        self.num_waits += 1
        loop = asyncio.get_running_loop()
        while not self.has_room(num_bytes) and loop.time() < loop_time_deadline:
            await asyncio.sleep(BACKPRESSURE_POLL_S)

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
                self._writing = {key for key, _, _ in batch}
            origins = {key: self._origins.pop(key) for key, _, _ in batch if key in self._origins}
            try:
                self.disk.write(batch, origins, keep=self._not_deleted)
            except OSError as exc:  # a full or failing disk: the blocks are simply not kept
                log.warning("disk write-back of %d blocks failed: %s", len(batch), exc)
            with self._cond:
                self._writing = set()
                self._deleted = set()
                self._unwritten_bytes -= num_bytes
                for _, view, _ in batch:  # keep buffers for reuse, up to the budget
                    buffer = view.obj
                    if (
                        isinstance(buffer, bytearray)
                        and self._spare_bytes + len(buffer) <= self.budget_bytes
                    ):
                        self._spare.setdefault(len(buffer), []).append(buffer)
                        self._spare_bytes += len(buffer)

    def _not_deleted(self, key: bytes) -> bool:
        """Whether a block of the batch being written is still wanted (asked by the disk
        under its one writer, so that no tombstone comes between)."""
        with self._cond:
            return key not in self._deleted

    def discard(self, keys: Sequence[bytes]) -> None:
        """Deleted keys: those still queued are not written, nor those of the batch being
        written that the disk has not written yet (a delete must not be undone by a
        write-back that was on its way).  Called before the disk's own delete."""
        gone = set(keys)
        with self._cond:
            self._deleted |= gone & self._writing
            if not self._queue:
                return
            kept = [item for item in self._queue if item[0] not in gone]
            if len(kept) != len(self._queue):
                dropped = sum(len(view) for key, view, _ in self._queue if key in gone)
                self._queue = deque(kept)
                self._unwritten_bytes -= dropped
        for key in gone:
            self._origins.pop(key, None)

    def stop(self) -> None:
        """Write what is queued, then stop the writer."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
