"""The worker half of the connector: transfers in flight, nothing else.

- Saves: in ``wait_for_save`` (after the step's forward), the blocks that became full are
  reserved in the pool and copied straight from the paged cache into the reserved space —
  one indexed copy for the batch — before the step ends, so vLLM may reuse the blocks at
  once.  Checksumming and committing them finishes in the background.
- Loads: ``start_load_kv`` starts one background job per request; it pins the blocks,
  verifies their checksums and copies the verified leading run into the paged cache with
  one indexed copy.  The request is reported through ``get_finished``; blocks that could
  not be loaded (missing, corrupt, pool down, deadline passed) are reported through
  ``get_block_ids_with_load_errors`` so vLLM recomputes just those.
- Every pool call has a deadline; a failure marks the pool unhealthy, and while it is,
  loads fail at once (the engine recomputes) and saves are skipped.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvpool.client.client import Client
from kvpool.client.health import HealthMonitor
from kvpool.client.leases import WriteLease
from kvpool.errors import ConfigError, KVPoolError
from kvpool.keys import Namespace

from .config import ConnectorConfig
from .layouts import PagedLayout
from .metadata import KVPoolMetadata, KVPoolStats, TransferJob

log = logging.getLogger("vllm.kvpool")  # under vLLM's logging configuration

IO_THREADS = 2
# Saves whose commit is still running, at most; past it a step's save is skipped rather than
# held up (each holds a pooled connection until it commits).
MAX_SAVES_IN_FLIGHT = 4


class KVPoolWorker:
    def __init__(self, config: ConnectorConfig, namespace: Namespace, expected_page_bytes: int):
        self.config = config
        self.namespace = namespace
        self.expected_page_bytes = expected_page_bytes
        self.layout: PagedLayout | None = None
        self._client: Client | None = None
        self.health = HealthMonitor(self._probe, config.health, name="kvpool (worker)")
        self._executor = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvpool-load")
        # Commits have their own thread: loads never hold them up, nor they the loads.
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="kvpool-commit")
        self._lock = threading.Lock()
        self._done_loading: set[str] = set()
        self._load_errors: set[int] = set()
        self._saving: set[Future[None]] = set()
        self.stats = KVPoolStats()

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(config=self.config.client)
            self.health.start()
        return self._client

    def _probe(self) -> None:
        self.client.health(timeout=self.config.lookup_timeout_s)

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        layout = PagedLayout.detect(kv_caches)
        if (
            layout.page_bytes * (layout.num_planes // max(len(_distinct(kv_caches)), 1))
            != self.expected_page_bytes
        ):
            raise ConfigError(
                f"unexpected KV cache layout: {layout.describe()}, but the model's shape needs "
                f"{self.expected_page_bytes} bytes per block and layer; refusing to share blocks "
                "that might not mean the same thing"
            )
        self.layout = layout
        log.info(
            "kvpool: KV cache layout %s; pool blocks of %d bytes",
            layout.describe(),
            layout.block_bytes,
        )

    # -- loads ----------------------------------------------------------------------------

    def start_load_kv(self, meta: KVPoolMetadata) -> None:
        for job in meta.loads:
            if not self.health.is_healthy or self.layout is None:
                self._finish_load(job, 0, "pool unhealthy")
                continue
            self._executor.submit(self._load, job)

    def _load(self, job: TransferJob) -> None:
        assert self.layout is not None
        started = time.perf_counter()
        num_loaded = 0
        reason = ""
        try:
            keys = self.namespace.keys(job.block_hashes)
            with self.client.acquire(
                keys, prefix=True, timeout=self.config.transfer_timeout_s
            ) as lease:
                num_loaded = lease.num_prefix
                if num_loaded:
                    ids = torch.tensor(job.block_ids[:num_loaded], dtype=torch.long)
                    extent = lease.extent(num_loaded)
                    if extent is not None:
                        self.layout.scatter(ids, self.layout.pool_view(extent, num_loaded))
                    else:  # scattered in the pool: stage them, still one copy into the cache
                        self.layout.scatter(ids, self.layout.stage(lease.views[:num_loaded]))
            self.health.report_call()
            if num_loaded < len(job.block_ids):
                reason = f"{len(job.block_ids) - num_loaded} block(s) missing or corrupt"
        except KVPoolError as exc:
            self.health.report_failure(exc)
            num_loaded, reason = 0, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # never let a pool problem fail the engine: recompute
            log.exception("kvpool: load failed")
            num_loaded, reason = 0, f"{type(exc).__name__}: {exc}"
        self._finish_load(job, num_loaded, reason, time.perf_counter() - started)

    def _finish_load(
        self, job: TransferJob, num_loaded: int, reason: str, seconds: float = 0.0
    ) -> None:
        failed = job.block_ids[num_loaded:]
        with self._lock:
            self.stats.add("loads")
            self.stats.add("loaded_blocks", num_loaded)
            if seconds:
                self.stats.observe("load", seconds)
            if failed:
                log.info(
                    "kvpool: request %s: %d of %d block(s) recomputed (%s)",
                    job.req_id,
                    len(failed),
                    len(job.block_ids),
                    reason,
                )
                self.stats.add("load_errors", len(failed))
                self.stats.data.setdefault("failed_req_ids", []).append(job.req_id)
                self._load_errors.update(failed)
            self._done_loading.add(job.req_id)

    # -- saves ----------------------------------------------------------------------------

    def wait_for_save(self, meta: KVPoolMetadata) -> None:
        if not meta.saves or self.layout is None:
            return
        if not self.health.is_healthy:
            with self._lock:
                self.stats.add("skipped_unhealthy", len(meta.saves))
            return
        block_ids = [b for job in meta.saves for b in job.block_ids]
        hashes = [h for job in meta.saves for h in job.block_hashes]
        with self._lock:
            busy = len(self._saving) >= MAX_SAVES_IN_FLIGHT
            if busy:
                self.stats.add("skipped_busy", len(block_ids))
        if busy:
            return  # the pool is behind: these blocks stay computable, the step goes on
        started = time.perf_counter()
        try:
            self._save(block_ids, hashes, started)
        except KVPoolError as exc:
            self.health.report_failure(exc)
            with self._lock:
                self.stats.add("save_errors", len(block_ids))
        except Exception:  # never let a pool problem fail the engine
            log.exception("kvpool: save failed")
            with self._lock:
                self.stats.add("save_errors", len(block_ids))

    def _save(self, block_ids: list[int], hashes: list[bytes], started: float) -> None:
        assert self.layout is not None
        layout = self.layout
        keys = self.namespace.keys(hashes)
        # This runs inside the forward step: only a short wait for the reservation.
        lease = self.client.reserve(
            keys, [layout.block_bytes] * len(keys), timeout=self.config.lookup_timeout_s
        )
        try:
            wanted = [i for i, view in enumerate(lease.views) if view is not None]
            if wanted:
                ids = torch.tensor([block_ids[i] for i in wanted], dtype=torch.long)
                extent = lease.extent() if len(wanted) == len(keys) else None
                if extent is not None:
                    layout.gather(ids, layout.pool_view(extent, len(wanted)))
                else:
                    batch = layout.batch(len(wanted))
                    layout.gather(ids, batch)
                    flat = batch.view(len(wanted), -1).view(torch.uint8)
                    for row, i in enumerate(wanted):
                        view = lease.views[i]
                        assert view is not None
                        torch.frombuffer(view, dtype=torch.uint8).copy_(flat[row])
        except BaseException:
            lease.abort()
            raise
        # The pages are copied out: the rest (checksums, commit) need not hold up the step.
        future = self._committer.submit(self._commit, lease, len(wanted), started)
        with self._lock:
            self._saving.add(future)
        future.add_done_callback(self._saving_done)

    def _commit(self, lease: WriteLease, num_blocks: int, started: float) -> None:
        try:
            result = lease.commit(timeout=self.config.transfer_timeout_s)
        except KVPoolError as exc:
            self.health.report_failure(exc)
            with self._lock:
                self.stats.add("save_errors", num_blocks)
            return
        self.health.report_call()
        with self._lock:
            self.stats.add("saves")
            self.stats.add("saved_blocks", sum(1 for s in result.statuses if s == 0))
            self.stats.observe("save", time.perf_counter() - started)

    def _saving_done(self, future: Future[None]) -> None:
        with self._lock:
            self._saving.discard(future)

    # -- reporting ------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._done_loading = self._done_loading, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> KVPoolStats | None:
        with self._lock:
            if self.stats.is_empty() and not self.stats.data.get("failed_req_ids"):
                return None
            stats, self.stats = self.stats, KVPoolStats()
        return stats

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=False)
        self._committer.shutdown(wait=True, cancel_futures=False)
        self.health.stop()
        if self._client is not None:
            self._client.close()


def _distinct(kv_caches: dict[str, Any]) -> set[int]:
    out = set()
    for cache in kv_caches.values():
        first = cache[0] if isinstance(cache, list | tuple) else cache
        out.add(first.data_ptr())
    return out
