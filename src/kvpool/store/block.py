"""A block and its state machine.

::

    reserve ──► RESERVED ──commit(checksum)──► COMMITTED ──delete / evict──► REMOVED
                   │                                                      (memory freed once
                   └──abort / lease timeout / owner gone──► FAILED         the last pin drops)

- RESERVED: memory is allocated and being filled; lookups see the key as *pending*, reads
  never see it, eviction skips it.  A reservation whose lease expires is aborted.
- COMMITTED: visible, atomically, with its checksum.  Readers pin it under a lease;
  eviction skips pinned blocks.
- REMOVED: gone from the index; its memory returns to the allocator when ``num_pins`` is 0.

A committed block lives as a row of the store's index (:mod:`kvpool.store.index`), not as
an object: a :class:`Block` is a pending block, or a copy of a committed one handed out in
flight (to a reader, a spill, an event).
- An evicted block may first be copied out to a lower tier (``BlockStore.spill``), before
  its memory returns to the allocator.
- FAILED: an aborted write; its memory returned at once (nobody could have pinned it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import numpy as np

from kvpool.errors import Status
from kvpool.keys import BlockOrigin


class BlockState(enum.IntEnum):
    RESERVED = 1
    COMMITTED = 2
    REMOVED = 3
    FAILED = 4


class Block(msgspec.Struct, gc=False, eq=False):
    """A block in flight: pending, or a copy of a committed one (committed blocks are rows
    of the index).  Never tracked by the garbage collector (it refers to no object that
    could refer back to it)."""

    key: bytes
    offset: int
    size: int
    state: BlockState = BlockState.RESERVED
    checksum: int = 0
    # The node hashed (or verified) these arena bytes itself: same-host readers need not.
    # Blocks adopted at a warm restart are not, until a reader or the scrubber verifies them.
    sealed: bool = False
    num_pins: int = 0
    num_reads: int = 0  # pins since it was committed (the admission policy's evidence)
    origin: BlockOrigin | None = None  # what it was computed from, if its writer said (events)


@dataclass(slots=True, eq=False)
class Reservation:
    """Blocks one writer is filling, reclaimed if not committed before ``deadline``."""

    reservation_id: int
    owner: int
    blocks: list[Block | None]
    deadline: float


@dataclass(slots=True, eq=False)
class Area:
    """A write area: free arena memory one same-host writer holds, to put the blocks of its
    next writes in, one after another, without asking first; reclaimed if not used again
    before ``deadline`` (each use renews the lease)."""

    area_id: int
    owner: int
    offset: int
    num_bytes: int
    lease_s: float
    deadline: float
    granted_bytes: int  # its size when granted: what a refill asks for


@dataclass(slots=True, eq=False)
class Pin:
    """Blocks one reader is copying (slots of the store's index), protected from eviction
    until ``deadline``."""

    pin_id: int
    owner: int
    slots: np.ndarray  # int64, distinct
    deadline: float


# -- what is told of blocks ---------------------------------------------------------------


class SpillTarget(Protocol):
    """A lower tier that evicted blocks can be handed to."""

    def offer(self, block: Block) -> bool:
        """Copy the block out now (its memory is freed when this returns), or refuse."""


class StoreEvents(Protocol):
    """Told of every block that becomes visible or leaves (the node's KV events)."""

    def stored(self, block: Block) -> None: ...

    def removed(self, block: Block) -> None: ...


@dataclass(slots=True)
class StoreCounters:
    lookup_hits: int = 0
    lookup_misses: int = 0
    get_hits: int = 0
    get_misses: int = 0
    puts: int = 0
    evictions: int = 0
    expired_reservations: int = 0
    expired_pins: int = 0
    corrupt_reports: int = 0
    spilled: int = 0  # evicted blocks a lower tier took
    adopted: int = 0  # blocks found in a surviving arena at start
    retained: int = 0  # blocks given a retention priority (kvpool.retention)
    retention_refused: int = 0  # retention hints past the tenant's account, in blocks


@dataclass(slots=True)
class ReserveResult:
    """Per key, a status and (where it is OK) the reserved block; the lease granted."""

    reservation_id: int
    statuses: list[Status]
    blocks: list[Block | None] = field(default_factory=list)
    lease_s: float = 0.0


@dataclass(slots=True)
class CommitResult:
    """Per key, whether it became visible; the keys that did, and their bytes."""

    statuses: list[Status]
    committed: list[bytes] = field(default_factory=list)
    num_bytes: int = 0


@dataclass(slots=True)
class PinResult:
    """Per key, the pinned block (``None``: not there); the lease granted."""

    pin_id: int
    blocks: list[Block | None]
    lease_s: float = 0.0
