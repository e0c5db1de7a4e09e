"""SGLang's HiCache pages through kvpool, beside a memcpy of the same pages, in one run.

A real SGLang MHA host pool (``page_first``, bfloat16; 16 layers x 8 KV heads x 128 dims,
64-token pages: 4 MiB a page) on CPU, the backend made by SGLang's
``StorageBackendFactory`` against one node on this host, and batches of 32 pages (128 MiB,
SGLang's own batches are at most 128 pages) moved by the controller's page paths:

- ``v1`` (``interface_v1``): ``batch_set_v1`` / ``batch_get_v1``, straight between the host
  pool and the node's arena;
- ``generic``: ``batch_set`` / ``batch_get`` of flat page tensors (SGLang copies each page
  out of, or into, the host pool itself: one more copy);
- ``memcpy``: the same pages gathered into (and scattered back from) one tensor
  (``index_select`` / ``index_copy_``): the ceiling of one copy on this host;
- the same v1 path on a host pool SGLang allocates as shared memory (``"allocator":
  "shm"``, a memfd), to see whether that pool changes anything for kvpool.

Each figure is the median of ``--repeat`` batches, saves under fresh keys each time, on a
node that has been running: its 1 GiB arena is written through once (``WARM_BATCHES``,
evicting as it goes) before anything is timed, as a pool in service has (a fresh arena's
first touch of each page costs a page fault that steady state does not pay), so saves evict
as they go.

    .venv-sglang/bin/python -m benchmarks.sglang_pages [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.managers.cache_controller import HiCacheController, PrefetchOperation
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from tests.sglang.pools import fill, mha_pool

from kvpool.harness.process import NodeProcess

LAYERS, HEADS, HEAD_DIM, PAGE = 16, 8, 128, 64
BATCH_PAGES = 32
ARENA = "1GiB"
WARM_BATCHES = 10  # 1.25 GiB of pages through the 1 GiB arena


def _config(address: str) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="bench/model",
        extra_config={
            "backend_name": "kvpool",
            "module_path": "kvpool.integrations.sglang",
            "class_name": "KVPoolStorage",
            "interface_v1": 1,
            "address": address,
            "transfer_timeout": 30,
            "timeout": 10,
        },
    )


def _pool(allocator: str) -> Any:
    pool = mha_pool(
        "page_first",
        allocator,
        num_layers=LAYERS,
        heads=HEADS,
        head_dim=HEAD_DIM,
        page_size=PAGE,
        device_tokens=BATCH_PAGES * PAGE,
    )
    fill(pool, seed=1)
    return pool


def _timed(run: Callable[[], object], repeat: int, num_bytes: int) -> float:
    """Median GB/s of ``repeat`` runs."""
    rates = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        rates.append(num_bytes / (time.perf_counter() - started) / 1e9)
    return statistics.median(rates)


def measure(address: str, allocator: str, repeat: int) -> dict[str, float]:
    pool = _pool(allocator)
    store = StorageBackendFactory.create_backend("dynamic", _config(address), pool)
    store.register_mem_pool_host(pool)
    ctrl = SimpleNamespace(
        storage_backend=store,
        storage_host_pool=pool,
        storage_config=store.storage_config,
        page_size=PAGE,
    )
    indices = torch.arange(BATCH_PAGES * PAGE, dtype=torch.int64)
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    num_bytes = BATCH_PAGES * page_bytes
    results: dict[str, float] = {}
    paths = {
        "v1": (HiCacheController._page_set_zero_copy, HiCacheController._page_get_zero_copy),
        "generic": (HiCacheController._generic_page_set, HiCacheController._generic_page_get),
    }
    for _ in range(WARM_BATCHES):
        batch = [secrets.token_hex(32) for _ in range(BATCH_PAGES)]
        _check(HiCacheController._page_set_zero_copy(ctrl, batch, indices))
    for via, (page_set, page_get) in paths.items():
        if allocator == "default" or via == "v1":
            results.update(_path(via, ctrl, page_set, page_get, indices, repeat, num_bytes))
    page_ids = torch.arange(BATCH_PAGES)
    planes = pool.kv_buffer.unflatten(1, (-1, PAGE)).flatten(2)  # [2, pages, page elems]
    batch = torch.empty(2, BATCH_PAGES, planes.shape[2], dtype=planes.dtype)
    results["memcpy gather"] = _timed(
        lambda: torch.index_select(planes, 1, page_ids, out=batch), repeat, num_bytes
    )
    results["memcpy scatter"] = _timed(
        lambda: planes.index_copy_(1, page_ids, batch), repeat, num_bytes
    )
    store.close()
    return results


def _path(
    via: str,
    ctrl: SimpleNamespace,
    page_set: Callable[..., bool],
    page_get: Callable[..., int],
    indices: torch.Tensor,
    repeat: int,
    num_bytes: int,
) -> dict[str, float]:
    """One controller path's set (fresh keys each time) and get (of the first batch)."""
    batches = [[secrets.token_hex(32) for _ in range(BATCH_PAGES)] for _ in range(repeat)]
    saved = iter(batches)
    operation = PrefetchOperation("bench", [])
    return {
        f"{via} set": _timed(
            lambda: _check(page_set(ctrl, next(saved), indices)), repeat, num_bytes
        ),
        f"{via} get": _timed(
            lambda: _check(page_get(ctrl, operation, batches[0], indices) == BATCH_PAGES),
            repeat,
            num_bytes,
        ),
    }


def _check(ok: object) -> None:
    if not ok:
        raise RuntimeError("a batch of pages did not move")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="kvpool-sglang-bench-", dir="/dev/shm")
    out: dict[str, Any] = {
        "page_mib": LAYERS * HEADS * HEAD_DIM * 2 * 2 * PAGE / (1 << 20),
        "batch_pages": BATCH_PAGES,
        "cpus": os.cpu_count(),
    }
    try:
        node = NodeProcess.private("sglang-bench", ARENA, run_dir=run_dir).start()
        try:
            out["default pool"] = measure(node.unix_address, "default", args.repeat)
            out["shm pool"] = measure(node.unix_address, "shm", args.repeat)
        finally:
            node.stop()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{out['batch_pages']} pages of {out['page_mib']:.0f} MiB a batch, GB/s (median)")
    for pool_kind in ("default pool", "shm pool"):
        for name, rate in out[pool_kind].items():
            print(f"  {pool_kind:13s} {name:15s} {rate:6.2f}")


if __name__ == "__main__":
    main()
