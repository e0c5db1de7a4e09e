"""The worker half against a real node, driven step by step the way vLLM's model runner
drives it (bind, per-layer hooks, wait_for_save), on CPU tensors shaped like vLLM's CPU
backend cache."""

import threading
import time

import pytest
import torch

from kvpool.integrations.vllm.config import connector_config
from kvpool.integrations.vllm.metadata import KVPoolMetadata, TransferJob
from kvpool.integrations.vllm.worker import KVPoolWorker
from kvpool.keys import Namespace
from kvpool.kvcache.ranks import writes_blocks

NB, H, BS, D, L = 16, 2, 16, 32, 4
NS = Namespace(model="worker-test", block_size=BS)
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(L)]


def caches(seed):
    generator = torch.Generator().manual_seed(seed)
    buffer = torch.randn(L * NB * H * BS * 2 * D, generator=generator)
    layers = buffer.view(L, NB, H, BS, 2 * D)
    return {name: layers[i] for i, name in enumerate(LAYERS)}


def worker(node, kv, namespace=NS, can_save=True, **extra):
    config = connector_config(
        {"address": node.unix_address, "lookup_timeout": 2.0, **extra}, environ={}
    )
    w = KVPoolWorker(config, namespace, H * BS * 2 * D * 4, can_save=can_save)
    w.register_kv_caches(kv)
    return w


def hashes(n, tag=b"h"):
    return [tag + bytes([i]) * 15 for i in range(n)]


def step(w, meta, on_layer=None):
    """One forward step: bind, then per layer wait-for-load, 'compute', save; then finish."""
    w.begin_step(meta)
    w.start_load_kv(meta)
    for name in LAYERS:
        w.wait_for_layer_load(name)
        if on_layer is not None:
            on_layer(name)
        w.save_kv_layer(name)
    w.wait_for_save(meta)


def drain(w):
    """Wait for the step's commits, as a later step would find them."""
    deadline = time.monotonic() + 10
    while w._saving and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not w._saving


@pytest.mark.parametrize("transfer", ["layerwise", "whole"])
def test_blocks_saved_in_a_step_load_into_another_engine(node, transfer):
    src, dst = caches(1), caches(2)
    saver, loader = worker(node, src, transfer=transfer), worker(node, dst, transfer=transfer)
    step(saver, KVPoolMetadata(saves=[TransferJob("r1", [3, 7, 9], hashes(3))]))
    drain(saver)

    seen = {}
    job = TransferJob("r2", [0, 1, 2], hashes(3))

    def check(name):
        # What the attention would read: the layer is in place before it runs.
        seen[name] = torch.equal(dst[name][[0, 1, 2]], src[name][[3, 7, 9]])

    if transfer == "layerwise":
        slow = type(loader.pool.layout).scatter_planes

        def slow_scatter(layout, planes, ids, rows):
            time.sleep(0.05)  # a slow pool: the attention must wait for each layer
            slow(layout, planes, ids, rows)

        loader.pool.layout.scatter_planes = slow_scatter.__get__(loader.pool.layout)
        step(loader, KVPoolMetadata(loads=[job]), on_layer=check)
        assert all(seen.values()) and len(seen) == L
        assert loader.get_finished(set()) == (None, None)  # loaded within the step
    else:
        step(loader, KVPoolMetadata(loads=[job]))
        deadline = time.monotonic() + 10
        done = None
        while done is None and time.monotonic() < deadline:
            done = loader.get_finished(set())[1]
            time.sleep(0.01)
        assert done == {"r2"}
    assert loader.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(dst[name][[0, 1, 2]], src[name][[3, 7, 9]])
    stats = loader.take_stats()
    assert stats is not None and stats.data["loaded_blocks"] == 3
    saver.shutdown()
    loader.shutdown()


def test_mla_ranks_share_one_copy_that_rank_0_saves(node, client):
    """MLA: every tensor-parallel rank holds the same latent KV; rank 1 saves nothing, rank
    0 saves the one copy, and rank 1 (of this or another engine) loads it."""
    mla = Namespace(model="worker-test", block_size=BS, is_mla=True, tp_size=2)
    rank0, rank1 = mla.for_rank(0, 0), mla.for_rank(1, 0)
    assert rank0 == rank1 and writes_blocks(rank0, 0) and not writes_blocks(rank1, 1)
    assert writes_blocks(NS.for_rank(1, 0), 1)  # a dense model's ranks each save their own
    src = caches(1)
    savers = [
        worker(node, src, namespace=ns, can_save=writes_blocks(ns, tp))
        for tp, ns in enumerate((rank0, rank1))
    ]
    save = KVPoolMetadata(saves=[TransferJob("r1", [3, 7], hashes(2))])
    step(savers[1], save)
    drain(savers[1])
    assert client.stats().num_blocks == 0
    step(savers[0], save)
    drain(savers[0])
    assert client.stats().num_blocks == 2
    dst = caches(2)
    loader = worker(node, dst, namespace=rank1, can_save=False)
    step(loader, KVPoolMetadata(loads=[TransferJob("r2", [0, 1], hashes(2))]))
    assert loader.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(dst[name][[0, 1]], src[name][[3, 7]])
    for w in (*savers, loader):
        w.shutdown()


def test_blocks_the_pool_lacks_are_recomputed(node):
    src, dst = caches(1), caches(2)
    saver, loader = worker(node, src), worker(node, dst)
    step(saver, KVPoolMetadata(saves=[TransferJob("r1", [3, 7], hashes(2))]))
    drain(saver)
    before = {name: dst[name].clone() for name in LAYERS}
    step(loader, KVPoolMetadata(loads=[TransferJob("r2", [0, 1, 2, 4], hashes(4))]))
    assert loader.get_block_ids_with_load_errors() == {2, 4}
    for name in LAYERS:
        assert torch.equal(dst[name][[0, 1]], src[name][[3, 7]])
        assert torch.equal(dst[name][[2, 4]], before[name][[2, 4]])
    saver.shutdown()
    loader.shutdown()


def test_layer_copies_of_a_save_run_behind_the_forward(node):
    """Each layer is copied out after its save_kv_layer, on the save thread, while later
    layers still 'compute'; what wait_for_save commits is each layer as it was then."""
    src = caches(1)
    saver = worker(node, src)
    copied = threading.Event()
    real_copy = type(saver.pool.layout).gather_planes

    def spy(layout, planes, ids, out):
        real_copy(layout, planes, ids, out)
        copied.set()

    saver.pool.layout.gather_planes = spy.__get__(saver.pool.layout)
    meta = KVPoolMetadata(saves=[TransferJob("r1", [5], hashes(1, b"s"))])
    saver.begin_step(meta)
    saver.wait_for_layer_load(LAYERS[0])
    saver.save_kv_layer(LAYERS[0])
    assert copied.wait(5), "layer 0 was not copied while the forward went on"
    expected = torch.cat([src[name][5].flatten() for name in LAYERS])
    for name in LAYERS[1:]:
        saver.save_kv_layer(name)
    saver.wait_for_save(meta)
    src[LAYERS[0]][5].zero_()  # the step is over: the block may be reused at once
    drain(saver)
    got = saver.pool.client.get(NS.keys(hashes(1, b"s")))
    assert got.values[0] is not None
    assert torch.equal(torch.frombuffer(got.values[0], dtype=torch.float32), expected)
    saver.shutdown()


def test_a_load_from_a_dead_pool_does_not_hold_the_forward(start_node):
    node = start_node()
    src, dst = caches(1), caches(2)
    saver = worker(node, src)
    step(saver, KVPoolMetadata(saves=[TransferJob("r1", [3], hashes(1))]))
    drain(saver)
    loader = worker(node, dst, transfer_timeout=1.0, timeout=0.5)
    node.kill()
    started = time.monotonic()
    step(loader, KVPoolMetadata(loads=[TransferJob("r2", [0], hashes(1))]))
    assert time.monotonic() - started < 5
    assert loader.get_block_ids_with_load_errors() == {0}
    saver.shutdown()
    loader.shutdown()


def test_hybrid_groups_save_each_shared_tensor_once_all_its_layers_ran(node):
    """vLLM's hybrid allocator: a sliding-window group (layers 0, 2) and a full-attention
    group (layers 1, 3) share two tensors, a layer of each per tensor.  A block is saved
    with the writes of every layer sharing its tensor (not copied once the first one ran),
    under its group's namespace; a load that fails is reported per request, never per
    block id (vLLM cannot map those back to a group)."""
    from kvpool.integrations.vllm.groups import FULL, SLIDING, CacheGroup

    groups = [CacheGroup(0, SLIDING, 64), CacheGroup(1, FULL)]

    def shared_caches(seed):
        layers = caches(seed)
        return {name: layers[LAYERS[i - i % 2]] for i, name in enumerate(LAYERS)}

    def hybrid_worker(kv):
        config = connector_config({"address": node.unix_address, "lookup_timeout": 2.0}, environ={})
        w = KVPoolWorker(config, NS, H * BS * 2 * D * 4, groups)
        w.register_kv_caches(kv)
        return w

    src, dst = shared_caches(1), shared_caches(2)
    saver, loader = hybrid_worker(src), hybrid_worker(dst)
    save = TransferJob("r1", [3, 7, 9], hashes(3), groups=[0, 1, 1])

    def compute(name):  # the layer's attention writes its KV into the step's blocks
        saver._saver.submit(lambda: None).result()  # a forward slower than the copies
        src[name][[3, 7, 9]] = torch.randn(3, H, BS, 2 * D)

    step(saver, KVPoolMetadata(saves=[save]), on_layer=compute)
    drain(saver)
    load = TransferJob("r2", [0, 1, 2], hashes(3), is_async=True, groups=[0, 1, 1])
    step(loader, KVPoolMetadata(loads=[load]))
    deadline = time.monotonic() + 10
    results = loader.get_transfer_results()
    while not results.finished_recving and time.monotonic() < deadline:
        time.sleep(0.01)
        results = loader.get_transfer_results()
    assert results.finished_recving == {"r2"} and not results.failed_recving
    for name in LAYERS:
        assert torch.equal(dst[name][[0, 1, 2]], src[name][[3, 7, 9]]), name
    # The same hashes under another group's namespace are not there: the request fails.
    crossed = TransferJob("r3", [4, 5], hashes(2), is_async=True, groups=[1, 0])
    step(loader, KVPoolMetadata(loads=[crossed]))
    deadline = time.monotonic() + 10
    results = loader.get_transfer_results()
    while not results.finished_recving and time.monotonic() < deadline:
        time.sleep(0.01)
        results = loader.get_transfer_results()
    assert results.failed_recving == {"r3"} == results.finished_recving
    assert loader.get_block_ids_with_load_errors() == set()
    saver.shutdown()
    loader.shutdown()
