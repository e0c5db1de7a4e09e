"""When the connector saves (kvpool.integrations.vllm.saving), against vLLM's own block pool
(its real free queue, in this process: no engine)."""

import hashlib

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

from kvpool.integrations.vllm.saving import AUTO_WINDOW, EAGER, EVICTING, SavePlan


def block_hash(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def cached_blocks(pool: BlockPool, num: int, first: int = 0) -> list:
    """``num`` blocks allocated, filled and cached as vLLM caches them, then freed (in the
    order vLLM frees a request's blocks: the last first, so that it is evicted first)."""
    blocks = pool.get_new_blocks(num)
    for i, block in enumerate(blocks):
        block_key = make_block_hash_with_group_id(block_hash(first + i), 0)
        block.set_block_hash(block_key)
        pool.cached_block_hash_to_block.insert(block_key, block)
    pool.free_blocks(reversed(blocks))
    return blocks


def test_blocks_never_cached_count_toward_the_window_and_are_never_saved():
    pool = BlockPool(num_gpu_blocks=33, enable_caching=True, hash_block_size=16)
    plan = SavePlan("evicting")
    plan.bind(pool, lookahead=8)
    blocks = pool.get_new_blocks(32)
    pool.free_blocks(blocks[:6])  # six uncached blocks at the head ...
    cached_blocks_after = blocks[6:]
    for i, block in enumerate(cached_blocks_after):  # ... then cached ones
        block.set_block_hash(make_block_hash_with_group_id(block_hash(i), 0))
    pool.free_blocks(cached_blocks_after)
    ids, _ = plan.evicting()
    assert ids == [b.block_id for b in cached_blocks_after[:2]]  # 8 - 6 of them


def test_evicting_walks_only_the_head_of_the_free_queue_and_skips_what_the_pool_holds():
    pool = BlockPool(num_gpu_blocks=33, enable_caching=True, hash_block_size=16)
    plan = SavePlan("evicting")
    plan.bind(pool, lookahead=8)
    blocks = cached_blocks(pool, 32)  # every block but the null one, freed leaf first
    ids, hashes = plan.evicting()
    leaves = list(reversed(blocks))[:8]
    assert ids == [b.block_id for b in leaves]
    assert hashes == [block_hash(31 - i) for i in range(8)]  # the hash less its group id
    plan.saved(hashes)
    ids, hashes = plan.evicting()
    assert ids == []  # the window holds only what was saved: nothing more this step
    pool.get_new_blocks(4)  # the engine takes four: four more come into the window
    ids, hashes = plan.evicting()
    assert hashes == [block_hash(31 - i) for i in range(8, 12)]


def test_auto_follows_whose_blocks_the_engine_loads():
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    plan = SavePlan("auto")
    plan.bind(pool, lookahead=8)
    assert plan.current == EAGER  # until it knows
    own = [block_hash(i) for i in range(AUTO_WINDOW)]
    plan.saved(own)
    plan.loaded(own)  # all its own: the pool gives back what it dropped
    assert plan.current == EVICTING
    others = [block_hash(10_000 + i) for i in range(AUTO_WINDOW)]
    plan.loaded(others)  # all another engine's: they need blocks early
    assert plan.current == EAGER
    assert plan.num_decisions == 2


def test_what_cannot_save_on_eviction_saves_eagerly():
    assert SavePlan("evicting", not_evicting="a producer").current == EAGER
    pool = BlockPool(num_gpu_blocks=8, enable_caching=False, hash_block_size=16)
    plan = SavePlan("evicting")
    plan.bind(pool, lookahead=8)  # no prefix caching: nothing is cached to be dropped
    assert plan.is_eager and plan.evicting() == ([], [])
