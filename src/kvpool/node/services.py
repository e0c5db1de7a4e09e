"""What a client connection's :class:`~kvpool.node.session.Session` may use of the node: one
narrow :class:`SessionServices` object, built once by the server and shared by every
session.

The session gets nothing else of the node: no server to reach back into.  Each piece is
small and named for its job:

- :class:`NodeIdentity`: the node's names and addresses, for the handshake and status;
- :class:`Credentials`: who may connect (a tenants file, one access key, or nobody);
- :class:`SessionRegistry`: the connections open now, and each tenant's cap on them;
- :class:`Traffic`: the bytes clients wrote and read, and the write-through of what they
  committed (:meth:`Traffic.published`);
- :class:`StoreChanges`: a lookup waiting for the store to change;
- :class:`Refusals`: refused handshakes, logged at a bounded rate.

All of it is touched from the daemon's event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvpool.config import NodeConfig
from kvpool.errors import NodeUnavailable
from kvpool.keys import EngineRef
from kvpool.limits import LeaseLimits
from kvpool.node.metrics import NodeMetrics
from kvpool.node.sealing import Sealer
from kvpool.protocol.messages import NodeStats
from kvpool.store.arena import Arena
from kvpool.store.block import CommitResult
from kvpool.store.block_store import BlockStore
from kvpool.tenants import Credential, Registry, Tenant, authenticate
from kvpool.tiers.chain import Tiers

if TYPE_CHECKING:
    from kvpool.node.handoff import HandoffResult

log = logging.getLogger("kvpool.node")

REFUSAL_LOG_INTERVAL_S = 10.0


class Connection(Protocol):
    """A session, as the registry sees it."""

    @property
    def tenant(self) -> Tenant | None: ...

    @property
    def credential(self) -> Credential | None: ...

    @property
    def buffer_bytes(self) -> int:
        """The memory its receive buffer takes now."""

    def close(self) -> None: ...


@dataclass
class NodeIdentity:
    """The node's names and addresses (``tcp_port`` is known once the listener is bound)."""

    node_id: str
    host_id: str
    host: str
    tcp_port: int
    advertise_host: str = ""
    started_at: float = field(default_factory=time.monotonic)
    # The Unix socket's file and user, which a local client's handshake proof covers
    # (:func:`kvpool.protocol.auth.unix_binding`; set once the socket is bound).
    unix_binding: bytes = b""

    @classmethod
    def of(cls, config: NodeConfig) -> NodeIdentity:
        return cls(config.name, config.host_id, config.host, config.port, config.advertise_host)

    @property
    def tcp_address(self) -> str:
        host = self.advertise_host or self.host
        return f"{host}:{self.tcp_port}"

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at


class Credentials:
    """Who may connect: the tenants file's keys, else the node's one access key, else anyone."""

    def __init__(self, config: NodeConfig, tenants: Registry | None) -> None:
        self.tenants = tenants
        self._access_id = config.access_id
        self._access_key = config.access_key

    @property
    def requires_auth(self) -> bool:
        return self.tenants is not None or bool(self._access_key)

    @property
    def announces_auth(self) -> bool:
        """Whether the CHALLENGE says keys are required (the node's own key only: a tenants
        file's clients know they need theirs)."""
        return bool(self._access_key)

    def credential(self, access_id: str) -> Credential | None:
        """The credential of an access id (None: unknown, or the node needs none)."""
        if self.tenants is not None:
            return self.tenants.credential(access_id)
        if self._access_key and access_id == self._access_id:
            return Credential(access_id, self._access_key, None)
        return None

    def authenticate(self, authorization: str) -> Credential | None:
        """The credential an HTTP ``Authorization`` header proves, by the same keys as the
        data port (the admin HTTP's check)."""
        return authenticate(authorization, self.credential)


class SessionRegistry:
    """The connections open now, and per tenant (each tenant has a cap)."""

    def __init__(self) -> None:
        self.sessions: set[Connection] = set()
        self._tenant_to_sessions: dict[str, set[Connection]] = {}

    def __len__(self) -> int:
        return len(self.sessions)

    def opened(self, session: Connection) -> None:
        self.sessions.add(session)

    def admit(self, session: Connection) -> None:
        """Count an authenticated tenant connection, refusing past the tenant's cap."""
        tenant = session.tenant
        if tenant is None:
            return
        sessions = self._tenant_to_sessions.setdefault(tenant.name, set())
        if len(sessions) >= tenant.max_connections:
            raise NodeUnavailable(
                f"tenant {tenant.name} has {tenant.max_connections} connections open, its cap"
            )
        sessions.add(session)

    def closed(self, session: Connection) -> None:
        self.sessions.discard(session)
        if session.tenant is not None:
            self._tenant_to_sessions.get(session.tenant.name, set()).discard(session)

    def buffer_bytes(self) -> int:
        """The receive buffers of every open connection: O(connections), for statistics."""
        return sum(session.buffer_bytes for session in self.sessions)

    def num_of(self, tenant: Tenant) -> int:
        return len(self._tenant_to_sessions.get(tenant.name, ()))


class WriteThrough(Protocol):
    def __call__(self, keys: Sequence[bytes]) -> None:
        """Write these committed keys through to their home nodes (best effort)."""


class DeleteThrough(Protocol):
    def __call__(self, keys: Sequence[bytes]) -> None:
        """Delete these keys at their home nodes too (best effort, in the background)."""


@dataclass
class Traffic:
    """Bytes clients wrote and read, and the write-through of what they committed (and of
    what they deleted)."""

    write_through: WriteThrough | None = None
    delete_through: DeleteThrough | None = None
    bytes_in: int = 0
    bytes_out: int = 0

    def published(self, result: CommitResult, replicate: bool) -> None:
        """Blocks a client wrote became visible (``replicate``: write them through)."""
        self.bytes_in += result.num_bytes
        if replicate and result.committed and self.write_through is not None:
            self.write_through([b.key for b in result.committed])

    def deleted(self, keys: Sequence[bytes], replicate: bool) -> None:
        """A client deleted these keys (``replicate``: at their homes too, where the
        write-through put them)."""
        if replicate and keys and self.delete_through is not None:
            self.delete_through(keys)

    def sent(self, num_bytes: int) -> None:
        self.bytes_out += num_bytes


class Refusals:
    """Refused handshakes, logged at most once per ``interval_s`` with a count: they come
    before authentication, so anyone who reaches a listener could otherwise fill the log."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.num_refused = 0  # since the node started
        self._num_unlogged = 0
        self._logged_at = -interval_s

    def note(self, reason: str, peer: str) -> None:
        self.num_refused += 1
        self._num_unlogged += 1
        now = time.monotonic()
        if now - self._logged_at < self.interval_s:
            return
        log.warning(
            "%d handshake(s) refused in the last %.0f s (latest: %s, from %s)",
            self._num_unlogged,
            min(now - self._logged_at, self.interval_s),
            reason,
            peer,
        )
        self._logged_at = now
        self._num_unlogged = 0


class StoreChanges:
    """Lookups that wait for a key to be committed wake on any change of the store."""

    def __init__(self) -> None:
        self._changed: asyncio.Future[None] | None = None

    def notify(self) -> None:
        if self._changed is not None and not self._changed.done():
            self._changed.set_result(None)
        self._changed = None

    async def wait(self, timeout: float) -> None:
        if self._changed is None:
            self._changed = asyncio.get_running_loop().create_future()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._changed), timeout)


@dataclass(frozen=True)
class SessionServices:
    """Everything a session uses of the node, and nothing more."""

    store: BlockStore
    arena: Arena
    tiers: Tiers
    sealer: Sealer
    metrics: NodeMetrics
    identity: NodeIdentity
    credentials: Credentials
    registry: SessionRegistry
    traffic: Traffic
    changes: StoreChanges
    stats: Callable[[Tenant | None], NodeStats]  # the node's (or a tenant's) statistics
    shutdown: Callable[[bool], None]  # a client asked the node to stop (True: drain it)
    # An operator asked the node to hand its blocks to other nodes (targets, rate, deadline).
    handoff: Callable[[list[str], int, float], Awaitable[HandoffResult]]
    refusals: Refusals = field(default_factory=Refusals)
    # An engine that loads a namespace's blocks said so (kvpool.node.kthena); None: the
    # node tells no router of engines.  False: past its bounds.
    attach_engine: Callable[[bytes, EngineRef], bool] | None = None

    @property
    def limits(self) -> LeaseLimits:
        """The node's one set of lease limits (its ledger's)."""
        return self.store.limits
