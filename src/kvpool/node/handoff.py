"""A node leaving the cluster hands its blocks to the nodes that will be their homes (the
HANDOFF operation, ``kvpool drain --to PEER``): a scale-in, or a host taken out for repair,
keeps the engines' hits instead of turning the node's blocks into misses.

Rules (each has a test in tests/cluster/test_handoff.py):

1. Every block the node holds is accounted for: its DRAM blocks, hottest first (what the
   deadline cuts off is what the engines were least likely to ask for), then its disk's
   (read and verified, a batch at a time), then, pass after pass, the blocks written
   meanwhile, until a pass finds none (at most ``MAX_PASSES``: writers that never stop are
   stopped by the seal, rule 5).  Each is *handed* (stored at its home, or there
   already), *failed* (a target refused it or did not answer; a disk block that did not
   verify) or *left* (still held here, not tried by the deadline).  Blocks in the object
   store are the cluster's already: not handed, not counted.
2. Each block goes to its home among the targets: rendezvous placement over the targets, as
   every client places keys once this node has left, so that the engines' reads find it
   where they look first (their lookups ask every node besides).
3. Bounded: a batch starts only once the bytes sent before it are within ``rate_bytes`` a
   second since the start (the first goes at once), and none at the deadline or after.  A
   DRAM batch is pinned while it is sent (the store's pin lease bounds the pin, the
   write-through timeout the send); a disk batch is read into at most ``DISK_BATCH_BYTES``
   of buffers; the node serves on meanwhile, its own copies untouched.
4. Best effort: a target that refuses a batch or does not answer in time is skipped for a
   while (as the write-through skips a home that failed), and its blocks are counted failed;
   the handoff goes on with the others.
5. ``seal`` (a drain about to empty the node): once a pass finds nothing new (or after
   ``MAX_PASSES``), the store stops
   admitting clients' writes (kvpool.store.block_store rule 19) and a last pass takes what
   landed before it; so nothing is written between the report and the node emptying.  A
   handoff that did not place everything takes writes again: the node is not emptied
   (``kvpool drain`` exits non-zero and keeps it unless told ``--discard-unplaced``).
6. Only the node's operators may ask it (``ADMIN_OPS``: its Unix socket, or the cluster's
   credential), of this node only (its id).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.cluster.cooldown import Cooldowns
from kvpool.cluster.membership import Member
from kvpool.cluster.placement import Placement
from kvpool.config import ClientConfig
from kvpool.errors import KVPoolError, Status
from kvpool.limits import WRITE_THROUGH_DOWN_S, WRITE_THROUGH_TIMEOUT_S
from kvpool.node.peers import PeerClients, pinned_for_send
from kvpool.store.arena import Arena
from kvpool.store.block_store import BlockStore
from kvpool.tiers.disk import DiskTier

log = logging.getLogger("kvpool.cluster")

BATCH_KEYS = 256
DISK_BATCH_BYTES = 32 << 20  # the buffers a disk batch is read into
MAX_PASSES = 4  # over what is held, before a seal stops the writes
STORED = (Status.OK, Status.EXISTS)


@dataclass(slots=True)
class HandoffResult:
    num_blocks: int = 0  # stored at their homes (or there already)
    num_bytes: int = 0
    num_failed: int = 0  # refused, not answered in time, or (from disk) unverified
    num_left: int = 0  # still held here and not tried: the deadline came first
    num_from_disk: int = 0  # of the handed, read from the disk tier
    num_written: int = 0  # of all, written to the node while the handoff ran
    is_sealed: bool = False  # the node takes no more writes (rule 5)
    elapsed_s: float = 0.0

    @property
    def is_complete(self) -> bool:
        """Every block the node held is at its home (nothing failed, nothing left)."""
        return self.num_failed == 0 and self.num_left == 0


class Handoff:
    """One handoff of a node's blocks to ``targets`` (see the module docstring)."""

    def __init__(
        self,
        store: BlockStore,
        arena: Arena,
        client_config: ClientConfig,
        targets: Sequence[Member],
        disk: DiskTier | None = None,
    ):
        self.store = store
        self.arena = arena
        self.disk = disk
        self.targets = {member.node_id: member for member in targets}
        self._placement = Placement(list(self.targets.values()))
        self._peers = PeerClients(client_config)
        self._down = Cooldowns(WRITE_THROUGH_DOWN_S)
        self.result = HandoffResult()
        self._accounted: set[bytes] = set()  # handed or failed
        self._started = 0.0
        self._end = 0.0
        self._rate = 1
        self._sent_bytes = 0

    async def run(self, rate_bytes: int, deadline_s: float, *, seal: bool = False) -> HandoffResult:
        """Hand the blocks over (rules 1-5); what was handed, failed and left."""
        self._started = time.monotonic()
        self._end = self._started + deadline_s
        self._rate = rate_bytes
        result = self.result
        initial = {key for key, _ in self._held()}
        try:
            for _ in range(MAX_PASSES):  # blocks written meanwhile, until a pass finds none
                if not await self._pass() or not self._has_time():
                    break
            if seal and self._has_time():
                self.store.leave()  # rule 5: what lands from here is refused
                result.is_sealed = True
                await self._pass()
        finally:
            await self._peers.close()
        held = self._held()
        result.num_left = sum(key not in self._accounted for key, _ in held)
        result.num_written = len({k for k, _ in held} - initial) + sum(
            key not in initial for key in self._accounted
        )
        if result.is_sealed and not result.is_complete:
            self.store.leave(False)  # not emptied: it takes writes again
            result.is_sealed = False
        result.elapsed_s = time.monotonic() - self._started
        log.info(
            "handoff: %d blocks (%d bytes, %d from disk) to %d nodes in %.1f s, %d failed, "
            "%d left, %d written meanwhile%s",
            result.num_blocks,
            result.num_bytes,
            result.num_from_disk,
            len(self.targets),
            result.elapsed_s,
            result.num_failed,
            result.num_left,
            result.num_written,
            "; sealed: no more writes" if result.is_sealed else "",
        )
        return result

    def _held(self) -> list[tuple[bytes, bool]]:
        """Every block the node holds now, ``(key, on disk)``: DRAM's hottest first, then
        the disk's (a key in both is DRAM's)."""
        store = self.store
        held = []
        for slot in store.hottest_first():
            entry = store.entry(int(slot))
            if entry is not None:
                held.append((entry.key, False))
        if self.disk is not None:
            in_dram = {key for key, _ in held}
            held += [(key, True) for key in self.disk.held_keys() if key not in in_dram]
        return held

    def _has_time(self) -> bool:
        return time.monotonic() < self._end

    async def _pass(self) -> int:
        """One pass over what is held and not yet accounted for; how many it accounted."""
        todo = [(key, on_disk) for key, on_disk in self._held() if key not in self._accounted]
        before = len(self._accounted)
        dram = [key for key, on_disk in todo if not on_disk]
        for start in range(0, len(dram), BATCH_KEYS):
            if not await self._pace():
                return len(self._accounted) - before
            await self._send_dram(dram[start : start + BATCH_KEYS])
        on_disk = [key for key, on_disk in todo if on_disk]
        batch: list[bytes] = []
        batch_bytes = 0
        for key in on_disk:
            size = self.disk.size_of(key) if self.disk is not None else None
            if size is None:
                continue  # gone meanwhile
            if batch and (batch_bytes + size > DISK_BATCH_BYTES or len(batch) >= BATCH_KEYS):
                if not await self._pace():
                    return len(self._accounted) - before
                await self._send_disk(batch)
                batch, batch_bytes = [], 0
            batch.append(key)
            batch_bytes += size
        if batch and await self._pace():
            await self._send_disk(batch)
        return len(self._accounted) - before

    async def _pace(self) -> bool:
        """Wait for the next batch's turn (rule 3); False at the deadline."""
        turn = self._started + self._sent_bytes / self._rate
        if max(turn, time.monotonic()) >= self._end:
            return False
        await asyncio.sleep(max(turn - time.monotonic(), 0.0))
        return True

    async def _send_dram(self, keys: list[bytes]) -> None:
        with pinned_for_send(self.store, self.arena, keys) as send:
            self._sent_bytes += sum(send.sizes)
            await self._send(send.keys, send.views, send.sizes, send.lease_s / 2)
        # Keys not pinned (evicted meanwhile) are not accounted: the next pass finds them
        # on disk, or they are gone.

    async def _send_disk(self, keys: list[bytes]) -> None:
        disk = self.disk
        if disk is None:
            return
        sizes = [disk.size_of(key) or 0 for key in keys]
        buffers = [memoryview(bytearray(size)) for size in sizes]
        loop = asyncio.get_running_loop()
        checksums = await loop.run_in_executor(
            None, disk.read_many, list(zip(keys, buffers, strict=True))
        )
        read = [i for i, checksum in enumerate(checksums) if checksum is not None]
        for i, checksum in enumerate(checksums):
            if checksum is None and disk.size_of(keys[i]) is None:
                self._failed([keys[i]])  # unverified, dropped by the disk: never sent
        self._sent_bytes += sum(sizes[i] for i in read)
        before = self.result.num_blocks
        await self._send(
            [keys[i] for i in read],
            [buffers[i] for i in read],
            [sizes[i] for i in read],
            WRITE_THROUGH_TIMEOUT_S,
        )
        self.result.num_from_disk += self.result.num_blocks - before

    async def _send(
        self,
        keys: list[bytes],
        views: list[memoryview],
        sizes: list[int],
        max_timeout: float,
    ) -> None:
        """Each block to its home among the targets (rule 2), the groups at once."""
        if not keys:
            return
        groups = self._placement.group(keys)
        await asyncio.gather(
            *(
                self._put(
                    node_id,
                    [keys[i] for i in ix],
                    [views[i] for i in ix],
                    [sizes[i] for i in ix],
                    max_timeout,
                )
                for node_id, ix in groups.items()
            )
        )

    async def _put(
        self,
        node_id: str,
        keys: list[bytes],
        views: list[memoryview],
        sizes: list[int],
        max_timeout: float,
    ) -> None:
        result = self.result
        if self._down.is_down(node_id, time.monotonic()):
            self._failed(keys)
            return
        try:
            timeout = min(WRITE_THROUGH_TIMEOUT_S, max_timeout, self._end - time.monotonic())
            client = self._peers.of(self.targets[node_id])
            put = await client.put(keys, views, timeout=max(timeout, 0.1))
        except KVPoolError as exc:
            self._failed(keys)
            self._down.failed(node_id)
            log.warning("handoff of %d blocks to %s failed: %s", len(keys), node_id, exc)
            return
        for key, size, status in zip(keys, sizes, put.statuses, strict=True):
            self._accounted.add(key)
            if status in STORED:
                result.num_blocks += 1
                result.num_bytes += size
            else:
                result.num_failed += 1

    def _failed(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key not in self._accounted:
                self._accounted.add(key)
                self.result.num_failed += 1
