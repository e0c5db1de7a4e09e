"""The client of one node: a pool of reusable connections, the node's mapped arena, and the
choice between the same-host shared-memory path and streaming over the socket.

A call takes a connection from the pool, runs one operation under the call's deadline and
returns it.  A pooled connection that turns out dead (the node restarted) is dropped and
the call is retried once on a fresh connection, so clients recover on their own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, TypeVar

from kvpool.config import Address, ClientConfig
from kvpool.directory import DirectoryReader
from kvpool.errors import ConnectError, NodeUnavailable, PoolTimeout, UsageError
from kvpool.keys import BlockOrigin, EngineRef
from kvpool.limits import LeaseLimits
from kvpool.protocol.messages import Health, NodeStats, PrefetchResponse, RetainResponse, Welcome

from . import ops, reads, writes
from .connection import Connection, map_arena
from .copier import Copier

T = TypeVar("T")
OpFactory = Callable[[Connection], Generator[Any, Any, T]]


ArenaHook = Callable[[memoryview, memoryview | None], None]


class _ArenaCache:
    """The mapping of the node's current arena and its shared directory (a restarted node
    has new ones), and the hooks told of each new arena mapping (new, and the one it
    replaces)."""

    def __init__(self, config: ClientConfig):
        self.config = config
        self._arena_id = b""
        self._arena: memoryview | None = None
        self._directory: DirectoryReader | None = None
        self._hooks: list[ArenaHook] = []
        self._lock = threading.Lock()

    def attach(self, conn: Connection) -> None:
        """Give a new connection the mappings of the arena its node named."""
        welcome = conn.welcome
        with self._lock:
            if welcome.arena_id != self._arena_id:
                old, self._arena = self._arena, map_arena(welcome, self.config)
                self._arena_id = welcome.arena_id
                self._directory = None
                if self._arena is not None:
                    self._directory = DirectoryReader.open(
                        welcome.directory_path, welcome.arena_id, welcome.arena_bytes
                    )
                    for hook in self._hooks:
                        hook(self._arena, old)
            conn.arena = self._arena
            # Same-host readers hash every block when asked to: the directory spares them that.
            conn.directory = None if self.config.verify_reads else self._directory

    def add_hook(self, hook: ArenaHook) -> None:
        with self._lock:
            self._hooks.append(hook)
            if self._arena is not None:
                hook(self._arena, None)


class NodeClient:
    """A thread-safe blocking client of one node."""

    def __init__(self, address: str, config: ClientConfig):
        self.address = Address.parse(address)
        self.config = config
        self.name = str(self.address)
        self._idle: list[Connection] = []
        self._num_open = 0
        self._cond = threading.Condition()
        self._arenas = _ArenaCache(config)
        self._copier = Copier(config.copy_threads)
        self._closed = False
        self.last_welcome: Welcome | None = None  # from the newest connection, if any

    # -- pool -----------------------------------------------------------------------------

    def _acquire(self, deadline: float) -> tuple[Connection, bool]:
        with self._cond:
            while True:
                if self._closed:
                    raise NodeUnavailable("client closed", node=self.name)
                if self._idle:
                    return self._idle.pop(), False
                if self._num_open < self.config.max_connections:
                    self._num_open += 1
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    raise PoolTimeout("no free connection before the deadline", node=self.name)
        try:
            conn = Connection(self.address, self.config, deadline)
        except BaseException:
            with self._cond:
                self._num_open -= 1
                self._cond.notify()
            raise
        self._arenas.attach(conn)
        self.name = conn.node
        self.last_welcome = conn.welcome
        return conn, True

    def _release(self, conn: Connection) -> None:
        with self._cond:
            if conn.broken or self._closed:
                conn.close()
                self._num_open -= 1
            else:
                self._idle.append(conn)
            self._cond.notify()

    def call(self, make: OpFactory[T], timeout: float | None = None) -> T:
        """Run one operation with a deadline, retrying once if a pooled connection died."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.config.timeout_s)
        for attempt in range(2):
            conn, fresh = self._acquire(deadline)
            try:
                return conn.run(make(conn), deadline)
            except (NodeUnavailable, ConnectError):
                if fresh or attempt:
                    raise
                self._drop_idle()  # they all lead to the node that went away
            finally:
                self._release(conn)
        raise AssertionError("unreachable")

    def _drop_idle(self) -> None:
        with self._cond:
            for conn in self._idle:
                conn.close()
                self._num_open -= 1
            self._idle.clear()

    def on_arena_mapped(self, hook: ArenaHook) -> None:
        """Call ``hook(arena, old)`` for the arena mapped now, if any, and for each new one
        (a restarted node's), before any operation uses it."""
        self._arenas.add_hook(hook)

    @property
    def welcome(self) -> Welcome:
        """The node's handshake answer (connects if needed)."""
        deadline = time.monotonic() + self.config.timeout_s
        conn, _ = self._acquire(deadline)
        try:
            return conn.welcome
        finally:
            self._release(conn)

    def close(self) -> None:
        self._copier.close()
        with self._cond:
            self._closed = True
            for conn in self._idle:
                conn.close()
                self._num_open -= 1
            self._idle.clear()
            self._cond.notify_all()

    # -- operations -----------------------------------------------------------------------

    def lookup(
        self,
        keys: Sequence[bytes],
        wait: float,
        wait_absent: bool,
        timeout: float | None,
        prefetch: float = 0.0,
    ) -> ops.LookupState:
        """The longest stored prefix; keys being written (and, with ``wait_absent``, keys
        nobody writes yet) are awaited up to ``wait`` seconds, on top of ``timeout``.
        With ``prefetch``, the node also starts bringing the prefix's lower-tier blocks
        into DRAM and holds them that long."""
        if not keys:
            return ops.LookupState(0, False)
        timeout = (timeout if timeout is not None else self.config.timeout_s) + wait
        return self.call(lambda _: ops.lookup(keys, wait, wait_absent, prefetch), timeout)

    def prefetch(
        self, keys: Sequence[bytes], hold: float, cancel: bool, timeout: float | None
    ) -> PrefetchResponse:
        if not keys:
            return PrefetchResponse()
        return self.call(lambda _: ops.prefetch(keys, hold, cancel), timeout)

    def limits(self, timeout: float | None = None) -> LeaseLimits:
        """The lease limits the node grants at most, as its Welcome announces them (a
        handshake first if this client has none yet); a node too old to announce them
        grants :class:`~kvpool.limits.LeaseLimits`' defaults."""
        if self.last_welcome is None:
            self.release(self.hold(timeout))
        welcome = self.last_welcome
        if welcome is None or welcome.limits is None:
            return LeaseLimits()
        return welcome.limits.lease_limits()

    def hold(self, timeout: float | None = None) -> Connection:
        """Take a connection out of the pool for a lease (reserve then commit, pin then
        unpin must use one connection); give it back with :meth:`release`."""
        deadline = time.monotonic() + (timeout if timeout is not None else self.config.timeout_s)
        for attempt in range(2):
            conn, fresh = self._acquire(deadline)
            if fresh or attempt:
                return conn
            try:  # a pooled connection may lead to a node that restarted: check it first
                conn.run(ops.health(), deadline)
                return conn
            except (NodeUnavailable, ConnectError):
                self._release(conn)
                self._drop_idle()
        raise AssertionError("unreachable")

    def release(self, conn: Connection) -> None:
        self._release(conn)

    @property
    def copier(self) -> Copier:
        """The client's copy threads (see :mod:`kvpool.client.copier`)."""
        return self._copier

    def exists(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        return self.call(lambda _: ops.exists(keys), timeout) if keys else []

    def presence(
        self, keys: Sequence[bytes], *, timeout: float | None = None
    ) -> tuple[list[bool], list[bool]]:
        """Which keys are stored, and which are being written."""
        return self.call(lambda _: ops.presence(keys), timeout) if keys else ([], [])

    def put(
        self,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        *,
        replicate: bool = True,
        timeout: float | None = None,
        origins: Sequence[BlockOrigin | None] | None = None,
    ) -> ops.PutResult:
        if not keys:
            return ops.PutResult([])
        if origins is not None and len(origins) != len(keys):
            raise UsageError(f"{len(keys)} keys but {len(origins)} origins")
        return self.call(
            lambda conn: writes.put_blocks(
                keys, views, conn.arena, conn.area, replicate, origins, self._copier
            ),
            timeout,
        )

    def get(
        self,
        keys: Sequence[bytes],
        dsts: Sequence[memoryview] | None,
        *,
        prefix: bool = False,
        timeout: float | None = None,
    ) -> ops.GetResult:
        if not keys:
            return ops.GetResult([], [], [])
        wait_ms = ops.lower_tier_wait_ms(timeout if timeout is not None else self.config.timeout_s)
        return self.call(
            lambda conn: reads.get_blocks(
                keys,
                dsts,
                conn.arena,
                conn.directory,
                prefix,
                wait_ms,
                self.config.verify_reads,
                self._copier,
            ),
            timeout,
        )

    def delete(
        self, keys: Sequence[bytes], *, replicate: bool = True, timeout: float | None = None
    ) -> list[Any]:
        return self.call(lambda _: ops.delete(keys, replicate), timeout) if keys else []

    def retain(
        self,
        keys: Sequence[bytes],
        priority: int,
        duration_s: float,
        *,
        timeout: float | None = None,
    ) -> RetainResponse:
        if not keys:
            return RetainResponse(num_retained=0)
        return self.call(lambda _: ops.retain(keys, priority, duration_s), timeout)

    def describe(
        self,
        namespace_id: bytes,
        label: str,
        *,
        engine: EngineRef | None = None,
        saving: str = "",
        timeout: float | None = None,
    ) -> None:
        self.call(lambda _: ops.describe(namespace_id, label, engine, saving), timeout)

    def stats(self, *, timeout: float | None = None) -> NodeStats:
        return self.call(lambda _: ops.stats(), timeout)

    def health(self, *, timeout: float | None = None) -> Health:
        return self.call(lambda _: ops.health(), timeout)

    @property
    def has_shm(self) -> bool:
        deadline = time.monotonic() + self.config.timeout_s
        conn, _ = self._acquire(deadline)
        try:
            return conn.arena is not None
        finally:
            self._release(conn)
