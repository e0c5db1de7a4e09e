"""Write and read transactions: a batch of blocks filled, or read, where they lie.

Every write of the client is a :class:`WriteTransaction` and every read a
:class:`ReadTransaction`, run either across calls (here: ``Client.begin_write`` /
``Client.begin_read``, also named ``reserve`` / ``acquire``) or within one call
(``Client.put`` / ``get`` and the writer run the same ops of :mod:`kvpool.client.reads` in one
go, with the copier).  What backs a transaction is decided once per direction:
:func:`~kvpool.client.writes.stage_write` and :func:`~kvpool.client.reads.open_read`.

Write lifecycle: ``begin_write(keys, sizes)`` → fill ``views`` (``None`` where a key gets
no block: already stored, or being written) → ``commit(checksums=None, origins=None)`` or
``abort()``.  On the node's host the views are reserved arena slots: the caller (or a DMA
engine) writes the blocks in place and the node hashes them unless ``checksums`` are given.
Off it they are private buffers, sent at commit through the client's routing (to the local
node, else to the keys' homes), exactly as a put.

Read lifecycle: ``begin_read(keys)`` → read ``views`` (read-only, verified) → check
``still_held`` (no pin ran out, no listed block was withdrawn: else what was read may not
be the block) → ``end()``.  On the node's host, blocks its shared directory lists are read
with no round trip, others are pinned and those the node has not sealed verified; off it
the blocks are received over the socket into private buffers.  In a cluster, gaps are
fetched from other nodes and ``adopt``-ed.

Both are context managers that abort / end on exit.  A transaction that holds a reservation
or a pin holds one connection of the client for its life (they belong to a connection); the
node grants it its own bound (``KVPOOL_RESERVE_LEASE`` / ``KVPOOL_PIN_LEASE``) and
reclaims what it holds when that runs out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.errors import Status, UsageError
from kvpool.keys import BlockOrigin

from . import ops, reads, writes
from .connection import Connection
from .node import NodeClient

SendBlocks = Callable[
    [list[bytes], list[memoryview], float | None, list[BlockOrigin | None] | None],
    ops.PutResult,
]


def _extent(views: Sequence[memoryview | None], offsets: Sequence[int], base: Any) -> Any:
    """One view over all the views if they are adjacent in ``base``, else ``None``."""
    present = [(o, len(v)) for v, o in zip(views, offsets, strict=True) if v is not None]
    # Views received or adopted from other nodes have no place in ``base`` (offset -1).
    if base is None or not present or len(present) != len(views) or any(o < 0 for o, _ in present):
        return None
    start = present[0][0]
    cursor = start
    for offset, size in present:
        if offset != cursor:
            return None
        cursor += size
    return base[start:cursor]


class _HeldConnection:
    """The connection a reservation or a pin belongs to, until the transaction ends."""

    def __init__(self, node: NodeClient, conn: Connection | None):
        self._node = node
        self._conn = conn

    def finish(self, op: ops.Op_[Any], timeout: float | None) -> Any:
        """Run the transaction's last op, then give the connection back (None: done)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return None
        try:
            return conn.run(op, _deadline(self._node, timeout))
        finally:
            self._node.release(conn)


def _deadline(node: NodeClient, timeout: float | None) -> float:
    return time.monotonic() + (timeout if timeout is not None else node.config.timeout_s)


class WriteTransaction:
    """Blocks to fill where they will lie, then commit (see the module)."""

    def __init__(
        self,
        staged: writes.StagedWrite,
        base: Any,
        *,
        send: SendBlocks,
        held: _HeldConnection | None = None,
        replicate: bool = False,
    ) -> None:
        self.keys = staged.keys
        self.statuses = staged.statuses
        self.views = staged.views
        self.offsets = staged.offsets
        self._staged = staged
        self._base = staged.buffer if staged.buffer is not None else base
        self._send = send
        self._held = held
        self._replicate = replicate
        self._done = False

    @classmethod
    def begin(
        cls,
        node: NodeClient,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        replicate: bool,
        timeout: float | None,
        send: SendBlocks,
    ) -> WriteTransaction:
        """Stage ``keys`` on ``node`` (reserved slots on its host, private buffers that
        ``send`` publishes elsewhere)."""
        if len(keys) != len(sizes):
            raise UsageError(f"{len(keys)} keys but {len(sizes)} sizes")
        deadline = _deadline(node, timeout)
        conn = node.hold(timeout)
        try:
            staged = conn.run(
                writes.stage_write(keys, sizes, conn.arena, None, copied=False), deadline
            )
        except BaseException:
            node.release(conn)
            raise
        if staged.slots is None or not staged.slots.slot_id:
            node.release(conn)
            return cls(staged, conn.arena, send=send)
        held = _HeldConnection(node, conn)
        return cls(staged, conn.arena, send=send, held=held, replicate=replicate)

    @classmethod
    def buffered(
        cls, keys: Sequence[bytes], sizes: Sequence[int], send: SendBlocks
    ) -> WriteTransaction:
        """Private buffers that ``send`` publishes (no local node to stage them on)."""
        if len(keys) != len(sizes):
            raise UsageError(f"{len(keys)} keys but {len(sizes)} sizes")
        return cls(writes.StagedWrite.off_host(keys, sizes, writes.Backing.BUFFER), None, send=send)

    @property
    def backing(self) -> writes.Backing:
        """What holds the blocks until the commit."""
        return self._staged.backing

    @property
    def is_shm(self) -> bool:
        """Whether the views are the node's arena memory (else private buffers)."""
        return self._staged.backing is not writes.Backing.BUFFER

    def extent(self) -> memoryview | None:
        """All the views as one adjacent region, if they are (so one copy fills them)."""
        return _extent(self.views, self.offsets, self._base)

    def commit(
        self,
        checksums: Sequence[int | None] | None = None,
        origins: Sequence[BlockOrigin | None] | None = None,
        *,
        timeout: float | None = None,
    ) -> ops.PutResult:
        """Publish the filled views; a status per key.  ``checksums``, per key, of the bytes
        written (None: the node hashes them); ``origins``, per key: what the block was
        computed from (the node's KV events say it to routers), if known."""
        if self._done:
            raise UsageError("transaction already committed or aborted")
        for what, values in (("checksums", checksums), ("origins", origins)):
            if values is not None and len(values) != len(self.keys):
                raise UsageError(f"{len(self.keys)} keys but {len(values)} {what}")
        self._done = True
        kept = list(origins) if origins is not None else None
        if self._staged.backing is writes.Backing.BUFFER:
            return self._send_buffers(timeout, kept)
        if self._held is None:  # nothing was reserved
            return ops.PutResult(self.statuses)
        self._staged.checksums = list(checksums) if checksums is not None else None
        op = writes.commit_staged(self._staged, None, 0, self._replicate, kept)
        result = self._held.finish(op, timeout)
        return result if result is not None else ops.PutResult(self.statuses)

    def _send_buffers(
        self, timeout: float | None, origins: list[BlockOrigin | None] | None
    ) -> ops.PutResult:
        present = [i for i, v in enumerate(self.views) if v is not None]
        blocks = [v for v in self.views if v is not None]
        kept = [origins[i] for i in present] if origins is not None else None
        return self._send([self.keys[i] for i in present], blocks, timeout, kept)

    def abort(self) -> None:
        """Give the staged space back without publishing anything."""
        if not self._done:
            self._done = True
            if self._held is not None:
                self._held.finish(writes.abort_staged(self._staged), None)

    def __enter__(self) -> WriteTransaction:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()


class ReadTransaction:
    """Verified blocks to read where they lie, then end (see the module)."""

    def __init__(self, slots: reads.Slots, base: Any, held: _HeldConnection | None = None) -> None:
        self.keys = slots.keys
        self.statuses = slots.statuses
        self.views = slots.views
        self.offsets = slots.offsets
        self._slots = slots
        self._base = base
        self._held = held

    @classmethod
    def begin(
        cls, node: NodeClient, keys: Sequence[bytes], prefix: bool, timeout: float | None
    ) -> ReadTransaction:
        """Open a read of ``keys`` on ``node`` (only the leading run of stored keys with
        ``prefix``)."""
        deadline = _deadline(node, timeout)
        conn = node.hold(timeout)
        wait_ms = ops.lower_tier_wait_ms(deadline - time.monotonic())
        verify_all = node.config.verify_reads
        try:
            op = reads.read_in_place(keys, conn.arena, conn.directory, prefix, wait_ms, verify_all)
            slots = conn.run(op, deadline)
        except BaseException:
            node.release(conn)  # a broken connection takes its pin with it
            raise
        base = conn.arena if slots.received is None else None
        if not slots.slot_id:
            node.release(conn)
            return cls(slots, base)
        return cls(slots, base, _HeldConnection(node, conn))

    @classmethod
    def empty(cls, keys: Sequence[bytes]) -> ReadTransaction:
        """A transaction holding nothing yet (no local node, or it is down)."""
        n = len(keys)
        slots = reads.Slots(list(keys), 0, [Status.NOT_FOUND] * n, [-1] * n, [None] * n, [], 0)
        return cls(slots, None)

    @property
    def still_held(self) -> bool:
        """Whether what was read from the views is surely the blocks: check it after reading
        them in place, and do not use what was read if it says no (the memory may have
        been reused)."""
        return self._slots.still_held

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

    def end(self) -> None:
        """Let go of the blocks (drop the pin); the views must not be used afterwards."""
        if self._held is not None:
            self._held.finish(reads.end_read(self._slots), None)

    release = end  # the name of a read lease's end

    def __enter__(self) -> ReadTransaction:
        return self

    def __exit__(self, *exc: object) -> None:
        self.end()
