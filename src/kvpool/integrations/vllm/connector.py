"""``KVPoolConnector``: vLLM's KV connector for kvpool — store instead of recompute.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVPoolConnector",
                           "kv_connector_module_path": "kvpool.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"address": "unix:/path/to/kvpool.sock"}}'

Roles: ``kv_both`` saves and loads; ``kv_producer`` (a prefill instance) only saves;
``kv_consumer`` (a decode instance) only loads, waiting a bounded time for blocks a producer
is still saving.

The hooks, in the order vLLM calls them, and what each promises:

Scheduler side (:mod:`.scheduler`; matching, policy and request state, no tensors):
    bind_gpu_block_pool()        once, at start: the engine's block pool, whose free queue
                                 the saves on eviction walk (``save: evicting``, :mod:`.saving`).
    set_xfer_handshake_metadata()  once, at start, before any request: the attention
                                 backends the workers run.  An engine whose backend cannot
                                 continue a prefix it did not compute (:mod:`.backends`) is
                                 offered no load; until the workers have said, none is.
    on_new_request()             once per request, when it arrives.
    get_num_new_matched_tokens() the tokens past the engine's own prefix-cache hit that the
                                 pool can load (asynchronously), or ``None`` to be asked
                                 again next step (a consumer waiting for its producer).
                                 May be called several times per request; side-effect free.
                                 One lookup under ``lookup_timeout``: a slow or dead pool is
                                 a miss.
    update_state_after_alloc()   once the request has blocks: plans its load into them and
                                 where its saves start.  Called again, with no external
                                 tokens, after an asynchronous load.
    build_connector_meta()       once per step: the step's loads, and a save for every block
                                 (of the prompt, or of generated tokens) whose KV the step
                                 completes and that is not in the pool (``save: eager``), or
                                 of the cached blocks nearest eviction (``evicting``).
    update_connector_output()    once per step, with the workers' stats and failed loads.
    request_finished()           once, before the request's blocks are freed: it never holds
    request_finished_all_groups()  them back (saves copy their pages out within the step).
                                 The second is vLLM's hybrid allocator's (``SupportsHMA``):
                                 every KV cache group is saved and loaded under its own
                                 namespace (:mod:`.groups`).

Worker side (:mod:`.worker`; transfers in flight only):
    register_kv_caches()         once, at start: the paged layout, checked against the model.
    get_handshake_metadata()     once, at start: the attention backends of this worker's
                                 layers, for the scheduler.
    bind_connector_metadata()    per step, before the forward: reserves the step's saves and
                                 starts its layer-by-layer loads, in the background.
    start_load_kv()              per step: starts the step's whole loads (``transfer: whole``)
                                 in the background.
    wait_for_layer_load()        per layer, before its attention: waits (bounded) until the
                                 layer's pages are loaded.
    save_kv_layer()              per layer, after its attention: queues the copy of the
                                 layer's pages into the reserved pool space.
    wait_for_save()              per step, after the forward: stops the step's loads, copies
                                 what is left of its saves before returning; checksums and
                                 commits finish in the background.
    get_transfer_results()       per step: the requests whose whole loads finished, and
                                 (several KV cache groups) those whose load failed, which
                                 vLLM recomputes whole.
    get_block_ids_with_load_errors()  per step: blocks that could not be loaded, which vLLM
                                 recomputes.

Both halves exchange :mod:`.metadata`.  Failures never reach the engine: they become misses
and recomputed blocks, and every pool call has a deadline.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpool.kvcache.ranks import writes_blocks

from .backends import selected_backends
from .config import connector_config, engine_ref, expected_page_bytes, namespaces
from .groups import cache_groups
from .metadata import KVPoolHandshake, KVPoolMetadata, KVPoolPromMetrics, KVPoolStats
from .scheduler import KVPoolScheduler
from .worker import KVPoolWorker

log = logging.getLogger("vllm.kvpool")  # under vLLM's logging configuration


class KVPoolConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.config = connector_config(transfer.kv_connector_extra_config)
        spaces = namespaces(vllm_config, self.config)
        groups = cache_groups(kv_cache_config, vllm_config.cache_config.block_size)
        kv_role = str(transfer.kv_role)
        if transfer.kv_load_failure_policy != "recompute":
            # vLLM reads the policy right after creating the scheduler's connector.  The pool
            # is a cache: a block it cannot deliver is recomputed, never a failed request.
            log.warning(
                "kvpool: kv_load_failure_policy=%r would fail requests whose pool load "
                "fails; using 'recompute'",
                transfer.kv_load_failure_policy,
            )
            transfer.kv_load_failure_policy = "recompute"
        if role == KVConnectorRole.SCHEDULER:
            log.info("kvpool connector (%s, scheduler): %s", kv_role, self.config.describe())
            self._scheduler: KVPoolScheduler | None = KVPoolScheduler(
                self.config,
                spaces,
                vllm_config.cache_config.block_size,
                can_load=kv_role in ("kv_both", "kv_consumer"),
                can_save=kv_role in ("kv_both", "kv_producer"),
                wait_for_pending=kv_role == "kv_consumer",
                groups=groups,
                engine=engine_ref(vllm_config, self.config),
            )
            self._worker: KVPoolWorker | None = None
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            rank = (get_tensor_model_parallel_rank(), get_pp_group().rank_in_group)
            self._scheduler = None
            self._worker = KVPoolWorker(
                self.config,
                spaces[rank],
                expected_page_bytes(vllm_config),
                groups,
                can_save=writes_blocks(spaces[rank], rank[0]),
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a lost save is a future miss, never an error

    # -- scheduler side -------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        assert self._scheduler is not None
        self._scheduler.set_attention_backends(_backends_of(metadata.values()))

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        # Every pipeline stage's workers: each runs some of the layers.
        assert self._scheduler is not None
        self._scheduler.set_attention_backends(_backends_of(metadata.values()))

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        # The engine's block pool: the saves on eviction (save: evicting/auto) walk it.
        if self._scheduler is None:
            return
        # Twice the blocks one step's tokens can take (vLLM's own offloader looks as far).
        batched = self._vllm_config.scheduler_config.max_num_batched_tokens
        per_step = -(-batched // self._vllm_config.cache_config.block_size)
        self._scheduler.bind_block_pool(gpu_block_pool, lookahead=2 * per_step)

    def on_new_request(self, request: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVPoolHandshake | None:
        if self._worker is None:
            return None
        return KVPoolHandshake(attention_backends=selected_backends(self._vllm_config))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, KVPoolMetadata)
            self._worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        self._worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPoolMetadata)
        self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return self._worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        return self._worker.get_transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.get_block_ids_with_load_errors()

    # -- both -----------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        half = self._scheduler or self._worker
        return half.take_stats() if half is not None else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVPoolStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVPoolPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for half in (self._scheduler, self._worker):
            if half is not None:
                half.shutdown()


def _backends_of(handshakes: Any) -> list[str]:
    return [
        name
        for handshake in handshakes
        if isinstance(handshake, KVPoolHandshake)
        for name in handshake.attention_backends
    ]
