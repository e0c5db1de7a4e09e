"""``KVPoolStorage``: kvpool as an SGLang HiCache storage backend (SGLang 0.5.23).

SGLang loads it as a dynamic backend, with no patch::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvpool",
        "module_path": "kvpool.integrations.sglang", "class_name": "KVPoolStorage",
        "interface_v1": 1}'

The calls, by who makes them (SGLang's ``HiCacheController`` threads):

- construction (``StorageBackendFactory``, at attach): the configuration
  (:mod:`.config`), the client and its health monitor; nothing is sent yet.
- ``register_mem_pool_host``: the host pool whose pages move; its layout
  (:func:`.pages.host_layout`, an unsupported one is refused: SGLang fails to attach) and
  this rank's namespace (:func:`.pages.page_namespace`).  ``register_mem_host_pool_v2``: a
  pool other than the KV one makes a hybrid model, which kvpool cannot restore: every
  lookup is a miss and nothing is saved, said once in the log.
- the prefetch thread: ``batch_exists`` (the count of leading pages the pool holds), then
  ``batch_get_v1`` (with ``interface_v1``: pages straight into the host pool, one indexed
  copy out of pool memory, :func:`kvpool.kvcache.load_into`) or ``batch_get`` (into flat
  page tensors SGLang copies in itself).  Both deliver a leading run of pages, each
  verified; the run stops at the first page missing, corrupt or unreadable.
- the backup thread: ``batch_set_v1`` (pages copied straight from the host pool into
  reserved pool memory, :func:`kvpool.kvcache.save_now`) or ``batch_set`` (flat page
  tensors, a put).  Only the rank SGLang makes the writer saves (``is_storage_writer``:
  every rank of a sharded model, one rank of MLA's replicated latent); the others store
  nothing.

House rules: a pool failure is a miss or a skipped save, never an exception into SGLang
(:class:`kvpool.kvcache.PoolGuard`); every call runs under a deadline (``timeout`` for
lookups, ``transfer_timeout`` for a batch of pages); while the health monitor says the pool
is down, calls return misses at once.  ``clear`` leaves the pool alone: its pages may be
other engines' too (``kvpool drain`` empties a node).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvpool.client.client import Client
from kvpool.client.health import HealthMonitor
from kvpool.errors import ConfigError
from kvpool.keys import Namespace
from kvpool.kvcache.cache import PagedCache
from kvpool.kvcache.copies import HostCopies
from kvpool.kvcache.guard import PoolGuard
from kvpool.kvcache.loads import load_into, read_rows
from kvpool.kvcache.saves import put_rows, save_now

from .config import StorageConfig, storage_config
from .pages import block_hash, host_layout, page_ids, page_namespace

log = logging.getLogger("kvpool.sglang")

Moved = TypeVar("Moved")
# A whole call's load or save of host pages (load_into, save_now): the cache, the client,
# the pool keys, the pages and the timeout.
HostMove = Callable[[PagedCache, Client, Sequence[bytes], Sequence[int], float], Moved]


class KVPoolStorage(HiCacheStorage):
    """kvpool as a HiCache storage backend (see the module's notes)."""

    def __init__(self, storage_config_: HiCacheStorageConfig, kwargs: Any = None):
        if storage_config_.dcp_size > 1:
            raise ConfigError("kvpool: decode context parallel (DCP) is not supported")
        self.storage_config = storage_config_
        self.config: StorageConfig = storage_config(storage_config_.extra_config)
        self.writes = bool(storage_config_.is_storage_writer)
        self.client = Client(config=self.config.client)
        self.health = HealthMonitor(self._probe, self.config.health, name="kvpool (sglang)")
        self.guard = PoolGuard(self.health, log)
        self.cache: PagedCache | None = None
        self.namespace: Namespace | None = None
        self.unsupported = ""  # why this engine's pages cannot be restored ("": they can)
        self.health.start()
        log.info(
            "kvpool HiCache storage (tp %d/%d, %s): %s",
            storage_config_.tp_rank,
            storage_config_.tp_size,
            "writes" if self.writes else "reads the writer's copy",
            self.config.describe(),
        )

    # -- registration ---------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        layout = host_layout(mem_pool_host)
        self.cache = PagedCache(HostCopies(layout), self.guard)
        self.namespace = page_namespace(
            self.storage_config, mem_pool_host, layout, self.config.tenant
        )
        log.info(
            "kvpool: SGLang host pool %s (%s), namespace %s",
            type(mem_pool_host).__name__,
            layout.describe(),
            self.namespace.id.hex(),
        )
        with self.guard.call("describe"):  # a label for status pages: never a failure
            self.client.describe(self.namespace, timeout=self.config.client.timeout_s)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._is_kv_pool(host_pool_name)

    def _is_kv_pool(self, pool_name: Any) -> bool:
        """Whether ``pool_name`` is the KV pool; any other pool makes this a hybrid model,
        which kvpool cannot restore (said once: every lookup a miss from then on)."""
        if str(pool_name) == PoolName.KV.value:
            return True
        if not self.unsupported:
            self.unsupported = f"a hybrid model (its {pool_name} pool)"
            log.warning(
                "kvpool: %s cannot be restored from the pool: it gets no hits and saves nothing",
                self.unsupported,
            )
        return False

    # -- lookups --------------------------------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages of ``keys`` the pool holds (0 when it cannot say)."""
        if not keys or not self._is_ready():
            return 0
        found = 0
        with self.guard.call("lookup"):
            found = self.client.lookup(self.pool_keys(keys), timeout=self.config.client.timeout_s)
        return found

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        for transfer in pool_transfers or []:
            self._is_kv_pool(transfer.name)
        num = 0 if self.unsupported else self.batch_exists(keys, extra_info)
        hits = {PoolName.KV: num} if num else {}
        return PoolTransferResult(num, hits, list(range(1, num + 1)))

    # -- the zero-copy path ---------------------------------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Load pages straight into the host pool: a leading run of True."""
        load = self._on_host_pages(load_into, keys, host_indices)
        if load is None:
            return [False] * len(keys)
        if load.reason:
            log.debug("kvpool: %d of %d pages loaded: %s", load.num_blocks, len(keys), load.reason)
        return [i < load.num_blocks for i in range(len(keys))]

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Save pages straight from the host pool: per page, whether the pool holds it."""
        saved = self._on_host_pages(save_now, keys, host_indices) if self.writes else None
        if saved is None:
            return [False] * len(keys)
        if saved.reason:
            log.debug("kvpool: save of %d pages: %s", len(keys), saved.reason)
        return list(saved.stored) if saved.stored else [False] * len(keys)

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, self.batch_get_v1)

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        return self._v2(transfers, self.batch_set_v1)

    def _v2(self, transfers: list[PoolTransfer], move: Any) -> dict[str, list[bool]]:
        """The KV pool's transfers as v1 calls; any other pool's are refused (hybrid)."""
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = transfer.keys or []
            if self._is_kv_pool(transfer.name) and transfer.host_indices is not None:
                results[transfer.name] = move(keys, transfer.host_indices)
            else:
                results[transfer.name] = [False] * len(keys)
        return results

    # -- the generic path: flat page tensors ----------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        targets = [target_location] if target_location is not None else None
        return self.batch_get([key], targets)[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Each page into its flat tensor (or a new one): the leading run found, then None."""
        misses: list[torch.Tensor | None] = [None] * len(keys)
        if not keys or not self._is_ready():
            return misses
        assert self.cache is not None
        if target_locations is None:
            target_locations = [
                self.mem_pool_host.get_dummy_flat_data_page() for _ in range(len(keys))
            ]
        if not self._are_pages(target_locations, len(keys)):
            return misses
        num = read_rows(
            self.guard,
            self.client,
            self.pool_keys(keys),
            list(target_locations),
            self.config.transfer_timeout_s,
        )
        return [target if i < num else None for i, target in enumerate(target_locations)]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """Store flat page tensors; whether the pool holds every one."""
        if not keys or not self.writes or not self._is_ready():
            return False
        if values is None or not self._are_pages(values, len(keys)):
            return False
        rows = [value.contiguous() for value in values]
        saved = put_rows(
            self.guard, self.client, self.pool_keys(keys), rows, self.config.transfer_timeout_s
        )
        return saved.num_stored == len(keys)

    # -- the rest -------------------------------------------------------------------------

    def clear(self) -> None:
        log.info(
            "kvpool: clear() leaves the pool's pages (other engines may share them); "
            "`kvpool drain` empties a node"
        )

    def close(self) -> None:
        self.health.stop()
        self.client.close()

    # -- helpers --------------------------------------------------------------------------

    def _probe(self) -> None:
        self.client.health(timeout=self.config.client.timeout_s)

    def _is_ready(self) -> bool:
        """Whether a call is worth making: a host pool is registered, its pages can be
        restored, and the pool is up."""
        return self.cache is not None and not self.unsupported and self.guard.is_healthy

    def pool_keys(self, keys: list[str]) -> list[bytes]:
        """The pool keys of SGLang's page keys, under this rank's namespace."""
        assert self.namespace is not None
        return self.namespace.keys([block_hash(key) for key in keys])

    def _on_host_pages(
        self, move: HostMove[Moved], keys: list[str], host_indices: torch.Tensor
    ) -> Moved | None:
        """``move`` (a load or a save) of a v1 call's pages of the host pool, or None
        (nothing to do: refused, or not ready)."""
        cache = self.cache
        if not keys or cache is None or not self._is_ready():
            return None
        page_size = int(self.mem_pool_host.page_size)
        ids = page_ids(host_indices.cpu(), page_size, len(keys))
        if ids is None or max(ids) >= cache.layout.num_blocks:
            log.error(
                "kvpool: %d host slots do not name %d whole pages of the host pool",
                host_indices.numel(),
                len(keys),
            )
            return None
        return move(cache, self.client, self.pool_keys(keys), ids, self.config.transfer_timeout_s)

    def _are_pages(self, tensors: Any, num: int) -> bool:
        """Whether ``tensors`` are ``num`` CPU tensors of one page each."""
        assert self.cache is not None
        block_bytes = self.cache.layout.block_bytes
        if len(tensors) == num and all(
            isinstance(t, torch.Tensor)
            and t.device.type == "cpu"
            and t.numel() * t.element_size() == block_bytes
            for t in tensors
        ):
            return True
        log.error("kvpool: the page tensors given are not %d pages of %d bytes", num, block_bytes)
        return False
