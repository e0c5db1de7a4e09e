"""A node leaving the cluster hands its blocks to the nodes that will be their homes (the
HANDOFF operation, ``kvpool drain --to PEER``): a scale-in, or a host taken out for repair,
keeps the engines' hits instead of turning the node's blocks into misses.

Rules (each has a test in tests/cluster/test_handoff.py):

1. Hottest first: the blocks go in the order of their last use, most recent first, so that
   what the deadline cuts off is what the engines were least likely to ask for.
2. Each block goes to its home among the targets: rendezvous placement over the targets, as
   every client places keys once this node has left, so that the engines' reads find it
   where they look first (their lookups ask every node besides).
3. Bounded: a batch starts only once the bytes sent before it are within ``rate_bytes`` a
   second since the start (the first goes at once), and none at the deadline or after.  A
   batch is pinned while it is sent (the store's pin lease bounds the pin, the
   write-through timeout the send), and the node serves on meanwhile: DRAM blocks only,
   read where they lie, the node's own copies untouched (a drain empties the node
   afterwards).
4. Best effort: a target that refuses a batch or does not answer in time is skipped for a
   while (as the write-through skips a home that failed), and its blocks are counted failed;
   the handoff goes on with the others.
5. Only the node's operators may ask it (``ADMIN_OPS``: its Unix socket, or the cluster's
   credential), of this node only (its id).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.client.aio import AsyncClient
from kvpool.cluster.cooldown import Cooldowns
from kvpool.cluster.membership import Member
from kvpool.cluster.placement import Placement
from kvpool.config import ClientConfig
from kvpool.errors import KVPoolError, Status
from kvpool.limits import WRITE_THROUGH_DOWN_S, WRITE_THROUGH_TIMEOUT_S
from kvpool.node.peers import pinned_for_send
from kvpool.store.arena import Arena
from kvpool.store.block_store import BlockStore

log = logging.getLogger("kvpool.cluster")

BATCH_KEYS = 256
STORED = (Status.OK, Status.EXISTS)


@dataclass(slots=True)
class HandoffResult:
    num_blocks: int = 0  # stored at their homes (or there already)
    num_bytes: int = 0
    num_failed: int = 0
    num_left: int = 0  # not tried: the deadline came first
    elapsed_s: float = 0.0


class Handoff:
    """One handoff of a node's blocks to ``targets`` (see the module docstring)."""

    def __init__(
        self,
        store: BlockStore,
        arena: Arena,
        client_config: ClientConfig,
        targets: Sequence[Member],
    ):
        self.store = store
        self.arena = arena
        self.client_config = client_config
        self.targets = {member.node_id: member for member in targets}
        self._placement = Placement(list(self.targets.values()))
        self._clients: dict[str, AsyncClient] = {}
        self._down = Cooldowns(WRITE_THROUGH_DOWN_S)
        self.result = HandoffResult()

    async def run(self, rate_bytes: int, deadline_s: float) -> HandoffResult:
        """Hand the blocks over (rules 1-4); what was handed, failed and left."""
        started = time.monotonic()
        end = started + deadline_s
        result = self.result
        slots = self.store.hottest_first()
        sent_bytes = 0
        try:
            for start in range(0, len(slots), BATCH_KEYS):
                # The bytes sent so far may not pass the rate: wait for the next batch's
                # turn, unless it comes at the deadline or later.
                turn = started + sent_bytes / rate_bytes
                if max(turn, time.monotonic()) >= end:
                    result.num_left = len(slots) - start
                    break
                await asyncio.sleep(max(turn - time.monotonic(), 0.0))
                batch = [self.store.entry(int(slot)) for slot in slots[start : start + BATCH_KEYS]]
                keys = [entry.key for entry in batch if entry is not None]
                sent_bytes += sum(entry.size for entry in batch if entry is not None)
                groups = self._placement.group(keys)
                sends = [self._send(n, [keys[i] for i in ix], end) for n, ix in groups.items()]
                await asyncio.gather(*sends)
        finally:
            for client in self._clients.values():
                await client.close()
        result.elapsed_s = time.monotonic() - started
        log.info(
            "handoff: %d blocks (%d bytes) to %d nodes in %.1f s, %d failed, %d left",
            result.num_blocks,
            result.num_bytes,
            len(self.targets),
            result.elapsed_s,
            result.num_failed,
            result.num_left,
        )
        return result

    async def _send(self, node_id: str, keys: list[bytes], end: float) -> None:
        result = self.result
        if self._down.is_down(node_id, time.monotonic()):
            result.num_failed += len(keys)
            return
        try:
            with pinned_for_send(self.store, self.arena, keys) as send:
                if not send.keys:
                    return
                timeout = min(WRITE_THROUGH_TIMEOUT_S, send.lease_s / 2, end - time.monotonic())
                client = self._client(self.targets[node_id])
                put = await client.put(send.keys, send.views, timeout=max(timeout, 0.1))
            for size, status in zip(send.sizes, put.statuses, strict=True):
                if status in STORED:
                    result.num_blocks += 1
                    result.num_bytes += size
                else:
                    result.num_failed += 1
        except KVPoolError as exc:
            result.num_failed += len(keys)
            self._down.failed(node_id)
            log.warning("handoff of %d blocks to %s failed: %s", len(keys), node_id, exc)

    def _client(self, member: Member) -> AsyncClient:
        client = self._clients.get(member.node_id)
        if client is None:
            config = self.client_config.replace(address=member.tcp_address)
            client = self._clients[member.node_id] = AsyncClient(config=config)
        return client
