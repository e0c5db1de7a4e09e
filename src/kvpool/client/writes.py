"""How a batch of blocks is written: the one decision of its path (:func:`stage_write`),
and the same-host writes into the node's arena.

- The writer hashes each block as it copies it in, over a few threads
  (:class:`~kvpool.client.copier.Copier`), and its COMMIT carries the checksums, so the node
  publishes the blocks at once, sealed, with no second pass over them.  A process that
  maps the arena can write any of it, so trusting its checksums trusts it with nothing
  more.  Two ways, one round trip or two:

  - Into the connection's write area (:class:`WriteArea`, :mod:`kvpool.store.areas`):
    copy the blocks one after another at its front, then one COMMIT names their keys and
    sizes.  A connection asks for an area (``AREA``, once in many puts) when it has none
    that fits.  The area is written only while at least half its lease is left (each
    commit renews it), so a copy ends long before the node could hand that memory to
    anyone else.  ``send_in_area`` and ``commit_reply`` are the two halves, which a
    :class:`~kvpool.client.writer.Writer` runs a put apart.
  - ``reserve_slots`` → fill → ``commit_slots`` (or ``ops.abort``): where the node had no
    area free, for a batch too large for one, and for write transactions filled in place.
    The bytes of those are written by the caller (or a DMA engine), not copied here, so
    their COMMIT carries no checksums unless the caller gives them, and the node hashes
    (seals) those blocks itself (:mod:`kvpool.node.sealing`).
- Off the node's host a put streams the caller's buffers over the socket (hashing each
  block as it goes), and a transaction filled in place gets private buffers that are sent
  the same way at its commit.

:func:`stage_write` decides among these (:class:`Backing`).  ``put_blocks`` runs a whole
put in one op (``Client.put``; the writer runs ``stage_write`` → ``fill_staged`` →
``send_in_area``, its COMMIT's reply read a put later); a write transaction
(:mod:`kvpool.client.transactions`) runs the same steps across calls.  Like
:mod:`kvpool.client.ops`, this is free of I/O: operations yield effects.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.buffers import arena_views
from kvpool.config import AREA_SHARE, PAGE_BYTES, page_bytes, pages_of
from kvpool.errors import ProtocolError, Status
from kvpool.keys import MIN_COLUMN_KEYS, BlockOrigin
from kvpool.protocol.messages import (
    MAX_AREA_BYTES,
    AreaRequest,
    AreaResponse,
    CommitRequest,
    CommitResponse,
    Op,
    ReserveRequest,
    ReserveResponse,
)

from .copier import Copier
from .ops import (
    Compute,
    Op_,
    PutResult,
    Recv,
    Request,
    abort,
    check_len,
    put_stream,
    statuses_of,
)
from .reads import Slots, slot_views

# A connection asks for an area twice as large as the batch that needs one (at least
# MIN_AREA_BYTES): the node swaps in a fresh one, in a COMMIT's reply, whenever the rest
# runs short, so a larger area would only keep more memory idle.
MIN_AREA_BYTES = 4 << 20
AREA_RETRY_S = 1.0  # after the node had none free, puts reserve for this long


@dataclass(slots=True)
class WriteArea:
    """A connection's write area: ``num_bytes`` of free arena memory at ``offset``, held
    until ``held_until`` at the latest (``time.monotonic``; ``area_id`` 0: none)."""

    area_id: int = 0
    offset: int = 0
    num_bytes: int = 0
    lease_s: float = 0.0
    held_until: float = 0.0
    refused_until: float = 0.0  # the node had none free: not asked again before then

    def fits(self, num_bytes: int) -> bool:
        """Whether ``num_bytes`` of blocks can go in now, with half the lease to spare."""
        return (
            bool(self.area_id)
            and num_bytes <= self.num_bytes
            and time.monotonic() + self.lease_s / 2 < self.held_until
        )

    def places(self, sizes: Sequence[int]) -> list[int]:
        """Where blocks of ``sizes`` go: one after another at the front, page-aligned."""
        if len(sizes) < MIN_COLUMN_KEYS:
            places, offset = [], self.offset
            for size in sizes:
                places.append(offset)
                offset += page_bytes(size)
            return places
        taken = pages_of(np.asarray(sizes, dtype=np.int64)) * PAGE_BYTES
        return (self.offset + np.cumsum(taken) - taken).tolist()

    def update(self, response: AreaResponse | None, arena_bytes: int, sent: float) -> None:
        """Hold the area the node says this connection holds, as of a request sent at
        ``sent`` (which renewed its lease); None: none."""
        self.area_id = 0
        if response is None or not response.area_id:
            return
        if response.offset < 0 or response.offset + response.num_bytes > arena_bytes:
            raise ProtocolError(f"node handed out an area outside its arena: {response.offset}")
        self.offset, self.num_bytes = response.offset, response.num_bytes
        self.lease_s = response.lease_ms / 1000
        self.held_until = sent + self.lease_s
        self.area_id = response.area_id


def arena_bytes_of(sizes: Sequence[int]) -> int:
    """The arena bytes blocks of ``sizes`` take together (whole pages each)."""
    if len(sizes) < MIN_COLUMN_KEYS:
        return sum(map(page_bytes, sizes))
    return int(pages_of(np.asarray(sizes, dtype=np.int64)).sum()) * PAGE_BYTES


def renew_area(area: WriteArea, num_bytes: int, arena_bytes: int, batches: int = 2) -> Op_[None]:
    """Ask for a write area of ``batches`` times ``num_bytes`` in place of the one held
    (less if that is too large, none if ``num_bytes`` is), unless the node had none free a
    moment ago."""
    bound = min(arena_bytes // AREA_SHARE // PAGE_BYTES * PAGE_BYTES, MAX_AREA_BYTES)
    if num_bytes > bound or time.monotonic() < area.refused_until:
        return
    sent = time.monotonic()
    area.area_id = 0
    want = min(max(batches * num_bytes, MIN_AREA_BYTES), bound)
    yield Request(Op.AREA, AreaRequest(num_bytes=want))
    response, _ = yield Recv(Op.AREA, AreaResponse)
    area.update(response, arena_bytes, sent)
    if not area.area_id:
        area.refused_until = sent + AREA_RETRY_S


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
    views = slot_views(statuses, response.offsets, sizes, arena)
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
    replicate: bool,
    origins: Sequence[BlockOrigin | None] | None = None,
    checksums: Sequence[int | None] | None = None,
) -> Op_[PutResult]:
    """Publish the filled slots, with the ``checksums`` of their bytes (None: the node
    hashes them); the statuses of the reservation and of the commit, merged.  ``origins``:
    what each block was computed from (for the node's KV events), if the writer knows."""
    request = CommitRequest(
        reservation_id=slots.slot_id,
        replicate=replicate,
        origins=list(origins) if origins is not None else None,
        checksums=[c or 0 for c in checksums] if checksums is not None else None,
    )
    yield Request(Op.COMMIT, request)
    response, _ = yield Recv(Op.COMMIT, CommitResponse)
    check_len("statuses", response.statuses, len(slots.keys))
    statuses = list(slots.statuses)
    for i, status in enumerate(statuses_of(response.statuses)):
        if statuses[i] is Status.OK:
            statuses[i] = status
    return PutResult(statuses, response.num_not_kept)


class Backing(enum.Enum):
    """What holds a write transaction's blocks until its commit."""

    AREA = "area"  # the front of the connection's write area: one round trip, at commit
    RESERVATION = "reservation"  # slots reserved first: for zero-copy fills, or no area
    BUFFER = "buffer"  # private buffers off the node's host, sent (routed) at commit
    STREAM = "stream"  # the caller's own buffers, streamed over the socket at commit


@dataclass(slots=True)
class StagedWrite:
    """A batch being written: where its blocks go, per key a status and a view to fill
    (``None`` where the key gets no block), and the checksums of what was copied in."""

    backing: Backing
    keys: list[bytes]
    sizes: list[int]
    statuses: list[Status]
    views: Sequence[memoryview | None]
    offsets: list[int]
    slots: Slots | None = None  # a reservation's
    checksums: list[int | None] | None = None  # set by :func:`fill_staged`
    buffer: memoryview | None = None  # private buffers: the one area holding them all

    @property
    def nothing_staged(self) -> bool:
        """Whether no key got a slot (all stored already, or being written)."""
        return self.slots is not None and not self.slots.slot_id

    @classmethod
    def off_host(cls, keys: Sequence[bytes], sizes: Sequence[int], backing: Backing) -> StagedWrite:
        """Blocks kept in memory of this process: private buffers, side by side (one
        allocation), or (a stream) the caller's own, handed over by :func:`fill_staged`."""
        n = len(keys)
        views: list[memoryview | None] = [None] * n
        staged = cls(backing, list(keys), list(sizes), [Status.OK] * n, views, [-1] * n)
        if backing is Backing.BUFFER:
            staged.buffer = memoryview(bytearray(sum(sizes)))
            cursor = 0
            for i, size in enumerate(sizes):
                views[i] = staged.buffer[cursor : cursor + size]
                staged.offsets[i] = cursor
                cursor += size
        return staged


def stage_write(
    keys: Sequence[bytes],
    sizes: Sequence[int],
    arena: memoryview | None,
    area: WriteArea | None,
    *,
    copied: bool,
    area_fits: bool | None = None,
    area_batches: int = 2,
) -> Op_[StagedWrite]:
    """Where a batch is written: the one place that decides it.

    - Off the node's host (no ``arena``): a copied batch (``copied``: the caller's buffers
      are copied in at once) is streamed from the caller's buffers, a batch filled in
      place gets private buffers.
    - On it, a copied batch goes at the front of the connection's write ``area`` where the
      area fits it (renewed if not, unless ``area_fits`` was decided already by a caller
      with replies still due on the connection); a batch filled in place, whose views may
      be held for long, gets reserved slots (the area is written only while half its
      lease is left), and so does a batch no area fits.
    """
    if arena is None:
        return StagedWrite.off_host(keys, sizes, Backing.STREAM if copied else Backing.BUFFER)
    if copied and area is not None:
        if area_fits is None:
            num_bytes = arena_bytes_of(sizes)
            if not area.fits(num_bytes):
                yield from renew_area(area, num_bytes, len(arena), area_batches)
            area_fits = area.fits(num_bytes)
        if area_fits:
            places, block_sizes = area.places(sizes), list(sizes)
            views = arena_views(arena, places, block_sizes)
            statuses = [Status.OK] * len(keys)
            return StagedWrite(Backing.AREA, list(keys), block_sizes, statuses, views, places)
    slots = yield from reserve_slots(keys, sizes, arena)
    return StagedWrite(
        Backing.RESERVATION,
        list(keys),
        list(sizes),
        slots.statuses,
        slots.views,
        slots.offsets,
        slots,
    )


def fill_staged(staged: StagedWrite, values: Sequence[memoryview], copier: Copier) -> Op_[None]:
    """Copy the caller's blocks into the staged views, hashing them as they land (a stream
    takes the caller's buffers as they are).  A failed copy gives reserved slots back."""
    if staged.nothing_staged:
        return
    if staged.backing is Backing.STREAM:
        staged.views = list(values)
        return
    checksums = yield Compute(lambda: _copy_in(copier, staged.views, values), sum(staged.sizes))
    if isinstance(checksums, BaseException):  # an area's front is still free: nothing to undo
        yield from abort_staged(staged)
        raise checksums
    staged.checksums = checksums


def commit_staged(
    staged: StagedWrite,
    area: WriteArea | None,
    arena_bytes: int,
    replicate: bool,
    origins: Sequence[BlockOrigin | None] | None = None,
) -> Op_[PutResult]:
    """Publish a staged batch with its ``checksums`` (None: the node hashes the blocks);
    a status per key.  Private buffers are not this op's: their transaction sends them."""
    if staged.backing is Backing.STREAM:
        views = [v for v in staged.views if v is not None]
        return (yield from put_stream(staged.keys, views, replicate, origins))
    if staged.backing is Backing.RESERVATION and staged.slots is not None:
        if not staged.slots.slot_id:
            return PutResult(staged.statuses)
        return (yield from commit_slots(staged.slots, replicate, origins, staged.checksums))
    if staged.backing is not Backing.AREA or area is None:
        raise ValueError(f"a {staged.backing.value} batch is not committed by an op")
    sent = yield from send_in_area(staged, area, replicate, origins)
    return (yield from commit_reply(sent, area, arena_bytes))


def abort_staged(staged: StagedWrite) -> Op_[None]:
    """Give a staged batch's space back, publishing nothing."""
    if staged.slots is not None and staged.slots.slot_id:  # a reservation's
        yield from abort(staged.slots.slot_id)


def put_blocks(
    keys: Sequence[bytes],
    views: Sequence[memoryview],
    arena: memoryview | None,
    area: WriteArea | None,
    replicate: bool,
    origins: Sequence[BlockOrigin | None] | None = None,
    copier: Copier | None = None,
) -> Op_[PutResult]:
    """A put as one op: stage the batch, copy it in (hashing), commit it."""
    staged = yield from stage_write(keys, [len(v) for v in views], arena, area, copied=True)
    yield from fill_staged(staged, views, copier or Copier(1))
    if staged.nothing_staged:
        return PutResult(staged.statuses)
    return (yield from commit_staged(staged, area, len(arena or b""), replicate, origins))


@dataclass(slots=True)
class SentCommit:
    """A COMMIT of blocks in a write area, sent, its reply not read yet.  ``kept``: the
    ``(area_id, offset, num_bytes)`` the writer goes on with (the node keeps the rest of
    the area where it is), or None (the writer waits for the reply to learn its area)."""

    keys: list[bytes]
    sent: float
    kept: tuple[int, int, int] | None


def send_in_area(
    staged: StagedWrite,
    area: WriteArea,
    replicate: bool,
    origins: Sequence[BlockOrigin | None] | None,
    keep: bool = False,
) -> Op_[SentCommit]:
    """Send the COMMIT of blocks copied in at the front of the write area.  With ``keep``,
    while the rest of the area holds another batch this large, the node is told to keep
    that rest, and ``area`` moves on to it at once."""
    sizes = staged.sizes
    taken = arena_bytes_of(sizes)
    keep = keep and area.num_bytes - taken >= taken
    checksums = staged.checksums
    request = CommitRequest(
        area_id=area.area_id,
        keys=staged.keys,
        sizes=sizes,
        checksums=[c or 0 for c in checksums] if checksums is not None else None,
        replicate=replicate,
        origins=list(origins) if origins is not None else None,
        keep_area=keep,
    )
    sent = time.monotonic()
    yield Request(Op.COMMIT, request)
    if not keep:
        area.area_id = 0  # until the reply says which area this connection holds now
        return SentCommit(staged.keys, sent, None)
    # The lease is not extended here: only a reply says the node renewed it.
    area.offset, area.num_bytes = area.offset + taken, area.num_bytes - taken
    return SentCommit(staged.keys, sent, (area.area_id, area.offset, area.num_bytes))


def commit_reply(sent: SentCommit, area: WriteArea, arena_bytes: int) -> Op_[PutResult]:
    """Read the reply to a COMMIT :func:`send_in_area` sent: its statuses, and the area."""
    response, _ = yield Recv(Op.COMMIT, CommitResponse)
    check_len("statuses", response.statuses, len(sent.keys))
    if sent.kept is None:
        area.update(response.area, arena_bytes, sent.sent)
    else:
        held = response.area
        if held is None or (held.area_id, held.offset, held.num_bytes) != sent.kept:
            raise ProtocolError("the node moved a write area it was told to keep")
        if area.area_id == held.area_id:  # renewed when the node read the COMMIT
            area.held_until = max(area.held_until, sent.sent + held.lease_ms / 1000)
    return PutResult(statuses_of(response.statuses), response.num_not_kept)


def _copy_in(
    copier: Copier, slots: Sequence[memoryview | None], views: Sequence[memoryview]
) -> list[int | None] | BaseException:
    """Copy each block into its slot (None: not written), hashing it as it lands; the
    checksums, or what the copy raised (reported once the slots are let go)."""
    try:
        return copier.copy(slots, views, hashed=True)
    except BaseException as exc:
        return exc
