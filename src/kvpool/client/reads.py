"""How a batch of blocks is read, and the arena slots both directions use (:class:`Slots`).

- Without a round trip: ``listed_slots`` finds every key in the node's shared directory
  (:mod:`kvpool.directory`) → read → ``still_held`` (no entry's generation moved, so no
  block's memory was handed out meanwhile) → ``ops.touch``, which needs no reply.  A key
  the directory does not list, or a copy that raced a removal, sends the whole batch down
  the pinned path.
- Pinned: ``pin_slots`` → read → ``verify_slots`` → ``ops.unpin``; blocks the node said
  are below DRAM (a read larger than DRAM: it had no room to bring them up) are then
  received with a GET on the same connection, straight into their buffers.  A sealed block is
  copied without hashing it again: the node hashed those very bytes, nothing writes a
  committed block, and the pin keeps its memory.  What a reader still checks is that the
  pin held: a copy that ended past the pin's lease (which began no earlier than the PIN
  was sent) is hashed after all.  Unsealed blocks (adopted at a warm restart), and every
  block when the client asks for it (``verify_reads``), are hashed as they are read.
- Off the node's host: a GET received over the socket, each block verified as it arrives.

:func:`open_read` decides among these.  ``get_blocks`` runs a whole get in one op
(``Client.get``); a read transaction (:mod:`kvpool.client.transactions`) runs
:func:`read_in_place` and, at its end, :func:`end_read`.  The write side is
:mod:`kvpool.client.writes`.  Slots are checked against the arena, and statuses merged,
only here and there.  Like :mod:`kvpool.client.ops`, this is free of I/O: operations yield
effects.
"""

from __future__ import annotations

import time
from collections.abc import MutableSequence, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpool import checksum as ck
from kvpool.buffers import arena_views
from kvpool.directory import DirectoryReader, Located
from kvpool.errors import ProtocolError, Status
from kvpool.keys import MIN_COLUMN_KEYS
from kvpool.protocol.messages import Op, PinRequest, PinResponse

from .copier import Copier
from .ops import (
    Compute,
    GetResult,
    Op_,
    Recv,
    Request,
    check_len,
    destinations,
    get_result,
    get_stream,
    report_corrupt,
    statuses_of,
    touch,
    unpin,
)


@dataclass(slots=True)
class Slots:
    """Arena slots of a batch that a node reserved (to fill) or pinned (to read), or that
    its directory listed (to read, ``locations`` set).

    ``slot_id`` is the reservation or pin id (0: nothing held); per key, ``statuses``,
    ``offsets`` and ``views`` (the slot's arena memory, ``None`` where the status is not
    OK); ``checksums`` are the stored blocks' (pins only); ``lease_ms`` is the lease the
    node granted.
    """

    keys: list[bytes]
    slot_id: int
    statuses: list[Status]
    offsets: list[int]
    views: MutableSequence[memoryview | None]
    checksums: list[int]
    lease_ms: int
    sealed: list[bool] = field(default_factory=list)  # pins only: see the module's notes
    held_until: float = 0.0  # pins only: the lease's end, at the latest (time.monotonic)
    directory: DirectoryReader | None = None  # listed slots only: where they were found
    located: Located | None = None
    received: GetResult | None = None  # received over the socket (no arena): the outcome
    # Pins only: per key, not in the arena but below it, where DRAM had no room for it: a
    # GET streams it from there (empty: none is).
    below: list[bool] = field(default_factory=list)

    def must_verify(self, verify_all: bool) -> list[bool]:
        """Per key: whether its bytes must be hashed as they are read."""
        if verify_all or len(self.sealed) != len(self.keys):
            return [True] * len(self.keys)
        return [not sealed for sealed in self.sealed]

    @property
    def still_held(self) -> bool:
        """Whether what was read from the views is surely good: the pin's lease has not run
        out yet, or no listed block was withdrawn since it was found."""
        if self.directory is not None and self.located is not None:
            return self.directory.unchanged(self.located)
        return not self.slot_id or time.monotonic() < self.held_until


def slot_views(
    statuses: list[Status], offsets: Sequence[int], sizes: Sequence[int], arena: memoryview
) -> MutableSequence[memoryview | None]:
    """The arena memory of each OK slot (None elsewhere); a slot outside the arena breaks
    the protocol."""
    if len(statuses) < MIN_COLUMN_KEYS:
        few: list[memoryview | None] = []
        for status, offset, size in zip(statuses, offsets, sizes, strict=True):
            if status is not Status.OK:
                few.append(None)
            elif offset < 0 or offset + size > len(arena):
                raise ProtocolError(f"node handed out a slot outside its arena: {offset}+{size}")
            else:
                few.append(arena[offset : offset + size])
        return few
    ok = np.array([status is Status.OK for status in statuses], dtype=bool)
    starts = np.asarray(offsets, dtype=np.int64)
    ends = starts + np.asarray(sizes, dtype=np.int64)
    outside = ok & ((starts < 0) | (ends > len(arena)))
    if outside.any():
        i = int(np.argmax(outside))
        raise ProtocolError(f"node handed out a slot outside its arena: {offsets[i]}+{sizes[i]}")
    views = arena_views(arena, list(offsets), list(sizes))
    for i in np.flatnonzero(~ok).tolist():
        views[i] = None
    return views


def listed_slots(
    keys: Sequence[bytes], arena: memoryview, directory: DirectoryReader
) -> Slots | None:
    """Every key's block as the directory lists it now, or ``None`` if one is not listed."""
    located = directory.find_all(keys)
    if located is None:
        return None
    n = len(keys)
    offsets = located.offsets.tolist()
    return Slots(
        list(keys),
        0,
        [Status.OK] * n,
        offsets,
        arena_views(arena, offsets, located.sizes.tolist()),
        [],
        0,
        sealed=[True] * n,
        directory=directory,
        located=located,
    )


def pin_slots(
    keys: Sequence[bytes], arena: memoryview, prefix: bool, lease_ms: int = 0, wait_ms: int = 0
) -> Op_[Slots]:
    """Pin the stored blocks among ``keys`` (only the leading run with ``prefix``)."""
    request = PinRequest(keys=list(keys), prefix=prefix, lease_ms=lease_ms, wait_ms=wait_ms)
    sent = time.monotonic()  # the node starts the lease after this, on the same clock
    yield Request(Op.PIN, request)
    response, _ = yield Recv(Op.PIN, PinResponse)
    for what in ("statuses", "offsets", "sizes", "checksums"):
        check_len(what, getattr(response, what), len(keys))
    statuses = statuses_of(response.statuses)
    views = slot_views(statuses, response.offsets, response.sizes, arena)
    return Slots(
        list(keys),
        response.pin_id,
        statuses,
        list(response.offsets),
        views,
        list(response.checksums),
        response.lease_ms,
        list(response.sealed) if len(response.sealed) == len(keys) else [],
        sent + response.lease_ms / 1000,
        below=list(response.below) if len(response.below) == len(keys) else [],
    )


def verify_slots(keys: Sequence[bytes], slots: Slots, checksums: Sequence[int | None]) -> Op_[None]:
    """Mark every pinned block whose bytes hashed to something else (``checksums``, None
    where not read) as CHECKSUM_MISMATCH, and report them so the node drops them."""
    corrupt = []
    for i, got in enumerate(checksums):
        if got is not None and got != slots.checksums[i]:
            slots.statuses[i] = Status.CHECKSUM_MISMATCH
            slots.views[i] = None
            corrupt.append(keys[i])
    if corrupt:
        yield from report_corrupt(corrupt)


def _copy_out(
    copier: Copier, slots: Slots, targets: list[memoryview | None], verify: list[bool]
) -> list[int | None] | BaseException:
    """Copy each block into its target, hashing those that need it (and, for a pin that ran
    out meanwhile, every one); the checksums, or what the copy raised."""
    try:
        checksums = copier.copy(targets, slots.views, verify)  # (each target is its size)
        if slots.slot_id and not slots.still_held:  # memory may have been handed out
            checksums = [
                c if c is not None or t is None else ck.checksum(t)
                for c, t in zip(checksums, targets, strict=True)
            ]
        return checksums
    except BaseException as exc:  # reported after the pin is dropped
        return exc


def open_read(
    keys: Sequence[bytes],
    dsts: Sequence[memoryview] | None,
    arena: memoryview | None,
    directory: DirectoryReader | None,
    prefix: bool,
    wait_ms: int,
) -> Op_[Slots]:
    """How a batch is read: the one place that decides it.  Off the node's host, the blocks
    are received over the socket (into ``dsts``, else private buffers) and verified as they
    arrive; on it, every key the shared ``directory`` lists is read with no round trip;
    else the stored blocks are pinned (only the leading run with ``prefix``)."""
    if arena is None:
        result = yield from get_stream(keys, dsts, prefix, wait_ms)
        return _received_slots(keys, dsts, result)
    listed = listed_slots(keys, arena, directory) if directory is not None else None
    if listed is not None:
        return listed
    return (yield from pin_slots(keys, arena, prefix, wait_ms=wait_ms))


def _received_slots(
    keys: Sequence[bytes], dsts: Sequence[memoryview] | None, result: GetResult
) -> Slots:
    views: list[memoryview | None] = []
    for i, (status, size) in enumerate(zip(result.statuses, result.sizes, strict=True)):
        if status is not Status.OK:
            views.append(None)
        elif dsts is not None:
            views.append(dsts[i][:size])
        else:
            views.append(memoryview(result.values[i] or b""))
    n = len(keys)
    return Slots(list(keys), 0, result.statuses, [-1] * n, views, [], 0, received=result)


def end_read(slots: Slots) -> Op_[None]:
    """Let go of what a read held: tell the node of blocks read through its directory, or
    drop the pin."""
    if slots.directory is not None:
        yield from touch(slots.keys)
    elif slots.slot_id:
        yield from unpin(slots.slot_id)


def read_in_place(
    keys: Sequence[bytes],
    arena: memoryview | None,
    directory: DirectoryReader | None,
    prefix: bool,
    wait_ms: int,
    verify_all: bool,
) -> Op_[Slots]:
    """Open a read whose views are read where they are (a read transaction): pinned blocks
    that need it are hashed in place and verified before any view is handed out; listed
    ones are reported read at once (their views stay good while ``still_held``)."""
    slots = yield from open_read(keys, None, arena, directory, prefix, wait_ms)
    if slots.received is not None:
        return slots
    if slots.directory is not None:
        yield from end_read(slots)
    else:
        verify = slots.must_verify(verify_all)
        checksums = yield Compute(lambda: _hash_in_place(slots.views, verify))
        yield from verify_slots(keys, slots, checksums)
        below = [i for i, is_below in enumerate(slots.below) if is_below]
        if below:  # not in the arena: received into private buffers, read from there
            sizes = [0] * len(keys)
            yield from _get_below(keys, None, below, slots.statuses, sizes, slots.views, wait_ms)
    slots.views = [v.toreadonly() if v is not None else None for v in slots.views]
    return slots


def _hash_in_place(views: Sequence[memoryview | None], verify: Sequence[bool]) -> list[int | None]:
    return [
        ck.checksum(v) if v is not None and hashed else None
        for v, hashed in zip(views, verify, strict=True)
    ]


def get_blocks(
    keys: Sequence[bytes],
    dsts: Sequence[memoryview] | None,
    arena: memoryview | None,
    directory: DirectoryReader | None,
    prefix: bool,
    wait_ms: int = 0,
    verify_all: bool = False,
    copier: Copier | None = None,
) -> Op_[GetResult]:
    """A get as one op: open the read, copy the blocks out (hashing those that need it),
    let go, verify.  A copy from the directory that raced a removal is done again through
    a pin."""
    copier = copier or Copier(1)
    slots = yield from open_read(keys, dsts, arena, directory, prefix, wait_ms)
    if slots.received is not None:
        return slots.received
    if slots.directory is not None:
        sizes = [len(v) if v is not None else 0 for v in slots.views]
        targets = destinations(dsts, sizes, slots.statuses)
        copied = yield Compute(
            lambda: _copy_out(copier, slots, targets, [False] * len(keys)), sum(sizes)
        )
        if isinstance(copied, BaseException):
            raise copied
        if slots.still_held:
            yield from end_read(slots)
            return get_result(slots.statuses, sizes, targets, dsts is None)
        slots = yield from open_read(keys, dsts, arena, None, prefix, wait_ms)
    return (yield from _get_pinned(keys, dsts, slots, verify_all, copier, wait_ms))


def _get_pinned(
    keys: Sequence[bytes],
    dsts: Sequence[memoryview] | None,
    slots: Slots,
    verify_all: bool,
    copier: Copier,
    wait_ms: int,
) -> Op_[GetResult]:
    sizes = [len(v) if v is not None else 0 for v in slots.views]
    targets = destinations(dsts, sizes, slots.statuses)
    verify = slots.must_verify(verify_all)
    checksums: list[int | None] | BaseException = [None] * len(keys)
    if slots.slot_id:
        checksums = yield Compute(lambda: _copy_out(copier, slots, targets, verify), sum(sizes))
        yield from end_read(slots)
    if isinstance(checksums, BaseException):
        raise checksums
    yield from verify_slots(keys, slots, checksums)
    below = [i for i, is_below in enumerate(slots.below) if is_below]
    if below:
        yield from _get_below(keys, dsts, below, slots.statuses, sizes, targets, wait_ms)
    return get_result(slots.statuses, sizes, targets, dsts is None)


def _get_below(
    keys: Sequence[bytes],
    dsts: Sequence[memoryview] | None,
    below: list[int],
    statuses: list[Status],
    sizes: list[int],
    targets: MutableSequence[memoryview | None],
    wait_ms: int,
) -> Op_[None]:
    """Receive the blocks at ``below`` with a GET, each into its buffer, and put what came
    into ``statuses``, ``sizes`` and ``targets``."""
    buffers = [dsts[i] for i in below] if dsts is not None else None
    got = yield from get_stream([keys[i] for i in below], buffers, False, wait_ms)
    for j, i in enumerate(below):
        statuses[i] = got.statuses[j]
        if got.statuses[j] is not Status.OK:
            continue
        sizes[i] = got.sizes[j]
        if buffers is not None:
            targets[i] = buffers[j][: got.sizes[j]]
        else:
            targets[i] = memoryview(got.values[j] or bytearray())
