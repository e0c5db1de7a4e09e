"""Layout detection and batched copies, on CPU tensors shaped like each backend's cache."""

import pytest
import torch

from kvpool.errors import ConfigError
from kvpool.kvcache.layouts import PagedLayout

NB, H, BS, D, L = 12, 2, 32, 64, 3


def cpu_backend():
    # One buffer; per layer [num_blocks, heads, block_size, 2*head_dim] views.
    buffer = torch.randn(L * NB * H * BS * 2 * D).to(torch.bfloat16)
    layers = buffer.view(L, NB, H, BS, 2 * D)
    return {f"model.layers.{layer}.self_attn.attn": layers[layer] for layer in range(L)}


def flash_nhd():
    # Logical [B, H, N, 2D] over a physical [B, N, H, 2D] (NHD) buffer per layer.
    buffer = torch.randn(L, NB, BS, H, 2 * D).to(torch.bfloat16)
    return {f"layer{layer}": buffer[layer].permute(0, 2, 1, 3) for layer in range(L)}


def stacked_kv():
    return {f"layer{layer}": torch.randn(2, NB, BS, H, D).to(torch.float16) for layer in range(L)}


def separate_kv():
    return {
        f"layer{layer}": (torch.randn(NB, BS, H, D), torch.randn(NB, BS, H, D))
        for layer in range(L)
    }


def mla():
    buffer = torch.randn(L, NB, BS, 576).to(torch.bfloat16)
    return {f"layer{layer}": buffer[layer] for layer in range(L)}


@pytest.mark.parametrize(
    ("make", "planes", "single"),
    [
        (cpu_backend, L, True),
        (flash_nhd, L, True),
        (stacked_kv, 2 * L, False),
        (separate_kv, 2 * L, False),
        (mla, L, True),
    ],
)
def test_gather_then_scatter_round_trips_blocks(make, planes, single):
    caches = make()
    layout = PagedLayout.detect(caches)
    assert layout.num_planes == planes and layout.num_blocks == NB
    assert layout.is_single_copy == single
    ids = torch.tensor([7, 2, 9])
    out = torch.empty(3, layout.num_planes, layout.page_elems, dtype=layout.dtype)
    layout.gather(ids, out)
    first = next(iter(caches.values()))
    first = first[0] if isinstance(first, tuple) else first
    # Every page of the pool block is the cache's page, byte for byte.
    before = {
        k: (v[0].clone(), v[1].clone()) if isinstance(v, tuple) else v.clone()
        for k, v in caches.items()
    }
    targets = torch.tensor([0, 1, 11])
    layout.scatter(targets, out)
    again = torch.empty_like(out)
    layout.gather(targets, again)
    assert torch.equal(again, out)
    layout.gather(ids, again)
    assert torch.equal(again, out)  # the sources are untouched
    # Blocks not scattered into are unchanged.
    for name, cache in caches.items():
        old = before[name]
        tensors = zip(cache, old, strict=True) if isinstance(cache, tuple) else [(cache, old)]
        for now, was in tensors:
            blocks = now if now.shape[0] == NB else now[0]
            prior = was if was.shape[0] == NB else was[0]
            assert torch.equal(blocks[3:11], prior[3:11])


def test_pool_view_over_a_buffer():
    layout = PagedLayout.detect(cpu_backend())
    buffer = bytearray(2 * layout.block_bytes)
    view = layout.pool_view(buffer, 2)
    layout.gather(torch.tensor([4, 5]), view)
    assert any(buffer)  # written in place, no staging copy


def test_blocks_held_apart_are_staged_into_one_copy():
    layout = PagedLayout.detect(stacked_kv())
    out = torch.empty(2, layout.num_planes, layout.page_elems, dtype=layout.dtype)
    layout.gather(torch.tensor([3, 8]), out)
    rows = out.view(2, -1).view(torch.uint8)
    # Two blocks from different places, one of them read-only (as pinned arena views are).
    views = [memoryview(bytes(rows[1].numpy())), memoryview(bytearray(rows[0].numpy()))]
    staged = layout.stage(views)
    assert staged.shape == (2, layout.block_elems)
    assert torch.equal(staged[0], out[1].flatten()) and torch.equal(staged[1], out[0].flatten())
    layout.scatter(torch.tensor([10, 11]), staged)
    again = torch.empty_like(out)
    layout.gather(torch.tensor([11, 10]), again)
    assert torch.equal(again, out)
    with pytest.raises(ValueError, match="bytes"):
        layout.stage([memoryview(b"short")])


def test_unknown_layouts_fail_fast_with_a_clear_message():
    strided = torch.randn(NB, 4, 2 * BS)[:, :, ::2]  # pages with holes
    with pytest.raises(ConfigError, match="unknown KV cache layout"):
        PagedLayout.detect({"weird": strided})
    with pytest.raises(ConfigError, match="unknown KV cache layout"):
        PagedLayout.detect({"three": (torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))})
    with pytest.raises(ConfigError, match="differ"):
        PagedLayout.detect({"a": torch.zeros(NB, 8), "b": torch.zeros(NB + 1, 8)})
    with pytest.raises(ConfigError, match="differ"):
        PagedLayout.detect({"a": torch.zeros(NB, 8), "b": torch.zeros(NB, 8, dtype=torch.int8)})
    with pytest.raises(ConfigError, match="no KV cache layers"):
        PagedLayout.detect({})


def test_planes_of_different_page_sizes_move_one_copy_per_plane():
    # An MLA layer that keeps its latent and its rotary part in two tensors.
    caches = {"a": (torch.randn(NB, BS, 512), torch.randn(NB, BS, 64))}
    layout = PagedLayout.detect(caches)
    assert not layout.is_uniform and not layout.is_single_copy
    assert layout.block_elems == BS * (512 + 64)
    out = layout.batch(2)
    layout.gather(torch.tensor([5, 2]), out)
    assert torch.equal(out[0, : BS * 512], caches["a"][0][5].flatten())
    assert torch.equal(out[1, BS * 512 :], caches["a"][1][2].flatten())
    layout.scatter(torch.tensor([0, 1]), out)
    assert torch.equal(caches["a"][0][0], caches["a"][0][5])
    assert torch.equal(caches["a"][1][1], caches["a"][1][2])


def test_shared_layers_count_once():
    caches = cpu_backend()
    first = next(iter(caches.values()))
    caches["model.layers.9.self_attn.attn"] = first  # KV sharing aliases a target layer
    assert PagedLayout.detect(caches).num_planes == L
