"""What ``register_kvcache`` is handed, turned into the true paged layout.

The EMS connector hands a list per layer of tensors, in one of these forms:

- K and V apart (the NPU form, and older CUDA ones): ``[K, V]``, each ``[blocks, ...]``;
- MLA: ``[latent]`` or ``[latent, rope]``, planes that may differ in size;
- vLLM's CPU backend, as the guide's connector unpacks it: one view per block of the
  layer's single ``[blocks, kv_heads, block_size, 2 * head_dim]`` tensor.  The views are
  evenly spaced in one storage; the layer tensor is rebuilt from them.

Anything else is refused with ``EMS_INVALID_ARGUMENT``: never a guess, never a crash.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.errors import ConfigError
from kvpool.kvcache.layouts import PagedLayout, Plane, dense_plane

from .errors import invalid

# More tensors than this in one layer can only be one view per block.
MAX_PLANES_PER_LAYER = 2


@dataclass
class Registered:
    layout: PagedLayout
    # Per layer, the tensors as the caller should see them now (one 4-D tensor per plane).
    layers: list[list[torch.Tensor]]
    describe: str


def rebuild(kv_caches: Sequence[Sequence[torch.Tensor]]) -> Registered:
    if not kv_caches:
        raise invalid("register_kvcache: no layers")
    planes: list[Plane] = []
    layers: list[list[torch.Tensor]] = []
    for index, layer in enumerate(kv_caches):
        tensors = list(layer)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise invalid(f"register_kvcache: layer {index} holds no tensors")
        rebuilt = len(tensors) > MAX_PLANES_PER_LAYER
        if rebuilt:
            tensors = [_layer_from_block_views(index, tensors)]
        for k, tensor in enumerate(tensors):
            try:
                planes.append(dense_plane(tensor, f"layer{index}.{k}"))
            except ConfigError as exc:
                raise invalid(f"register_kvcache: {exc}") from None
        layers.append([_four_d(t) for t in tensors] if rebuilt else tensors)
    try:
        layout = PagedLayout(planes)
    except ConfigError as exc:
        raise invalid(f"register_kvcache: {exc}") from None
    shapes = sorted({tuple(t.shape[1:]) for layer in layers for t in layer})
    return Registered(layout, layers, f"{len(layers)} layers, planes {shapes}")


def _layer_from_block_views(index: int, views: list[torch.Tensor]) -> torch.Tensor:
    """The layer tensor that ``views`` (one per block) are consecutive slices of."""
    first = views[0]
    if any(v.shape != first.shape or v.dtype != first.dtype for v in views):
        raise invalid(f"register_kvcache: layer {index}: per-block views differ in shape")
    if any(v.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for v in views):
        raise invalid(f"register_kvcache: layer {index}: per-block views of several tensors")
    step = views[1].storage_offset() - first.storage_offset()
    if step < first.numel() or any(
        views[i].storage_offset() != first.storage_offset() + i * step for i in range(len(views))
    ):
        raise invalid(f"register_kvcache: layer {index}: per-block views are not evenly spaced")
    if any(v.stride() != first.stride() for v in views):
        raise invalid(f"register_kvcache: layer {index}: per-block views differ in strides")
    return torch.as_strided(
        first, (len(views), *first.shape), (step, *first.stride()), first.storage_offset()
    )


def _four_d(tensor: torch.Tensor) -> torch.Tensor:
    """A rebuilt layer tensor as ``[blocks, block_size, heads, head_size]``, the shape the
    guide's connector unpacks after registering.  vLLM's CPU layer tensor is ``[blocks,
    kv_heads, block_size, 2 * head_dim]``: its middle dimensions swap (a view)."""
    if tensor.dim() == 4:
        return tensor.permute(0, 2, 1, 3)
    if tensor.dim() == 3:
        return tensor.unsqueeze(2)
    return tensor
