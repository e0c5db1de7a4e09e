"""The connections a node has open, and what they cost it: the one place that admits them.

- **Strangers** (TCP connections that have not authenticated yet) live in a pool of their
  own: at most ``max_strangers`` at once, and ``max_strangers_per_address`` from one
  address.  Past the address's cap the oldest stranger of that address is closed to make
  room; past the pool's, the oldest of the address that has the most.  Strangers crowd out
  each other, never a connection that authenticated, and a flood from a few addresses
  closes its own connections, not a client's handshake from another address.  Each has
  ``handshake_s`` to authenticate (the session's own deadline), a 4 KiB buffer, and may
  send a HELLO of 4 KiB at most.
- **Members** (authenticated, or on the Unix socket, which only the daemon's user and group
  reach): at most ``max_connections``, of which remote ones ``local_reserved`` fewer, so
  the local engines stay served whatever arrives over the network; a tenant's at most its
  ``max_connections`` (its account's ``CONNECTIONS``).  Past a cap the handshake is
  refused with a clear error.
- **Buffers**: a member's read-ahead is charged to its tenant's ``BUFFER_BYTES`` as it is
  admitted; a frame whose metadata does not fit its read-ahead is read into a buffer of its
  own, charged while the request is served (:meth:`SessionRegistry.frame_buffer`), after
  waiting, within the frame's deadline, while the tenant's budget is spent
  (:meth:`SessionRegistry.wait_for_buffer`).
- **Idle** members (nothing received for ``idle_s``, no request in service) are closed
  (:meth:`SessionRegistry.close_idle`); a client reconnects on its next call.

All of it is touched from the daemon's event loop only.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Protocol

from kvpool.errors import NodeUnavailable
from kvpool.limits import Budgets
from kvpool.protocol.frames import RecvBuffer
from kvpool.store.accounts import NODE, Accounts, Resource
from kvpool.tenants import Credential, Tenant

# What a member's read-ahead costs its tenant (kvpool.protocol.frames.RecvBuffer).
READ_AHEAD_BYTES = RecvBuffer.INITIAL_BYTES


class Connection(Protocol):
    """A session, as the registry sees it."""

    @property
    def tenant(self) -> Tenant | None: ...

    @property
    def credential(self) -> Credential | None: ...

    @property
    def account(self) -> bytes:
        """Whose account it is charged to (:mod:`kvpool.store.accounts`)."""

    @property
    def peer(self) -> str:
        """Its address (``"unix"`` on the Unix socket)."""

    @property
    def is_local(self) -> bool: ...

    @property
    def buffer_bytes(self) -> int:
        """The memory its read-ahead buffer takes now."""

    @property
    def is_idle_since(self) -> float | None:
        """When it last received a request, if none is in service (None: busy)."""

    def close(self) -> None: ...


class SessionRegistry:
    """Every connection open, strangers and members, under the node's :class:`Budgets` and
    each tenant's account."""

    def __init__(self, budgets: Budgets | None = None, accounts: Accounts | None = None) -> None:
        self.budgets = budgets or Budgets()
        self.accounts = accounts if accounts is not None else Accounts(self.budgets)
        self.sessions: set[Connection] = set()
        self._strangers: dict[Connection, None] = {}  # oldest first
        self._address_to_strangers: dict[str, dict[Connection, None]] = {}
        self._members: set[Connection] = set()
        self._charged: set[Connection] = set()  # members whose slots their accounts pay
        self._num_remote = 0
        self.frame_bytes = 0  # metadata buffers of frames being served
        self.num_evicted = 0  # strangers closed to make room for newer ones
        self._buffer_waiters: dict[bytes, list[asyncio.Future[None]]] = {}

    def __len__(self) -> int:
        return len(self.sessions)

    @property
    def num_strangers(self) -> int:
        return len(self._strangers)

    def can_open_local(self) -> bool:
        """Whether a Unix socket connection just accepted may stay (every member slot)."""
        return len(self._members) < self.budgets.max_connections

    def opened(self, session: Connection) -> None:
        """A connection was accepted: a member at once on the Unix socket (counted against
        every slot), a stranger in the stranger pool over TCP (closing the oldest past a
        cap)."""
        self.sessions.add(session)
        if session.is_local:
            self._members.add(session)
            return
        same_address = self._address_to_strangers.get(session.peer, {})
        while len(same_address) >= self.budgets.max_strangers_per_address:
            self._evict(next(iter(same_address)))
        while len(self._strangers) >= self.budgets.max_strangers:
            # The address with the most (at most max_strangers of them: bounded work).
            crowd = max(self._address_to_strangers.values(), key=len)
            self._evict(next(iter(crowd)))
        self._strangers[session] = None
        self._address_to_strangers.setdefault(session.peer, {})[session] = None

    def _evict(self, stranger: Connection) -> None:
        self._forget_stranger(stranger)
        self.num_evicted += 1
        stranger.close()

    def _forget_stranger(self, stranger: Connection) -> bool:
        if self._strangers.pop(stranger, False) is None:
            same_address = self._address_to_strangers[stranger.peer]
            del same_address[stranger]
            if not same_address:
                del self._address_to_strangers[stranger.peer]
            return True
        return False

    def admit(self, session: Connection) -> None:
        """The connection authenticated (or needs no key): it becomes a member, refused
        (:class:`NodeUnavailable`) past the node's cap, its tenant's connection cap or its
        tenant's buffer budget."""
        if session in self._members:  # the Unix socket's: a member since it was accepted
            self._charge(session)
            return
        if not self._forget_stranger(session):
            raise NodeUnavailable("the connection waited too long to authenticate")
        remote_cap = self.budgets.max_connections - self.budgets.local_reserved
        if self._num_remote >= remote_cap or len(self._members) >= self.budgets.max_connections:
            raise NodeUnavailable(f"the node has {remote_cap} remote connections open, its cap")
        self._charge(session)
        self._members.add(session)
        self._num_remote += 1

    def _charge(self, session: Connection) -> None:
        accounts, account = self.accounts, session.account
        tenant = session.tenant
        if not accounts.charge(account, Resource.CONNECTIONS):
            name = tenant.name if tenant is not None else "?"
            cap = accounts.limit(account, Resource.CONNECTIONS)
            raise NodeUnavailable(f"tenant {name} has {cap} connections open, its cap")
        if not accounts.charge(account, Resource.BUFFER_BYTES, READ_AHEAD_BYTES):
            accounts.credit(account, Resource.CONNECTIONS)
            name = tenant.name if tenant is not None else "?"
            raise NodeUnavailable(f"tenant {name} holds its whole buffer budget")
        self._charged.add(session)

    def closed(self, session: Connection) -> None:
        """The connection ended (whatever ended it): everything it held is credited back."""
        self.sessions.discard(session)
        self._forget_stranger(session)
        if session in self._members:
            self._members.discard(session)
            if not session.is_local:
                self._num_remote -= 1
        if session in self._charged:
            self._charged.discard(session)
            self.accounts.credit(session.account, Resource.CONNECTIONS)
            self.accounts.credit(session.account, Resource.BUFFER_BYTES, READ_AHEAD_BYTES)
            self._wake_buffer_waiters(session.account)

    async def wait_for_buffer(self, session: Connection, num_bytes: int, timeout_s: float) -> None:
        """Until the session's tenant has room for a frame's own metadata buffer of
        ``num_bytes`` (``TimeoutError`` past ``timeout_s``: the caller closes the
        connection).  Charge it with :meth:`frame_buffer` right after, with no await
        between."""
        account, accounts = session.account, self.accounts
        if accounts.has_room(account, Resource.BUFFER_BYTES, num_bytes):
            return
        async with asyncio.timeout(timeout_s):
            while not accounts.has_room(account, Resource.BUFFER_BYTES, num_bytes):
                waiter = asyncio.get_running_loop().create_future()
                self._buffer_waiters.setdefault(account, []).append(waiter)
                await waiter

    @contextlib.contextmanager
    def frame_buffer(self, session: Connection, num_bytes: int) -> Iterator[None]:
        """Charge a frame's own metadata buffer to the session's tenant while its request
        is served (after :meth:`wait_for_buffer`)."""
        account = session.account
        self.accounts.charge(account, Resource.BUFFER_BYTES, num_bytes)
        self.frame_bytes += num_bytes
        try:
            yield
        finally:
            self.frame_bytes -= num_bytes
            self.accounts.credit(account, Resource.BUFFER_BYTES, num_bytes)
            self._wake_buffer_waiters(account)

    def _wake_buffer_waiters(self, account: bytes) -> None:
        if account == NODE:
            return
        for waiter in self._buffer_waiters.pop(account, ()):
            if not waiter.done():
                waiter.set_result(None)

    def close_idle(self, now: float) -> int:
        """Close every member idle since ``idle_s`` before ``now``; how many."""
        oldest = now - self.budgets.idle_s
        idle = [
            s for s in self._members if (since := s.is_idle_since) is not None and since < oldest
        ]
        for session in idle:
            session.close()
        return len(idle)

    def buffer_bytes(self) -> int:
        """The receive buffers of every open connection, and of the frames being served:
        O(connections), for statistics."""
        return sum(session.buffer_bytes for session in self.sessions) + self.frame_bytes

    def num_of(self, tenant: Tenant) -> int:
        return self.accounts.used(tenant.tag, Resource.CONNECTIONS)
