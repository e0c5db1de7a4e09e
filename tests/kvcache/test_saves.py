"""Saves against a real node, on CPU tensors: a save reserved first and filled plane by
plane, a save copied out at once and written later, a whole save at once from a cache in
host memory (a page-based engine's host pool), and blocks in the engine's own buffers."""

import torch

from kvpool import Client
from kvpool.errors import Status
from kvpool.kvcache.loads import read_rows
from kvpool.kvcache.saves import Save, put_batch, put_rows, save_from, save_now
from tests.kvcache.test_loads import L, keys, paged_cache


def block(tensors, block_id):
    return torch.cat([tensors[f"layer{i}"][block_id].flatten() for i in range(L)])


def stored(client, block_keys):
    got = client.get(block_keys)
    return [torch.frombuffer(v, dtype=torch.float32) if v is not None else None for v in got.values]


def test_a_save_reserved_first_commits_each_plane_as_it_was_when_copied(client):
    src, cache = paged_cache(1)
    wanted = keys(2, b"s")
    save = Save(cache, wanted, [3, 6], started=0.0)
    save.reserve(client, timeout=5.0)
    expected = [block(src, 3), block(src, 6)]
    save.copy(cache.layout.layers["layer0"])
    src["layer0"][3].zero_()  # after its copy: not what is saved
    lease = save.close()
    assert lease is not None
    src["layer1"][6].zero_()  # after close: the cache is the engine's again
    result = save.commit(timeout=5.0)
    assert [s for s in result.statuses] == [Status.OK, Status.OK]
    for got, want in zip(stored(client, wanted), expected, strict=True):
        assert torch.equal(got, want)


def test_a_save_abandoned_before_its_reservation_gives_the_space_back(client):
    _, cache = paged_cache(1)
    wanted = keys(1, b"a")
    save = Save(cache, wanted, [0], started=0.0)
    save.abandon()  # the step ended first
    save.reserve(client, timeout=5.0)
    assert save.lease is None
    assert client.lookup(wanted) == 0
    again = Save(cache, wanted, [0], started=0.0)
    again.reserve(client, timeout=5.0)  # the space is free to reserve again
    assert again.wanted == [0]
    again.abandon()


def test_blocks_copied_out_are_written_later_and_present_ones_count(client):
    src, cache = paged_cache(1)
    wanted = keys(3, b"c")
    client.put(wanted[:1], [block(src, 2).numpy()])
    blocks = save_from(cache, [2, 4, 7])
    expected = [block(src, b) for b in (2, 4, 7)]
    for tensor in src.values():
        tensor.zero_()  # the engine reuses its blocks at once
    saved = put_batch(cache, client, wanted, blocks, timeout=5.0)
    assert saved[:3] == (3, "", 0) and saved.stored == (True, True, True)
    for got, want in zip(stored(client, wanted), expected, strict=True):
        assert torch.equal(got, want)


def test_a_whole_save_at_once_copies_into_pool_memory_and_counts_present_blocks(client):
    src, cache = paged_cache(1)
    wanted = keys(3, b"n")
    client.put(wanted[1:2], [block(src, 5).numpy()])
    saved = save_now(cache, client, wanted, [4, 5, 6], timeout=5.0)
    assert saved == (3, "", 0, (True, True, True))
    assert client.lookup(wanted) == 3
    for got, want in zip(stored(client, wanted), [block(src, b) for b in (4, 5, 6)], strict=True):
        assert torch.equal(got, want)


def test_a_whole_save_to_a_dead_pool_stores_nothing_and_says_why(start_node):
    node = start_node()
    _, cache = paged_cache(1)
    with Client(node.unix_address, timeout=0.5) as client:
        node.kill()
        saved = save_now(cache, client, keys(2, b"d"), [0, 1], timeout=0.5)
    assert saved.num_stored == 0 and saved.reason and saved.stored == ()


def test_rows_of_the_engines_own_are_put_and_read_back_to_the_first_missing_one(client):
    src, cache = paged_cache(1)
    wanted = keys(3, b"r")
    rows = [block(src, b) for b in (1, 2, 3)]
    assert put_rows(cache.guard, client, wanted[:1] + wanted[2:], [rows[0], rows[2]], 5.0)[0] == 2
    out = [torch.zeros_like(r) for r in rows]
    assert read_rows(cache.guard, client, wanted, out, 5.0) == 1
    assert torch.equal(out[0], rows[0]) and not out[1].any() and not out[2].any()
