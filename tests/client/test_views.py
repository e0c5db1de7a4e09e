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
