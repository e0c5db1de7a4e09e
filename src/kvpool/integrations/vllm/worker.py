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
- **Where the copies run** is :mod:`kvpool.kvcache.copies`' business: on the pool threads
  for a cache in host memory, as said above; for a cache on a GPU, all planes at once on
  the worker's own CUDA streams, which the engine's stream waits for on the GPU (a load
  before its first layer, a save's gather before the step ends), never on its host thread.
- The loads and saves themselves, and the rule that a pool failure is a miss, are
  :mod:`kvpool.kvcache`'s: this module only times them to vLLM's hooks.  What the worker
  needs for them (the copies for the cache, a client that registers each arena it maps
  with them, its health monitor) is built once, when vLLM registers the cache
  (:class:`WorkerPool`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvpool.client.client import Client
from kvpool.client.health import HealthMonitor
from kvpool.errors import ConfigError, KVPoolError
from kvpool.keys import Namespace, block_key
from kvpool.kvcache.cache import PagedCache
from kvpool.kvcache.copies import Mark, copies_for
from kvpool.kvcache.guard import PoolGuard
from kvpool.kvcache.layouts import PagedLayout
from kvpool.kvcache.loads import Load, load_into
from kvpool.kvcache.saves import Save
from kvpool.retention import DEFAULT_PRIORITY, by_hint

from .config import ConnectorConfig
from .groups import FULL, SLIDING, STATE, CacheGroup, group_namespace, unsupported_reason
from .metadata import KVPoolMetadata, KVPoolStats, TransferJob

log = logging.getLogger("vllm.kvpool")  # under vLLM's logging configuration

IO_THREADS = 2
# Saves whose commit is still running, at most; past it a step's save is skipped rather than
# held up (each holds a pooled connection until it commits).
MAX_SAVES_IN_FLIGHT = 4


def leave_engine_cpus() -> None:
    """Move the calling thread off the CPUs the engine's forward runs on.

    vLLM's CPU worker binds its forward thread to its cores, and threads inherit the binding
    of the thread that starts them: left alone, every pool thread (loads, saves, commits,
    health probes) would take turns with the forward on its own cores, and lengthen every
    step.  Called first thing in each pool thread; where the forward is not bound (GPU
    engines) or no other CPU is allowed, nothing changes.
    """
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        inherited = os.sched_getaffinity(0)
        spare = set(range(os.cpu_count() or 1)) - inherited
        if spare:
            os.sched_setaffinity(0, spare)
    except OSError:  # a cpuset that allows none of them: stay where we are
        pass


class WorkerPool:
    """What the worker reaches the pool with, built once vLLM has registered its cache:
    the copies for the cache, a client that registers each arena it maps with them, the
    client's health monitor (probing from the start) and the cache's guard."""

    def __init__(self, config: ConnectorConfig, layout: PagedLayout):
        self.timeout_s = config.lookup_timeout_s
        self.layout = layout
        self.copies = copies_for(layout)
        self.client = Client(config=config.client, on_arena_mapped=self.copies.arena_mapped)
        self.health = HealthMonitor(
            self._probe, config.health, name="kvpool (worker)", on_thread_start=leave_engine_cpus
        )
        self.cache = PagedCache(self.copies, PoolGuard(self.health, log))
        self.health.start()

    def _probe(self) -> None:
        self.client.health(timeout=self.timeout_s)

    def close(self) -> None:
        self.health.stop()
        self.client.close()


class KVPoolWorker:
    def __init__(
        self,
        config: ConnectorConfig,
        namespace: Namespace,
        expected_page_bytes: int,
        groups: list[CacheGroup] | None = None,
        *,
        can_save: bool = True,
    ):
        self.config = config
        self.namespace = namespace
        self.can_save = can_save  # False: another rank saves this rank's blocks
        groups = groups or [CacheGroup(0, FULL)]
        # Several KV cache groups: each block's key is under its group's namespace.
        self.is_hybrid = len(groups) > 1
        # A failed load fails its whole request: with several groups (vLLM cannot map a
        # block id back to its group), and with a group that keeps only some blocks of a
        # prefix (recomputing from a failed block would read the null blocks before it).
        self.fails_whole_requests = self.is_hybrid or any(
            g.kind in (SLIDING, STATE) for g in groups
        )
        self.has_state_groups = any(g.kind == STATE for g in groups)
        self._is_plain_attention = all(g.kind == FULL for g in groups)
        self._attention_layers = {n for g in groups if g.kind != STATE for n in g.layer_names}
        # A pure state-space model: its pages are the state layers' own (vLLM's spec says
        # their size), not the attention page the model's shape would give.
        self._state_page_bytes = groups[0].page_bytes if all(g.kind == STATE for g in groups) else 0
        self.unsupported = unsupported_reason(groups)
        self._group_ns_ids = [group_namespace(namespace, g, len(groups)).id for g in groups]
        self._failed_loading: set[str] = set()
        self._layers_per_plane: dict[int, int] = {}  # several groups: layers sharing a plane
        self._layers_left: dict[int, int] = {}  # of them, not yet run in this step
        self.expected_page_bytes = expected_page_bytes
        self.layerwise = config.transfer == "layerwise"
        self.pool: WorkerPool | None = None  # once the cache is registered
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
        self._step_loads: list[tuple[TransferJob, Load]] = []
        self._step_save: tuple[Save, Future[None]] | None = None
        self.stats = KVPoolStats()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self.unsupported:
            log.warning("kvpool: the pool is not used by this engine: %s", self.unsupported)
            return
        if self.has_state_groups and self._attention_layers:
            # Recurrent state layers view the same tensors as attention layers, in views
            # smaller than a page: the attention layers' views cover the whole page.
            kv_caches = {n: c for n, c in kv_caches.items() if n in self._attention_layers}
        layout = PagedLayout.detect(kv_caches)
        expected = self._state_page_bytes or self.expected_page_bytes
        if layout.page_bytes * (layout.num_planes // max(len(_distinct(kv_caches)), 1)) != expected:
            reason = (
                f"unexpected KV cache layout: {layout.describe()}, but the model's shape needs "
                f"{expected} bytes per block and layer; refusing to share blocks "
                "that might not mean the same thing"
            )
            if self._is_plain_attention and not self.is_hybrid:
                raise ConfigError(reason)
            # A new kind of cache: its loads fail (recomputed), nothing is saved.
            log.error("kvpool: the pool is not used by this engine: %s", reason)
            return
        self.pool = pool = WorkerPool(self.config, layout)
        for planes in layout.layers.values():
            for plane in planes:
                self._layers_per_plane[plane] = self._layers_per_plane.get(plane, 0) + 1
        log.info(
            "kvpool: KV cache layout %s; pool blocks of %d bytes; %s transfers%s",
            layout.describe(),
            layout.block_bytes,
            self.config.transfer,
            "" if pool.copies.per_plane else ", all planes at once on the worker's own streams",
        )
        if not pool.copies.per_plane:
            self._map_arena_now(pool)

    def _map_arena_now(self, pool: WorkerPool) -> None:
        """Map (and so register) the local node's arena at start, not on the first load."""
        try:
            pool.client.health(timeout=self.config.lookup_timeout_s)
        except KVPoolError as exc:
            log.warning("kvpool: the pool is not reachable yet (%s); its arena maps later", exc)

    # -- a step ---------------------------------------------------------------------------

    def begin_step(self, meta: KVPoolMetadata) -> None:
        """Before the forward: reserve the step's saves, start its layer-by-layer loads."""
        pool = self.pool
        if pool is None:
            return
        if meta.saves and self.can_save:
            self._begin_save(pool, meta.saves)
        if self.layerwise:
            deadline = time.monotonic() + self.config.transfer_timeout_s
            after = pool.copies.mark() if meta.loads else None
            for job in meta.loads:
                if job.is_async:
                    continue  # started by start_load_kv
                if not pool.health.is_healthy:
                    self._finish_load(job, 0, "pool unhealthy", is_async=False)
                    continue
                keys = self._keys(job)
                load = Load(pool.cache, keys, job.block_ids, deadline, after=after, by_layer=True)
                self._step_loads.append((job, load))
                self._executor.submit(load.run, pool.client)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._step_loads and self.pool is not None:
            planes = self.pool.layout.layers.get(layer_name, ())
            for _, load in self._step_loads:
                self._engine_waits(load, load.wait_for(planes))

    def save_kv_layer(self, layer_name: str) -> None:
        pool = self.pool
        if self.layerwise and self._step_save is not None and pool is not None:
            save = self._step_save[0]
            if pool.copies.per_plane:
                self._saver.submit(save.copy, self._computed_planes(pool.layout, layer_name))

    def _computed_planes(self, layout: PagedLayout, layer_name: str) -> tuple[int, ...]:
        """The planes ``layer_name`` completes.  With several KV cache groups, a layer
        tensor holds one layer of each group (each group's blocks are its own pages), and
        it is complete only once every layer sharing it has run this step."""
        planes = layout.layers.get(layer_name, ())
        if self.has_state_groups:
            return ()  # state layers report no save (or share the planes): copy at the end
        if not self.is_hybrid:
            return planes
        left = self._layers_left
        for plane in planes:
            left[plane] = left.get(plane, self._layers_per_plane.get(plane, 1)) - 1
        return tuple(p for p in planes if left[p] <= 0)

    def wait_for_save(self, meta: KVPoolMetadata) -> None:
        """After the forward: stop the step's loads, fill its saves; the step may end then."""
        if self.pool is None:
            return
        loads, self._step_loads = self._step_loads, []
        for job, load in loads:
            num = load.stop()
            self._engine_waits(load, load.done)  # a late copy lands before any recompute
            self._finish_load(job, num, load.reason, time.perf_counter() - load.started, False)
        step_save, self._step_save = self._step_save, None
        if step_save is not None:
            self._finish_save(*step_save)

    def _engine_waits(self, load: Load, mark: Mark) -> None:
        if mark is not None and load.waited is not mark and self.pool is not None:
            self.pool.copies.engine_waits(mark)
            load.waited = mark

    def _keys(self, job: TransferJob) -> list[bytes]:
        if job.groups is None:
            return self.namespace.keys(job.block_hashes)
        ns_ids = self._group_ns_ids
        return [block_key(ns_ids[g], h) for g, h in zip(job.groups, job.block_hashes, strict=True)]

    # -- loads ----------------------------------------------------------------------------

    def start_load_kv(self, meta: KVPoolMetadata) -> None:
        after: Mark = None
        for job in meta.loads:
            if self.layerwise and not job.is_async:
                continue  # started with the step (begin_step)
            pool = self.pool
            if pool is None or not pool.health.is_healthy:
                self._finish_load(job, 0, "pool unhealthy")
                continue
            if after is None:
                after = pool.copies.mark()
            self._executor.submit(self._load, pool, job, after)

    def _load(self, pool: WorkerPool, job: TransferJob, after: Mark) -> None:
        """A whole load (``transfer: whole``, or blocks from a lower tier), off the step."""
        keys = self._keys(job)
        timeout = self.config.transfer_timeout_s
        load = load_into(pool.cache, pool.client, keys, job.block_ids, timeout, after)
        self._finish_load(job, load.num_blocks, load.reason, time.perf_counter() - load.started)

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
                if self.fails_whole_requests:
                    self._failed_loading.add(job.req_id)
                else:
                    self._load_errors.update(failed)
            if is_async:
                self._done_loading.add(job.req_id)

    # -- saves ----------------------------------------------------------------------------

    def _begin_save(self, pool: WorkerPool, jobs: list[TransferJob]) -> None:
        block_ids = [b for job in jobs for b in job.block_ids]
        if not pool.health.is_healthy:
            with self._lock:
                self.stats.add("skipped_unhealthy", len(block_ids))
            return
        with self._lock:
            busy = len(self._saving) >= MAX_SAVES_IN_FLIGHT
            if busy:
                self.stats.add("skipped_busy", len(block_ids))
        if busy:
            return  # the pool is behind: these blocks stay computable, the step goes on
        keys = [key for job in jobs for key in self._keys(job)]
        origins = (
            [o for job in jobs for o in job.origins or ()]
            if all(job.origins is not None for job in jobs)
            else None
        )
        retention = (
            [
                r
                for job in jobs
                for r in job.retention or [(DEFAULT_PRIORITY, 0.0)] * len(job.block_ids)
            ]
            if any(job.retention for job in jobs)
            else None
        )
        save = Save(pool.cache, keys, block_ids, time.perf_counter(), origins, retention)
        reserved = self._saver.submit(save.reserve, pool.client, self.config.lookup_timeout_s)
        self._step_save = (save, reserved)
        self._layers_left = {}

    def _finish_save(self, save: Save, reserved: Future[None]) -> None:
        # The reservation was asked for before the forward (with a lookup's deadline); past
        # the forward, the step waits for it no longer than a lookup.
        done, _ = wait([reserved], timeout=self.config.lookup_timeout_s)
        if not done:
            save.abandon()
            with self._lock:
                self.stats.add("skipped_busy", len(save.keys))
            return
        with save.cache.guard.call("save") as outcome:
            reserved.result()  # the reservation's own failure, if it failed
            lease = save.close()
        if outcome.failed:
            save.abandon()
            with self._lock:
                self.stats.add("save_errors", len(save.keys))
            return
        if lease is None:
            return
        # The pages are out of the cache: the rest (into pool memory, commit) need not hold
        # up the step.
        future = self._committer.submit(self._commit, save)
        with self._lock:
            self._saving.add(future)
        future.add_done_callback(self._saving_done)

    def _commit(self, save: Save) -> None:
        with save.cache.guard.call("save") as outcome:
            result = save.commit(self.config.transfer_timeout_s)
        with self._lock:
            if outcome.failed:
                self.stats.add("save_errors", len(save.wanted))
                return
            self.stats.add("saves")
            self.stats.add("saved_blocks", sum(1 for s in result.statuses if s == 0))
            self.stats.observe("save", time.perf_counter() - save.started)
        if save.retention is not None:
            self._retain(save)

    def _retain(self, save: Save) -> None:
        """A saved request's retention hints, once its blocks are published (kvpool.retention):
        one call per priority and duration, under a lookup's deadline."""
        assert save.retention is not None and self.pool is not None
        for (priority, duration_s), keys in by_hint(save.keys, save.retention).items():
            with save.cache.guard.call("retain") as outcome:
                retained = self.pool.client.retain(
                    keys, priority, duration_s, timeout=self.config.lookup_timeout_s
                )
            if not outcome.failed:
                with self._lock:
                    self.stats.add("retained_blocks", retained.num_retained)
                    self.stats.add("retention_refused", retained.num_refused)

    def _saving_done(self, future: Future[None]) -> None:
        with self._lock:
            self._saving.discard(future)

    # -- reporting ------------------------------------------------------------------------

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results()
        return None, results.finished_recving or None

    def get_transfer_results(self) -> KVConnectorTransferResults:
        """The requests whose whole loads finished since the last call, and of them those
        whose load failed (several groups, or a partial one: vLLM recomputes them whole)."""
        with self._lock:
            done, self._done_loading = self._done_loading, set()
            failed, self._failed_loading = self._failed_loading, set()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

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
        if self.pool is not None:
            self.pool.close()


def _distinct(kv_caches: dict[str, Any]) -> set[int]:
    out = set()
    for cache in kv_caches.values():
        first = cache[0] if isinstance(cache, list | tuple) else cache
        out.add(first.data_ptr())
    return out
