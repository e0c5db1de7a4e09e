"""Paged KV cache layouts, as page planes: engine-neutral (vLLM's backends, the EMS SDK's
tensors and any engine whose cache is blocks of pages).

A *plane* is a ``[num_blocks, page]`` view of one part of a layer's cache in which each
block's page is one dense run of memory: the whole layer for the CPU backend
(``[num_blocks, kv_heads, block_size, 2 * head_dim]``), for flash-attention with K and V
packed per block (``[num_blocks, ..., 2 * head_dim]`` in any physical order), and for MLA
(``[num_blocks, block_size, head_dim]``); K and V separately for caches that stack them
outside the block dimension (``[2, num_blocks, block_size, kv_heads, head_dim]``) or keep
them in two tensors.  Pages are copied as opaque bytes, so the layout inside a page never
matters.

A pool block is one vLLM block across every plane of the worker, plane after plane: the
whole batch of a save or load moves with one ``index_select`` / ``index_copy_`` over all
planes when they are evenly spaced in one buffer (vLLM allocates them so), else one per
plane — never a copy per block.  Planes may differ in page size (the two planes of an MLA
layer that keeps its latent and its rotary part apart); they then move one copy per plane.
A batch of pool blocks is a ``[n, block_elems]`` tensor (``[n, planes, page]`` is accepted
too when the planes are alike).

For layer-by-layer transfers, ``layers`` names the planes of each layer (layers that share a
cache name the same planes), and ``gather_planes`` / ``scatter_planes`` move some planes of
a batch: one indexed copy per plane.

``gather`` / ``scatter`` (and the plane variants) move a batch held on the host and are done
when they return.  ``gather_rows`` / ``scatter_rows`` are the same indexed copies with the
batch on the cache's own device: the GPU path (:mod:`.copies`) stages batches there, on
its own streams.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import torch

from kvpool.errors import ConfigError


@dataclass(frozen=True)
class Plane:
    view: torch.Tensor  # [num_blocks, page_elems]
    name: str


def _dense_page_elems(tensor: torch.Tensor) -> int | None:
    """Elements of one block's page if dims 1.. form a dense box, else None."""
    dims = sorted(
        (
            (size, stride)
            for size, stride in zip(tensor.shape[1:], tensor.stride()[1:], strict=True)
            if size > 1
        ),
        key=lambda d: d[1],
    )
    expected = 1
    for size, stride in dims:
        if stride != expected:
            return None
        expected *= size
    if tensor.shape[0] > 1 and tensor.stride(0) < expected:
        return None
    return expected


def dense_plane(tensor: torch.Tensor, name: str) -> Plane:
    page = _dense_page_elems(tensor)
    if page is None:
        raise ConfigError(
            f"unknown KV cache layout for {name}: shape {tuple(tensor.shape)}, strides "
            f"{tuple(tensor.stride())}: a block's page is not one dense run of memory"
        )
    view = torch.as_strided(
        tensor, (tensor.shape[0], page), (tensor.stride(0), 1), tensor.storage_offset()
    )
    return Plane(view, name)


def _planes_of(name: str, cache: Any, num_blocks: int | None) -> list[Plane]:
    if isinstance(cache, list | tuple):
        if len(cache) != 2:
            raise ConfigError(f"unknown KV cache layout for {name}: a {len(cache)}-tuple")
        return [dense_plane(cache[0], f"{name}.k"), dense_plane(cache[1], f"{name}.v")]
    if not isinstance(cache, torch.Tensor) or cache.dim() < 2:
        raise ConfigError(f"unknown KV cache layout for {name}: {type(cache).__name__}")
    if (
        cache.shape[0] == 2
        and cache.dim() >= 4
        and (num_blocks is None or cache.shape[1] == num_blocks)
    ):
        return [dense_plane(cache[0], f"{name}.k"), dense_plane(cache[1], f"{name}.v")]
    return [dense_plane(cache, name)]


def _settle(device: torch.device) -> None:
    """Wait until the calling thread's copies into ``device`` have run: a plane reported
    loaded must be there before another stream's attention reads it."""
    if device.type != "cpu":
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_stream"):
            module.current_stream(device).synchronize()


class PagedLayout:
    """Gather and scatter whole blocks between a worker's paged KV cache and pool blocks."""

    def __init__(self, planes: list[Plane], layers: Mapping[str, Sequence[int]] | None = None):
        if not planes:
            raise ConfigError("no KV cache layers registered")
        first = planes[0].view
        for plane in planes:
            if plane.view.shape[0] != first.shape[0] or plane.view.dtype != first.dtype:
                raise ConfigError(
                    f"KV cache planes differ: {plane.name} is {tuple(plane.view.shape)} "
                    f"{plane.view.dtype}, {planes[0].name} is {tuple(first.shape)} {first.dtype}"
                )
            if plane.view.device != first.device:
                raise ConfigError("KV cache layers live on different devices")
        self.planes = planes
        self.num_blocks, self.page_elems = first.shape
        self.dtype = first.dtype
        self.device = first.device
        self.num_planes = len(planes)
        self.page_bytes = self.page_elems * first.element_size()
        self.plane_bounds: list[tuple[int, int]] = []
        cursor = 0
        for plane in planes:
            self.plane_bounds.append((cursor, cursor + plane.view.shape[1]))
            cursor += plane.view.shape[1]
        self.block_elems = cursor
        self.block_bytes = self.block_elems * first.element_size()
        self.is_uniform = all(p.view.shape == first.shape for p in planes)
        self._combined = self._evenly_spaced() if self.is_uniform else None
        # The planes of each layer, in the order the model runs them.
        self.layers: dict[str, tuple[int, ...]] = (
            {name: tuple(indices) for name, indices in layers.items()}
            if layers is not None
            else {plane.name: (i,) for i, plane in enumerate(planes)}
        )

    @classmethod
    def detect(cls, kv_caches: Mapping[str, Any]) -> PagedLayout:
        """Planes of every distinct layer cache (layers that share a cache count once)."""
        seen: dict[int, tuple[int, ...]] = {}
        planes: list[Plane] = []
        layers: dict[str, tuple[int, ...]] = {}
        num_blocks: int | None = None
        for name, cache in kv_caches.items():
            first = cache[0] if isinstance(cache, list | tuple) else cache
            key = first.data_ptr() if isinstance(first, torch.Tensor) else id(cache)
            if key not in seen:
                layer_planes = _planes_of(name, cache, num_blocks)
                num_blocks = layer_planes[0].view.shape[0]
                seen[key] = tuple(range(len(planes), len(planes) + len(layer_planes)))
                planes.extend(layer_planes)
            layers[name] = seen[key]
        return cls(planes, layers)

    def _evenly_spaced(self) -> torch.Tensor | None:
        """One ``[num_blocks, planes, page]`` view over all planes, if they are evenly spaced
        in one storage (so a whole batch moves with a single indexed copy)."""
        views = [p.view for p in self.planes]
        base = views[0]
        if any(v.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() for v in views):
            return None
        if any(v.stride(0) != base.stride(0) for v in views):
            return None
        offsets = [int(v.storage_offset()) for v in views]
        step = offsets[1] - offsets[0] if len(offsets) > 1 else self.page_elems
        if any(b - a != step for a, b in pairwise(offsets)):
            return None
        if len(offsets) > 1 and abs(step) < self.page_elems:
            return None
        return torch.as_strided(
            base,
            (self.num_blocks, self.num_planes, self.page_elems),
            (base.stride(0), step, 1),
            offsets[0],
        )

    @property
    def is_single_copy(self) -> bool:
        return self._combined is not None

    def pool_view(self, buffer: Any, num_blocks: int) -> torch.Tensor:
        """``num_blocks`` pool blocks laid out in ``buffer`` (writable) as a tensor."""
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=num_blocks * self.block_bytes)
        return flat.view(self.dtype).view(num_blocks, self.block_elems)

    def batch(self, num_blocks: int) -> torch.Tensor:
        """A host tensor for ``num_blocks`` pool blocks (pinned for a cache on a GPU)."""
        return torch.empty(
            num_blocks, self.block_elems, dtype=self.dtype, pin_memory=self.device.type == "cuda"
        )

    def stage(self, views: Sequence[memoryview | None]) -> torch.Tensor:
        """Blocks held apart in the pool, side by side in one host tensor (so that the copy
        into the cache is still one copy); read-only views are fine."""
        batch = self.batch(len(views))
        rows = batch.view(torch.uint8).numpy()
        for row, view in zip(rows, views, strict=True):
            if view is None or len(view) != self.block_bytes:
                raise ValueError(
                    f"a pool block of {len(view or b'')} bytes, not {self.block_bytes}"
                )
            row[:] = np.frombuffer(view, dtype=np.uint8)
        return batch

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` (on the cache's device) as a new ``[n, block_elems]`` tensor there."""
        if self._combined is not None:
            return self._combined.index_select(0, ids).view(len(ids), self.block_elems)
        rows = torch.empty(len(ids), self.block_elems, dtype=self.dtype, device=self.device)
        for (start, end), plane in zip(self.plane_bounds, self.planes, strict=True):
            rows[:, start:end].copy_(plane.view.index_select(0, ids))
        return rows

    def scatter_rows(self, ids: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy ``rows`` (``[n, block_elems]``, on the cache's device) into blocks ``ids``."""
        if self._combined is not None:
            combined = rows.view(len(ids), self.num_planes, self.page_elems)
            self._combined.index_copy_(0, ids, combined)
            return
        for (start, end), plane in zip(self.plane_bounds, self.planes, strict=True):
            plane.view.index_copy_(0, ids, rows[:, start:end])

    def gather(self, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` of the cache into ``out`` (a batch, on the host); done
        when it returns."""
        rows = out.view(len(block_ids), self.block_elems)
        if self.device.type != "cpu":
            rows.copy_(self.gather_rows(block_ids.to(self.device)))
        elif self._combined is not None:
            combined = rows.view(len(block_ids), self.num_planes, self.page_elems)
            torch.index_select(self._combined, 0, block_ids, out=combined)
        else:  # straight into the batch's columns: no staging on the host
            self.gather_planes(range(self.num_planes), block_ids, out)

    def scatter(self, block_ids: torch.Tensor, src: torch.Tensor) -> None:
        """Copy ``src`` (a batch, on the host) into blocks ``block_ids`` of the cache; done
        when it returns."""
        rows = src.view(len(block_ids), self.block_elems)
        self.scatter_rows(block_ids.to(self.device), rows.to(self.device))
        _settle(self.device)

    def _plane_columns(
        self, planes: Sequence[int], block_ids: torch.Tensor, batch: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The ids on the cache's device, and per plane of ``planes``: (its view, its
        columns in ``batch``)."""
        rows = batch.view(len(block_ids), self.block_elems)
        columns = []
        for index in planes:
            start, end = self.plane_bounds[index]
            columns.append((self.planes[index].view, rows[:, start:end]))
        return block_ids.to(self.device), columns

    def gather_planes(
        self, planes: Sequence[int], block_ids: torch.Tensor, out: torch.Tensor
    ) -> None:
        """Copy planes ``planes`` of blocks ``block_ids`` into their columns of ``out``."""
        ids, columns = self._plane_columns(planes, block_ids, out)
        for view, column in columns:
            column.copy_(view.index_select(0, ids))

    def scatter_planes(
        self, planes: Sequence[int], block_ids: torch.Tensor, src: torch.Tensor
    ) -> None:
        """Copy the columns of planes ``planes`` of ``src`` into blocks ``block_ids``."""
        ids, columns = self._plane_columns(planes, block_ids, src)
        for view, column in columns:
            view.index_copy_(0, ids, column.to(self.device))
        _settle(self.device)

    def describe(self) -> str:
        itemsize = self.planes[0].view.element_size()
        sizes = ", ".join(str((end - start) * itemsize) for start, end in self.plane_bounds)
        pages = f"{self.page_bytes} B pages" if self.is_uniform else f"pages of {sizes} B"
        return (
            f"{self.num_planes} planes x {self.num_blocks} blocks x {pages} "
            f"({self.dtype}, {self.device.type}, "
            f"{'one copy per batch' if self.is_single_copy else 'one copy per plane'})"
        )
