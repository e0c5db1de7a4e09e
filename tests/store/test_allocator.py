import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.config import PAGE_BYTES
from kvpool.store.allocator import BumpAllocator, SegregatedFitAllocator, pages

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
