"""Zero-copy leases: fill blocks in place, or read them in place.

A :class:`WriteLease` reserves space and hands out writable views; the caller writes its
blocks straight into them (on the node's host these are arena memory, so an engine copies
its KV cache into the pool with no staging buffer), then ``commit()`` checksums and
publishes them atomically.  A :class:`ReadLease` pins blocks, verifies their checksums and
hands out read-only views until ``release()``.

Lifecycle: ``open`` → use ``views`` → ``commit()`` / ``abort()`` (write) or ``release()``
(read).  Both are context managers that abort / release on exit.  A lease holds one
connection of the client for its life (a reservation or a pin belongs to a connection),
and the node reclaims what a lease holds when its lease time runs out.

Off the node's host, the views are private buffers: ``commit()`` streams them to the node
and ``open`` of a read lease receives them; the interface is the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool import checksum as ck
from kvpool.errors import Status, UsageError

from . import ops
from .connection import Connection
from .node import NodeClient

WRITE_LEASE_MS = 30_000
READ_LEASE_MS = 10_000


def _deadline(node: NodeClient, timeout: float | None) -> float:
    return time.monotonic() + (timeout if timeout is not None else node.config.timeout_s)


def _extent(views: Sequence[memoryview | None], offsets: Sequence[int], base: Any) -> Any:
    """One view over all the views if they are adjacent in ``base``, else ``None``."""
    present = [(o, len(v)) for v, o in zip(views, offsets, strict=True) if v is not None]
    # Views adopted from other nodes have no place in ``base`` (offset -1).
    if not present or len(present) != len(views) or any(o < 0 for o, _ in present):
        return None
    start = present[0][0]
    cursor = start
    for offset, size in present:
        if offset != cursor:
            return None
        cursor += size
    return base[start:cursor]


class WriteLease:
    """Reserved space to fill in place, then commit."""

    def __init__(
        self,
        node: NodeClient,
        keys: Sequence[bytes],
        statuses: list[Status],
        views: list[memoryview | None],
        offsets: list[int],
        base: Any,
        conn: Connection | None,
        reservation_id: int,
        replicate: bool,
    ) -> None:
        self.node = node
        self.keys = list(keys)
        self.statuses = statuses
        self.views = views
        self.offsets = offsets
        self._base = base
        self._conn = conn
        self._reservation_id = reservation_id
        self._replicate = replicate
        self._done = False
        self._send: (
            Callable[[list[bytes], list[memoryview], float | None], ops.PutResult] | None
        ) = None

    @classmethod
    def buffered(
        cls,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        send: Callable[[list[bytes], list[memoryview], float | None], ops.PutResult],
    ) -> WriteLease:
        """A lease over private buffers (one contiguous area) that ``send`` publishes."""
        area = memoryview(bytearray(sum(sizes)))
        views: list[memoryview | None] = []
        offsets = []
        cursor = 0
        for size in sizes:
            views.append(area[cursor : cursor + size])
            offsets.append(cursor)
            cursor += size
        lease = cls(None, keys, [Status.OK] * len(keys), views, offsets, area, None, 0, False)  # type: ignore[arg-type]
        lease._send = send
        return lease

    @classmethod
    def open(
        cls,
        node: NodeClient,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        replicate: bool,
        timeout: float | None,
    ) -> WriteLease:
        if len(keys) != len(sizes):
            raise UsageError(f"{len(keys)} keys but {len(sizes)} sizes")
        deadline = _deadline(node, timeout)
        conn: Connection | None = node.hold(timeout)
        assert conn is not None
        try:
            if conn.arena is None:
                # Another host: private buffers, sent on commit.
                node.release(conn)
                return cls.buffered(
                    keys, sizes, lambda ks, vs, t: node.put(ks, vs, replicate=replicate, timeout=t)
                )
            reserved = conn.run(ops.reserve(keys, sizes, WRITE_LEASE_MS), deadline)
        except BaseException:
            node.release(conn)
            raise
        arena = conn.arena
        statuses = ops._statuses(reserved.statuses)
        views = []
        for status, offset, size in zip(statuses, reserved.offsets, sizes, strict=True):
            ok = status is Status.OK and offset >= 0 and offset + size <= len(arena)
            views.append(arena[offset : offset + size] if ok else None)
        if not reserved.reservation_id:
            node.release(conn)
            conn = None
        return cls(
            node,
            keys,
            statuses,
            views,
            list(reserved.offsets),
            arena,
            conn,
            reserved.reservation_id,
            replicate,
        )

    @property
    def is_shm(self) -> bool:
        return self._send is None

    def extent(self) -> memoryview | None:
        """All the views as one adjacent region, if they are (so one copy fills them)."""
        return _extent(self.views, self.offsets, self._base)

    def commit(self, timeout: float | None = None) -> ops.PutResult:
        """Checksum the filled views and publish them; returns a status per key."""
        if self._done:
            raise UsageError("lease already committed or aborted")
        self._done = True
        if self._send is not None:
            views = [v for v in self.views if v is not None]
            keys = [k for k, v in zip(self.keys, self.views, strict=True) if v is not None]
            return self._send(keys, views, timeout)
        if self._conn is None:  # nothing was reserved
            return ops.PutResult(self.statuses)
        deadline = _deadline(self.node, timeout)
        conn = self._conn
        assert conn is not None
        try:
            checksums = [ck.checksum(v) if v is not None else None for v in self.views]
            committed = conn.run(
                ops.commit(self._reservation_id, checksums, self._replicate), deadline
            )
        finally:
            self.node.release(conn)
            self._conn = None
        statuses = list(self.statuses)
        for i, status in enumerate(committed):
            if statuses[i] is Status.OK:
                statuses[i] = status
        return ops.PutResult(statuses)

    def abort(self) -> None:
        """Give the reserved space back without publishing anything."""
        if self._done:
            return
        self._done = True
        if self._conn is not None:
            try:
                self._conn.run(ops.abort(self._reservation_id), _deadline(self.node, None))
            finally:
                self.node.release(self._conn)
                self._conn = None

    def __enter__(self) -> WriteLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class ReadLease:
    """Pinned, verified blocks to read in place, then release."""

    def __init__(
        self,
        node: NodeClient,
        keys: Sequence[bytes],
        statuses: list[Status],
        views: list[memoryview | None],
        offsets: list[int],
        base: Any,
        conn: Connection | None,
        pin_id: int,
    ) -> None:
        self.node = node
        self.keys = list(keys)
        self.statuses = statuses
        self.views = views
        self.offsets = offsets
        self._base = base
        self._conn = conn
        self._pin_id = pin_id

    @classmethod
    def open(
        cls, node: NodeClient, keys: Sequence[bytes], prefix: bool, timeout: float | None
    ) -> ReadLease:
        deadline = _deadline(node, timeout)
        conn: Connection | None = node.hold(timeout)
        assert conn is not None
        views: list[memoryview | None] = []
        if conn.arena is None:
            node.release(conn)
            result = node.get(keys, None, prefix=prefix, timeout=timeout)
            views = [memoryview(v) if v is not None else None for v in result.values]
            sizes = [len(v) if v is not None else 0 for v in views]
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            return cls(node, keys, result.statuses, views, offsets, None, None, 0)
        try:
            pinned = conn.run(ops.pin(keys, prefix, READ_LEASE_MS), deadline)
            arena = conn.arena
            statuses = ops._statuses(pinned.statuses)
            corrupt: list[bytes] = []
            for i, (status, offset, size) in enumerate(
                zip(statuses, pinned.offsets, pinned.sizes, strict=True)
            ):
                if status is not Status.OK or offset < 0 or offset + size > len(arena):
                    views.append(None)
                    continue
                view = arena[offset : offset + size]
                if ck.checksum(view) != pinned.checksums[i]:
                    statuses[i] = Status.CHECKSUM_MISMATCH
                    corrupt.append(keys[i])
                    views.append(None)
                else:
                    views.append(view.toreadonly())
            if corrupt:
                conn.run(ops.report_corrupt(corrupt), deadline)
        except BaseException:
            node.release(conn)
            raise
        if not pinned.pin_id:
            node.release(conn)
            conn = None
        return cls(node, keys, statuses, views, list(pinned.offsets), arena, conn, pinned.pin_id)

    @classmethod
    def empty(cls, keys: Sequence[bytes]) -> ReadLease:
        """A lease holding nothing yet (no local node, or it is down)."""
        n = len(keys)
        return cls(None, keys, [Status.NOT_FOUND] * n, [None] * n, [-1] * n, None, None, 0)  # type: ignore[arg-type]

    def adopt(self, index: int, view: memoryview) -> None:
        """Hold a verified block fetched from elsewhere (another node) at ``index``."""
        self.statuses[index] = Status.OK
        self.views[index] = view
        self.offsets[index] = -1

    @property
    def num_prefix(self) -> int:
        """How many leading keys have verified views."""
        for i, view in enumerate(self.views):
            if view is None:
                return i
        return len(self.views)

    def extent(self, num: int | None = None) -> memoryview | None:
        """The first ``num`` views (default: all) as one adjacent region, if they are.  It is
        writable memory of the arena, for zero-copy use by tensor libraries that want a
        writable buffer: never write through it."""
        num = len(self.views) if num is None else num
        if self._base is None:
            return None
        return _extent(self.views[:num], self.offsets[:num], self._base)

    def release(self) -> None:
        """Drop the pins; the views must not be used afterwards."""
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        try:
            conn.run(ops.unpin(self._pin_id), _deadline(self.node, None))
        finally:
            self.node.release(conn)

    def __enter__(self) -> ReadLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
