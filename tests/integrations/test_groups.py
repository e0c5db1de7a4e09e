"""KV cache groups: which blocks of a prefix each kind of group needs, and their keys."""

from __future__ import annotations

import pytest

from kvpool.integrations.vllm.groups import (
    FULL,
    SLIDING,
    STATE,
    UNSUPPORTED,
    CacheGroup,
    group_namespace,
    group_namespaces,
    unsupported_reason,
)
from kvpool.keys import Namespace

BS = 32


def test_full_attention_needs_every_block_a_recurrent_state_its_last():
    assert CacheGroup(0, FULL).first_needed_block(57, BS) == 0
    # vLLM keeps the state after N blocks in block N-1 (a prefix hit's last block).
    assert CacheGroup(0, STATE).first_needed_block(57, BS) == 56
    assert CacheGroup(0, STATE).first_needed_block(1, BS) == 0


@pytest.mark.parametrize(
    ("window", "num_blocks", "first"),
    [
        # vLLM skips the tokens before the window of the next token: with N blocks computed,
        # the first N*32 - W + 1 tokens; 128 tokens need the last 4 blocks (127 tokens).
        (128, 55, 51),
        (128, 4, 0),
        (128, 5, 1),
        (128, 1, 0),
        (129, 10, 6),  # 320 - 129 + 1 = 192 tokens skipped: 6 blocks
        (96, 10, 7),  # 320 - 96 + 1 = 225 tokens: 7 blocks, the last 3 read
        (33, 10, 9),  # 320 - 33 + 1 = 288: 9 blocks; the last block holds the window
        (32, 10, 9),
        (4096, 10, 0),
    ],
)
def test_sliding_window_needs_the_blocks_of_the_next_tokens_window(window, num_blocks, first):
    group = CacheGroup(1, SLIDING, window)
    assert group.first_needed_block(num_blocks, BS) == first
    # The window the next token reads lies in the blocks kept, and the block before holds
    # only tokens outside it.
    next_token = num_blocks * BS
    assert first * BS <= max(0, next_token - window + 1)
    assert first == 0 or (first - 1) * BS + BS - 1 < next_token - window + 1


def test_one_group_keeps_its_namespace_and_groups_never_share_keys():
    base = Namespace(model="m", block_size=BS, extra="page=4096")
    full, sliding = CacheGroup(0, FULL), CacheGroup(1, SLIDING, 128)
    assert group_namespace(base, full, 1) is base
    spaces = {(0, 0): base, (1, 0): Namespace(model="m", tp_rank=1, tp_size=2)}
    by_rank = group_namespaces(spaces, [full, sliding])
    ids = {ns.id for spaces in by_rank.values() for ns in spaces}
    assert len(ids) == 4 and base.id not in ids
    assert by_rank[(0, 0)][1].extra == "page=4096;group=1:sliding128"
    # Another window is another namespace.
    other = group_namespace(base, CacheGroup(1, SLIDING, 256), 2)
    assert other.id != by_rank[(0, 0)][1].id


def test_a_group_the_pool_cannot_reuse_names_itself():
    groups = [CacheGroup(0, FULL), CacheGroup(1, UNSUPPORTED, spec_name="MambaSpec")]
    assert "MambaSpec" in unsupported_reason(groups)
    assert unsupported_reason([CacheGroup(0, FULL), CacheGroup(1, SLIDING, 128)]) == ""


def test_groups_of_vllms_kv_cache_config():
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from kvpool.integrations.vllm.groups import cache_groups

    def config(*specs, hash_block_size=BS):
        groups = [SimpleNamespace(kv_cache_spec=s, layer_names=[]) for s in specs]
        return SimpleNamespace(kv_cache_groups=groups, hash_block_size=hash_block_size)

    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(
        block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, sliding_window=128
    )
    mamba = MambaSpec(block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,))
    # One group (the hybrid allocator off, or a plain model): the engine's only group, of
    # its own kind: a model whose every layer has a window, a pure state-space model.
    assert [(g.kind, g.page_bytes) for g in cache_groups(config(full), BS)] == [
        (FULL, full.page_size_bytes)
    ]
    assert cache_groups(SimpleNamespace(), BS) == [CacheGroup(0, FULL)]
    assert [(g.kind, g.sliding_window) for g in cache_groups(config(window), BS)] == [
        (SLIDING, 128)
    ]
    assert [(g.kind, g.sliding_window) for g in cache_groups(config(window, full), BS)] == [
        (SLIDING, 128),
        (FULL, 0),
    ]
    assert [g.kind for g in cache_groups(config(mamba, full), BS)] == [UNSUPPORTED, FULL]
    aligned = MambaSpec(
        block_size=BS, shapes=((4, 8),), dtypes=(torch.float32,), mamba_cache_mode="align"
    )
    assert [g.kind for g in cache_groups(config(aligned, full), BS)] == [STATE, FULL]
    assert [g.kind for g in cache_groups(config(aligned), BS)] == [STATE]
    # A state kept only for the running request (no prefix caching): nothing to reuse.
    (alone,) = cache_groups(config(mamba), BS)
    assert alone.kind == UNSUPPORTED and "cache mode none" in unsupported_reason([alone])
    # Hashes finer than a block, or a group of another block size: nothing is keyed right.
    assert {g.kind for g in cache_groups(config(window, full, hash_block_size=16), BS)} == {
        UNSUPPORTED
    }
    assert [g.kind for g in cache_groups(config(window, full), 2 * BS)] == [UNSUPPORTED] * 2
