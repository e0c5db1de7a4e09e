"""A stream of same-host puts whose commits overlap the next put's copy (:class:`Writer`).

A put on the node's host is a copy into the connection's write area and then a COMMIT;
``Client.put`` waits for the COMMIT's reply (the node's statuses, per key) before it
returns, so each put pays a round trip to the node after its copy.  A writer sends the
COMMIT and returns a future at once.  The node publishes the blocks while the caller
prepares and copies its next batch, and that reply is read after the next copy, by which
time it is there: a stream of puts moves at the speed of its copies.

- The writer copies its next batch into the rest of its area before the node has read the
  COMMIT, so that COMMIT tells the node to keep the rest where it is (``keep_area``); it
  does so only while the rest holds another batch as large.  Else the next put waits for
  the reply, which says where the node put a fresh area.  The area's lease is renewed
  only by replies read, so a copy still ends long before the node could hand that memory
  to anyone else (see :mod:`kvpool.client.reads`).
- At most one COMMIT is in flight when a put returns: the reply of the one before is read
  by then.  ``flush()`` reads every reply due; the future of a put holds its statuses once
  its reply is read (``result()`` reads it if needed).
- Blocks are visible to readers once the node has read their COMMIT (for a reader that
  must see them, ``flush()`` first).  A write the node refused gives its future the error
  (e.g. :class:`~kvpool.errors.LeaseExpired`); the connection failing fails every future
  due and the writer opens a new one for the next put.
- Off the node's host, or where the node has no area free, a put is a plain put: its
  future is ready when it returns.
- In a cluster (``route`` given), a put the local node cannot take (there is none, or it
  fails to answer) goes where ``Client.put`` sends it: through the cluster's routing.

A writer holds one connection of the client until it is closed; use it from one thread at
a time (calls are serialised).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.errors import StoreError, TransportError, UsageError
from kvpool.keys import BlockOrigin

from . import ops, writes
from .connection import Connection
from .futures import PoolFuture
from .node import NodeClient

AREA_BATCHES = 4  # a writer's area holds this many batches: one put in four waits for a reply

RoutedPut = Callable[
    [Sequence[bytes], Sequence[memoryview], float, Sequence[BlockOrigin | None] | None],
    ops.PutResult,
]


class _WriterFuture(PoolFuture[ops.PutResult]):
    """A put's future whose ``result()`` reads the replies due up to it."""

    def __init__(self, future: concurrent.futures.Future[ops.PutResult], writer: Writer):
        super().__init__(future)
        self._writer = writer

    def result(self, timeout: float | None = None) -> ops.PutResult:
        self._settle(timeout)
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._settle(timeout)
        return self._future.exception(timeout)

    def _settle(self, timeout: float | None) -> None:
        """Read the replies due, this one's included.  What a failed read raises, the
        futures due hold already (this one's too), so it is not raised here."""
        if not self._future.done():
            with contextlib.suppress(Exception):
                self._writer.flush(timeout)


class Writer:
    """Puts to one node whose commits overlap the next put's copy (see the module)."""

    def __init__(
        self,
        node: NodeClient | None,
        replicate: bool,
        timeout: float,
        route: RoutedPut | None = None,
    ):
        """``route(keys, views, deadline, origins)``: the client's routed put, for puts the
        local ``node`` cannot take (a cluster's writer; None: the node's errors raise)."""
        self._node = node
        self._replicate = replicate
        self._timeout = timeout
        self._route = route
        self._conn: Connection | None = None
        self._due: collections.deque[
            tuple[writes.SentCommit, concurrent.futures.Future[ops.PutResult]]
        ] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        origins: Sequence[BlockOrigin | None] | None = None,
    ) -> PoolFuture[ops.PutResult]:
        """Store one block per key, as :meth:`Client.put` does; return once the blocks are
        copied and their COMMIT is sent.  The values may be reused at once."""
        views = ops.check_buffers(keys, values, writable=False) or []
        if origins is not None and len(origins) != len(keys):
            raise UsageError(f"{len(keys)} keys but {len(origins)} origins")
        future: concurrent.futures.Future[ops.PutResult] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise UsageError("the writer is closed")
            deadline = time.monotonic() + self._timeout
            if not keys:
                future.set_result(ops.PutResult([]))
            elif self._node is None and self._route is not None:
                future.set_result(self._route(keys, views, deadline, origins))
            else:
                try:
                    self._put(keys, views, origins, future, deadline)
                except TransportError:
                    if self._route is None:
                        raise
                    future.set_result(self._route(keys, views, deadline, origins))
        return _WriterFuture(future, self)

    def _put(
        self,
        keys: Sequence[bytes],
        views: list[memoryview],
        origins: Sequence[BlockOrigin | None] | None,
        future: concurrent.futures.Future[ops.PutResult],
        deadline: float,
    ) -> None:
        """Put through the local node: its COMMIT sent, or the whole put done."""
        conn = self._connection(deadline)
        num_bytes = writes.arena_bytes_of([len(v) for v in views])
        fits = conn.arena is not None and conn.area.fits(num_bytes)
        if not fits:  # what comes next waits for its own reply: read those due first,
            self._drain(conn, 0, deadline)  # which may say where a fresh area is
            fits = conn.arena is not None and conn.area.fits(num_bytes)
        try:
            outcome = conn.run(self._put_op(conn, keys, views, origins, fits), deadline)
        except BaseException as exc:
            if conn.broken:
                self._fail_due(conn, exc)
            raise
        if isinstance(outcome, ops.PutResult):
            future.set_result(outcome)
        else:
            self._due.append((outcome, future))
            self._drain(conn, 1, deadline)

    def _put_op(
        self,
        conn: Connection,
        keys: Sequence[bytes],
        views: list[memoryview],
        origins: Sequence[BlockOrigin | None] | None,
        fits: bool,
    ) -> ops.Op_[ops.PutResult | writes.SentCommit]:
        """The put's operation: a COMMIT sent into the area (``fits``: it has room, decided
        once, before: only then may replies still be due), or a whole put."""
        arena, area = conn.arena, conn.area
        sizes = [len(v) for v in views]
        staged = yield from writes.stage_write(
            keys, sizes, arena, area, copied=True, area_fits=fits or None, area_batches=AREA_BATCHES
        )
        yield from writes.fill_staged(staged, views, self._local.copier)
        if staged.backing is writes.Backing.AREA:
            return (
                yield from writes.send_in_area(staged, area, self._replicate, origins, keep=True)
            )
        if staged.nothing_staged:
            return ops.PutResult(staged.statuses)
        arena_bytes = len(arena or b"")
        return (
            yield from writes.commit_staged(staged, area, arena_bytes, self._replicate, origins)
        )

    def flush(self, timeout: float | None = None) -> None:
        """Read every reply due: each put's future is ready after this."""
        with self._lock:
            if self._conn is not None:
                deadline = time.monotonic() + (timeout if timeout is not None else self._timeout)
                self._drain(self._conn, 0, deadline)

    def close(self) -> None:
        """Flush, then give the connection back to the client."""
        try:
            self.flush()
        finally:
            with self._lock:
                self._closed = True
                if self._conn is not None:  # nothing due on it: a failed read dropped it
                    self._local.release(self._conn)
                    self._conn = None

    @property
    def _local(self) -> NodeClient:
        if self._node is None:
            raise UsageError("this writer has no local node")
        return self._node

    def _connection(self, deadline: float) -> Connection:
        if self._conn is None:
            self._conn = self._local.hold(max(deadline - time.monotonic(), 0.001))
        return self._conn

    def _drain(self, conn: Connection, leave: int, deadline: float) -> None:
        """Read replies until ``leave`` are due."""
        while len(self._due) > leave:
            sent, future = self._due[0]
            try:
                result = conn.run(
                    writes.commit_reply(sent, conn.area, len(conn.arena or b"")), deadline
                )
            except StoreError as exc:  # the node refused that COMMIT; the connection is fine
                self._due.popleft()
                conn.area.area_id = 0  # ask the node again where to write
                future.set_exception(exc)
                continue
            except BaseException as exc:
                conn.broken = True  # a reply half read, or none: the stream is lost
                self._fail_due(conn, exc)
                raise
            self._due.popleft()
            future.set_result(result)

    def _fail_due(self, conn: Connection, error: BaseException) -> None:
        """The connection broke: every reply due is lost (their futures get ``error``), and
        the connection goes back to the client, which closes it."""
        while self._due:
            _, future = self._due.popleft()
            future.set_exception(error)
        self._conn = None
        self._local.release(conn)
