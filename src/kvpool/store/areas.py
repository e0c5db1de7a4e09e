"""Write areas: free arena memory that same-host writers hold, one area per writer, so that
a put needs no round trip before its copy (rule 14 of :mod:`kvpool.store.block_store`).

A writer places the blocks of each put one after another at the front of its area, copies
them in, and names their keys in one COMMIT; the node carves that front off the area with
the allocator (the pieces become the blocks, freed one by one later) and renews the
area's lease.  Once the rest is smaller than what was just taken, the node swaps it for a
fresh area of the size first granted, and says so in the COMMIT's reply: a steady writer
never asks again.  An area is taken only where a free extent is that large now: nothing
is evicted for one, and a writer that gets none reserves its blocks the usual way.  A
writer that copies its next blocks before the node read its COMMIT asks the node to keep
the rest where it is (``keep``), so the node never swaps the memory it is writing.  It is
bounded to a share of the arena, and its memory returns when its lease runs out, its
writer leaves, or the writer asks for another.  Areas are leases of the node's ledger
(:mod:`kvpool.store.leases`, kind ``AREA``), granted as long as a reservation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool.config import AREA_SHARE, PAGE_BYTES, page_bytes, pages_of
from kvpool.errors import BadRequest, LeaseExpired
from kvpool.keys import MIN_COLUMN_KEYS
from kvpool.store.allocator import Allocator
from kvpool.store.block import Area
from kvpool.store.leases import LeaseBook, LeaseKind, LeaseLedger


class WriteAreas:
    def __init__(self, allocator: Allocator, ledger: LeaseLedger):
        self.allocator = allocator
        self.ledger = ledger
        self._book: LeaseBook[Area] = ledger.open_book(LeaseKind.AREA, self._free)
        self.num_bytes = 0  # held by all the areas now

    def grant(self, num_bytes: int, owner: int, lease_s: float = 0.0) -> Area | None:
        """An area of ``num_bytes`` (whole pages) for ``owner``, in place of the one it held,
        if an extent that large is free now."""
        self.release(owner)
        return self._new(num_bytes, owner, lease_s)

    def _new(self, num_bytes: int, owner: int, lease_s: float) -> Area | None:
        size = page_bytes(num_bytes)
        offset = None
        if size <= self.allocator.capacity // AREA_SHARE:
            offset = self.allocator.allocate(size)
        if offset is None:
            return None
        granted, deadline = self.ledger.deadline(LeaseKind.AREA, lease_s)
        area = Area(self.ledger.new_id(), owner, offset, size, granted, deadline, size)
        self._book.add(area.area_id, area)
        self.num_bytes += size
        return area

    def held_by(self, owner: int) -> Area | None:
        """The area ``owner`` holds now, if any."""
        ids = self._book.ids_of(owner)
        return self._book.get(ids[0], owner) if ids else None

    def take_front(
        self, area_id: int, owner: int, sizes: Sequence[int], *, keep: bool = False
    ) -> list[int]:
        """Carve pieces of ``sizes`` (page-rounded, in order) off the front of the area: their
        offsets, each now allocated on its own.  The rest stays the area's, its lease
        renewed, unless it is smaller than the pieces and a fresh area is free (see
        :meth:`held_by`).  With ``keep`` the rest always stays: the writer is copying its
        next blocks there already (a pipelined commit)."""
        area = self._book.get(area_id, owner)
        if area is None:
            raise LeaseExpired(f"write area {area_id} expired or was replaced")
        pieces: list[int] | np.ndarray
        if len(sizes) < MIN_COLUMN_KEYS:
            pieces = [page_bytes(size) for size in sizes]
            taken = sum(pieces)
        else:
            pieces = pages_of(np.asarray(sizes, dtype=np.int64)) * PAGE_BYTES
            taken = int(pieces.sum())
        rest = area.num_bytes - taken
        if rest < 0:
            raise BadRequest(f"{taken} bytes of blocks in a write area of {area.num_bytes}")
        offsets = self.allocator.carve(area.offset, [*pieces, rest] if rest else pieces)
        self.num_bytes -= taken
        if rest:
            area.offset, area.num_bytes = offsets.pop(), rest
            area.deadline = self.ledger.clock() + area.lease_s
        else:
            self._book.pop(area_id, owner)
        if rest < taken and not keep:  # the next write like this would not fit: refill
            fresh = self._new(area.granted_bytes, owner, area.lease_s)
            if fresh is not None and rest:  # else, with none free, the rest stays
                self._drop(area_id)
        return offsets

    def release(self, owner: int) -> None:
        """Free the area ``owner`` holds, if any (it asks for another)."""
        for area_id in self._book.ids_of(owner):
            self._drop(area_id)

    def _drop(self, area_id: int) -> None:
        area = self._book.pop(area_id)
        if area is not None:
            self._free(area_id, area)

    def _free(self, area_id: int, area: Area) -> None:
        """An area's lease ended (its book dropped the record already): its memory returns."""
        self.num_bytes -= area.num_bytes
        self.allocator.free(area.offset)

    def __len__(self) -> int:
        return len(self._book)
