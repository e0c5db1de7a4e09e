"""The seal of every same-host commit (with its writer's checksums, or hashed by the node),
and the scrub of what the node holds.

- **Sealing.** A same-host writer that copies its blocks in hashes each one as it copies it,
  over the bytes that landed in the arena, and its COMMIT carries those checksums: the node
  publishes the blocks with them at once, with no second pass over their bytes (see
  :mod:`kvpool.client.writes`; a write area's blocks go straight in, never pending:
  :meth:`~kvpool.store.block_store.BlockStore.commit_placed`).  A zero-copy write lease's
  bytes are written by its caller (a DMA engine, an engine's own copy), so its COMMIT
  carries none: the node takes the reservation (its lease ends, the blocks stay pending),
  replies at once, and hashes the blocks off its event loop while the writer goes on; then
  it publishes them with that checksum.  A block is *sealed* when its checksum was computed
  or verified over its bytes in the arena, by the node or by a same-host writer (which maps
  the whole arena writable, so trusting its checksums trusts it with nothing more): sealed
  commits, PUT payloads, promotions from the lower tiers.  Nothing writes a committed block,
  and readers pin it, so a same-host reader of a sealed block copies it without hashing it
  again; only blocks adopted at a warm restart are read verified.
- Reads of a key being sealed wait for its seal (a few milliseconds at most), so a write
  that returned is seen by every later read, on any connection.
- **Scrubbing.** Memory can still be damaged in place (a stray write by a process that maps
  the arena).  The scrubber re-hashes committed blocks, a step of the index at a time, at
  a bounded rate, and drops, and counts, any that no longer match: they become misses and
  are recomputed.
  Adopted blocks that pass become sealed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import numpy as np

from kvpool import checksum as ck
from kvpool.keys import BlockOrigin
from kvpool.store.arena import Arena
from kvpool.store.block import Block, CommitResult
from kvpool.store.block_store import WALK_STEP, BlockStore
from kvpool.store.journal import Entry, Replay

log = logging.getLogger("kvpool.node")

# Batches at most this large are hashed on the event loop: a hand-off to a thread costs
# more than hashing them (~50 us at memory speed).
INLINE_SEAL_BYTES = 1 << 20
# The scrubber hashes about this much per hand-off to its thread, then sleeps: its memory
# bandwidth stays smooth, not bursts of many blocks.
SCRUB_STEP_BYTES = 8 << 20


class Sealer:
    """Seals of same-host commits in flight, by key, and the scrubber."""

    def __init__(
        self,
        store: BlockStore,
        arena: Arena,
        on_published: Callable[[CommitResult, bool], None],
    ):
        self.store = store
        self.arena = arena
        self._on_published = on_published
        self._sealing: dict[bytes, asyncio.Future[None]] = {}
        self.scrubbed_bytes = 0
        self.scrub_dropped = 0

    def _hash(self, blocks: Sequence[Block | None]) -> list[int | None]:
        return [
            ck.checksum(self.arena.slice(b.offset, b.size)) if b is not None else None
            for b in blocks
        ]

    def seal(
        self,
        blocks: list[Block | None],
        replicate: bool,
        origins: Sequence[BlockOrigin | None] | None,
        checksums: Sequence[int] | None = None,
        evicting: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        """Publish ``blocks`` (taken from their reservation, or placed in a write area) with
        the ``checksums`` their writer computed as it copied them in, or else hash them
        first, behind the caller; reads of their keys wait meanwhile.  A publish behind
        the caller runs within ``evicting()``, the writer's count of what the evictions of
        its publish lost (see :meth:`kvpool.node.session.Session._evicting`)."""
        if checksums is not None:
            self._publish(blocks, list(checksums), replicate, origins)
            return
        num_bytes = sum(b.size for b in blocks if b is not None)
        if num_bytes <= INLINE_SEAL_BYTES:
            self._publish(blocks, self._hash(blocks), replicate, origins)
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        keys = [b.key for b in blocks if b is not None]
        # Acknowledged before it is hashed: a daemon that dies meanwhile hashes it at start.
        self.store.journal.filled(Entry(b.key, b.offset, b.size, None) for b in blocks if b)
        for key in keys:
            self._sealing[key] = done

        def finish(task: asyncio.Future[list[int | None]]) -> None:
            checksums: list[int | None] = [None] * len(blocks)  # dropped, unless hashed
            if not task.cancelled() and task.exception() is None:
                checksums = task.result()
            elif not task.cancelled():
                log.error("sealing %d blocks failed: %s", len(keys), task.exception())
            try:
                with evicting():
                    self._publish(blocks, checksums, replicate, origins)
            except Exception:
                log.exception("publishing %d sealed blocks failed", len(keys))
            finally:
                for key in keys:
                    if self._sealing.get(key) is done:
                        del self._sealing[key]
                done.set_result(None)

        def start() -> None:
            asyncio.ensure_future(asyncio.to_thread(self._hash, blocks)).add_done_callback(finish)

        # Once the writer's reply is on its way: waking the worker thread first delayed the
        # reply by ~0.08 ms on 2 vCPUs.
        loop.call_soon(start)

    def _publish(
        self,
        blocks: list[Block | None],
        checksums: list[int | None],
        replicate: bool,
        origins: Sequence[BlockOrigin | None] | None,
    ) -> None:
        self._on_published(self.store.publish(blocks, checksums, origins), replicate)

    async def wait(self, keys: Sequence[bytes] | None = None) -> None:
        """Until the seals of ``keys`` (None: of every key) in flight now are done."""
        if not self._sealing:
            return
        if keys is None:
            pending = set(self._sealing.values())
        else:
            pending = {f for k in keys if (f := self._sealing.get(k)) is not None}
        if pending:
            await asyncio.wait(pending)

    # -- scrubbing ------------------------------------------------------------------------

    async def scrub(self, rate_bytes_s: float) -> None:
        """Re-hash committed blocks, a walk over the index at a time, at most
        ``rate_bytes_s`` on average."""
        index = self.store.index
        cursor = 0
        while True:
            # A bounded step of the index at a time: a pass takes minutes, and the index
            # changes meanwhile (a block evicted since is skipped, one added is met later).
            steps, num_bytes = [], 0
            while num_bytes < SCRUB_STEP_BYTES:
                slots, cursor = index.live_from(cursor, WALK_STEP)
                steps.append(slots)
                num_bytes += int(index.sizes[slots].sum())
                if not cursor:
                    break
            slots = np.concatenate(steps)
            if len(slots):
                await self.scrub_slots(slots)
                await asyncio.sleep(num_bytes / rate_bytes_s)
            if not cursor and not len(slots):
                await asyncio.sleep(1.0)

    async def scrub_slots(self, slots: np.ndarray) -> int:
        """Verify the committed blocks of ``slots`` against their checksums, drop those that
        fail; how many did.  The columns are read once, on the event loop; the hashing runs
        on a thread.

        A block still committed after its hash kept its memory throughout (memory returns
        only once a block is removed), so a mismatch is damage; a block removed meanwhile
        is skipped, whatever its memory held."""
        index = self.store.index
        offsets, sizes = index.offsets[slots], index.sizes[slots]
        checksums = index.checksums[slots]
        found = await asyncio.to_thread(self._hash_extents, offsets.tolist(), sizes.tolist())
        held = self.store.still_held(slots, offsets, checksums)
        intact = np.array(found, dtype=np.uint64) == checksums
        self.store.seal_slots(slots[held & intact])
        self.scrubbed_bytes += int(sizes.sum())
        bad = slots[held & ~intact]
        if len(bad):
            self.scrub_dropped += len(bad)
            log.warning("scrub: %d blocks no longer match their checksums; dropped", len(bad))
            self.store.report_corrupt([index.key(slot) for slot in bad.tolist()])
        return len(bad)

    def _hash_extents(self, offsets: list[int], sizes: list[int]) -> list[int]:
        arena = self.arena
        return [ck.checksum(arena.slice(o, n)) for o, n in zip(offsets, sizes, strict=True)]


def seal_replayed(replay: Replay, arena: Arena) -> int:
    """Hash the blocks a journal says were filled but not yet hashed when the last daemon
    stopped (their writers had finished them), so that they can be adopted; how many.
    Those that do not lie inside ``arena`` stay unhashed (and are not adopted)."""
    offsets, sizes = replay.offsets, replay.sizes
    inside = (offsets >= 0) & (sizes >= 0) & (offsets <= arena.num_bytes - sizes)
    unhashed = np.flatnonzero(~replay.hashed & inside).tolist()
    for i in unhashed:
        replay.checksums[i] = ck.checksum(arena.slice(int(offsets[i]), int(sizes[i])))
    replay.hashed[unhashed] = True
    return len(unhashed)
