"""Copies between pool memory and a paged cache: where they run, and how they are ordered
against the engine's own work.  Each :class:`Copies` serves one cache (its layout); a batch
of pool blocks is a ``[n, block_elems]`` tensor ``rows``.  :func:`copies_for` picks one of
two by the cache's device:

- :class:`HostCopies`, for a cache in host memory (vLLM's CPU backend).  Copies run on the
  calling pool thread and are done when they return.  They may move a few planes at a time
  (``per_plane``), so layer-by-layer loads and saves overlap the forward.
- :class:`StreamCopies`, for a cache on a GPU.
  - **The arena is registered once.**  When the client maps the node's arena, it is
    registered with CUDA (``cudaHostRegister``: the client calls :meth:`Copies.arena_mapped`,
    given to it at construction), so copies between it and the GPU run at
    pinned-memory speed, with no bounce buffer.  A restarted node's new arena replaces the
    old registration.
  - **Own streams; the engine's stream is never synchronised.**  Loads and saves run on
    two streams of their own.  Events order them:
    - a copy starts after a *mark* of the engine's stream, taken on the engine's thread: at
      the step's start for a load (the blocks it fills are free by then), after the
      forward for a save;
    - the engine's stream waits (``wait_event``, on the GPU) for a load before the first
      layer reads its blocks, and for a save's gather before its later work may overwrite
      the blocks.  It never waits for a save's copy to the host;
    - pool threads wait on the host (``Event.synchronize``) for the copies to have run,
      before they unpin or commit.
  - **Batched.**  A batch moves through device staging of at most ``STAGING_BYTES`` at a
    time, with one indexed copy on the device (over all planes when they are evenly spaced,
    else one per plane) and one contiguous copy to or from the host, never a copy per block.
  - **Whole batches.**  A plane's pages are strided in pool blocks, and torch copies strided
    host memory through a pageable bounce buffer.  So GPU transfers move all planes at once
    (``per_plane`` is false), and overlap the forward through the streams instead.
  - **No checksums on the host.**  The node hashes each block once, as it seals it
    (:mod:`kvpool.node.sealing`), and same-host readers of sealed blocks do not hash them
    again.  So a load of sealed blocks from the local arena costs no CPU memory bandwidth
    beyond the DMA.

The CUDA calls sit behind :class:`CudaRuntime`, so that the same copy code runs on CPU
tensors in the tests with a stand-in runtime.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

import torch

from .layouts import PagedLayout

log = logging.getLogger("kvpool.kvcache")

# Device memory a batch moves through at a time (one save or load may be larger).
STAGING_BYTES = 512 << 20

Mark = Any  # a point in a stream's work (a CUDA event); None: nothing to wait for


Planes = tuple[int, ...] | None  # some planes of each block; None: all of them


class Copies(Protocol):
    """The copies of one paged cache (``layout``).  The caller guarantees that ``rows``
    (pool memory or a host batch) stays alive and held until ``settle`` of the returned
    mark has returned.  ``per_plane``: copies are done when they return and may move a few
    planes at a time (else they move whole batches, and finish on their own stream)."""

    layout: PagedLayout
    per_plane: bool

    def mark(self) -> Mark:
        """A point in the engine's stream, taken on the engine's thread."""

    def load(self, ids: torch.Tensor, rows: torch.Tensor, planes: Planes, after: Mark) -> Mark:
        """Copy ``rows`` into blocks ``ids`` of the cache (only ``planes``, if given)."""

    def save(
        self, ids: torch.Tensor, rows: torch.Tensor, planes: Planes, after: Mark
    ) -> tuple[Mark, Mark]:
        """Copy blocks ``ids`` of the cache into ``rows``; (gathered, copied): the cache
        may be overwritten after the first, ``rows`` read after the second."""

    def engine_waits(self, mark: Mark) -> None:
        """The engine's later work waits for ``mark`` (called on the engine's thread)."""

    def settle(self, mark: Mark) -> None:
        """Until the work before ``mark`` has run (called on a pool thread)."""

    def arena_mapped(self, arena: memoryview, old: memoryview | None) -> None:
        """The client mapped a node's arena (``old``: the one it replaces)."""


class HostCopies:
    """Copies on the calling thread, for a cache in host memory."""

    per_plane = True

    def __init__(self, layout: PagedLayout):
        self.layout = layout

    def mark(self) -> Mark:
        return None

    def load(self, ids: torch.Tensor, rows: torch.Tensor, planes: Planes, after: Mark) -> Mark:
        if planes is None or len(planes) == self.layout.num_planes:
            self.layout.scatter(ids, rows)
        else:
            self.layout.scatter_planes(planes, ids, rows)
        return None

    def save(
        self, ids: torch.Tensor, rows: torch.Tensor, planes: Planes, after: Mark
    ) -> tuple[Mark, Mark]:
        if planes is None or len(planes) == self.layout.num_planes:
            self.layout.gather(ids, rows)  # the whole batch: one indexed copy
        elif planes:
            self.layout.gather_planes(planes, ids, rows)
        return None, None

    def engine_waits(self, mark: Mark) -> None:
        pass

    def settle(self, mark: Mark) -> None:
        pass

    def arena_mapped(self, arena: memoryview, old: memoryview | None) -> None:
        pass


class Runtime(Protocol):
    """The device calls :class:`StreamCopies` makes (CUDA's, or a stand-in in tests)."""

    def stream(self) -> Any: ...
    def on(self, stream: Any) -> AbstractContextManager[Any]: ...
    def record(self, stream: Any | None) -> Mark: ...  # None: the calling thread's stream
    def wait(self, stream: Any | None, mark: Mark) -> None: ...
    def synchronize(self, mark: Mark) -> None: ...
    def register(self, address: int, num_bytes: int) -> bool: ...
    def unregister(self, address: int) -> None: ...


class CudaRuntime:
    def __init__(self, device: torch.device):
        self.device = device

    def stream(self) -> Any:
        return torch.cuda.Stream(self.device)

    def on(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record(self, stream: Any | None) -> Mark:
        event = torch.cuda.Event(blocking=True)  # a host wait sleeps, not spins
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def wait(self, stream: Any | None, mark: Mark) -> None:
        (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(mark)

    def synchronize(self, mark: Mark) -> None:
        mark.synchronize()

    def register(self, address: int, num_bytes: int) -> bool:
        result = torch.cuda.cudart().cudaHostRegister(address, num_bytes, 0)
        return int(result[0] if isinstance(result, tuple) else result) == 0

    def unregister(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)


def _address(view: memoryview) -> int:
    anchor = ctypes.c_char.from_buffer(view)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # the export ends: the mapping may be closed again


class StreamCopies:
    """Copies on streams of their own, for a cache on a GPU (see the module's notes)."""

    per_plane = False

    def __init__(self, layout: PagedLayout, runtime: Runtime):
        self.layout = layout
        self.device = layout.device
        self.runtime = runtime
        self.load_stream = runtime.stream()
        self.save_stream = runtime.stream()
        self._lock = threading.Lock()
        self.registered: dict[int, int] = {}  # address -> bytes, of arenas registered

    def _chunks(self, num: int) -> list[slice]:
        step = max(1, STAGING_BYTES // self.layout.block_bytes)
        return [slice(start, min(start + step, num)) for start in range(0, num, step)]

    def mark(self) -> Mark:
        return self.runtime.record(None)

    def load(self, ids: torch.Tensor, rows: torch.Tensor, planes: Planes, after: Mark) -> Mark:
        with self.runtime.on(self.load_stream), self._drained_on_failure(self.load_stream):
            if after is not None:
                self.runtime.wait(self.load_stream, after)
            device_ids = ids.to(self.device, non_blocking=True)
            for part in self._chunks(len(ids)):
                staged = rows[part].to(self.device, non_blocking=True)
                self.layout.scatter_rows(device_ids[part], staged)
            return self.runtime.record(self.load_stream)

    def save(
        self, ids: torch.Tensor, rows: torch.Tensor, planes: Planes, after: Mark
    ) -> tuple[Mark, Mark]:
        gathered: Mark = None
        with self.runtime.on(self.save_stream), self._drained_on_failure(self.save_stream):
            if after is not None:
                self.runtime.wait(self.save_stream, after)
            device_ids = ids.to(self.device, non_blocking=True)
            parts = self._chunks(len(ids))
            for i, part in enumerate(parts):
                staged = self.layout.gather_rows(device_ids[part])
                if i == len(parts) - 1:
                    gathered = self.runtime.record(self.save_stream)
                rows[part].copy_(staged, non_blocking=True)
            return gathered, self.runtime.record(self.save_stream)

    @contextmanager
    def _drained_on_failure(self, stream: Any) -> Iterator[None]:
        """A batch that fails half-way (e.g. out of device memory) leaves no copy running:
        the caller releases the pool memory it used at once."""
        try:
            yield
        except BaseException:
            self.runtime.synchronize(self.runtime.record(stream))
            raise

    def engine_waits(self, mark: Mark) -> None:
        if mark is not None:
            self.runtime.wait(None, mark)

    def settle(self, mark: Mark) -> None:
        if mark is not None:
            self.runtime.synchronize(mark)

    def arena_mapped(self, arena: memoryview, old: memoryview | None) -> None:
        """Register the new arena; drop the old one's registration once no copy of ours
        can still be reading or writing it."""
        address = _address(arena)
        with self._lock:
            if self.runtime.register(address, len(arena)):
                self.registered[address] = len(arena)
                log.info("kvpool: %d MiB of pool arena registered with CUDA", len(arena) >> 20)
            else:
                log.warning(
                    "kvpool: cudaHostRegister refused the pool's arena: copies run at "
                    "pageable-memory speed"
                )
            if old is not None:
                old_address = _address(old)
                if self.registered.pop(old_address, None) is not None:
                    for stream in (self.load_stream, self.save_stream):
                        self.runtime.synchronize(self.runtime.record(stream))
                    self.runtime.unregister(old_address)


def copies_for(layout: PagedLayout) -> Copies:
    """The copies for a cache with ``layout``, by the cache's device."""
    if layout.device.type == "cuda":
        return StreamCopies(layout, CudaRuntime(layout.device))
    return HostCopies(layout)
