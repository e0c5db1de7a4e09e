"""Arena space allocators.

The interface (:class:`Allocator`): ``allocate(num_bytes) -> offset | None`` and
``free(offset)``; ``carve(offset, sizes)`` splits one allocated extent into separately
freeable pieces, so that the blocks of one batch sit contiguously in the arena and move as
one large copy; ``adopt(extents)``, on an allocator that has handed out nothing yet, marks
extents found in a surviving arena as allocated (a warm restart), and says which it took.
The caller guarantees it frees only offsets it was given or adopted, once (the segregated
fit allocator checks it: any other free raises ``ValueError``).  Every offset and size is a
multiple of the page size.

:class:`SegregatedFitAllocator` is a two-level segregated fit (TLSF) allocator: free
extents live in bins indexed by (power of two, 8 linear sub-ranges); a bitmap finds the
first bin that can hold a request in O(1); neighbours are coalesced on free in O(1).  Its
memory does not grow with the extents it hands out: a byte per arena page says which are
(a restart adopts millions of blocks, and a Python object per block is ~100 bytes).
:class:`BumpAllocator` is the trivial implementation for tests: it never reuses memory.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvpool.config import PAGE_BYTES, pages, pages_of
from kvpool.keys import MIN_COLUMN_KEYS

SL_BITS = 3  # 8 second-level bins per power of two
SL_COUNT = 1 << SL_BITS
# Extents of this many pages or more keep their length in a dict, not in their page's byte.
LONG = 255


__all__ = ["Allocator", "BumpAllocator", "SegregatedFitAllocator", "pages"]


class Allocator(Protocol):
    capacity: int
    used: int

    def allocate(self, num_bytes: int) -> int | None: ...

    def free(self, offset: int) -> None: ...

    def carve(self, offset: int, sizes: Sequence[int] | np.ndarray) -> list[int]: ...

    def largest_free(self) -> int: ...

    def adopt(self, extents: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray: ...


def _bin_of(num_pages: int) -> int:
    """The bin that holds a free extent of ``num_pages``."""
    if num_pages < SL_COUNT:
        return num_pages
    fl = num_pages.bit_length() - 1
    sl = (num_pages >> (fl - SL_BITS)) - SL_COUNT
    return (fl - SL_BITS + 1) * SL_COUNT + sl


def _bins_of(num_pages: np.ndarray) -> np.ndarray:
    """:func:`_bin_of` of each of an array of extent lengths."""
    # frexp's exponent is the bit length, exactly (lengths are far below 2**53).
    fl = np.frexp(num_pages.astype(np.float64))[1].astype(np.int64) - 1
    shift = np.maximum(fl - SL_BITS, 0)
    large = (fl - SL_BITS + 1) * SL_COUNT + (num_pages >> shift) - SL_COUNT
    return np.where(num_pages < SL_COUNT, num_pages, large)


def _bin_for_request(num_pages: int) -> int:
    """The first bin whose every extent can hold ``num_pages`` (round up to a bin edge)."""
    if num_pages < SL_COUNT:
        return num_pages
    fl = num_pages.bit_length() - 1
    round_up = (1 << (fl - SL_BITS)) - 1
    return _bin_of(num_pages + round_up)


class SegregatedFitAllocator:
    """O(1) allocation and free with coalescing, in units of pages.

    What is handed out is kept in a byte per arena page, not an object per extent: the
    length in pages of the extent that starts at that page (0: none starts there), or
    ``LONG`` for an extent of ``LONG`` pages or more, whose length is in a dict (extents of
    a megabyte or more: few, and large).  A byte per page is 0.02% of the arena (256 MiB
    for a 1 TiB arena), allocated zeroed so that the kernel backs its pages only as the
    arena's pages are first handed out.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity // PAGE_BYTES * PAGE_BYTES
        self.used = 0
        self._free_start_to_pages: dict[int, int] = {}
        self._free_end_to_start: dict[int, int] = {}
        self._page_table = np.zeros(self.capacity // PAGE_BYTES, dtype=np.uint8)
        # The same bytes, read and written a page at a time: a memoryview indexes at
        # dict speed (numpy's scalar indexing costs 3 times as much).
        self._start_to_pages = self._page_table.data
        self._long_start_to_pages: dict[int, int] = {}
        self._bins: list[dict[int, None]] = [{} for _ in range(_bin_of(1 << 62) + 1)]
        self._bitmap = 0
        total = self.capacity // PAGE_BYTES
        if total:
            self._insert_free(0, total)

    def __sizeof__(self) -> int:
        tables = (self._free_start_to_pages, self._free_end_to_start, self._long_start_to_pages)
        # The table of extents by page as allocated: its pages are resident once the arena's
        # pages have all been handed out once (the steady state of a cache).  The dicts'
        # int keys are per free or long extent: few, not counted.
        bins = sum(map(sys.getsizeof, self._bins))
        return (
            object.__sizeof__(self)
            + self._page_table.nbytes
            + sum(map(sys.getsizeof, tables))
            + bins
        )

    def allocate(self, num_bytes: int) -> int | None:
        want = pages(num_bytes)
        index = _bin_for_request(want)
        if index >= len(self._bins):
            return None
        candidates = self._bitmap >> index
        if not candidates:
            return self._allocate_exact_fit(want)
        index += (candidates & -candidates).bit_length() - 1
        start = next(iter(self._bins[index]))
        self._take(start, want)
        return start * PAGE_BYTES

    def _allocate_exact_fit(self, want: int) -> int | None:
        # Rounding up to a bin edge can miss an extent that fits in the request's own bin.
        index = _bin_of(want)
        for start in self._bins[index] if index < len(self._bins) else ():
            if self._free_start_to_pages[start] >= want:
                self._take(start, want)
                return start * PAGE_BYTES
        return None

    def _take(self, start: int, want: int) -> None:
        have = self._remove_free(start)
        if have > want:
            self._insert_free(start + want, have - want)
        self._hold(start, want)
        self.used += want * PAGE_BYTES

    def _hold(self, start: int, num_pages: int) -> None:
        """Record the extent of ``num_pages`` at page ``start`` as handed out."""
        if num_pages < LONG:
            self._start_to_pages[start] = num_pages
        else:
            self._start_to_pages[start] = LONG
            self._long_start_to_pages[start] = num_pages

    def _release(self, offset: int) -> tuple[int, int]:
        """The start page and length of the extent handed out at ``offset``, which is
        handed out no more; a ``ValueError`` if none was."""
        if offset % PAGE_BYTES or not 0 <= offset < self.capacity:
            raise ValueError(f"offset {offset} was not handed out")
        start = offset // PAGE_BYTES
        num_pages = self._start_to_pages[start]
        if not num_pages:
            raise ValueError(f"offset {offset} was not handed out")
        self._start_to_pages[start] = 0
        if num_pages == LONG:
            num_pages = self._long_start_to_pages.pop(start)
        return start, num_pages

    def free(self, offset: int) -> None:
        start, num_pages = self._release(offset)
        self.used -= num_pages * PAGE_BYTES
        following = start + num_pages
        if following in self._free_start_to_pages:
            num_pages += self._remove_free(following)
        preceding = self._free_end_to_start.get(start)
        if preceding is not None:
            num_pages += self._remove_free(preceding)
            start = preceding
        self._insert_free(start, num_pages)

    def carve(self, offset: int, sizes: Sequence[int] | np.ndarray) -> list[int]:
        """Split the allocated extent at ``offset`` into pieces of ``sizes`` (page-rounded,
        in order); the extent's tail beyond them is freed."""
        start, total = self._release(offset)
        if len(sizes) < MIN_COLUMN_KEYS:
            return self._carve_each(start, total, [pages(int(size)) for size in sizes])
        piece_pages = pages_of(np.asarray(sizes, dtype=np.int64))
        num_pages = int(piece_pages.sum())
        if num_pages > total:
            self._hold(start, total)
            raise ValueError("pieces exceed the extent")
        starts = start + np.cumsum(piece_pages) - piece_pages
        short = piece_pages < LONG
        self._page_table[starts[short]] = piece_pages[short]
        for long_start, long_pages in zip(
            starts[~short].tolist(), piece_pages[~short].tolist(), strict=True
        ):
            self._hold(long_start, long_pages)
        cursor = start + num_pages
        leftover = start + total - cursor
        if leftover:
            self._hold(cursor, leftover)
            self.free(cursor * PAGE_BYTES)
        return (starts * PAGE_BYTES).tolist()

    def _carve_each(self, start: int, total: int, piece_pages: list[int]) -> list[int]:
        """:meth:`carve` of a few pieces, one at a time."""
        if sum(piece_pages) > total:
            self._hold(start, total)
            raise ValueError("pieces exceed the extent")
        offsets: list[int] = []
        cursor = start
        for num_pages in piece_pages:
            self._hold(cursor, num_pages)
            offsets.append(cursor * PAGE_BYTES)
            cursor += num_pages
        leftover = start + total - cursor
        if leftover:
            self._hold(cursor, leftover)
            self.free(cursor * PAGE_BYTES)
        return offsets

    def largest_free(self) -> int:
        if not self._bitmap:
            return 0
        top = self._bitmap.bit_length() - 1
        return max(self._free_start_to_pages[s] for s in self._bins[top]) * PAGE_BYTES

    def adopt(self, extents: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
        """Mark ``(offset, num_bytes)`` extents (pairs, or an array of two columns) as
        allocated, on an allocator that has handed out nothing yet; an extent that is
        misaligned, outside the arena, of a negative size or overlaps an earlier one is
        refused (``False`` in the boolean array returned), the others are taken
        (``True``)."""
        if self.used:
            raise ValueError("adopt needs an allocator that has handed out nothing")
        total = self.capacity // PAGE_BYTES
        columns = np.asarray(extents, dtype=np.int64).reshape(-1, 2)
        if total:
            self._remove_free(0)
        if not len(columns):
            if total:
                self._insert_free(0, total)
            return np.zeros(0, dtype=bool)
        # In bulk (a restart adopts millions): sorted by offset, each extent is taken if it
        # is aligned, inside the arena and starts at or after the end of the last one taken.
        order = np.argsort(columns[:, 0], kind="stable")
        offsets = columns[order, 0]
        starts = offsets // PAGE_BYTES
        num_pages = np.maximum(1, -(-columns[order, 1] // PAGE_BYTES))
        ends = starts + num_pages
        fits = (offsets % PAGE_BYTES == 0) & (offsets >= 0) & (num_pages <= total - starts)
        fits &= columns[order, 1] >= 0
        before = np.concatenate(([0], np.maximum.accumulate(np.where(fits, ends, 0))[:-1]))
        ok = fits & (starts >= before)
        if not (ok == fits).all():
            # An overlap: a refused extent must not push the cursor on, so decide in order
            # (a damaged journal only).
            cursor = 0
            for i in np.flatnonzero(fits).tolist():
                ok[i] = starts[i] >= cursor
                if ok[i]:
                    cursor = int(ends[i])
        starts, num_pages, ends = starts[ok], num_pages[ok], ends[ok]
        long = num_pages >= LONG
        self._page_table[starts] = np.where(long, LONG, num_pages)
        self._long_start_to_pages.update(
            zip(starts[long].tolist(), num_pages[long].tolist(), strict=True)
        )
        self.used += int(num_pages.sum()) * PAGE_BYTES
        gap_starts = np.concatenate(([0], ends))
        gap_pages = np.concatenate((starts, [total])) - gap_starts
        gaps = gap_pages > 0
        self._insert_free_many(gap_starts[gaps], gap_pages[gaps])
        taken = np.zeros(len(columns), dtype=bool)
        taken[order] = ok
        return taken

    def _insert_free_many(self, starts: np.ndarray, num_pages: np.ndarray) -> None:
        """:meth:`_insert_free` of many extents, a dict update per bin, not a call each."""
        if not len(starts):
            return
        start_list = starts.tolist()
        self._free_start_to_pages.update(zip(start_list, num_pages.tolist(), strict=True))
        self._free_end_to_start.update(zip((starts + num_pages).tolist(), start_list, strict=True))
        bin_of = _bins_of(num_pages)
        order = np.argsort(bin_of, kind="stable")  # offset order within a bin, as one by one
        bins = bin_of[order]
        cuts = np.flatnonzero(np.diff(bins)) + 1
        firsts = np.concatenate(([0], cuts))
        for index, group in zip(bins[firsts].tolist(), np.split(starts[order], cuts), strict=True):
            self._bins[index].update(dict.fromkeys(group.tolist()))
            self._bitmap |= 1 << index

    def _insert_free(self, start: int, num_pages: int) -> None:
        self._free_start_to_pages[start] = num_pages
        self._free_end_to_start[start + num_pages] = start
        index = _bin_of(num_pages)
        self._bins[index][start] = None
        self._bitmap |= 1 << index

    def _remove_free(self, start: int) -> int:
        num_pages = self._free_start_to_pages.pop(start)
        del self._free_end_to_start[start + num_pages]
        index = _bin_of(num_pages)
        bin_ = self._bins[index]
        del bin_[start]
        if not bin_:
            self._bitmap &= ~(1 << index)
        return num_pages


class BumpAllocator:
    """Hands out memory front to back and never reuses it (for tests)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._next = 0
        self._sizes: dict[int, int] = {}

    def allocate(self, num_bytes: int) -> int | None:
        size = pages(num_bytes) * PAGE_BYTES
        if self._next + size > self.capacity:
            return None
        offset, self._next = self._next, self._next + size
        self._sizes[offset] = size
        self.used += size
        return offset

    def free(self, offset: int) -> None:
        self.used -= self._sizes.pop(offset)

    def carve(self, offset: int, sizes: Sequence[int] | np.ndarray) -> list[int]:
        total = self._sizes.pop(offset)
        offsets = []
        for size in map(int, sizes):
            self._sizes[offset] = pages(size) * PAGE_BYTES
            offsets.append(offset)
            offset += pages(size) * PAGE_BYTES
            total -= pages(size) * PAGE_BYTES
        self.used -= total
        return offsets

    def largest_free(self) -> int:
        return self.capacity - self._next

    def adopt(self, extents: Sequence[tuple[int, int]] | np.ndarray) -> np.ndarray:
        pairs = [(o, n) for o, n in np.asarray(extents, dtype=np.int64).reshape(-1, 2).tolist()]
        taken = []
        for offset, num_bytes in sorted(pairs):
            size = pages(num_bytes) * PAGE_BYTES
            ok = offset >= self._next and offset + size <= self.capacity
            if ok:
                self._sizes[offset] = size
                self.used += size
                self._next = offset + size
            taken.append(ok)
        order = sorted(range(len(pairs)), key=lambda i: pairs[i])
        result = np.zeros(len(pairs), dtype=bool)
        result[order] = taken
        return result
