"""The worker half of the connector: transfers in flight, nothing else.

Each step, vLLM binds the step's metadata before the forward, runs the layers, then calls
``wait_for_save``.  What the worker does around that:

- **Saves.**  At bind, the pool space for the step's full blocks is reserved on the save
  thread, while the forward runs.  Layer by layer (``transfer: layerwise``), each layer's
  pages are copied into that space on the save thread as soon as ``save_kv_layer`` says the
  layer is computed; ``wait_for_save`` copies whatever is left (everything, with ``whole``)
  before the step ends, so vLLM may reuse the blocks at once.  Checksumming and committing
  finish on the commit thread.  A reservation not granted by ``lookup_timeout`` skips the
  save: a step never waits longer for the pool.
- **Loads, layer by layer** (the default).  The load runs in the step that computes the
  rest of the prompt: at bind, a load thread pins the blocks (verifying their checksums)
  and copies them into the paged cache one layer at a time; ``wait_for_layer_load`` waits
  for the layer the attention is about to read, at most until the load's deadline.  Blocks
  the load could not deliver, or not in time, are reported through
  ``get_block_ids_with_load_errors`` and vLLM recomputes them.  A load is stopped before
  ``wait_for_save`` returns, so it never writes into blocks of a finished step.
- **Whole loads** (``transfer: whole``, and any load of blocks that were only in a lower
  tier: the node is bringing them into DRAM meanwhile).  ``start_load_kv`` starts one job
  per request, which copies all layers with one indexed copy; the request waits off the
  step for it (vLLM's ``WAITING_FOR_REMOTE_KVS``) and is reported through ``get_finished``.
- Every pool call has a deadline; a failure marks the pool unhealthy, and while it is,
  loads fail at once (the engine recomputes) and saves are skipped.
- **Where the copies run** is :mod:`.streams`' business: on the pool threads for a cache in
  host memory, as said above; for a cache on a GPU, all planes at once on the worker's own
  CUDA streams, which the engine's stream waits for on the GPU (a load before its first
  layer, a save's gather before the step ends), never on its host thread.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
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
from .streams import Copies, HostCopies, Mark, copies_for
from .transfers import LayerwiseLoad, StepSave, leave_engine_cpus, pool_rows

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
        self.layerwise = config.transfer == "layerwise"
        self.layout: PagedLayout | None = None
        self.copies: Copies = HostCopies()
        self._client: Client | None = None
        self.health = HealthMonitor(
            self._probe, config.health, name="kvpool (worker)", on_thread_start=leave_engine_cpus
        )
        self._executor = ThreadPoolExecutor(
            IO_THREADS, thread_name_prefix="kvpool-load", initializer=leave_engine_cpus
        )
        # Reservations and layer copies of saves, in order, on their own thread.
        self._saver = ThreadPoolExecutor(
            1, thread_name_prefix="kvpool-save", initializer=leave_engine_cpus
        )
        # Commits have their own thread: loads never hold them up, nor they the loads.
        self._committer = ThreadPoolExecutor(
            1, thread_name_prefix="kvpool-commit", initializer=leave_engine_cpus
        )
        self._lock = threading.Lock()
        self._done_loading: set[str] = set()
        self._load_errors: set[int] = set()
        self._saving: set[Future[None]] = set()
        self._step_loads: list[LayerwiseLoad] = []
        self._step_save: tuple[StepSave, Future[None]] | None = None
        self.stats = KVPoolStats()

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(config=self.config.client)
            self._client.on_arena_mapped(self.copies.arena_mapped)
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
        self.copies = copies_for(layout.device)
        log.info(
            "kvpool: KV cache layout %s; pool blocks of %d bytes; %s transfers%s",
            layout.describe(),
            layout.block_bytes,
            self.config.transfer,
            "" if self.copies.per_plane else ", all planes at once on the worker's own streams",
        )
        if not self.copies.per_plane:
            self._map_arena_now()

    def _map_arena_now(self) -> None:
        """Map (and so register) the local node's arena at start, not on the first load."""
        try:
            self.client.health(timeout=self.config.lookup_timeout_s)
        except KVPoolError as exc:
            log.warning("kvpool: the pool is not reachable yet (%s); its arena maps later", exc)

    # -- a step ---------------------------------------------------------------------------

    def begin_step(self, meta: KVPoolMetadata) -> None:
        """Before the forward: reserve the step's saves, start its layer-by-layer loads."""
        if self.layout is None:
            return
        if meta.saves:
            self._begin_save(meta.saves)
        if self.layerwise:
            deadline = time.monotonic() + self.config.transfer_timeout_s
            after = self.copies.mark() if meta.loads else None
            for job in meta.loads:
                if job.is_async:
                    continue  # started by start_load_kv
                if not self.health.is_healthy:
                    self._finish_load(job, 0, "pool unhealthy", is_async=False)
                    continue
                load = LayerwiseLoad(job, deadline, after)
                self._step_loads.append(load)
                self._executor.submit(load.run, self)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._step_loads and self.layout is not None:
            planes = self.layout.layers.get(layer_name, ())
            for load in self._step_loads:
                self._engine_waits(load, load.wait_for(planes))

    def save_kv_layer(self, layer_name: str) -> None:
        if self.layerwise and self._step_save is not None and self.layout is not None:
            save = self._step_save[0]
            if self.copies.per_plane:
                planes = self.layout.layers.get(layer_name, ())
                self._saver.submit(save.copy, self.copies, self.layout, planes)

    def wait_for_save(self, meta: KVPoolMetadata) -> None:
        """After the forward: stop the step's loads, fill its saves; the step may end then."""
        if self.layout is None:
            return
        loads, self._step_loads = self._step_loads, []
        for load in loads:
            num = load.stop(self.layout.num_planes)
            self._engine_waits(load, load.done)  # a late copy lands before any recompute
            self._finish_load(load.job, num, load.reason, time.perf_counter() - load.started, False)
        step_save, self._step_save = self._step_save, None
        if step_save is not None:
            self._finish_save(*step_save)

    def _engine_waits(self, load: LayerwiseLoad, mark: Mark) -> None:
        if mark is not None and load.waited is not mark:
            self.copies.engine_waits(mark)
            load.waited = mark

    # -- loads ----------------------------------------------------------------------------

    def start_load_kv(self, meta: KVPoolMetadata) -> None:
        after: Mark = None
        for job in meta.loads:
            if self.layerwise and not job.is_async:
                continue  # started with the step (begin_step)
            if not self.health.is_healthy or self.layout is None:
                self._finish_load(job, 0, "pool unhealthy")
                continue
            if after is None:
                after = self.copies.mark()
            self._executor.submit(self._load, job, after)

    def _load(self, job: TransferJob, after: Mark = None) -> None:
        """A whole load (``transfer: whole``): every layer with one indexed copy."""
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
                    rows = pool_rows(self.layout, lease, num_loaded)
                    self.copies.settle(self.copies.load(self.layout, ids, rows, None, after))
                if not lease.still_held:  # its memory may have been reused
                    num_loaded, reason = 0, "the pool's pin ran out mid-load"
            self.health.report_call()
            if num_loaded < len(job.block_ids) and not reason:
                reason = f"{len(job.block_ids) - num_loaded} block(s) missing or corrupt"
        except KVPoolError as exc:
            self.health.report_failure(exc)
            num_loaded, reason = 0, f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # never let a pool problem fail the engine: recompute
            log.exception("kvpool: load failed")
            num_loaded, reason = 0, f"{type(exc).__name__}: {exc}"
        self._finish_load(job, num_loaded, reason, time.perf_counter() - started)

    def _finish_load(
        self,
        job: TransferJob,
        num_loaded: int,
        reason: str,
        seconds: float = 0.0,
        is_async: bool = True,
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
            if is_async:
                self._done_loading.add(job.req_id)

    # -- saves ----------------------------------------------------------------------------

    def _begin_save(self, jobs: list[TransferJob]) -> None:
        block_ids = [b for job in jobs for b in job.block_ids]
        if not self.health.is_healthy:
            with self._lock:
                self.stats.add("skipped_unhealthy", len(block_ids))
            return
        with self._lock:
            busy = len(self._saving) >= MAX_SAVES_IN_FLIGHT
            if busy:
                self.stats.add("skipped_busy", len(block_ids))
        if busy:
            return  # the pool is behind: these blocks stay computable, the step goes on
        keys = self.namespace.keys([h for job in jobs for h in job.block_hashes])
        origins = (
            [o for job in jobs for o in job.origins or ()]
            if all(job.origins is not None for job in jobs)
            else None
        )
        save = StepSave(keys, block_ids, time.perf_counter(), origins)
        self._step_save = (save, self._saver.submit(save.reserve, self))

    def _finish_save(self, save: StepSave, reserved: Future[None]) -> None:
        assert self.layout is not None
        # The reservation was asked for before the forward (with a lookup's deadline); past
        # the forward, the step waits for it no longer than a lookup.
        try:
            reserved.result(timeout=self.config.lookup_timeout_s)
            lease = save.close(self.copies, self.layout)
        except FutureTimeout:
            save.abandon()
            with self._lock:
                self.stats.add("skipped_busy", len(save.keys))
            return
        except Exception as exc:  # never let a pool problem fail the engine
            save.abandon()
            if isinstance(exc, KVPoolError):
                self.health.report_failure(exc)
            else:
                log.exception("kvpool: save failed")
            with self._lock:
                self.stats.add("save_errors", len(save.keys))
            return
        if lease is None:
            return
        # The pages are out of the cache: the rest (into pool memory, commit) need not hold
        # up the step.
        future = self._committer.submit(self._commit, save, lease)
        with self._lock:
            self._saving.add(future)
        future.add_done_callback(self._saving_done)

    def _commit(self, save: StepSave, lease: WriteLease) -> None:
        try:
            save.deliver(self.copies)
            result = lease.commit(timeout=self.config.transfer_timeout_s, origins=save.origins)
        except KVPoolError as exc:
            self.health.report_failure(exc)
            with self._lock:
                self.stats.add("save_errors", len(save.wanted))
            return
        except Exception:  # never let a pool problem fail the engine
            log.exception("kvpool: save failed")
            lease.abort()
            with self._lock:
                self.stats.add("save_errors", len(save.wanted))
            return
        self.health.report_call()
        with self._lock:
            self.stats.add("saves")
            self.stats.add("saved_blocks", sum(1 for s in result.statuses if s == 0))
            self.stats.observe("save", time.perf_counter() - save.started)

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
        self._saver.shutdown(wait=True, cancel_futures=False)
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
