"""A daemon's part in a cluster: joining the membership, and writing blocks through to their
home nodes.

A client writes to the node on its own host (local affinity); that node then copies each
block it did not already hold as a home to the block's home nodes (rendezvous placement,
``replicas`` of them), so that any node can find it.  Write-through is best effort and
bounded: a home that is down or slow makes its blocks misses there, nothing more, and the
queue drops the oldest keys rather than grow without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvpool.client import ops
from kvpool.client.aio import AsyncClient
from kvpool.cluster.cooldown import Cooldowns
from kvpool.cluster.membership import EtcdMembership, Member, Membership, membership_for
from kvpool.cluster.placement import group_by_home
from kvpool.config import DEFAULT_NODE_NAME, Address, ClientConfig, NodeConfig
from kvpool.errors import ConfigError, KVPoolError
from kvpool.limits import WRITE_THROUGH_DOWN_S, WRITE_THROUGH_TIMEOUT_S
from kvpool.store.arena import Arena
from kvpool.store.block_store import BlockStore
from kvpool.store.leases import Owner

log = logging.getLogger("kvpool.cluster")

MAX_QUEUED_KEYS = 65536
BATCH_KEYS = 256
FETCH_TIMEOUT_S = 5.0  # a prefetch's read from another node


@dataclass
class PinnedSend:
    """The blocks of some keys that the store holds, pinned for a send to another node:
    their keys, sizes and arena views (in the keys' order, absent ones left out), and how
    long the pin lasts."""

    lease_s: float
    keys: list[bytes] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    views: list[memoryview] = field(default_factory=list)


@contextlib.contextmanager
def pinned_for_send(store: BlockStore, arena: Arena, keys: list[bytes]) -> Iterator[PinnedSend]:
    """Pin the blocks of ``keys`` that ``store`` holds while the caller sends them (the
    store's pin lease bounds how long: a send must end within it), and unpin them after."""
    pinned = store.pin(keys, Owner.REPLICATOR)
    try:
        send = PinnedSend(pinned.lease_s)
        for key, block in zip(keys, pinned.blocks, strict=True):
            if block is not None:
                send.keys.append(key)
                send.sizes.append(block.size)
                send.views.append(arena.slice(block.offset, block.size))
        yield send
    finally:
        if pinned.pin_id:
            store.unpin(pinned.pin_id)


def peer_client_config(config: NodeConfig) -> ClientConfig:
    """How a node reaches other nodes (write-through, prefetch, handoff): over TCP, as the
    node's own identity (the cluster's, with tenants), with their TLS."""
    return ClientConfig(
        address="",
        access_id=config.access_id,
        access_key=config.access_key,
        timeout_s=WRITE_THROUGH_TIMEOUT_S,
        use_shm=False,
        host_id=config.host_id,
        write_rcache=False,  # a home does not write through again
        max_connections=2,
        # Other nodes' TLS: verified against --tls-ca; this node's certificate presented.
        tls=bool(config.tls.cert or config.tls.ca),
        tls_ca=config.tls.ca,
        tls_cert=config.tls.cert,
        tls_key=config.tls.key,
        tls_server_name=config.tls.server_name,
    )


class PeerClients:
    """A client of each other node, made on first use and closed together: every talk of
    this node to its peers (write-through, deletes, prefetch, handoff) goes through one."""

    def __init__(self, config: ClientConfig):
        self.config = config  # :func:`peer_client_config`'s, for every peer's address
        self._by_address: dict[str, AsyncClient] = {}

    def of(self, member: Member) -> AsyncClient:
        client = self._by_address.get(member.tcp_address)
        if client is None:
            config = self.config.replace(address=member.tcp_address)
            client = self._by_address[member.tcp_address] = AsyncClient(config=config)
        return client

    async def close(self) -> None:
        for client in self._by_address.values():
            await client.close()
        self._by_address.clear()


class NodeAgent:
    """Built before the node's server (which it is handed to as its cluster hooks); joins
    the cluster once the server listens (:meth:`start`)."""

    def __init__(self, config: NodeConfig, store: BlockStore, arena: Arena):
        self.config = config
        self.store = store
        self.arena = arena
        cluster = config.cluster
        membership = membership_for(
            cluster.peers, cluster.etcd, cluster.etcd_prefix, ca=config.tls.ca
        )
        if membership is None:
            raise ConfigError("a node joins a cluster only with --peers or --etcd")
        self.membership: Membership = membership
        self.member = Member(node_id="", tcp_address="")
        self.peers = PeerClients(peer_client_config(config))
        self._queue: deque[bytes] = deque(maxlen=MAX_QUEUED_KEYS)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._deletes: set[asyncio.Future[None]] = set()  # deletes at homes in flight
        self.num_replicated = 0
        self.num_failed = 0
        self.num_dropped = 0  # queued past MAX_QUEUED_KEYS: never written through
        self._down = Cooldowns(WRITE_THROUGH_DOWN_S)  # homes that failed a write-through
        self.is_joined = False

    def _member(self, tcp: str, admin_port: int) -> Member:
        config = self.config
        if config.cluster.etcd:
            return Member(
                # Nodes left with the default name would overwrite each other in etcd.
                node_id=config.name if config.name != DEFAULT_NODE_NAME else tcp,
                tcp_address=tcp,
                admin_url=f"http://{config.advertise_host or config.admin_host}:{admin_port}",
                host_id=config.host_id,
                started_at=time.time(),
            )
        address = str(Address.parse(tcp))
        return Member(node_id=address, tcp_address=address)

    def peer_ids(self) -> list[str]:
        return [m.node_id for m in self.membership.members()]

    def members(self) -> list[Member]:
        return self.membership.members()

    async def start(self, tcp_address: str, admin_port: int) -> None:
        """Join the cluster as the node serving at ``tcp_address``."""
        self.member = self._member(tcp_address, admin_port)
        loop = asyncio.get_running_loop()
        if isinstance(self.membership, EtcdMembership):
            membership = self.membership
            await loop.run_in_executor(
                None, membership.register, self.member, self.config.cluster.etcd_ttl_s
            )
            await loop.run_in_executor(None, membership.start)
        elif self.member.node_id not in {m.node_id for m in self.membership.members()}:
            log.warning(
                "this node's address %s is not in --peers %s: it will not be any key's home",
                self.member.tcp_address,
                ",".join(m.tcp_address for m in self.membership.members()),
            )
        self._task = asyncio.ensure_future(self._replicate_loop())
        self.is_joined = True
        log.info("joined the cluster as %s (%s)", self.member.node_id, self.member.tcp_address)

    async def stop(self) -> None:
        self.is_joined = False
        for pending in list(self._deletes):
            pending.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.peers.close()
        await asyncio.get_running_loop().run_in_executor(None, self.membership.stop)

    # -- write-through --------------------------------------------------------------------

    def enqueue(self, keys: Sequence[bytes]) -> None:
        if len(self.membership.members()) < 2:
            return  # alone: every key is at home here
        overflow = len(self._queue) + len(keys) - MAX_QUEUED_KEYS
        if overflow > 0:  # the oldest go: their homes will miss them, nothing is wrong
            if not self.num_dropped:
                log.warning("write-through is behind: dropping the oldest queued keys")
            self.num_dropped += overflow
        self._queue.extend(keys)
        self._wakeup.set()

    async def _replicate_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(BATCH_KEYS, len(self._queue)))]
                try:
                    await self._replicate(batch)
                except Exception:  # a bug must not end write-through for good
                    log.exception("write-through of %d keys failed", len(batch))
                    self.num_failed += len(batch)

    async def _replicate(self, keys: list[bytes]) -> None:
        members = {m.node_id: m for m in self.membership.members()}
        groups = group_by_home(
            keys, list(members.values()), self.config.cluster.replicas, skip=self.member.node_id
        )
        now = time.monotonic()
        sends = []
        for node_id, indices in groups.items():
            if self._down.is_down(node_id, now):
                self.num_failed += len(indices)  # a home that just failed is not waited on
            elif node_id in members:
                sends.append(self._send(members[node_id], [keys[i] for i in indices]))
        await asyncio.gather(*sends)

    async def _send(self, target: Member, keys: list[bytes]) -> None:
        # Pinned for as long as the send may take: the store's pin lease bounds it, and the
        # client's own deadline (the write-through timeout) is shorter.
        try:
            with pinned_for_send(self.store, self.arena, keys) as send:
                if not send.keys:
                    return
                client = self.peers.of(target)
                timeout = min(WRITE_THROUGH_TIMEOUT_S, send.lease_s / 2)
                result = await client.put(send.keys, send.views, timeout=timeout)
                self.num_replicated += result.num_stored
        except KVPoolError as exc:
            self.num_failed += len(keys)
            self._down.failed(target.node_id)
            log.debug("write-through of %d blocks to %s failed: %s", len(keys), target.node_id, exc)

    # -- deletes ----------------------------------------------------------------------------

    def delete_at_homes(self, keys: Sequence[bytes]) -> None:
        """A client deleted ``keys`` here: delete the copies written through to their homes
        too, in the background (best effort, like the write-through: a home that is down
        keeps its copy until it evicts it).  The homes do not forward it again."""
        if len(self.membership.members()) < 2:
            return
        task = asyncio.ensure_future(self._delete_at_homes(list(keys)))
        self._deletes.add(task)
        task.add_done_callback(self._deletes.discard)

    async def _delete_at_homes(self, keys: list[bytes]) -> None:
        members = {m.node_id: m for m in self.membership.members()}
        groups = group_by_home(
            keys, list(members.values()), self.config.cluster.replicas, skip=self.member.node_id
        )

        async def delete(node_id: str, indices: list[int]) -> None:
            try:
                client = self.peers.of(members[node_id])
                await client.delete([keys[i] for i in indices], timeout=WRITE_THROUGH_TIMEOUT_S)
            except KVPoolError as exc:
                log.debug("delete of %d blocks at %s failed: %s", len(indices), node_id, exc)

        await asyncio.gather(*(delete(n, ix) for n, ix in groups.items() if n in members))

    # -- reads from other nodes (prefetch) ------------------------------------------------

    async def fetch(self, keys: list[bytes], max_bytes: int) -> list[bytes | None]:
        """The blocks among ``keys`` that their other home nodes hold (verified by the
        client as they arrive), ``max_bytes`` at most in all, shared among the homes asked
        at once (each home's answer is bounded from the sizes it announces, before its
        bytes are buffered); ``None`` where no home answered with it in time, or past the
        bound."""
        members = {m.node_id: m for m in self.membership.members()}
        groups = group_by_home(
            keys, list(members.values()), self.config.cluster.replicas, skip=self.member.node_id
        )
        found: list[bytes | None] = [None] * len(keys)
        now = time.monotonic()
        max_bytes_per_home = max_bytes // max(len(groups), 1)
        loop = asyncio.get_running_loop()

        async def ask(node_id: str, indices: list[int]) -> None:
            if self._down.is_down(node_id, now) or node_id not in members:
                return
            wanted = [i for i in indices if found[i] is None]
            if not wanted:
                return
            node = self.peers.of(members[node_id]).sync.local
            assert node is not None  # a client of one address: its node
            asked = [keys[i] for i in wanted]
            try:
                result = await loop.run_in_executor(
                    None,
                    lambda: node.call(
                        lambda _: ops.get_stream(asked, None, False, 0, max_bytes_per_home),
                        FETCH_TIMEOUT_S,
                    ),
                )
            except KVPoolError as exc:
                log.debug("prefetch from %s failed: %s", node_id, exc)
                return
            for i, value in zip(wanted, result.values, strict=True):
                if value is not None and found[i] is None:
                    found[i] = bytes(value)

        await asyncio.gather(*(ask(n, ix) for n, ix in groups.items()))
        return found
