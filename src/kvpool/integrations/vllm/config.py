"""The connector's configuration, read once from ``kv_connector_extra_config`` (and the
``KVPOOL_*`` environment), and the pool namespaces of an engine.

Every ``kv_connector_extra_config`` key is an option declared once, beside its field: the
client's (:class:`~kvpool.config.ClientConfig`: ``address``, ``access_id``, ``timeout``,
``peers``, ...), the connector's (:class:`ConnectorConfig`: ``lookup_timeout``,
``transfer``, ``consumer_wait``, ``kthena_pod``, ...) and the health policy's
(:class:`~kvpool.client.health.HealthPolicy`: ``health_*``); each also a ``KVPOOL_*``
variable, which a key overrides.  docs/configuration.md lists them all, with defaults,
generated from these declarations (``kvpool.cli.reference``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.client.health import HealthPolicy
from kvpool.config import (
    DEFAULT_TRANSFER_TIMEOUT_S,
    ClientConfig,
    config_from,
    option,
    parse_bool,
)
from kvpool.errors import ConfigError
from kvpool.integrations.vllm.saving import EAGER, check_save_mode
from kvpool.keys import MAX_MODEL_CHARS, MAX_POD_CHARS, EngineRef, Namespace, check_hash_stability

log = logging.getLogger("vllm.kvpool")  # under vLLM's logging configuration

DEFAULT_LOOKUP_TIMEOUT_S = 0.2
DEFAULT_CONSUMER_WAIT_S = 2.0
DEFAULT_STATS_INTERVAL_S = 10.0
DEFAULT_PREFETCH_HOLD_S = 60.0
TRANSFERS = ("layerwise", "whole")


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's own options, beside its client's and its health policy's."""

    client: ClientConfig
    lookup_timeout_s: float = option(
        DEFAULT_LOOKUP_TIMEOUT_S,
        "Deadline of the scheduler's lookup, seconds (a slow pool is a miss).",
        parse=float,
    )
    transfer_timeout_s: float = option(
        DEFAULT_TRANSFER_TIMEOUT_S, "Deadline of one load or save, seconds.", parse=float
    )
    min_load_tokens: int = option(0, "Load only if at least this many tokens hit.", parse=int)
    min_load_blocks: int = option(1, "Load only if at least this many blocks hit.", parse=int)
    consumer_wait_s: float = option(
        DEFAULT_CONSUMER_WAIT_S,
        "How long a consumer (kv_consumer) waits for blocks a producer is still saving.",
        parse=float,
    )
    transfer: str = option(
        TRANSFERS[0],
        "layerwise: a load runs in the step that uses it, layer by layer ahead of the "
        "attention that reads it, and saves stream out as each layer is computed; whole: a "
        "request waits a step for its whole load.",
    )
    save: str = option(
        EAGER,
        "When blocks are saved (kv_both engines; :mod:`kvpool.integrations.vllm.saving`): "
        "eager, as the engine computes them; evicting, as the engine is about to drop them "
        "from its own prefix cache (the pool then holds what the engine does not); auto, "
        "whichever the engine's pool hits call for.",
    )
    tenant: str = option("", "Isolates the blocks of one tenant (its namespaces).")
    stats_interval_s: float = option(
        DEFAULT_STATS_INTERVAL_S, "Seconds between the connector's stats log lines.", parse=float
    )
    prefetch_hold_s: float = option(
        DEFAULT_PREFETCH_HOLD_S,
        "A request whose prefix is only in lower tiers: the node brings it into DRAM and "
        "holds it this long for the request (0: no hint, the load reads lower tiers).",
        parse=float,
    )
    mla_any_tp: bool = option(
        False,
        "MLA: share blocks with engines of any tensor-parallel size (a TP=8 prefill and a "
        "TP=1 decode); off, only the ranks of engines of one size share.",
        parse=parse_bool,
    )
    kthena_pod: str = option(
        "",
        "This engine's pod as Kthena names it (<pod>.<namespace>): its node writes Kthena's "
        "Redis entries for it (kvpool serve --kthena-redis).",
    )
    kthena_model: str = option(
        "", "The model name requests to this engine carry (default: its served name)."
    )
    health: HealthPolicy = field(default_factory=HealthPolicy)

    def validate(self) -> ConnectorConfig:
        if self.lookup_timeout_s <= 0 or self.transfer_timeout_s <= 0:
            raise ConfigError("lookup_timeout and transfer_timeout must be positive")
        if self.min_load_tokens < 0 or self.min_load_blocks < 1:
            raise ConfigError("min_load_tokens must be >= 0 and min_load_blocks >= 1")
        if self.consumer_wait_s < 0:
            raise ConfigError("consumer_wait must be >= 0")
        if not 0 <= self.prefetch_hold_s <= 600:
            raise ConfigError("prefetch_hold must be 0-600 seconds")
        check_save_mode(self.save)
        if self.transfer not in TRANSFERS:
            raise ConfigError(f"transfer must be one of {', '.join(TRANSFERS)}")
        if len(self.kthena_pod) > MAX_POD_CHARS or len(self.kthena_model) > MAX_MODEL_CHARS:
            raise ConfigError(
                f"kthena_pod and kthena_model: at most {MAX_POD_CHARS} and "
                f"{MAX_MODEL_CHARS} characters"
            )
        return self

    def describe(self) -> str:
        c = self.client
        return (
            f"address={c.address} timeout={c.timeout_s}s lookup_timeout={self.lookup_timeout_s}s "
            f"transfer_timeout={self.transfer_timeout_s}s min_load_tokens={self.min_load_tokens} "
            f"min_load_blocks={self.min_load_blocks} consumer_wait={self.consumer_wait_s}s "
            f"transfer={self.transfer} save={self.save} "
            f"write_rcache={c.write_rcache} read_local_only={c.read_local_only} "
            f"peers={list(c.peers)} etcd={c.etcd or '-'} tenant={self.tenant or '-'} "
            f"auth={'on' if c.access_key else 'off'}"
        )


def connector_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> ConnectorConfig:
    """The effective configuration: defaults, then ``KVPOOL_*`` variables, then
    ``kv_connector_extra_config`` (its strings parsed as the variables are)."""
    return config_from(ConnectorConfig, extra, environ, where="kv_connector_extra_config")


def engine_ref(vllm_config: Any, config: ConnectorConfig) -> EngineRef | None:
    """The engine as Kthena names it, for its node to write Kthena's entries for
    (:mod:`kvpool.node.kthena`); None without ``kthena_pod``."""
    if not config.kthena_pod:
        return None
    served = vllm_config.model_config.served_model_name or vllm_config.model_config.model
    if isinstance(served, list | tuple):
        served = served[0]
    return EngineRef(pod=config.kthena_pod, model=config.kthena_model or str(served))


def _kv_dtype(vllm_config: Any) -> str:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def expected_page_bytes(vllm_config: Any) -> int:
    """The bytes of one block of one layer, from the model's shape (what the worker's KV
    cache must hold; checked against it at start)."""
    import torch

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    block_size = vllm_config.cache_config.block_size
    dtype = _kv_dtype(vllm_config)
    torch_dtype = getattr(torch, dtype, None) if not dtype.startswith("fp8") else torch.uint8
    if not isinstance(torch_dtype, torch.dtype):
        raise ConfigError(f"unsupported KV cache dtype {dtype!r}")
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    if model.use_mla:
        return block_size * model.get_head_size() * itemsize
    return block_size * model.get_num_kv_heads(parallel) * 2 * model.get_head_size() * itemsize


def namespaces(vllm_config: Any, config: ConnectorConfig) -> dict[tuple[int, int], Namespace]:
    """The namespace of every (tensor-parallel rank, pipeline-parallel rank) of an engine
    (:meth:`Namespace.for_rank`: one per rank, except that MLA's tensor-parallel ranks share
    one, whatever the engine's tensor-parallel size).

    The scheduler looks up each distinct one (a prefix counts only if every rank has it);
    each worker loads under its own, and saves under it unless another rank saves the same
    copy (:func:`kvpool.kvcache.ranks.writes_blocks`).  Data-parallel ranks are whole
    replicas of the engine, each with its own scheduler: no data-parallel rank is in the
    namespace, so each engine core loads what any other saved.
    """
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    hash_algo = str(cache.prefix_caching_hash_algo)
    check_hash_stability(hash_algo, _engine_environ())
    base = Namespace(
        model=str(model.model),
        revision=str(model.revision or ""),
        dtype=_kv_dtype(vllm_config),
        layout=_physical_layout(vllm_config, current_platform),
        num_layers=int(getattr(model.hf_text_config, "num_hidden_layers", 0)),
        block_size=int(cache.block_size),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_dim=int(model.get_head_size()),
        is_mla=bool(model.use_mla),
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        tenant=config.tenant,
        hash_algo=hash_algo,
        extra=f"page={expected_page_bytes(vllm_config)}",
    )
    return {
        (tp, pp): base.for_rank(tp, pp, mla_any_tp=config.mla_any_tp)
        for tp in range(base.tp_size)
        for pp in range(base.pp_size)
    }


def _physical_layout(vllm_config: Any, platform: Any) -> str:
    """What decides how a page's bytes are ordered, beyond its shape: the device, the
    attention backend (chosen, or picked automatically for the GPU generation), the KV
    cache layout override, and vLLM's version.  Engines that differ in any of these never
    share blocks."""
    import vllm

    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None)
    capability = platform.get_device_capability()
    parts = [
        str(platform.device_type),
        f"attn={getattr(backend, 'name', backend) or 'auto'}",
        f"cc={capability.major}.{capability.minor}" if capability is not None else "",
        f"kv_layout={os.environ['VLLM_KV_CACHE_LAYOUT']}"
        if os.environ.get("VLLM_KV_CACHE_LAYOUT")
        else "",
        "vllm=" + ".".join(str(vllm.__version__).split(".")[:2]),
    ]
    return "/".join(p for p in parts if p)


def _engine_environ() -> Mapping[str, str]:
    return os.environ
