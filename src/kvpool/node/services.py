"""What a client connection's :class:`~kvpool.node.session.Session` may use of the node: one
narrow :class:`SessionServices` object, built once by the server and shared by every
session.

The session gets nothing else of the node: no server to reach back into.  Each piece is
small and named for its job:

- :class:`NodeIdentity`: the node's names and addresses, for the handshake and status;
- :class:`Credentials`: who may connect (a tenants file, one access key, or nobody);
- :class:`~kvpool.node.connections.SessionRegistry`: the connections open now, and what
  they cost (strangers, members, caps, buffers);
- :class:`~kvpool.store.accounts.Accounts`: how much of every shared resource each tenant
  holds;
- :class:`Traffic`: the bytes clients wrote and read, and the write-through of what they
  committed (:meth:`Traffic.published`);
- :class:`StoreChanges`: lookups parked on the key they wait for;
- :class:`Turns`: the event loop's turns, by account, for requests that were waiting;
- :class:`Refusals`: refused handshakes, logged at a bounded rate.

All of it is touched from the daemon's event loop only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvpool.config import NodeConfig
from kvpool.keys import EngineRef
from kvpool.limits import LeaseLimits
from kvpool.node.connections import SessionRegistry
from kvpool.node.metrics import NodeMetrics
from kvpool.node.sealing import Sealer
from kvpool.protocol.messages import NodeStats
from kvpool.store.accounts import Accounts
from kvpool.store.arena import Arena
from kvpool.store.block import CommitResult
from kvpool.store.block_store import BlockStore
from kvpool.tenants import Credential, Registry, Tenant, authenticate
from kvpool.tiers.chain import Tiers

if TYPE_CHECKING:
    from kvpool.node.handoff import HandoffResult

log = logging.getLogger("kvpool.node")

REFUSAL_LOG_INTERVAL_S = 10.0


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
            self.write_through(result.committed)

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
    """Lookups parked on the key they wait for: the store tells the keys whose presence
    changed (committed, or a reservation ended), and only the lookups waiting on those keys
    wake, each to look at its own key (never a rescan of every parked lookup on every
    change of the store)."""

    def __init__(self) -> None:
        self._key_to_waiters: dict[bytes, list[asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return len(self._key_to_waiters)

    def notify(self, keys: Sequence[bytes]) -> None:
        if not self._key_to_waiters:
            return
        for key in keys:
            for waiter in self._key_to_waiters.pop(key, ()):
                if not waiter.done():
                    waiter.set_result(None)

    async def wait(self, key: bytes, timeout: float) -> None:
        """Until ``key`` changes, or ``timeout`` passes."""
        waiter = asyncio.get_running_loop().create_future()
        waiters = self._key_to_waiters.setdefault(key, [])
        waiters.append(waiter)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await waiter
        finally:
            if not waiter.done():
                waiter.cancel()
            left = self._key_to_waiters.get(key)
            if left is not None:
                with contextlib.suppress(ValueError):
                    left.remove(waiter)
                if not left:
                    del self._key_to_waiters[key]


class Turns:
    """The event loop's turns, taken by account (:mod:`kvpool.store.accounts`): a session
    whose next request was there already (pipelined, or queued while the loop served
    others) waits for its account's turn, and the accounts that wait take turns round
    robin, one session each a round.  A tenant with many busy connections gets no more
    turns than one with a single connection."""

    def __init__(self) -> None:
        self._account_to_waiting: dict[bytes, collections.deque[asyncio.Future[None]]] = {}
        self._is_scheduled = False

    async def take(self, account: bytes) -> None:
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        self._account_to_waiting.setdefault(account, collections.deque()).append(turn)
        if not self._is_scheduled:
            self._is_scheduled = True
            loop.call_soon(self._grant)
        await turn

    def _grant(self) -> None:
        """One waiting session of each account goes on; again next round while any wait."""
        self._is_scheduled = False
        for account in list(self._account_to_waiting):
            waiting = self._account_to_waiting[account]
            while waiting:
                turn = waiting.popleft()
                if not turn.done():  # (a session closed while it waited)
                    turn.set_result(None)
                    break
            if not waiting:
                del self._account_to_waiting[account]
        if self._account_to_waiting:
            self._is_scheduled = True
            asyncio.get_running_loop().call_soon(self._grant)


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
    accounts: Accounts
    traffic: Traffic
    changes: StoreChanges
    stats: Callable[[Tenant | None], NodeStats]  # the node's (or a tenant's) statistics
    shutdown: Callable[[bool], None]  # a client asked the node to stop (True: drain it)
    # An operator asked the node to hand its blocks to other nodes (targets, rate, deadline).
    handoff: Callable[[list[str], int, float, bool], Awaitable[HandoffResult]]
    refusals: Refusals = field(default_factory=Refusals)
    # An engine that loads a namespace's blocks said so (kvpool.node.kthena); None: the
    # node tells no router of engines.  False: past its bounds.
    attach_engine: Callable[[bytes, EngineRef], bool] | None = None
    turns: Turns = field(default_factory=Turns)

    @property
    def limits(self) -> LeaseLimits:
        """The node's one set of lease limits (its ledger's)."""
        return self.store.limits
