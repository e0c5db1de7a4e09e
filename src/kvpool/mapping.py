"""Shared mappings of the arena with their page tables populated: up front for an arena
of up to 2 GiB, behind the caller for a larger one.  The one place the daemon and its
same-host clients map the arena.

A first-touch fault per 4 KiB page would halve the speed of every first copy into a part
of the arena, so page tables are populated.  That costs ~150 ms per GiB (more for a fresh
arena), so an arena past 2 GiB is mapped at once and populated from a thread: a client's
first call (an engine's first lookup) and a restarted daemon's readiness never wait
seconds for it.  Smaller arenas are still populated as they are mapped: populating behind
a caller that writes at once made its first puts ~4x slower (the faults and the population
contend).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import weakref

# madvise(MADV_POPULATE_WRITE), Linux 5.14+: fault a range's page tables in, writable.
MADV_POPULATE_WRITE = 23
POPULATE_CHUNK_BYTES = 64 << 20
SYNC_POPULATE_MAX_BYTES = 2 << 30  # arenas up to this size are populated as they are mapped


def map_shared(fd: int, num_bytes: int) -> mmap.mmap:
    """``fd``'s first ``num_bytes``, mapped shared and writable, page tables populated (see
    the module's docstring)."""
    if num_bytes <= SYNC_POPULATE_MAX_BYTES:
        return mmap.mmap(fd, num_bytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    mapping = mmap.mmap(fd, num_bytes, mmap.MAP_SHARED)
    threading.Thread(
        target=_populate,
        args=(weakref.ref(mapping),),
        name="kvpool-arena-populate",
        daemon=True,
    ).start()
    return mapping


def _populate(ref: weakref.ref[mmap.mmap]) -> None:
    """Fault a fresh mapping's page tables in, a chunk at a time, through libc (ctypes
    drops the GIL for the call, so the caller's threads run meanwhile); stop once nobody
    uses the mapping any more.  Where the kernel cannot (before 5.14), pages fault on use."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    start = 0
    while True:
        mapping = ref()
        if mapping is None or mapping.closed or start >= len(mapping):
            return
        length = min(POPULATE_CHUNK_BYTES, len(mapping) - start)
        try:
            anchor = ctypes.c_char.from_buffer(mapping, start)
        except (TypeError, ValueError, BufferError):
            return
        address = ctypes.addressof(anchor)
        del mapping
        result = libc.madvise(
            ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE
        )
        del anchor  # the export ends: the mapping may be closed again
        if result != 0:
            return
        start += length
