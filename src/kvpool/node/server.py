"""The node's protocol server: listeners on a Unix socket and TCP, one
:class:`~kvpool.node.session.Session` per connection, the store's expiry clock, and the
node's statistics.

The server owns what its sessions share: the store (touched only from the event loop), the
arena, byte counters, and the cluster hooks it was built with (write-through of committed
blocks to their home nodes, and the member list for status).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import msgspec

from kvpool.config import NodeConfig
from kvpool.node.metrics import NodeMetrics
from kvpool.node.session import Session
from kvpool.node.tiers import Tiers
from kvpool.protocol.messages import NodeStats
from kvpool.store.arena import Arena
from kvpool.store.pool import BlockStore
from kvpool.timing import EXPIRE_INTERVAL_S

log = logging.getLogger("kvpool.node")

MAX_CONNECTIONS = 4096
SOCKET_BUFFER_BYTES = 4 << 20


class ClusterHooks(Protocol):
    """What the server needs of the node's part in a cluster."""

    def enqueue(self, keys: Sequence[bytes]) -> None:
        """Write these committed keys through to their home nodes (best effort)."""

    def peer_ids(self) -> list[str]:
        """The members of the cluster, for status."""


class NodeServer:
    def __init__(
        self,
        config: NodeConfig,
        store: BlockStore,
        arena: Arena,
        tiers: Tiers | None = None,
        cluster: ClusterHooks | None = None,
        on_shutdown: Callable[[bool], None] | None = None,
    ):
        self.config = config
        self.store = store
        self.arena = arena
        self.tiers = tiers or Tiers(store, arena)
        self.cluster = cluster
        self._on_shutdown = on_shutdown
        self.node_id = config.name
        self.started_at = time.monotonic()
        self.bytes_in = 0
        self.bytes_out = 0
        self.sessions: set[Session] = set()
        self._owner_ids = itertools.count(1)
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed: asyncio.Future[None] | None = None
        self.store.on_change = self._on_store_change
        self.tcp_port = config.port
        self.metrics = NodeMetrics(self.stats)

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.tiers.start()
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path = self.config.socket_path
        path.unlink(missing_ok=True)
        old_umask = os.umask(0o117)
        try:
            unix.bind(str(path))
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o660)
        unix.listen(512)
        unix.setblocking(False)
        tcp = socket.create_server(
            (self.config.host, self.config.port), family=_family(self.config.host), backlog=512
        )
        tcp.setblocking(False)
        self.tcp_port = tcp.getsockname()[1]
        self._listeners = [unix, tcp]
        for listener in self._listeners:
            self._spawn(self._accept_loop(loop, listener))
        self._spawn(self._expire_loop())

    async def stop(self) -> None:
        for listener in self._listeners:
            listener.close()
        for task in list(self._tasks):
            task.cancel()
        for session in list(self.sessions):
            session.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.tiers.stop()
        with contextlib.suppress(FileNotFoundError):
            Path(self.config.socket_path).unlink()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _accept_loop(self, loop: asyncio.AbstractEventLoop, listener: socket.socket) -> None:
        while True:
            try:
                sock, _ = await loop.sock_accept(listener)
            except OSError as exc:
                if listener.fileno() < 0:
                    return
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            if len(self.sessions) >= MAX_CONNECTIONS:
                sock.close()
                continue
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            session = Session(self, sock, next(self._owner_ids))
            self._spawn(session.run())

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)
            if self.store.expire():
                self._on_store_change()
            self.tiers.holds.expire()

    # -- store change notification (for lookups that wait) --------------------------------

    def _on_store_change(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    async def wait_for_change(self, timeout: float) -> None:
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._changed), timeout)

    def request_shutdown(self, *, drain: bool) -> None:
        """A client asked the node to stop (and, with ``drain``, to empty itself)."""
        if self._on_shutdown is not None:
            self._on_shutdown(drain)

    def replicate(self, keys: Sequence[bytes]) -> None:
        """Committed keys a client asked to write through to their homes."""
        if self.cluster is not None:
            self.cluster.enqueue(keys)

    # -- status ---------------------------------------------------------------------------

    def stats(self) -> NodeStats:
        store = self.store
        counters = store.counters
        namespaces = [msgspec.structs.replace(usage) for usage in store.namespaces]
        return NodeStats(
            node_id=self.node_id,
            host_id=self.config.host_id,
            tcp_address=self.tcp_address,
            capacity_bytes=store.capacity,
            used_bytes=store.used_bytes,
            reserved_bytes=store.reserved_bytes,
            num_blocks=len(store),
            num_pinned=store.num_pinned,
            hits=counters.lookup_hits,
            misses=counters.lookup_misses,
            puts=counters.puts,
            evictions=counters.evictions,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            num_connections=len(self.sessions),
            uptime_s=time.monotonic() - self.started_at,
            namespaces=namespaces,
            peers=self.cluster.peer_ids() if self.cluster is not None else [],
            corrupt_reports=counters.corrupt_reports,
            tiers=self.tiers.stats(),
            prefetch=self.tiers.prefetch_stats() if self.tiers.can_prefetch else None,
        )

    @property
    def tcp_address(self) -> str:
        host = self.config.advertise_host or self.config.host
        return f"{host}:{self.tcp_port}"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
