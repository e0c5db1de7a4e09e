"""The node's protocol server: listeners on a Unix socket and TCP, one
:class:`~kvpool.node.session.Session` per connection, the lease ledger's expiry clock, and
the node's statistics.

The server builds what its sessions share once, as one
:class:`~kvpool.node.services.SessionServices` (the store, touched only from the event
loop, the arena, the tiers, the sealer, credentials, the session registry, the account
ledger, byte counters, the write-through of committed blocks to their home nodes), and
hands each session that and nothing else.  Every ``EXPIRE_INTERVAL_S`` it ends the expired
leases of every kind through the store's one ledger (:meth:`BlockStore.expire`), and now
and then it closes the connections idle past ``--idle-timeout``.
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
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from kvpool.cluster.membership import Member
from kvpool.config import Address, NodeConfig
from kvpool.errors import BadRequest, ConfigError
from kvpool.formats import ARENA, DISK_SEGMENT, DISK_TIER, JOURNAL, RELEASE, Format, Stamp
from kvpool.limits import EXPIRE_INTERVAL_S
from kvpool.node.connections import SessionRegistry
from kvpool.node.metrics import NodeMetrics
from kvpool.node.sealing import Sealer
from kvpool.node.services import (
    Credentials,
    NodeIdentity,
    SessionServices,
    StoreChanges,
    Traffic,
)
from kvpool.node.session import Session
from kvpool.protocol import auth
from kvpool.protocol.messages import MAX_ACCOUNTS, NodeStats
from kvpool.stats import AccountStats, FormatStats
from kvpool.store.accounts import Accounts, Resource
from kvpool.store.arena import Arena
from kvpool.store.block_store import BlockStore
from kvpool.tenants import Registry, Tenant
from kvpool.tiers.chain import MAX_STAGED_BYTES, PREFETCH_MAX_BYTES, Tiers
from kvpool.tls import CertFiles

if TYPE_CHECKING:
    from kvpool.node.handoff import HandoffResult
    from kvpool.node.kthena import KthenaSink

log = logging.getLogger("kvpool.node")

RELOAD_INTERVAL_S = 1.0  # how often the tenants file is checked for changes
MAX_IDLE_CHECK_S = 5.0  # idle connections are looked for at least this often
# While strangers crowd each other out, the accept loop takes one connection at most this
# often (about a thousand a second, a tenth of what the event loop can serve).
CROWDED_ACCEPT_S = 0.001
SOCKET_BUFFER_BYTES = 4 << 20


class ClusterHooks(Protocol):
    """What the server needs of the node's part in a cluster."""

    def enqueue(self, keys: Sequence[bytes]) -> None:
        """Write these committed keys through to their home nodes (best effort)."""

    def delete_at_homes(self, keys: Sequence[bytes]) -> None:
        """Delete these keys at their home nodes too (best effort)."""

    def peer_ids(self) -> list[str]:
        """The members of the cluster, for status."""

    def members(self) -> list[Member]:
        """The members of the cluster (a handoff places blocks as they do)."""


class NodeServer:
    """Listens, accepts a :class:`Session` per connection (numbered from 1: its lease owner
    id), expires leases, and reports the node's statistics.  ``start`` binds and spawns
    its loops; ``stop`` closes every session and waits for them."""

    def __init__(
        self,
        config: NodeConfig,
        store: BlockStore,
        arena: Arena,
        tiers: Tiers,
        changes: StoreChanges,
        cluster: ClusterHooks | None = None,
        on_shutdown: Callable[[bool], None] | None = None,
        tenants: Registry | None = None,
        tls: CertFiles | None = None,
        kthena: KthenaSink | None = None,
        tcp: socket.socket | None = None,
    ):
        """``changes``: what the store tells the keys that changed (built with it, as
        ``BlockStore(on_change=changes.notify)``), which waiting lookups are parked on.  The
        store's account ledger (``store.accounts``) is the node's.  ``tcp``: the data port's
        listener, bound already (:func:`bind_tcp`: a port in use refuses the start before
        anything is written), else bound by :meth:`start`."""
        self.config = config
        self._tcp = tcp
        self.kthena = kthena  # Kthena's Redis entries, when the node writes them
        self.tenants = tenants
        self.tls = tls  # the TCP listener's TLS (the Unix socket stays local, in the clear)
        self.store = store
        self.arena = arena
        self.tiers = tiers
        self.cluster = cluster
        self._on_shutdown = on_shutdown
        self.identity = NodeIdentity.of(config)
        self.accounts: Accounts = store.accounts
        self.registry = SessionRegistry(config.budgets, self.accounts)
        self.traffic = Traffic(
            cluster.enqueue if cluster is not None else None,
            cluster.delete_at_homes if cluster is not None else None,
        )
        self.changes = changes
        self.credentials = Credentials(config, tenants)
        self._owner_ids = itertools.count(1)  # connection numbers: lease owners >= 1
        self._handing_off = False
        self._listeners: list[socket.socket] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self.sealer = Sealer(store, arena, self.traffic.published)
        self.metrics = NodeMetrics(self.stats)
        self.services = SessionServices(
            store=store,
            arena=arena,
            tiers=self.tiers,
            sealer=self.sealer,
            metrics=self.metrics,
            identity=self.identity,
            credentials=self.credentials,
            registry=self.registry,
            accounts=self.accounts,
            traffic=self.traffic,
            changes=self.changes,
            stats=self.stats,
            shutdown=self._shutdown_requested,
            handoff=self.handoff,
            attach_engine=kthena.attach if kthena is not None else None,
        )
        self._apply_quotas()

    @property
    def node_id(self) -> str:
        return self.identity.node_id

    @property
    def tcp_port(self) -> int:
        return self.identity.tcp_port

    @property
    def sessions(self) -> set[Session]:
        return self.registry.sessions  # type: ignore[return-value]

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
        os.chmod(path, 0o660)  # the daemon's user and group: those it trusts with the arena
        bound = path.stat()
        self.identity.unix_binding = auth.unix_binding(bound.st_dev, bound.st_ino, os.geteuid())
        unix.listen(512)
        unix.setblocking(False)
        tcp = self._tcp or bind_tcp(self.config.host, self.config.port)
        tcp.setblocking(False)
        self.identity.tcp_port = tcp.getsockname()[1]
        self._listeners = [unix, tcp]
        for listener in self._listeners:
            self._spawn(self._accept_loop(loop, listener))
        self._spawn(self._expire_loop())
        self._spawn(self._idle_loop())
        if self.config.scrub_bytes_s:
            self._spawn(self.sealer.scrub(self.config.scrub_bytes_s))
        if self.tenants is not None or self.tls is not None:
            self._spawn(self._reload_loop())

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
            if not self._admits(sock):
                sock.close()
                continue
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
            if self.tls is not None and sock.family != socket.AF_UNIX:
                sock.setblocking(False)
                sock = self.tls.context.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
            session = Session(self.services, sock, next(self._owner_ids))
            session.task = self._spawn(session.run())
            # A flood of connections waiting to be accepted takes its turns with the
            # sessions, one connection a turn: accepting never holds the event loop.  Once
            # the strangers crowd each other out (a newcomer closed an older one), newcomers
            # are taken at a bounded rate: a flood costs the members a bounded share.
            evicted = self.registry.num_evicted
            await asyncio.sleep(0)
            if self.registry.num_evicted != evicted:
                await asyncio.sleep(CROWDED_ACCEPT_S)

    def _admits(self, sock: socket.socket) -> bool:
        """Whether a connection just accepted may have a session: one on the Unix socket
        while a member slot is free; one over TCP always, as a stranger (the registry makes
        room among the strangers: :mod:`kvpool.node.connections`)."""
        return sock.family != socket.AF_UNIX or self.registry.can_open_local()

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_INTERVAL_S)
            self.store.expire()  # every lease of the node's one ledger

    async def _idle_loop(self) -> None:
        interval = min(MAX_IDLE_CHECK_S, self.config.budgets.idle_s / 4)
        while True:
            await asyncio.sleep(interval)
            closed = self.registry.close_idle(time.monotonic())
            if closed:
                log.debug("closed %d idle connection(s)", closed)

    # -- tenants -------------------------------------------------------------------------

    def _apply_quotas(self) -> None:
        """The tenants' limits of everything, in the ledger, then every tier's count of
        what each holds there."""
        if self.tenants is None:
            return
        self.accounts.set_tenants(
            self.tenants.current.tenants.values(),
            self.tiers.holds.max_bytes,
            PREFETCH_MAX_BYTES,
            MAX_STAGED_BYTES,
            self.tiers.capacities(),
        )
        self.tiers.recount_quotas()

    async def _reload_loop(self) -> None:
        while True:
            await asyncio.sleep(RELOAD_INTERVAL_S)
            if self.tls is not None:
                self.tls.reload()
            if self.tenants is not None:
                self._reload_tenants()

    def _reload_tenants(self) -> None:
        """Apply a changed tenants file: new quotas, and connections whose key was revoked
        or rotated, or whose tenant changed, closed (they may reconnect with a valid key)."""
        assert self.tenants is not None
        if not self.tenants.reload():
            return
        self._apply_quotas()
        closed = 0
        for session in list(self.registry.sessions):
            held = session.credential
            if held is None:
                continue
            now = self.tenants.credential(held.access_id)
            same = now is not None and now.key == held.key
            if same and held.tenant is not None:
                same = held.tenant.same_as(now.tenant if now is not None else None)
            if not same:
                session.close()
                closed += 1
        log.info("%d connection(s) closed by the new tenants file", closed)

    # -- what sessions ask of the node --------------------------------------------------

    def _shutdown_requested(self, drain: bool) -> None:
        """A client asked the node to stop (and, with ``drain``, to empty itself)."""
        if self._on_shutdown is not None:
            self._on_shutdown(drain)

    # -- status ---------------------------------------------------------------------------

    def stats(self, tenant: Tenant | None = None) -> NodeStats:
        """The node's statistics; for a tenant, only its own namespaces and usage."""
        if tenant is not None:
            return self._tenant_stats(tenant)
        store = self.store
        counters = store.counters
        namespaces = [msgspec.structs.replace(usage) for usage in store.namespaces]
        return NodeStats(
            node_id=self.node_id,
            host_id=self.identity.host_id,
            tcp_address=self.tcp_address,
            capacity_bytes=store.capacity,
            used_bytes=store.used_bytes,
            reserved_bytes=store.reserved_bytes,
            area_bytes=store.areas.num_bytes,
            num_blocks=len(store),
            num_pinned=store.num_pinned,
            hits=counters.lookup_hits,
            misses=counters.lookup_misses,
            puts=counters.puts,
            evictions=counters.evictions,
            bytes_in=self.traffic.bytes_in,
            bytes_out=self.traffic.bytes_out,
            num_connections=len(self.registry),
            uptime_s=self.identity.uptime_s,
            namespaces=namespaces,
            peers=self.cluster.peer_ids() if self.cluster is not None else [],
            corrupt_reports=counters.corrupt_reports,
            retained_blocks=store.retention.num_retained,
            retained=counters.retained,
            retention_refused=counters.retention_refused,
            scrubbed_bytes=self.sealer.scrubbed_bytes,
            scrub_dropped=self.sealer.scrub_dropped,
            tiers=self.tiers.stats(),
            prefetch=self.tiers.prefetch_stats() if self.tiers.can_prefetch else None,
            metadata_bytes=store.metadata_bytes(),
            connection_buffer_bytes=self.registry.buffer_bytes(),
            heap_bytes=_heap_bytes(),
            release=RELEASE,
            formats=self.formats(),
            accounts=self._accounts(),
            num_strangers=self.registry.num_strangers,
            strangers_evicted=self.registry.num_evicted,
            kthena_written=self.kthena.num_written if self.kthena is not None else 0,
            kthena_dropped=self.kthena.num_dropped if self.kthena is not None else 0,
        )

    async def handoff(
        self, targets: list[str], rate_bytes: int, deadline_s: float, seal: bool = False
    ) -> HandoffResult:
        """Hand this node's blocks to ``targets`` (:mod:`kvpool.node.handoff`), one handoff
        at a time."""
        from kvpool.node.handoff import Handoff  # the client's code: only when asked
        from kvpool.node.peers import peer_client_config

        if self._handing_off:
            raise BadRequest("a handoff is under way on this node")
        known = {m.tcp_address: m for m in self.cluster.members()} if self.cluster else {}
        members = []
        for target in targets:
            try:
                address = str(Address.parse(target))
            except ConfigError as exc:
                raise BadRequest(f"handoff target {target!r}: {exc}") from exc
            if address == self.tcp_address or address.startswith("unix:"):
                raise BadRequest(f"handoff target {target!r}: another node's TCP address")
            members.append(known.get(address) or Member(node_id=address, tcp_address=address))
        handoff = Handoff(
            self.store,
            self.arena,
            peer_client_config(self.config),
            members,
            disk=self.tiers.lower.disk,
        )
        self._handing_off = True
        try:
            return await handoff.run(rate_bytes, deadline_s, seal=seal)
        finally:
            self._handing_off = False

    def formats(self) -> list[FormatStats]:
        """The node's persistent formats: what it writes, and what its start found."""
        found: list[tuple[Format, Stamp | None]] = [
            (ARENA, self.arena.found),
            (JOURNAL, self.store.journal.found),
        ]
        disk = self.tiers.lower.disk
        if disk is not None:
            found.append((DISK_TIER, disk.found))
        rows = [
            FormatStats(fmt.name, fmt.version, RELEASE, stamp.describe() if stamp else "")
            for fmt, stamp in found
        ]
        if disk is not None:
            older = {v: n for v, n in disk.segment_versions().items() if v != DISK_SEGMENT.version}
            rows.append(
                FormatStats(
                    DISK_SEGMENT.name,
                    DISK_SEGMENT.version,
                    RELEASE,
                    ", ".join(f"{n} of format {v}" for v, n in sorted(older.items())),
                )
            )
        return rows

    def _accounts(self, tenant: Tenant | None = None) -> list[AccountStats]:
        """Each tenant's account (``tenant``: its own), its arena and lower tiers' bytes
        included."""
        return self.accounts.usage(tenant.tag if tenant is not None else None)[:MAX_ACCOUNTS]

    def _tenant_stats(self, tenant: Tenant) -> NodeStats:
        rows = [
            msgspec.structs.replace(row)
            for row in self.store.namespaces
            if bytes.fromhex(row.namespace_id).startswith(tenant.tag)
        ]
        used = self.accounts.used(tenant.tag, Resource.ARENA_BYTES)
        return NodeStats(
            node_id=self.node_id,
            host_id=self.identity.host_id,
            tcp_address=self.tcp_address,
            capacity_bytes=tenant.quota_bytes,
            used_bytes=used,
            reserved_bytes=0,
            num_blocks=sum(r.num_blocks for r in rows),
            num_pinned=0,
            hits=sum(r.hits for r in rows),
            misses=sum(r.misses for r in rows),
            puts=sum(r.puts for r in rows),
            evictions=0,
            bytes_in=0,
            bytes_out=0,
            num_connections=self.registry.num_of(tenant),
            uptime_s=self.identity.uptime_s,
            namespaces=rows,
            accounts=self._accounts(tenant),
        )

    @property
    def tcp_address(self) -> str:
        return self.identity.tcp_address


def _heap_bytes() -> int:
    """The daemon's anonymous resident memory (Linux), 0 where the kernel does not say."""
    try:
        with open("/proc/self/status", "rb") as status:
            for line in status:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def bind_tcp(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one)."""
    return socket.create_server((host, port), family=_family(host), backlog=512)


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
