import itertools
import sys
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.config import PAGE_BYTES
from kvpool.store.allocator import (
    LONG,
    BumpAllocator,
    SegregatedFitAllocator,
    _bin_of,
    _bins_of,
    pages,
)

CAPACITY = 4096 * PAGE_BYTES


def _check_no_overlap(live: dict[int, int]) -> None:
    spans = sorted((o, o + pages(s) * PAGE_BYTES) for o, s in live.items())
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start
    for start, end in spans:
        assert start % PAGE_BYTES == 0 and start >= 0 and end <= CAPACITY


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300 * PAGE_BYTES)), max_size=200))
def test_random_allocations_never_overlap_and_coalesce_back(ops):
    alloc = SegregatedFitAllocator(CAPACITY)
    live: dict[int, int] = {}
    for is_alloc, size in ops:
        if is_alloc or not live:
            offset = alloc.allocate(size)
            if offset is not None:
                assert offset not in live
                live[offset] = size
        else:
            offset = next(iter(live))
            alloc.free(offset)
            del live[offset]
        _check_no_overlap(live)
        assert alloc.used == sum(pages(s) * PAGE_BYTES for s in live.values())
    for offset in list(live):
        alloc.free(offset)
    assert alloc.used == 0
    assert alloc.largest_free() == CAPACITY  # everything coalesced into one extent
    assert alloc.allocate(CAPACITY) == 0


def test_allocation_fails_cleanly_when_full_and_finds_exact_fits():
    alloc = SegregatedFitAllocator(16 * PAGE_BYTES)
    offsets = [alloc.allocate(PAGE_BYTES) for _ in range(16)]
    assert None not in offsets and alloc.allocate(1) is None
    alloc.free(offsets[5])
    assert alloc.allocate(PAGE_BYTES) == offsets[5]
    alloc.free(offsets[0])
    alloc.free(offsets[1])
    alloc.free(offsets[2])
    assert (
        alloc.allocate(3 * PAGE_BYTES) == offsets[0]
    )  # an exact fit in a bin below the rounded one


def test_carve_splits_an_extent_into_separately_freed_blocks():
    alloc = SegregatedFitAllocator(64 * PAGE_BYTES)
    extent = alloc.allocate(10 * PAGE_BYTES)
    pieces = alloc.carve(extent, [PAGE_BYTES, 3 * PAGE_BYTES, 100])
    assert pieces == [extent, extent + PAGE_BYTES, extent + 4 * PAGE_BYTES]
    assert alloc.used == 5 * PAGE_BYTES  # the unused tail went back
    for p in pieces:
        alloc.free(p)
    assert alloc.used == 0 and alloc.largest_free() == 64 * PAGE_BYTES


@pytest.mark.parametrize("cls", [SegregatedFitAllocator, BumpAllocator])
def test_allocators_share_the_interface(cls):
    alloc = cls(8 * PAGE_BYTES)
    a = alloc.allocate(PAGE_BYTES)
    assert a is not None and alloc.used == PAGE_BYTES
    alloc.free(a)
    assert alloc.used == 0


def test_a_free_of_an_offset_never_handed_out_raises_and_changes_nothing():
    alloc = SegregatedFitAllocator(64 * PAGE_BYTES)
    extent = alloc.allocate(4 * PAGE_BYTES)
    assert extent is not None
    bad = [
        extent + PAGE_BYTES,  # inside the extent
        extent + 1,  # misaligned, in its first page
        extent + 8 * PAGE_BYTES,  # free memory
        64 * PAGE_BYTES,  # past the arena
        -PAGE_BYTES,  # before it (an index from the end, to numpy)
    ]
    for offset in bad:
        with pytest.raises(ValueError):
            alloc.free(offset)
        assert alloc.used == 4 * PAGE_BYTES
    with pytest.raises(ValueError):
        alloc.carve(extent + PAGE_BYTES, [PAGE_BYTES])
    with pytest.raises(ValueError):
        alloc.carve(extent, [5 * PAGE_BYTES])  # more than the extent: it stays whole
    alloc.free(extent)
    with pytest.raises(ValueError):
        alloc.free(extent)  # twice
    assert alloc.used == 0 and alloc.largest_free() == 64 * PAGE_BYTES


def test_long_extents_are_handed_out_carved_freed_and_adopted():
    """Extents of LONG pages or more keep their length apart from the page table."""
    alloc = SegregatedFitAllocator(4 * LONG * PAGE_BYTES)
    extent = alloc.allocate(3 * LONG * PAGE_BYTES)
    assert extent == 0 and alloc.used == 3 * LONG * PAGE_BYTES
    pieces = alloc.carve(extent, [LONG * PAGE_BYTES, PAGE_BYTES, (LONG + 3) * PAGE_BYTES])
    assert pieces == [0, LONG * PAGE_BYTES, (LONG + 1) * PAGE_BYTES]
    assert alloc.used == (2 * LONG + 4) * PAGE_BYTES  # the tail past the pieces went back
    for offset in pieces:
        alloc.free(offset)
    assert alloc.used == 0 and alloc.largest_free() == alloc.capacity
    adopted = SegregatedFitAllocator(4 * LONG * PAGE_BYTES)
    taken = adopted.adopt(
        np.array(
            [
                (PAGE_BYTES, 3 * LONG * PAGE_BYTES),
                (0, PAGE_BYTES),
                ((3 * LONG + 2) * PAGE_BYTES, -1),
            ]
        )
    )
    assert taken.tolist() == [True, True, False]  # a negative size (a journal's 2**64 - 1)
    adopted.free(PAGE_BYTES)
    assert adopted.largest_free() == (4 * LONG - 1) * PAGE_BYTES  # coalesced with the rest


def test_the_allocator_takes_no_heap_per_extent_it_hands_out():
    """Millions of blocks are held: what is handed out costs a byte per arena page,
    allocated up front, and no Python object per extent; ``sys.getsizeof`` says so."""
    num_extents = 20_000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        alloc = SegregatedFitAllocator(num_extents * PAGE_BYTES)
        created = tracemalloc.get_traced_memory()[0] - before
        for _ in range(num_extents):
            alloc.allocate(PAGE_BYTES)  # the offsets are not kept: they are the caller's
        grown = tracemalloc.get_traced_memory()[0] - before - created
    finally:
        tracemalloc.stop()
    assert alloc.used == alloc.capacity
    assert grown < 2 * num_extents, grown
    assert 0.7 * created <= sys.getsizeof(alloc) <= 1.3 * created, (created, sys.getsizeof(alloc))


def test_bins_of_an_array_are_the_bins_of_each_length():
    lengths = np.array([*range(1, 5000), 1 << 20, (1 << 31) - 1, (1 << 40) + 12345])
    assert _bins_of(lengths).tolist() == [_bin_of(n) for n in lengths.tolist()]
