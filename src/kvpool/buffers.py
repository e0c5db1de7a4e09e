"""Byte views of what callers pass (bytes, numpy arrays, CPU torch tensors), and copies
between them that let go of the GIL.

:func:`copy_with_checksum` fuses the copy and the hash (:mod:`kvpool.checksum`): it hashes
each piece right after copying it, while the piece is still in the CPU cache, which costs
far less than a second pass over memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvpool.checksum import checksum, new_hasher

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
