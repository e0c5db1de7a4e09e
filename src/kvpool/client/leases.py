"""Zero-copy leases: fill blocks in place, or read them in place.

A :class:`WriteLease` reserves space and hands out writable views; the caller writes its
blocks straight into them (on the node's host these are arena memory, so an engine copies
its KV cache into the pool with no staging buffer), then ``commit()`` publishes them
atomically (the node hashes them).  A :class:`ReadLease` hands out read-only views of
blocks until ``release()``: on the node's host, blocks its shared directory lists are
taken from there with no round trip, others are pinned and those the node has not sealed
verified (see :mod:`kvpool.client.shm`); ``still_held`` says whether what was read from
the views surely came from the blocks (no entry's generation moved, no pin ran out).

Lifecycle: ``open`` → use ``views`` → ``commit()`` / ``abort()`` (write) or ``release()``
(read).  Both are context managers that abort / release on exit.  A lease holds one
connection of the client for its life (a reservation or a pin belongs to a connection).
The node grants the lease its own bound (``KVPOOL_RESERVE_LEASE`` / ``KVPOOL_PIN_LEASE``)
and reclaims what a lease holds when that runs out.

On the node's host the leases run the same slot operations as ``put`` and ``get``
(:mod:`kvpool.client.ops`), across calls.  Off the node's host the views are private
buffers: ``commit()`` streams them to the node and ``open`` of a read lease receives them;
the interface is the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool import checksum as ck
from kvpool.errors import Status, UsageError
from kvpool.keys import BlockOrigin

from . import ops, shm
from .connection import Connection
from .node import NodeClient

SendBlocks = Callable[
    [list[bytes], list[memoryview], float | None, list[BlockOrigin | None] | None],
    ops.PutResult,
]


def _deadline(node: NodeClient, timeout: float | None) -> float:
    return time.monotonic() + (timeout if timeout is not None else node.config.timeout_s)


def _extent(views: Sequence[memoryview | None], offsets: Sequence[int], base: Any) -> Any:
    """One view over all the views if they are adjacent in ``base``, else ``None``."""
    present = [(o, len(v)) for v, o in zip(views, offsets, strict=True) if v is not None]
    # Views adopted from other nodes have no place in ``base`` (offset -1).
    if base is None or not present or len(present) != len(views) or any(o < 0 for o, _ in present):
        return None
    start = present[0][0]
    cursor = start
    for offset, size in present:
        if offset != cursor:
            return None
        cursor += size
    return base[start:cursor]


def _private(sizes: Sequence[int]) -> tuple[memoryview, list[memoryview | None], list[int]]:
    """One private area holding a buffer per size, side by side."""
    area = memoryview(bytearray(sum(sizes)))
    views: list[memoryview | None] = []
    offsets = []
    cursor = 0
    for size in sizes:
        views.append(area[cursor : cursor + size])
        offsets.append(cursor)
        cursor += size
    return area, views, offsets


class _Lease:
    """What both leases show: per key, a status, a view (``None`` where there is no block)
    and its offset in ``base`` (the arena, or a private area)."""

    def __init__(self, slots: shm.Slots, base: Any) -> None:
        self.keys = slots.keys
        self.statuses = slots.statuses
        self.views = slots.views
        self.offsets = slots.offsets
        self._base = base


class WriteLease(_Lease):
    """Reserved space to fill in place, then commit."""

    def __init__(
        self,
        slots: shm.Slots,
        base: Any,
        commit: Callable[[float | None, list[BlockOrigin | None] | None], ops.PutResult],
        abort: Callable[[], None],
    ) -> None:
        super().__init__(slots, base)
        self._commit = commit
        self._abort = abort
        self._done = False
        self.is_shm = True

    @classmethod
    def buffered(cls, keys: Sequence[bytes], sizes: Sequence[int], send: SendBlocks) -> WriteLease:
        """A lease over private buffers (one contiguous area) that ``send`` publishes."""
        area, views, offsets = _private(sizes)
        n = len(keys)
        slots = shm.Slots(list(keys), 0, [Status.OK] * n, offsets, views, [], 0)

        def commit(
            timeout: float | None, origins: list[BlockOrigin | None] | None
        ) -> ops.PutResult:
            present = [i for i, v in enumerate(views) if v is not None]
            blocks = [v for v in views if v is not None]
            kept = [origins[i] for i in present] if origins is not None else None
            return send([slots.keys[i] for i in present], blocks, timeout, kept)

        lease = cls(slots, area, commit, lambda: None)
        lease.is_shm = False
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
        conn = node.hold(timeout)
        if conn.arena is None:  # another host: private buffers, sent on commit
            node.release(conn)
            return cls.buffered(
                keys,
                sizes,
                lambda ks, vs, t, o: node.put(ks, vs, replicate=replicate, timeout=t, origins=o),
            )
        try:
            slots = conn.run(shm.reserve_slots(keys, sizes, conn.arena), deadline)
        except BaseException:
            node.release(conn)
            raise
        held: list[Connection | None] = [conn if slots.slot_id else None]
        if not slots.slot_id:
            node.release(conn)

        def finish(op: Any, timeout: float | None) -> Any:
            conn = held[0]
            held[0] = None
            if conn is None:
                return None
            try:
                return conn.run(op, _deadline(node, timeout))
            finally:
                node.release(conn)

        def commit(
            timeout: float | None, origins: list[BlockOrigin | None] | None
        ) -> ops.PutResult:
            result = finish(shm.commit_slots(slots, replicate, origins), timeout)
            return result if result is not None else ops.PutResult(slots.statuses)

        return cls(slots, conn.arena, commit, lambda: finish(ops.abort(slots.slot_id), None))

    def extent(self) -> memoryview | None:
        """All the views as one adjacent region, if they are (so one copy fills them)."""
        return _extent(self.views, self.offsets, self._base)

    def commit(
        self, timeout: float | None = None, origins: Sequence[BlockOrigin | None] | None = None
    ) -> ops.PutResult:
        """Publish the filled views; returns a status per key.
        ``origins``, per key: what the block was computed from (the node's KV events say
        it to routers), if known."""
        if self._done:
            raise UsageError("lease already committed or aborted")
        if origins is not None and len(origins) != len(self.keys):
            raise UsageError(f"{len(self.keys)} keys but {len(origins)} origins")
        self._done = True
        return self._commit(timeout, list(origins) if origins is not None else None)

    def abort(self) -> None:
        """Give the reserved space back without publishing anything."""
        if not self._done:
            self._done = True
            self._abort()

    def __enter__(self) -> WriteLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class ReadLease(_Lease):
    """Pinned, verified blocks to read in place, then release."""

    def __init__(self, slots: shm.Slots, base: Any, release: Callable[[], None]) -> None:
        super().__init__(slots, base)
        self._release = release
        self._slots = slots

    @property
    def still_held(self) -> bool:
        """Whether the pins surely still hold: check it after reading the views in place,
        and do not use what was read if it says no (the memory may have been reused)."""
        return self._slots.still_held

    @classmethod
    def open(
        cls, node: NodeClient, keys: Sequence[bytes], prefix: bool, timeout: float | None
    ) -> ReadLease:
        deadline = _deadline(node, timeout)
        conn = node.hold(timeout)
        if conn.arena is None:  # another host: the blocks in private buffers
            node.release(conn)
            result = node.get(keys, None, prefix=prefix, timeout=timeout)
            lease = cls.empty(keys)
            for i, value in enumerate(result.values):
                if value is not None:
                    lease.adopt(i, memoryview(value))
            return lease
        listed = (
            shm.listed_slots(keys, conn.arena, conn.directory)
            if conn.directory is not None
            else None
        )
        if listed is not None:  # no pin: the directory tells whether the reads held
            try:
                conn.run(ops.touch(keys), deadline)
            finally:
                node.release(conn)
            listed.views = [v.toreadonly() if v is not None else None for v in listed.views]
            return cls(listed, conn.arena, lambda: None)
        try:
            wait_ms = ops.lower_tier_wait_ms(deadline - time.monotonic())
            slots = conn.run(shm.pin_slots(keys, conn.arena, prefix, wait_ms=wait_ms), deadline)
            verify = slots.must_verify(node.config.verify_reads)
            checksums = [
                ck.checksum(v) if v is not None and hashed else None
                for v, hashed in zip(slots.views, verify, strict=True)
            ]
            conn.run(shm.verify_slots(keys, slots, checksums), deadline)
        except BaseException:
            node.release(conn)  # the connection is broken, and with it the pin goes
            raise
        slots.views = [v.toreadonly() if v is not None else None for v in slots.views]
        if not slots.slot_id:
            node.release(conn)
            return cls(slots, conn.arena, lambda: None)
        held: list[Connection | None] = [conn]

        def release() -> None:
            conn = held[0]
            held[0] = None
            if conn is not None:
                try:
                    conn.run(ops.unpin(slots.slot_id), _deadline(node, None))
                finally:
                    node.release(conn)

        return cls(slots, conn.arena, release)

    @classmethod
    def empty(cls, keys: Sequence[bytes]) -> ReadLease:
        """A lease holding nothing yet (no local node, or it is down)."""
        n = len(keys)
        slots = shm.Slots(list(keys), 0, [Status.NOT_FOUND] * n, [-1] * n, [None] * n, [], 0)
        return cls(slots, None, lambda: None)

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
        return _extent(self.views[:num], self.offsets[:num], self._base)

    def release(self) -> None:
        """Drop the pins; the views must not be used afterwards."""
        self._release()

    def __enter__(self) -> ReadLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
