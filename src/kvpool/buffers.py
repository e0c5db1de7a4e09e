"""Byte views of what callers pass (bytes, numpy arrays, CPU torch tensors), and copies
between them that let go of the GIL.

:func:`copy_with_checksum` fuses the copy and the hash (:mod:`kvpool.checksum`): it hashes
each piece right after copying it, while the piece is still in the CPU cache, which costs
far less than a second pass over memory.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableSequence
from typing import Any, overload

import numpy as np

from kvpool.checksum import checksum, new_hasher
from kvpool.keys import MIN_COLUMN_KEYS

# Pieces of this size stay in a core's L2 cache between the copy and the hash.
FUSED_PIECE_BYTES = 512 << 10
# Copies at least this large go through numpy, which lets go of the GIL meanwhile (so that
# other threads copy too: see kvpool.client.copier); smaller ones cost less in place.
GIL_FREE_BYTES = 64 << 10


def copy(dst: memoryview, src: memoryview) -> None:
    """Copy ``src`` into ``dst`` (same length), without holding the GIL."""
    if len(dst) != len(src):
        raise ValueError(f"copy of {len(src)} bytes into a buffer of {len(dst)}")
    if len(src) < GIL_FREE_BYTES:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def copy_with_checksum(dst: memoryview, src: memoryview) -> int:
    """Copy ``src`` into ``dst`` (same length) and return the checksum of the copy."""
    num_bytes = len(src)
    if len(dst) != num_bytes:
        raise ValueError(f"copy of {num_bytes} bytes into a buffer of {len(dst)}")
    if num_bytes <= FUSED_PIECE_BYTES:
        copy(dst, src)
        return checksum(dst)
    # numpy copies without holding the GIL, so other threads run during the copy.
    dst_array = np.frombuffer(dst, dtype=np.uint8)
    src_array = np.frombuffer(src, dtype=np.uint8)
    hasher = new_hasher()
    for start in range(0, num_bytes, FUSED_PIECE_BYTES):
        end = min(start + FUSED_PIECE_BYTES, num_bytes)
        np.copyto(dst_array[start:end], src_array[start:end])
        hasher.update(dst[start:end])
    return hasher.intdigest()


def byte_view(obj: Any, *, writable: bool = False) -> memoryview:
    """A flat byte view of a buffer: bytes, bytearray, memoryview, numpy array, or a CPU
    torch tensor (any dtype, bf16 included).  The object must be C-contiguous."""
    if isinstance(obj, memoryview):
        view = obj
    elif isinstance(obj, bytes | bytearray | np.ndarray):
        view = memoryview(obj)  # type: ignore[arg-type]
    elif type(obj).__module__.startswith("torch"):
        view = _torch_view(obj)
    else:
        view = memoryview(obj)
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError("destination buffer is read-only")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _torch_view(tensor: Any) -> memoryview:
    if tensor.device.type != "cpu":
        raise ValueError("only CPU tensors can be copied directly; move it to the CPU first")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    import torch

    flat = tensor.reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())


class ArenaViews(MutableSequence[memoryview | None]):
    """Views of the blocks at ``offsets`` in the arena (``sizes`` bytes each), each made
    when it is used: a long prompt's 2,000 views alive at once were 2,000 objects for the
    caller's garbage collector to walk, for a copy that needs one at a time.  A view set in
    place of one (None: a block dropped) is kept; the length is fixed."""

    __slots__ = ("_arena", "_offsets", "_set", "_sizes")

    def __init__(self, arena: memoryview, offsets: list[int], sizes: list[int]):
        self._arena, self._offsets, self._sizes = arena, offsets, sizes
        self._set: dict[int, memoryview | None] = {}

    def __len__(self) -> int:
        return len(self._offsets)

    def __iter__(self) -> Iterator[memoryview | None]:
        arena, taken = self._arena, self._set
        for i, (offset, size) in enumerate(zip(self._offsets, self._sizes, strict=True)):
            yield taken[i] if i in taken else arena[offset : offset + size]

    @overload
    def __getitem__(self, i: int) -> memoryview | None: ...

    @overload
    def __getitem__(self, i: slice) -> list[memoryview | None]: ...

    def __getitem__(self, i: int | slice) -> memoryview | list[memoryview | None] | None:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            arena, taken = self._arena, self._set
            places = zip(self._offsets[start:stop], self._sizes[start:stop], strict=True)
            return [
                taken[j] if j in taken else arena[offset : offset + size]
                for j, (offset, size) in enumerate(places, start)
            ]
        i = range(len(self))[i]  # bounds and negative indexes, as a list's
        if i in self._set:
            return self._set[i]
        offset = self._offsets[i]
        return self._arena[offset : offset + self._sizes[i]]

    @overload
    def __setitem__(self, i: int, view: memoryview | None) -> None: ...

    @overload
    def __setitem__(self, i: slice, view: Any) -> None: ...

    def __setitem__(self, i: int | slice, view: Any) -> None:
        if isinstance(i, slice):
            raise TypeError("views are set one at a time")
        self._set[range(len(self))[i]] = view

    def sizes(self) -> list[int | None]:
        """Each view's length (None: no view), without making the views."""
        sizes: list[int | None] = list(self._sizes)
        for i, view in self._set.items():
            sizes[i] = len(view) if view is not None else None
        return sizes

    def __eq__(self, other: object) -> bool:  # as a list of the views compares
        if isinstance(other, ArenaViews | list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list

    def __delitem__(self, i: int | slice) -> None:
        raise TypeError("a batch's views are as many as its blocks")

    def insert(self, index: int, value: memoryview | None) -> None:
        raise TypeError("a batch's views are as many as its blocks")


def arena_views(
    arena: memoryview, offsets: list[int], sizes: list[int]
) -> MutableSequence[memoryview | None]:
    """The views of the blocks at ``offsets``: made as they are used for a batch of many
    (:class:`ArenaViews`), at once for a few (a list costs less than the lazy views' calls)."""
    if len(offsets) < MIN_COLUMN_KEYS:
        return [arena[offset : offset + size] for offset, size in zip(offsets, sizes, strict=True)]
    return ArenaViews(arena, offsets, sizes)
