"""What passes between the connector's scheduler half and its worker half.

vLLM pickles the metadata from the scheduler process to the worker processes, so it holds
only plain values: request ids, block ids and block hashes (each worker turns hashes into
keys under its own namespace).  Stats travel back the same way, and so, once at start, does
each worker's handshake: the attention backends its layers run (:mod:`.backends`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvpool.keys import BlockOrigin


@dataclass
class TransferJob:
    """Blocks of one request to move between the paged KV cache and the pool."""

    req_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    # Saves: what each block was computed from (its tokens, its parent's hash), which the
    # node's KV events tell routers.
    origins: list[BlockOrigin | None] | None = None
    # Loads: the whole job before the request runs (vLLM's WAITING_FOR_REMOTE_KVS), not
    # layer by layer in its step: ``transfer: whole``, or blocks coming up from lower tiers.
    is_async: bool = False
    # Engines with several KV cache groups (vLLM's hybrid allocator): the group of each
    # block, which picks its namespace.  None: every block is the only group's.
    groups: list[int] | None = None
    # Saves: each block's retention hint, (priority, duration_s) (kvpool.retention); None:
    # every block at the default priority.
    retention: list[tuple[int, float]] | None = None


@dataclass
class KVPoolMetadata(KVConnectorMetadata):
    loads: list[TransferJob] = field(default_factory=list)
    saves: list[TransferJob] = field(default_factory=list)


@dataclass
class KVPoolHandshake(KVConnectorHandshakeMetadata):
    """A worker's word to the scheduler, once, before any request: the attention backends
    vLLM selected for its layers."""

    attention_backends: tuple[str, ...] = ()


_SUMS = (
    "lookups",
    "lookup_blocks",
    "hit_blocks",
    "hit_blocks_dram",
    "hit_blocks_disk",
    "hit_blocks_object",
    "hit_blocks_remote",
    "loads",
    "loaded_blocks",
    "load_errors",
    "saves",
    "saved_blocks",
    "evicting_saved_blocks",
    "retained_blocks",
    "retention_refused",
    "save_errors",
    "skipped_unhealthy",
    "skipped_busy",
    "skipped_unsupported",
    "load_s",
    "save_s",
)


@dataclass
class KVPoolStats(KVConnectorStats):
    """Counters of one interval; load_s / save_s sum the latencies, with their min and max."""

    def reset(self) -> None:
        self.data = {}

    def add(self, name: str, value: float = 1) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def observe(self, kind: str, seconds: float) -> None:
        self.add(f"{kind}_s", seconds)
        low, high = f"{kind}_min_s", f"{kind}_max_s"
        self.data[low] = min(self.data.get(low, seconds), seconds)
        self.data[high] = max(self.data.get(high, seconds), seconds)

    def aggregate(self, other: KVConnectorStats) -> KVPoolStats:
        for key, value in other.data.items():
            if isinstance(value, list):
                self.data[key] = [*self.data.get(key, []), *value]
            elif key.endswith("_min_s"):
                self.data[key] = min(self.data.get(key, value), value)
            elif key.endswith("_max_s"):
                self.data[key] = max(self.data.get(key, value), value)
            else:
                self.data[key] = self.data.get(key, 0) + value
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in _SUMS)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {
            "loads": int(d.get("loads", 0)),
            "saves": int(d.get("saves", 0)),
            "blocks_loaded": int(d.get("loaded_blocks", 0)),
            "blocks_saved": int(d.get("saved_blocks", 0)),
            "load_errors": int(d.get("load_errors", 0)),
            "hit_rate": round(d.get("hit_blocks", 0) / d["lookup_blocks"], 4)
            if d.get("lookup_blocks")
            else 0.0,
        }
        for name in ("evicting_saved_blocks", "retained_blocks", "retention_refused"):
            if d.get(name):
                out[name] = int(d[name])
        for tier in ("dram", "disk", "object", "remote"):
            if d.get(f"hit_blocks_{tier}"):
                out[f"hit_blocks_{tier}"] = int(d[f"hit_blocks_{tier}"])
        for kind in ("load", "save"):
            count = d.get(f"{kind}s", 0)
            if count:
                out[f"{kind}_avg_ms"] = round(1e3 * d.get(f"{kind}_s", 0) / count, 3)
                out[f"{kind}_min_ms"] = round(1e3 * d.get(f"{kind}_min_s", 0), 3)
                out[f"{kind}_max_ms"] = round(1e3 * d.get(f"{kind}_max_s", 0), 3)
        return out

    def line(self) -> str:
        r = self.reduce()
        parts = [
            f"loads={r['loads']}",
            f"saves={r['saves']}",
            f"blocks loaded={r['blocks_loaded']}",
            f"saved={r['blocks_saved']}",
            f"hit rate={100 * r['hit_rate']:.1f}%",
        ]
        by_tier = [
            f"{tier}={r[f'hit_blocks_{tier}']}"
            for tier in ("dram", "disk", "object", "remote")
            if f"hit_blocks_{tier}" in r
        ]
        if by_tier:
            parts.append(f"loadable hits by tier: {' '.join(by_tier)}")
        for kind in ("load", "save"):
            if f"{kind}_avg_ms" in r:
                parts.append(
                    f"{kind} ms avg/min/max={r[f'{kind}_avg_ms']:.2f}/{r[f'{kind}_min_ms']:.2f}/"
                    f"{r[f'{kind}_max_ms']:.2f}"
                )
        if r["load_errors"]:
            parts.append(f"load errors={r['load_errors']}")
        return " ".join(parts)


def merge(stats: KVPoolStats, data: dict[str, Any] | None) -> None:
    if data:
        stats.aggregate(KVPoolStats(data=dict(data)))


class KVPoolPromMetrics(KVConnectorPromMetrics):
    """Counters on vLLM's own /metrics: ``vllm:kvpool_*``."""

    COUNTERS = {
        "loaded_blocks": (
            "vllm:kvpool_blocks_loaded",
            "Blocks loaded from kvpool instead of recomputed.",
        ),
        "saved_blocks": ("vllm:kvpool_blocks_saved", "Blocks saved into kvpool."),
        "load_errors": (
            "vllm:kvpool_load_errors",
            "Blocks that could not be loaded and were recomputed.",
        ),
        "lookup_blocks": ("vllm:kvpool_lookup_blocks", "Prompt blocks looked up in kvpool."),
        "hit_blocks": ("vllm:kvpool_hit_blocks", "Prompt blocks found in kvpool."),
        "hit_blocks_dram": (
            "vllm:kvpool_hit_blocks_dram",
            "Blocks past the engine's own cache found in the node's DRAM.",
        ),
        "hit_blocks_disk": (
            "vllm:kvpool_hit_blocks_disk",
            "Blocks past the engine's own cache found on the node's disk tier.",
        ),
        "hit_blocks_object": (
            "vllm:kvpool_hit_blocks_object",
            "Blocks past the engine's own cache found only in the shared object store.",
        ),
        "hit_blocks_remote": (
            "vllm:kvpool_hit_blocks_remote",
            "Blocks past the engine's own cache found on other nodes.",
        ),
        "skipped_unhealthy": (
            "vllm:kvpool_skipped_unhealthy",
            "Lookups and saves skipped while kvpool was unhealthy.",
        ),
        "skipped_busy": (
            "vllm:kvpool_skipped_busy",
            "Blocks not saved because earlier saves were still being committed.",
        ),
        "skipped_unsupported": (
            "vllm:kvpool_skipped_unsupported",
            "Requests offered no pool blocks: the model keeps KV state the pool does not reuse.",
        ),
    }

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter_cls: Any = self._counter_cls
        histogram_cls: Any = self._histogram_cls
        self._counters = {
            key: counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for key, (name, doc) in self.COUNTERS.items()
        }
        self._latency = {
            kind: histogram_cls(
                name=f"vllm:kvpool_{kind}_seconds",
                documentation=f"Mean time of one kvpool {kind} in a logging interval.",
                labelnames=labelnames,
                buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0],
            )
            for kind in ("load", "save")
        }
        # Every engine's series exist from the start, at 0: rates and alerts on them work
        # before the first event (a load error, a disk hit) ever happens.
        for labels in per_engine_labelvalues.values():
            for counter in self._counters.values():
                counter.labels(*labels)
            for histogram in self._latency.values():
                histogram.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, counter in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if isinstance(value, int | float) and value > 0:
                counter.labels(*labels).inc(value)
        for kind, histogram in self._latency.items():
            count = transfer_stats_data.get(f"{kind}s", 0)
            if count:
                histogram.labels(*labels).observe(transfer_stats_data.get(f"{kind}_s", 0) / count)
