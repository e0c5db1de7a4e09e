"""kvpool as SGLang's HiCache storage backend, with SGLang's own code on CPU: its real host
pools (:mod:`tests.sglang.pools`), the backend created by its ``StorageBackendFactory`` as
the dynamic backend it documents, and pages moved by ``HiCacheController``'s own page paths
(generic and zero-copy), called on a stand-in controller as SGLang's CPU test for its
SeaweedFS backend does: the controller's constructor needs a device pool and CUDA events,
which this machine has not.  Page keys are SGLang's own page hashes of a token list
(``_storage_hit_query``), against real ``kvpool serve`` processes."""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

# SGLang's own code runs in its own environment (.venv-sglang, `make pytest-sglang`:
# docs/testing.md); elsewhere this module is skipped, saying so.
pytest.importorskip("sglang", reason="runs in the SGLang environment: make pytest-sglang")

import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvpool import Client
from kvpool.errors import ConfigError
from kvpool.harness.process import NodeProcess
from kvpool.integrations.sglang import KVPoolStorage
from tests.security.tenants import TenantsFile
from tests.sglang.pools import PAGE_SIZE, fill, mha_pool, mla_pool, page_bytes

NUM_PAGES = 4
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
POOLS = {"mha": mha_pool, "mla": mla_pool}
PAGE_SET = {
    "generic": HiCacheController._generic_page_set,
    "zero_copy": HiCacheController._page_set_zero_copy,
}
PAGE_GET = {
    "generic": HiCacheController._generic_page_get,
    "zero_copy": HiCacheController._page_get_zero_copy,
}


@pytest.fixture(scope="module")
def shared_node() -> Iterator[NodeProcess]:
    """One node for the tests whose point is not a fresh process (each uses its own
    tokens, so its own pages)."""
    run_dir = Path("/dev/shm") / f"kvpool-sglang-{os.getpid()}-{secrets.token_hex(4)}"
    run_dir.mkdir(mode=0o770)
    node = NodeProcess.private("sglang", "128MiB", run_dir=str(run_dir)).start()
    yield node
    node.stop()
    shutil.rmtree(run_dir, ignore_errors=True)


def storage_config(
    address: str, *, tp_rank: int = 0, tp_size: int = 1, is_mla: bool = False, **extra: Any
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="Qwen/Qwen3-0.6B",
        extra_config={
            "backend_name": "kvpool",
            "module_path": "kvpool.integrations.sglang",
            "class_name": "KVPoolStorage",
            "interface_v1": 1,
            "address": address,
            "timeout": 2.0,
            "transfer_timeout": 2.0,
            **extra,
        },
    )


_OPEN: list[KVPoolStorage] = []


@pytest.fixture(autouse=True)
def close_backends() -> Iterator[None]:
    """Each test's backends are closed (their health probes stop) when it ends."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def backend(config: HiCacheStorageConfig, pool: Any) -> KVPoolStorage:
    """The backend as SGLang's attach creates and registers it."""
    store = StorageBackendFactory.create_backend("dynamic", config, pool)
    assert isinstance(store, KVPoolStorage)
    _OPEN.append(store)
    store.register_mem_pool_host(pool)
    return store


def controller(store: KVPoolStorage, pool: Any) -> SimpleNamespace:
    """What the controller's page paths read of the controller."""
    return SimpleNamespace(
        storage_backend=store,
        storage_host_pool=pool,
        storage_config=store.storage_config,
        page_size=PAGE_SIZE,
    )


def tokens(tag: str, num_pages: int = NUM_PAGES) -> list[int]:
    seed = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:7], "little")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (num_pages * PAGE_SIZE,), generator=generator).tolist()


def page_hashes(token_ids: list[int]) -> list[str]:
    """SGLang's keys of the pages of ``token_ids``: its chained page hashes."""
    return list(get_storage_hash_str(token_ids, None, page_size=PAGE_SIZE))


def hit_query(ctrl: SimpleNamespace, token_ids: list[int]) -> tuple[list[str], int]:
    """SGLang's prefetch lookup: its page hashes of the tokens, and how many tokens the
    storage holds (leading pages)."""
    operation = PrefetchOperation("r", token_ids)
    return HiCacheController._storage_hit_query(ctrl, operation)


def host_indices(num_pages: int = NUM_PAGES) -> torch.Tensor:
    return torch.arange(num_pages * PAGE_SIZE, dtype=torch.int64)


def save(ctrl: SimpleNamespace, keys: list[str], via: str = "zero_copy") -> bool:
    """The backup thread's page set, skipped on a rank SGLang does not make the writer."""
    if HiCacheController.backup_skip.fget(ctrl):  # type: ignore[attr-defined]
        return True
    return PAGE_SET[via](ctrl, keys, host_indices(len(keys)))


def load(ctrl: SimpleNamespace, keys: list[str], via: str = "zero_copy") -> int:
    operation = PrefetchOperation("r", [])
    return PAGE_GET[via](ctrl, operation, keys, host_indices(len(keys)))


def saved_pages(
    address: str, kind: str, layout: str, tag: str, **extra: Any
) -> tuple[SimpleNamespace, list[str], list[bytes]]:
    """A host pool of random pages whose first NUM_PAGES are saved: its controller, SGLang's
    keys of the pages and their bytes."""
    pool = POOLS[kind](layout)
    fill(pool, seed=len(tag))
    ctrl = controller(backend(storage_config(address, is_mla=kind == "mla", **extra), pool), pool)
    keys = page_hashes(tokens(tag))
    assert hit_query(ctrl, tokens(tag)) == ([], 0)
    assert save(ctrl, keys)
    return ctrl, keys, [page_bytes(pool, i) for i in range(NUM_PAGES)]


def fresh(address: str, kind: str, layout: str, **extra: Any) -> SimpleNamespace:
    pool = POOLS[kind](layout)
    return controller(backend(storage_config(address, is_mla=kind == "mla", **extra), pool), pool)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_pages_saved_by_one_host_pool_load_byte_identical_into_a_fresh_one(
    shared_node: NodeProcess, kind: str, layout: str
) -> None:
    """Every layout, both paths, either way round: the pool block is SGLang's flat page."""
    address = shared_node.unix_address
    for set_via in PAGE_SET:
        for get_via in PAGE_GET:
            tag = f"{kind}-{layout}-{set_via}-{get_via}"
            _, keys, expected = saved_pages(address, kind, layout, tag)
            reader = fresh(address, kind, layout)
            found, num_tokens = hit_query(reader, tokens(tag))
            assert (found, num_tokens) == (keys, NUM_PAGES * PAGE_SIZE)
            assert load(reader, keys, get_via) == NUM_PAGES, tag
            pool = reader.storage_host_pool
            assert [page_bytes(pool, i) for i in range(NUM_PAGES)] == expected, tag
            assert not any(page_bytes(pool, NUM_PAGES))  # nothing past the pages loaded


@pytest.mark.parametrize("via", ["generic", "zero_copy"])
def test_a_load_stops_at_the_first_missing_page(shared_node: NodeProcess, via: str) -> None:
    """Pages after a missing one are not part of the prefix: not counted, not copied."""
    address = shared_node.unix_address
    writer, keys, expected = saved_pages(address, "mha", "page_first", f"missing-{via}")
    store = writer.storage_backend
    with Client(address) as client:
        client.delete(store.pool_keys(keys[2:3]))
    reader = fresh(address, "mha", "page_first")
    found, num_tokens = hit_query(reader, tokens(f"missing-{via}"))
    assert (found, num_tokens) == (keys[:2], 2 * PAGE_SIZE)
    assert load(reader, keys, via) == 2
    pool = reader.storage_host_pool
    assert [page_bytes(pool, i) for i in range(2)] == expected[:2]
    assert not any(page_bytes(pool, 3))  # the page after the gap was not loaded


def test_a_damaged_page_is_refused(shared_node: NodeProcess) -> None:
    """A byte flipped in the arena under a stored page: a verifying reader refuses the page
    and everything after it, and the node drops it (to be saved again)."""
    address = shared_node.unix_address
    writer, keys, expected = saved_pages(address, "mla", "page_first_direct", "damaged")
    with (
        Client(address) as client,
        client.begin_read(writer.storage_backend.pool_keys(keys)) as read,
    ):
        offset = read.offsets[1]
    with open(shared_node.info["arena"], "r+b") as arena:
        arena.seek(offset + 100)
        byte = arena.read(1)
        arena.seek(offset + 100)
        arena.write(bytes([byte[0] ^ 0xFF]))
    reader = fresh(address, "mla", "page_first_direct", verify_reads=True)
    assert load(reader, keys) == 1
    pool = reader.storage_host_pool
    assert page_bytes(pool, 0) == expected[0]
    assert not any(page_bytes(pool, 1))
    assert hit_query(reader, tokens("damaged"))[1] == PAGE_SIZE  # dropped by the node


def test_a_node_that_stops_mid_read_and_dies_is_a_miss_within_the_deadline(
    run_dir: Path,
) -> None:
    """The node freezes (SIGSTOP) with a read on its way over its socket, then is killed:
    the read comes back as misses by its deadline, nothing raises into SGLang's
    controller, and later calls miss at once while the pool is down.  (A same-host reader
    of sealed pages copies them out of the arena without the node, through its directory:
    there a dead node's pages still load, verified unchanged.)"""
    node = NodeProcess.private("dies", "64MiB", run_dir=str(run_dir)).start()
    try:
        _, keys, _ = saved_pages(node.unix_address, "mha", "layer_first", "dies")
        reader = fresh(node.tcp_address, "mha", "layer_first", use_shm=False)
        results: list[int] = []
        node.signal(signal.SIGSTOP)
        started = time.monotonic()
        reading = threading.Thread(target=lambda: results.append(load(reader, keys)))
        reading.start()
        node.kill()
        reading.join(10)
        assert results == [0]
        assert time.monotonic() - started < 2.0 + 3.0  # transfer_timeout, and a margin
        began = time.monotonic()
        assert hit_query(reader, tokens("dies")) == ([], 0)
        assert not save(reader, keys)
        assert time.monotonic() - began < 2.0
    finally:
        node.stop()


def test_tp2_mla_ranks_share_one_copy(shared_node: NodeProcess) -> None:
    """MLA's latent is alike on every tensor-parallel rank: the rank SGLang makes the writer
    (rank 0) saves it once, and the other rank loads that copy byte for byte."""
    address = shared_node.unix_address
    with Client(address) as client:
        before = client.stats().num_blocks
    pools = [mla_pool("page_first"), mla_pool("page_first")]
    fill(pools[0], seed=7)
    fill(pools[1], seed=7)  # the same latents on both ranks, as MLA computes them
    ctrls = [
        controller(
            backend(storage_config(address, tp_rank=r, tp_size=2, is_mla=True), pools[r]),
            pools[r],
        )
        for r in range(2)
    ]
    keys = page_hashes(tokens("tp2-mla"))
    expected = [page_bytes(pools[0], i) for i in range(NUM_PAGES)]
    assert ctrls[1].storage_backend.pool_keys(keys) == ctrls[0].storage_backend.pool_keys(keys)
    assert save(ctrls[0], keys) and save(ctrls[1], keys)
    assert ctrls[1].storage_backend.batch_set_v1(keys, host_indices()) == [False] * NUM_PAGES
    with Client(address) as client:
        assert client.stats().num_blocks - before == NUM_PAGES  # one copy, not two
    pools[1].kv_buffer.zero_()
    assert load(ctrls[1], keys) == NUM_PAGES
    assert [page_bytes(pools[1], i) for i in range(NUM_PAGES)] == expected


def test_mha_tensor_parallel_ranks_keep_their_own_pages(shared_node: NodeProcess) -> None:
    address = shared_node.unix_address
    _, keys, _ = saved_pages(address, "mha", "page_first", "tp2-mha", tp_size=2)
    other = fresh(address, "mha", "page_first", tp_rank=1, tp_size=2)
    assert hit_query(other, tokens("tp2-mha")) == ([], 0)
    assert load(other, keys) == 0


def test_two_tenants_do_not_see_each_others_pages(
    start_node: Callable[..., NodeProcess], run_dir: Path
) -> None:
    """On a node with tenants, the same prompt saved by tenant a is no hit for tenant b (the
    node scopes every key by the connection's tenant), and b's save of it is b's own."""
    tenants = TenantsFile(run_dir / "tenants.toml")
    ((a_id, a_key),) = tenants.add("a")
    ((b_id, b_key),) = tenants.add("b")
    tenants.write()
    node = start_node(name="tenants", extra=["--tenants", str(tenants.path)])
    a = {"access_id": a_id, "access_key": a_key}
    b = {"access_id": b_id, "access_key": b_key}
    _, keys, expected = saved_pages(node.unix_address, "mha", "page_first", "tenants", **a)
    other = fresh(node.unix_address, "mha", "page_first", **b)
    assert hit_query(other, tokens("tenants")) == ([], 0)
    assert load(other, keys) == 0
    same = fresh(node.unix_address, "mha", "page_first", **a)
    assert load(same, keys) == NUM_PAGES
    assert [page_bytes(same.storage_host_pool, i) for i in range(NUM_PAGES)] == expected


def test_a_hybrid_model_gets_no_hits_and_a_log_line(
    shared_node: NodeProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """A model with a pool besides the KV one (Mamba's states, here) cannot be restored
    from KV pages alone: no hits, nothing saved, one warning."""
    address = shared_node.unix_address
    _, keys, _ = saved_pages(address, "mha", "page_first", "hybrid")
    pool, side = mha_pool("page_first"), mha_pool("page_first")
    store = backend(storage_config(address), pool)
    with caplog.at_level(logging.WARNING, logger="kvpool.sglang"):
        store.register_mem_host_pool_v2(pool, PoolName.KV)
        store.register_mem_host_pool_v2(side, PoolName.MAMBA)
        transfers = [
            PoolTransfer(name=PoolName.KV, host_indices=host_indices(), keys=keys),
            PoolTransfer(name=PoolName.MAMBA, host_indices=host_indices(), keys=keys),
        ]
        assert store.batch_exists_v2(keys, transfers).kv_hit_pages == 0
        assert store.batch_exists(keys) == 0
        assert store.batch_get_v2(transfers) == {
            PoolName.KV: [False] * NUM_PAGES,
            PoolName.MAMBA: [False] * NUM_PAGES,
        }
        assert store.batch_set_v1(keys, host_indices()) == [False] * NUM_PAGES
    warnings = [r for r in caplog.records if "gets no hits" in r.getMessage()]
    assert len(warnings) == 1 and "mamba" in warnings[0].getMessage()


def test_v2_kv_transfers_move_pages_as_v1(shared_node: NodeProcess) -> None:
    address = shared_node.unix_address
    _, keys, expected = saved_pages(address, "mha", "page_first_direct", "v2")
    reader = fresh(address, "mha", "page_first_direct")
    store = reader.storage_backend
    transfer = PoolTransfer(name=PoolName.KV, host_indices=host_indices(), keys=keys)
    assert store.batch_exists_v2(keys, []).kv_hit_pages == NUM_PAGES
    assert store.batch_get_v2([transfer]) == {PoolName.KV: [True] * NUM_PAGES}
    pool = reader.storage_host_pool
    assert [page_bytes(pool, i) for i in range(NUM_PAGES)] == expected


def test_an_unsupported_host_layout_is_refused_at_attach(shared_node: NodeProcess) -> None:
    pool = mha_pool("page_head")
    with pytest.raises(ConfigError, match="page_first_direct"):
        backend(storage_config(shared_node.unix_address), pool)


def test_a_misspelt_key_is_refused_at_attach(shared_node: NodeProcess) -> None:
    """A key kvpool does not know (SGLang's own are passed over) stops the attach."""
    config = storage_config(shared_node.unix_address, transfer_timout=1)
    with pytest.raises(ConfigError, match="transfer_timout"):
        StorageBackendFactory.create_backend("dynamic", config, None)
