"""The same-host path: blocks copied straight between the caller's buffers and the node's
arena, with one path per direction, built from :class:`Slots`.

- Writes: ``reserve_slots`` → fill → ``commit_slots`` (or ``ops.abort``).
- Reads: ``pin_slots`` → read → ``verify_slots`` → ``ops.unpin``.

``put_shm`` / ``get_shm`` run them in one call; the leases (:mod:`kvpool.client.leases`) run
them across calls.  Slots are checked against the arena, and statuses merged, only here.
Like :mod:`kvpool.client.ops`, this is free of I/O: operations yield effects.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool import checksum as ck
from kvpool.errors import ProtocolError, Status
from kvpool.keys import BlockOrigin
from kvpool.protocol.messages import (
    CommitRequest,
    Op,
    PinRequest,
    PinResponse,
    ReserveRequest,
    ReserveResponse,
    StatusResponse,
)

from .ops import (
    Compute,
    GetResult,
    Op_,
    PutResult,
    Recv,
    Request,
    abort,
    check_len,
    destinations,
    get_result,
    report_corrupt,
    statuses_of,
    unpin,
)


@dataclass(slots=True)
class Slots:
    """Arena slots of a batch that a node reserved (to fill) or pinned (to read).

    ``slot_id`` is the reservation or pin id (0: nothing held); per key, ``statuses``,
    ``offsets`` and ``views`` (the slot's arena memory, ``None`` where the status is not
    OK); ``checksums`` are the stored blocks' (pins only); ``lease_ms`` is the lease the
    node granted.
    """

    keys: list[bytes]
    slot_id: int
    statuses: list[Status]
    offsets: list[int]
    views: list[memoryview | None]
    checksums: list[int]
    lease_ms: int


def _slot_views(
    statuses: list[Status], offsets: Sequence[int], sizes: Sequence[int], arena: memoryview
) -> list[memoryview | None]:
    """The arena memory of each OK slot; a slot outside the arena breaks the protocol."""
    views: list[memoryview | None] = []
    for status, offset, size in zip(statuses, offsets, sizes, strict=True):
        if status is not Status.OK:
            views.append(None)
        elif offset < 0 or offset + size > len(arena):
            raise ProtocolError(f"node handed out a slot outside its arena: {offset}+{size}")
        else:
            views.append(arena[offset : offset + size])
    return views


def reserve_slots(
    keys: Sequence[bytes], sizes: Sequence[int], arena: memoryview, lease_ms: int = 0
) -> Op_[Slots]:
    """Reserve a slot per key (``lease_ms`` 0: the node's bound)."""
    request = ReserveRequest(keys=list(keys), sizes=list(sizes), lease_ms=lease_ms)
    yield Request(Op.RESERVE, request)
    response, _ = yield Recv(Op.RESERVE, ReserveResponse)
    check_len("offsets", response.offsets, len(keys))
    check_len("statuses", response.statuses, len(keys))
    statuses = statuses_of(response.statuses)
    views = _slot_views(statuses, response.offsets, sizes, arena)
    return Slots(
        list(keys),
        response.reservation_id,
        statuses,
        list(response.offsets),
        views,
        [],
        response.lease_ms,
    )


def commit_slots(
    slots: Slots,
    checksums: Sequence[int | None],
    replicate: bool,
    origins: Sequence[BlockOrigin | None] | None = None,
) -> Op_[PutResult]:
    """Publish the filled slots (a ``None`` checksum drops that one); the statuses of the
    reservation and of the commit, merged.  ``origins``: what each block was computed from
    (for the node's KV events), if the writer knows."""
    request = CommitRequest(
        reservation_id=slots.slot_id,
        checksums=list(checksums),
        replicate=replicate,
        origins=list(origins) if origins is not None else None,
    )
    yield Request(Op.COMMIT, request)
    response, _ = yield Recv(Op.COMMIT, StatusResponse)
    check_len("statuses", response.statuses, len(checksums))
    statuses = list(slots.statuses)
    for i, status in enumerate(statuses_of(response.statuses)):
        if statuses[i] is Status.OK:
            statuses[i] = status
    return PutResult(statuses)


def pin_slots(
    keys: Sequence[bytes], arena: memoryview, prefix: bool, lease_ms: int = 0, wait_ms: int = 0
) -> Op_[Slots]:
    """Pin the stored blocks among ``keys`` (only the leading run with ``prefix``)."""
    request = PinRequest(keys=list(keys), prefix=prefix, lease_ms=lease_ms, wait_ms=wait_ms)
    yield Request(Op.PIN, request)
    response, _ = yield Recv(Op.PIN, PinResponse)
    for what in ("statuses", "offsets", "sizes", "checksums"):
        check_len(what, getattr(response, what), len(keys))
    statuses = statuses_of(response.statuses)
    views = _slot_views(statuses, response.offsets, response.sizes, arena)
    return Slots(
        list(keys),
        response.pin_id,
        statuses,
        list(response.offsets),
        views,
        list(response.checksums),
        response.lease_ms,
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


def put_shm(
    keys: Sequence[bytes],
    views: Sequence[memoryview],
    arena: memoryview,
    replicate: bool,
    origins: Sequence[BlockOrigin | None] | None = None,
) -> Op_[PutResult]:
    """Reserve arena slots, copy the blocks in directly, then commit them."""
    slots = yield from reserve_slots(keys, [len(v) for v in views], arena)
    if not slots.slot_id:
        return PutResult(slots.statuses)

    def copy_in() -> list[int | None] | BaseException:
        try:
            return [
                ck.copy_with_checksum(slot, view) if slot is not None else None
                for slot, view in zip(slots.views, views, strict=True)
            ]
        except BaseException as exc:  # reported after the reservation is aborted
            return exc

    checksums = yield Compute(copy_in, sum(len(v) for v in views))
    if isinstance(checksums, BaseException):
        yield from abort(slots.slot_id)
        raise checksums
    return (yield from commit_slots(slots, checksums, replicate, origins))


def get_shm(
    keys: Sequence[bytes],
    dsts: Sequence[memoryview] | None,
    arena: memoryview,
    prefix: bool,
    wait_ms: int = 0,
) -> Op_[GetResult]:
    """Pin the blocks, copy them straight out of the arena, verify, unpin."""
    slots = yield from pin_slots(keys, arena, prefix, wait_ms=wait_ms)
    sizes = [len(v) if v is not None else 0 for v in slots.views]
    targets = destinations(dsts, sizes, slots.statuses)

    def copy_out() -> list[int | None] | BaseException:
        try:
            return [
                ck.copy_with_checksum(t, v[: len(t)]) if t is not None and v is not None else None
                for t, v in zip(targets, slots.views, strict=True)
            ]
        except BaseException as exc:  # reported after the pin is dropped
            return exc

    checksums: list[int | None] | BaseException = [None] * len(keys)
    if slots.slot_id:
        checksums = yield Compute(copy_out, sum(sizes))
        yield from unpin(slots.slot_id)
    if isinstance(checksums, BaseException):
        raise checksums
    yield from verify_slots(keys, slots, checksums)
    return get_result(slots.statuses, sizes, targets, dsts is None)
