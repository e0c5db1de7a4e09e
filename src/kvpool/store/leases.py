"""The lease ledger: everything that holds the node's memory for a while, in one place.

Kinds of hold (:class:`LeaseKind`), each a book of the ledger:

- ``RESERVATION``: blocks a writer is filling (:meth:`BlockStore.reserve`); ended by a
  commit or an abort, and aborted when it expires or its owner goes away.
- ``PIN``: committed blocks a reader is copying (:meth:`BlockStore.pin`); ended by an
  unpin, dropped when it expires or its owner goes away.
- ``AREA``: a write area a same-host writer puts its next blocks in
  (:mod:`kvpool.store.areas`); renewed by each use, freed when it expires or its owner
  goes away.
- ``HOLD``: a block kept in DRAM for a queued request (:mod:`kvpool.store.holds`); ended
  by the read, released when it lapses.

Owners (who holds a lease):

- a client connection: its number, an ``int`` >= 1, given by the node as it accepts it;
- the node itself: an :class:`Owner` (negative, so never a connection's number):
  ``Owner.REPLICATOR`` pins what it writes through to other nodes, ``Owner.PROMOTER``
  reserves what it copies up from a lower tier (``held``: no lease, it always ends in a
  commit or an abort), ``Owner.PREFETCHER`` holds blocks for queued requests.

Rules:

1. Every lease is granted by the ledger's :class:`~kvpool.limits.LeaseLimits`: whatever a
   caller asks for, it lasts at most the bound of its kind (:meth:`LeaseLedger.grant`).
2. :meth:`LeaseLedger.expire` ends every lease of every kind whose deadline passed, each
   the way its book says (an abort, an unpin, a free, a release), and counts them.
3. :meth:`LeaseLedger.release` ends every lease an owner holds, of every kind (a client
   that went away).
4. Lease ids come from one counter: an id names one lease of one kind.

The ledger keeps the records and the deadlines; the book's ``end`` (given by whoever opens
the book) decides what ending a lease means.  Synchronous, touched from one thread (the
daemon's event loop), as the store is.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from kvpool.limits import LeaseLimits

# An owner id: a client connection's number (>= 1), or one of the node's own Owners.
OwnerId = int


class Owner(enum.IntEnum):
    """The node's own holders of leases, apart from every connection's number."""

    REPLICATOR = -1  # pins of blocks being written through to their home nodes
    PROMOTER = -2  # reservations of blocks being copied up from a lower tier
    PREFETCHER = -3  # holds of blocks that queued requests will read


class LeaseKind(enum.Enum):
    RESERVATION = "reservation"
    PIN = "pin"
    AREA = "area"
    HOLD = "hold"


class Held(Protocol):
    @property
    def owner(self) -> int: ...

    @property
    def deadline(self) -> float: ...


H = TypeVar("H", bound=Held)


class LeaseBook(Generic[H]):
    """The leases of one kind, by id and by owner.  Opened on a ledger
    (:meth:`LeaseLedger.open_book`), which ends them when they expire or their owner goes
    away by calling ``end(lease_id, lease)`` after the book dropped the record."""

    def __init__(self, kind: LeaseKind, end: Callable[[int, H], None]) -> None:
        self.kind = kind
        self._end = end
        self._id_to_held: dict[int, H] = {}
        self._owner_to_ids: dict[int, set[int]] = {}

    def add(self, id_: int, held: H) -> None:
        self._id_to_held[id_] = held
        self._owner_to_ids.setdefault(held.owner, set()).add(id_)

    def get(self, id_: int, owner: int) -> H | None:
        """The lease ``id_``, if ``owner`` holds it."""
        held = self._id_to_held.get(id_)
        if held is None or held.owner != owner:
            return None
        return held

    def pop(self, id_: int, owner: int | None = None) -> H | None:
        """Drop the record of lease ``id_`` and return it, if it is held (by ``owner``, when
        given).  Ending what it held is the caller's job."""
        held = self._id_to_held.get(id_)
        if held is None:
            return None
        if owner is not None and held.owner != owner:
            return None
        del self._id_to_held[id_]
        ids = self._owner_to_ids[held.owner]
        ids.discard(id_)
        if not ids:
            del self._owner_to_ids[held.owner]
        return held

    def ids_of(self, owner: int) -> list[int]:
        return list(self._owner_to_ids.get(owner, ()))

    def values(self) -> list[H]:
        return list(self._id_to_held.values())

    def __len__(self) -> int:
        return len(self._id_to_held)

    def expire(self, now: float) -> int:
        """End every lease whose deadline passed; how many."""
        expired = [i for i, held in self._id_to_held.items() if held.deadline <= now]
        self._end_all(expired)
        return len(expired)

    def release(self, owner: int) -> int:
        """End every lease ``owner`` holds; how many."""
        ids = self.ids_of(owner)
        self._end_all(ids)
        return len(ids)

    def _end_all(self, ids: list[int]) -> None:
        for id_ in ids:
            held = self.pop(id_)
            if held is not None:  # ending one may have ended another
                self._end(id_, held)


class LeaseLedger:
    """Every lease on the node's memory, of every kind, under one set of limits."""

    def __init__(
        self, limits: LeaseLimits | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits or LeaseLimits()
        self.clock = clock
        self._ids = itertools.count(1)
        self._books: dict[LeaseKind, LeaseBook[Held]] = {}
        self.num_expired: dict[LeaseKind, int] = dict.fromkeys(LeaseKind, 0)

    def open_book(self, kind: LeaseKind, end: Callable[[int, H], None]) -> LeaseBook[H]:
        """The book of ``kind``'s leases; ``end`` ends one that expired or whose owner left."""
        if kind in self._books:
            raise ValueError(f"the ledger has a book of {kind.value}s already")
        book: LeaseBook[H] = LeaseBook(kind, end)
        self._books[kind] = book  # type: ignore[assignment]
        return book

    def new_id(self) -> int:
        return next(self._ids)

    def grant(self, kind: LeaseKind, requested_s: float = 0.0) -> float:
        """How long a lease of ``kind`` lasts for a caller that asks ``requested_s`` (rule 1)."""
        limits = self.limits
        if kind is LeaseKind.PIN:
            return limits.pin(requested_s)
        if kind is LeaseKind.HOLD:
            return limits.hold(requested_s)
        return limits.reserve(requested_s)  # reservations and write areas

    def deadline(self, kind: LeaseKind, requested_s: float = 0.0) -> tuple[float, float]:
        """The lease granted for ``requested_s`` and the deadline it gives from now."""
        granted = self.grant(kind, requested_s)
        return granted, self.clock() + granted

    @staticmethod
    def no_deadline() -> float:
        """The deadline of a lease that never expires (the node's own ``held`` copies)."""
        return math.inf

    def expire(self, now: float | None = None) -> int:
        """End every expired lease of every kind (rule 2); how many."""
        when = self.clock() if now is None else now
        total = 0
        for kind, book in self._books.items():
            num = book.expire(when)
            self.num_expired[kind] += num
            total += num
        return total

    def release(self, owner: int) -> int:
        """End every lease ``owner`` holds, of every kind (rule 3); how many."""
        return sum(book.release(owner) for book in self._books.values())

    def count(self, kind: LeaseKind) -> int:
        book = self._books.get(kind)
        return len(book) if book is not None else 0
