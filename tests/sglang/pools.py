"""SGLang's own host pools on CPU tensors (``pin_memory=False``, ``device="cpu"``): what a
HiCache storage backend moves pages to and from, built the way SGLang's host-pool
assembler builds them, from a description of the device pool's buffers."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

PAGE_SIZE = 16
NUM_LAYERS = 2
DEVICE_TOKENS = 128  # the device pool's; the host pool holds twice as many, plus a page
HEADS, HEAD_DIM = 2, 16
KV_LORA_RANK, ROPE_DIM = 32, 8
DTYPE = torch.bfloat16
CPU = torch.device("cpu")


def _pointers(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(
    layout: str,
    allocator: str = "default",
    *,
    num_layers: int = NUM_LAYERS,
    heads: int = HEADS,
    head_dim: int = HEAD_DIM,
    page_size: int = PAGE_SIZE,
    device_tokens: int = DEVICE_TOKENS,
) -> MHATokenToKVPoolHost:
    shape = (device_tokens + page_size, heads, head_dim)
    k = tuple(torch.zeros(shape, dtype=DTYPE) for _ in range(num_layers))
    v = tuple(torch.zeros(shape, dtype=DTYPE) for _ in range(num_layers))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k,
            v=v,
            k_data_ptrs=_pointers(k),
            v_data_ptrs=_pointers(v),
            layout=KVBufferLayout.NHD,
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=DTYPE,
        device=CPU,
    )
    return MHATokenToKVPoolHost(
        info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=num_layers,
    )


def mla_pool(layout: str, allocator: str = "default") -> MLATokenToKVPoolHost:
    width = KV_LORA_RANK + ROPE_DIM
    rows = tuple(
        torch.zeros((DEVICE_TOKENS + PAGE_SIZE, 1, width), dtype=DTYPE) for _ in range(NUM_LAYERS)
    )
    info = MLABufferInfo(
        buffers=rows,
        data_ptrs=_pointers(rows),
        layer_indices=tuple(range(NUM_LAYERS)),
        device_layer_num=NUM_LAYERS,
        page_size=PAGE_SIZE,
        kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=ROPE_DIM,
        kv_cache_dim=width,
        dtype=DTYPE,
        device=CPU,
    )
    return MLATokenToKVPoolHost(
        info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PAGE_SIZE,
        layout=layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=NUM_LAYERS,
        target_layer_num=NUM_LAYERS,
    )


def fill(pool, seed: int) -> None:
    """Random values in every page of the pool."""
    generator = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=generator).to(DTYPE))


def page_bytes(pool, page: int) -> bytes:
    """Page ``page`` of the pool, as SGLang's own flat data page."""
    flat = pool.get_data_page(page * pool.page_size, flat=True)
    return flat.contiguous().view(torch.uint8).numpy().tobytes()
