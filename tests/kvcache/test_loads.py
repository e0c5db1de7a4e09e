"""One load path against a real node, on CPU tensors: the whole request in one step
(``load_into``) and layer by layer (``Load`` with ``by_layer``)."""

import logging
import threading
import time

import torch

from kvpool import Client
from kvpool.keys import Namespace
from kvpool.kvcache.cache import PagedCache
from kvpool.kvcache.copies import copies_for
from kvpool.kvcache.guard import PoolGuard
from kvpool.kvcache.layouts import PagedLayout
from kvpool.kvcache.loads import Load, load_into

NB, H, BS, D, L = 8, 2, 4, 8, 3
NS = Namespace(model="kvcache-loads", block_size=BS)
log = logging.getLogger("test.loads")


def paged_cache(seed, head_dim=D):
    numel = L * NB * H * BS * 2 * head_dim
    buffer = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    layers = buffer.view(L, NB, H, BS, 2 * head_dim)
    tensors = {f"layer{i}": layers[i] for i in range(L)}
    layout = PagedLayout.detect(tensors)
    return tensors, PagedCache(copies_for(layout), PoolGuard(None, log))


def keys(n, tag=b"k"):
    return NS.keys([tag + bytes([i]) * 15 for i in range(n)])


def store(client, tensors, block_ids, block_keys):
    """Put blocks of a cache into the pool, as pool blocks (plane after plane)."""
    values = [torch.cat([tensors[f"layer{i}"][b].flatten() for i in range(L)]) for b in block_ids]
    result = client.put(block_keys, [v.numpy() for v in values])
    assert all(s == 0 for s in result.statuses)


def test_a_whole_load_fills_the_blocks_and_stops_at_the_first_missing_one(client):
    src, _ = paged_cache(1)
    dst, cache = paged_cache(2)
    before = {name: t.clone() for name, t in dst.items()}
    wanted = keys(4)
    store(client, src, [5, 6], wanted[:2])
    store(client, src, [7], wanted[3:])  # after a gap: not part of the prefix
    load = load_into(cache, client, wanted, [0, 1, 2, 3], timeout=5.0)
    assert load.num_blocks == 2 and load.finished
    assert load.reason == "2 block(s) missing or corrupt"
    for name in dst:
        assert torch.equal(dst[name][[0, 1]], src[name][[5, 6]])
        assert torch.equal(dst[name][[2, 3]], before[name][[2, 3]])


def test_layer_by_layer_each_plane_is_in_place_before_its_wait_returns(client):
    src, _ = paged_cache(1)
    dst, cache = paged_cache(2)
    wanted = keys(3, b"l")
    store(client, src, [1, 2, 3], wanted)
    load = Load(cache, wanted, [4, 5, 6], time.monotonic() + 5, by_layer=True)
    thread = threading.Thread(target=load.run, args=(client,))
    thread.start()
    for i in range(L):
        load.wait_for(cache.layout.layers[f"layer{i}"])
        assert torch.equal(dst[f"layer{i}"][[4, 5, 6]], src[f"layer{i}"][[1, 2, 3]])
    assert load.stop() == 3
    thread.join(5)
    assert load.reason == ""


def test_a_dead_pool_is_a_miss_not_an_exception(start_node):
    node = start_node()
    _, cache = paged_cache(2)
    with Client(node.unix_address, timeout=0.5) as client:
        node.kill()
        load = load_into(cache, client, keys(2), [0, 1], timeout=1.0)
    assert load.num_blocks == 0 and load.reason and load.finished


def test_blocks_of_another_size_are_never_sliced_into_pages(client):
    """From a writer's side: blocks of twice the cache's page size, put side by side (one
    adjacent run in the arena, which the zero-copy load views whole), and a block of half
    a page.  A load delivers only blocks of the page's size; the rest are misses, and the
    cache's pages are untouched."""
    src, cache = paged_cache(1, head_dim=64)
    page = cache.layout.block_bytes
    assert page % 4096 == 0  # blocks of twice its size lie side by side in the arena
    dst, cache = paged_cache(2, head_dim=64)
    before = {name: t.clone() for name, t in dst.items()}
    double = keys(2, b"d")
    assert client.put(double, [bytes([7]) * (2 * page)] * 2).statuses == [0, 0]
    with client.begin_read(double) as lease:
        assert lease.extent(2) is not None  # one adjacent run: what a zero-copy load views
    load = load_into(cache, client, double, [0, 1], timeout=5.0)
    assert load.num_blocks == 0 and "missing or corrupt" in load.reason
    for name in dst:
        assert torch.equal(dst[name], before[name])
    # One block of the page's size, then one of another size: the first only.
    mixed = keys(2, b"m")
    store(client, src, [5], mixed[:1])
    assert client.put(mixed[1:], [bytes([9]) * (page // 2)]).statuses == [0]
    load = load_into(cache, client, mixed, [2, 3], timeout=5.0)
    assert load.num_blocks == 1
    for name in dst:
        assert torch.equal(dst[name][2], src[name][5])
        assert torch.equal(dst[name][3], before[name][3])


def test_a_row_read_counts_only_blocks_of_the_rows_size(client):
    """``read_rows`` (SGLang's flat page reads): a block shorter than its row fills only
    part of it, so it is a miss, and so is every row after it."""
    from kvpool.kvcache.loads import read_rows

    wanted = keys(3, b"r")
    assert client.put(wanted, [b"a" * 4096, b"b" * 2048, b"c" * 4096]).statuses == [0, 0, 0]
    rows = [bytearray(4096) for _ in range(3)]
    assert read_rows(PoolGuard(None, log), client, wanted, rows, timeout=5.0) == 1
    assert rows[0] == b"a" * 4096
