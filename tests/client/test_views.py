"""A batch's arena views: made as they are used for many blocks, at once for a few; either
way the same views as a list of slices of the arena."""

import pytest

from kvpool.buffers import ArenaViews, arena_views
from kvpool.keys import MIN_COLUMN_KEYS


@pytest.mark.parametrize("num", [1, MIN_COLUMN_KEYS - 1, MIN_COLUMN_KEYS, 3 * MIN_COLUMN_KEYS])
def test_the_views_are_the_arenas_slices_made_either_way(num: int) -> None:
    arena = memoryview(bytearray(range(256)) * (num + 1))
    offsets = [256 * ((7 * i) % (num + 1)) for i in range(num)]
    sizes = [1 + (i % 200) for i in range(num)]
    expected = [arena[o : o + s] for o, s in zip(offsets, sizes, strict=True)]
    views = arena_views(arena, offsets, sizes)
    assert isinstance(views, ArenaViews) == (num >= MIN_COLUMN_KEYS)
    assert len(views) == num and list(views) == expected and views == expected
    assert [views[i] for i in range(num)] == expected and views[-1] == expected[-1]
    views[0] = None  # a block dropped
    assert list(views) == [None, *expected[1:]] and views[0] is None
    if isinstance(views, ArenaViews):
        assert views.sizes() == [None, *sizes[1:]]
        assert views[:] == [None, *expected[1:]] and views[::2] == list(views)[::2]
    assert list(views[1:3]) == expected[1:3]
    with pytest.raises(IndexError):
        views[num]


@pytest.mark.parametrize("num", [4, 2 * MIN_COLUMN_KEYS])
def test_a_reads_slots_are_views_of_the_arena_and_one_outside_it_is_refused(num: int) -> None:
    # What a node hands out is checked before it is used: a slot past the arena's end (a
    # node that lies, or one whose arena is not the one mapped) breaks the protocol.
    from kvpool.client.reads import slot_views
    from kvpool.errors import ProtocolError, Status

    arena = memoryview(bytearray(4096 * num))
    statuses = [Status.OK if i % 3 else Status.NOT_FOUND for i in range(num)]
    offsets = [4096 * i for i in range(num)]
    sizes = [100 + i for i in range(num)]
    views = slot_views(statuses, offsets, sizes, arena)
    for i, view in enumerate(views):
        expected = arena[offsets[i] : offsets[i] + sizes[i]] if i % 3 else None
        assert view == expected
    ok_last = [*statuses[:-1], Status.OK]
    for offset, size in ((4096 * num - 10, 100), (-4096, 10)):
        with pytest.raises(ProtocolError, match="outside its arena"):
            slot_views(ok_last, [*offsets[:-1], offset], [*sizes[:-1], size], arena)
    # A slot that is not OK is never looked at, wherever it says it is.
    not_ok = [*statuses[:-1], Status.NOT_FOUND]
    assert slot_views(not_ok, [*offsets[:-1], -4096], sizes, arena)[-1] is None
