"""Promotion: bringing blocks back into DRAM, from a lower tier or from another node.

There is one path, and three entry points, each the one before it plus a step:

- :meth:`Promotions.bring_up` (the one path, whatever the bytes' source): reserve slots
  under the node's own owner (``Owner.PROMOTER``, no lease), ``fill`` them on an I/O thread
  (the caller's fill verifies, or computes, each checksum), then commit what arrived (or
  abort on a bug).  The blocks of the read it serves (``keep``) that are in DRAM are pinned
  until the commit, and the trim after it, are done: a read larger than DRAM must not evict
  what it is about to read.  Prefetches from other nodes call it directly
  (:mod:`kvpool.tiers.prefetch`).
- :meth:`Promotions.start_from_below`: :meth:`bring_up` with a fill that reads each block
  from its lower tier (:meth:`LowerTiers.read`: a block its tier lost meanwhile is tried
  in the tiers after it), started as a task of its own and registered by key, so that
  concurrent reads (and prefetches) of one block share one promotion; it counts what each
  tier promoted, and which keys found no room in DRAM.  Promotion on read and prefetch
  from the lower tiers start it.
- :meth:`Promotions.on_read`: a PIN's or GET's promotion: it joins the promotions under way
  of the read's keys, starts one from below for the rest, and waits at most ``wait_s``
  for them.  A promotion outlives its reader: a reader that goes away (or stops waiting at
  its deadline) cannot cut it short while its thread still writes into the arena; the
  reader then finds what has arrived.

What found no room in DRAM (a read larger than DRAM) stays known as such until it comes
up (:meth:`Promotions.found_no_room`): the read serves those blocks from below
(:mod:`kvpool.tiers.reads`), and so do overlapping reads of the same blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from kvpool.errors import Status
from kvpool.store.arena import Arena
from kvpool.store.block_store import BlockStore
from kvpool.store.leases import Owner
from kvpool.tiers.lower import LowerTiers, Wanted

log = logging.getLogger("kvpool.node")

DEFAULT_WAIT_S = 2.0  # a read that names no deadline waits this long for lower tiers
MAX_NO_ROOM_KEYS = 1 << 16  # keys remembered as having found no room in DRAM

# Fills reserved slots, given as ``(index, destination)``: per slot, its checksum or None.
Fill = Callable[[list[tuple[int, memoryview]]], list[int | None]]
# A promotion under way: it comes to the keys that came up.
Promotion = asyncio.Future[list[bytes]]


class Promotions:
    """The promotions under way, by key, and what they did.  ``read_lane``: the threads of
    reads' promotions (a prefetch passes its own, slower lane)."""

    def __init__(
        self, store: BlockStore, arena: Arena, lower: LowerTiers, read_lane: ThreadPoolExecutor
    ) -> None:
        self.store = store
        self.arena = arena
        self.lower = lower
        self.read_lane = read_lane
        self.promoted = {tier.tier_id: 0 for tier in lower.chain}  # blocks, by source tier
        self.num_late = 0  # reads that stopped waiting for a promotion at their deadline
        # Promotions under way, by key: each comes to the keys that came up.
        self._promoting: dict[bytes, Promotion] = {}
        # Keys whose latest promotion found no room in DRAM (a read larger than DRAM): the
        # read serves them from below.  Bounded: the oldest are forgotten first.
        self._no_room: OrderedDict[bytes, None] = OrderedDict()

    # -- what lookups, reads and prefetches ask ----------------------------------------

    def is_promoting(self, key: bytes) -> bool:
        """Whether a promotion of ``key`` is under way (a slot is reserved for it in DRAM,
        but nobody writes it: it counts as held where it comes from, not as pending)."""
        return key in self._promoting

    def under_way(self, key: bytes) -> Promotion | None:
        """The promotion of ``key`` under way, to join (None: none is)."""
        return self._promoting.get(key)

    def found_no_room(self, key: bytes) -> bool:
        """Whether the latest promotion of ``key`` found no room in DRAM."""
        return key in self._no_room

    def track(self, keys: Sequence[bytes], promotion: Promotion) -> None:
        """Register a promotion that is not started here (a prefetch from other nodes), so
        that reads and prefetches join it; it calls :meth:`forget` as it ends."""
        for key in keys:
            self._promoting[key] = promotion

    def forget(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._promoting.pop(key, None)

    async def wait_all(self) -> None:
        """Until every promotion under way has ended (the node stops)."""
        if self._promoting:
            await asyncio.wait(list(set(self._promoting.values())))

    # -- a read's promotion -------------------------------------------------------------

    async def on_read(self, keys: Sequence[bytes], prefix: bool, wait_s: float = 0.0) -> bool:
        """Bring the blocks among ``keys`` that are in a lower tier but not in DRAM back
        into DRAM (with ``prefix``, only up to the first block held nowhere), waiting at
        most ``wait_s`` (0: ``DEFAULT_WAIT_S``) for them; whether they all came (or found
        no room) in that time."""
        if not self.lower.chain:
            return True
        waits, wanted = self._plan(keys, prefix)
        if wanted:
            # The read's own blocks in DRAM stay while its others come up (a read larger
            # than DRAM gets what found no room from below).
            waits.append(self.start_from_below(wanted, self.read_lane, keep=keys))
        if not waits:
            return True
        try:
            async with asyncio.timeout(wait_s or DEFAULT_WAIT_S):
                await asyncio.shield(asyncio.gather(*waits, return_exceptions=True))
        except TimeoutError:
            self.num_late += 1  # what is not up yet is a miss for this read
            return False
        return True

    def _plan(self, keys: Sequence[bytes], prefix: bool) -> tuple[list[Promotion], list[Wanted]]:
        """Promotions to join, and ``(key, size, tier)`` to start."""
        waits: list[Promotion] = []
        wanted: list[Wanted] = []
        in_dram = self.store.lookup_mask(keys, count=False)
        if all(in_dram):
            return waits, wanted
        for key, held in zip(keys, in_dram, strict=True):
            if held:
                continue
            if key in self._promoting:
                waits.append(self._promoting[key])
                continue
            source = self.lower.source(key)
            if source is None:
                if prefix:
                    break
                continue
            wanted.append((key, *source))
        return waits, wanted

    # -- from the lower tiers -----------------------------------------------------------

    def start_from_below(
        self, wanted: list[Wanted], lane: ThreadPoolExecutor, keep: Sequence[bytes] = ()
    ) -> Promotion:
        """Start promoting ``(key, size, tier)`` blocks from the lower tiers on ``lane``, as
        a task that reads and prefetches of the same keys join; it comes to the keys that
        came up."""
        task = asyncio.ensure_future(self._from_below(wanted, lane, keep))
        self.track([key for key, _, _ in wanted], task)
        return task

    async def _from_below(
        self, wanted: list[Wanted], lane: ThreadPoolExecutor, keep: Sequence[bytes]
    ) -> list[bytes]:
        keys = [k for k, _, _ in wanted]
        served: list[int | None] = [None] * len(wanted)  # the tier each block came from
        try:
            checksums = await self.bring_up(
                keys,
                [size for _, size, _ in wanted],
                lambda slots: self.lower.read(wanted, slots, served),
                lane,
                keep,
            )
        finally:
            self.forget(keys)
        promoted = []
        for key, tier_id, checksum in zip(keys, served, checksums, strict=True):
            if tier_id is not None and checksum is not None:
                self.promoted[tier_id] += 1
                promoted.append(key)
                self._no_room.pop(key, None)  # found room at last
        return promoted

    # -- the one path -------------------------------------------------------------------

    async def bring_up(
        self,
        keys: list[bytes],
        sizes: list[int],
        fill: Fill,
        lane: ThreadPoolExecutor,
        keep: Sequence[bytes] = (),
    ) -> list[int | None]:
        """The one promotion path: with the blocks of ``keep`` in DRAM pinned, reserve,
        fill and commit (:meth:`_reserve_fill_commit`).  Per key, its checksum, or None
        where it did not come up (already stored or pending, no room, or not read)."""
        store = self.store
        guard = store.pin(keep, Owner.PROMOTER, count=False) if keep else None
        try:
            return await self._reserve_fill_commit(keys, sizes, fill, lane)
        finally:
            if guard is not None and guard.pin_id:
                store.unpin(guard.pin_id)

    async def _reserve_fill_commit(
        self, keys: list[bytes], sizes: list[int], fill: Fill, lane: ThreadPoolExecutor
    ) -> list[int | None]:
        """Reserve slots for ``keys`` under ``Owner.PROMOTER`` (noting those that found no
        room), ``fill`` them on ``lane``, and commit what arrived; abort on a bug."""
        store = self.store
        result = store.reserve(keys, sizes, Owner.PROMOTER, held=True)
        for key, status in zip(keys, result.statuses, strict=True):
            if status in (Status.NO_SPACE, Status.OVER_QUOTA):
                self._no_room[key] = None
        while len(self._no_room) > MAX_NO_ROOM_KEYS:
            self._no_room.popitem(last=False)
        checksums: list[int | None] = [None] * len(keys)
        slots = [
            (i, self.arena.slice(block.offset, block.size))
            for i, block in enumerate(result.blocks)
            if block is not None
        ]
        try:
            if slots:
                loop = asyncio.get_running_loop()
                # Not cancellable: this task outlives the readers that wait on it.
                filled = await loop.run_in_executor(lane, fill, slots)
                for (i, _), checksum in zip(slots, filled, strict=True):
                    checksums[i] = checksum
            if result.reservation_id:
                store.commit(result.reservation_id, checksums, Owner.PROMOTER)
        except Exception:  # a bug must not leave a reservation held for good
            log.exception("promotion of %d blocks failed", len(keys))
            store.abort(result.reservation_id, Owner.PROMOTER)
            return [None] * len(keys)
        return checksums
