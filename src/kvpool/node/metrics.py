"""Prometheus metrics of one node: gauges and counters read from the store on scrape, and
latency histograms observed by the server.  Each daemon has its own registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.protocol.messages import NodeStats

# 50 µs .. 1 s, three buckets a decade.
LATENCY_BUCKETS = (*(m * 10.0**e for e in range(-5, -1) for m in (5, 10, 25)), 1.0)


class Stat(NamedTuple):
    """One metric of a table: its family, its name (after the table's prefix), its help
    text, and the attribute of the stats it reports."""

    family: type[GaugeMetricFamily | CounterMetricFamily]
    name: str
    doc: str
    attribute: str


def gauge(name: str, doc: str, attribute: str = "") -> Stat:
    """A gauge of the stats' ``attribute`` (by default, the one named as the metric)."""
    return Stat(GaugeMetricFamily, name, doc, attribute or name)


def counter(name: str, doc: str, attribute: str = "") -> Stat:
    """A counter of the stats' ``attribute`` (by default, the one named as the metric)."""
    return Stat(CounterMetricFamily, name, doc, attribute or name)


NODE_METRICS = (
    gauge("capacity_bytes", "Arena capacity."),
    gauge("used_bytes", "Arena bytes allocated (committed and reserved)."),
    gauge("reserved_bytes", "Arena bytes reserved by writes in flight."),
    gauge("area_bytes", "Free arena bytes that same-host writers hold as write areas."),
    gauge("blocks", "Committed blocks.", attribute="num_blocks"),
    gauge("pinned_blocks", "Blocks pinned by readers.", attribute="num_pinned"),
    gauge("connections", "Open client connections.", attribute="num_connections"),
    gauge(
        "strangers",
        "Connections still in their handshake (their own pool).",
        attribute="num_strangers",
    ),
    counter(
        "strangers_evicted", "Connections closed in their handshake to make room for newer ones."
    ),
    gauge("metadata_bytes", "Heap the block index takes (an O(1) estimate)."),
    gauge("connection_buffer_bytes", "Receive buffers of the open connections."),
    gauge(
        "heap_bytes",
        "The daemon's anonymous resident memory (RssAnon): index, buffers and the rest.",
    ),
    counter("kthena_written", "Owner changes of Kthena's Redis entries written (each once)."),
    counter(
        "kthena_dropped",
        "Owner changes of Kthena's Redis entries dropped: the queue was full, or "
        "Redis did not take them past the retries.",
    ),
    counter("hits", "Blocks found by lookups."),
    counter("misses", "Blocks not found by lookups."),
    counter("puts", "Blocks committed."),
    counter("evictions", "Blocks evicted."),
    gauge("retained_blocks", "Blocks retention hints hold at a priority other than the default."),
    counter(
        "retention_refused", "Blocks retention hints asked for past their tenant's retained bytes."
    ),
    counter("bytes_in", "Payload bytes written into the arena."),
    counter("bytes_out", "Payload bytes read out of the arena."),
    counter(
        "corrupt_blocks",
        "Blocks found corrupt (by readers or the scrubber) and dropped.",
        attribute="corrupt_reports",
    ),
    counter("scrubbed_bytes", "Bytes the scrubber re-hashed."),
)

# What the node's bookkeeping costs per unit: the name, the help text, the stats' total and
# the count it is divided by.
PER_UNIT_METRICS = (
    (
        "metadata_bytes_per_block",
        "Heap the block index takes per committed block.",
        "metadata_bytes",
        "num_blocks",
    ),
    (
        "connection_buffer_bytes_per_connection",
        "Receive buffer bytes per open connection.",
        "connection_buffer_bytes",
        "num_connections",
    ),
)

TIER_METRICS = (
    gauge("capacity_bytes", "Capacity of the tier."),
    gauge("used_bytes", "Bytes the tier uses."),
    gauge("blocks", "Blocks the tier holds.", attribute="num_blocks"),
    gauge(
        "recovered_blocks",
        "Blocks found at start (adopted or re-indexed).",
        attribute="recovered",
    ),
    counter("hits", "Blocks lookups found in the tier."),
    counter("reads", "Blocks read out of the tier."),
    counter("writes", "Blocks written into the tier."),
    counter("refused", "Write-backs the admission policy refused."),
    counter(
        "dropped",
        "Blocks dropped on their way into the tier (gone): its queue was full, or the "
        "object store's upload failed.",
    ),
    counter("slowed", "Writes held until the write-back caught up (backpressure)."),
    counter("promotions", "Blocks copied from the tier back into DRAM."),
    counter("served", "Blocks read from the tier straight into a reply (DRAM had no room)."),
    counter("evictions", "Blocks evicted from the tier."),
    counter("corrupt", "Blocks of the tier found corrupt (never served)."),
    counter("errors", "Requests to the tier that failed or ran out of time."),
)

PREFETCH_METRICS = (
    counter("issued", "Blocks named by prefetches."),
    counter("started", "Prefetched blocks brought up from a lower tier (or joined)."),
    counter("completed", "Prefetched blocks brought up into DRAM and verified."),
    counter("refused", "Prefetched blocks refused: past the bound in flight or held."),
    counter("useful", "Prefetched blocks read while held."),
    counter("wasted", "Prefetched blocks whose hold lapsed unread."),
    gauge("held_blocks", "Blocks held in DRAM for queued requests."),
    gauge("held_bytes", "Bytes held in DRAM for queued requests."),
)


class _StatsCollector(Collector):
    """The node's stats, read on each scrape: the node's own, its tiers', its prefetches',
    its namespaces' and its tenants'."""

    def __init__(self, stats: Callable[[], NodeStats]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        node = [([s.node_id], s)]
        yield from _families("kvpool_", NODE_METRICS, ["node"], node)
        yield from _per_unit_families(s)
        tiers = [([s.node_id, tier.name], tier) for tier in s.tiers]
        yield from _families("kvpool_tier_", TIER_METRICS, ["node", "tier"], tiers)
        yield _estimates_family(s)
        if s.prefetch is not None:
            prefetch = [([s.node_id], s.prefetch)]
            yield from _families("kvpool_prefetch_", PREFETCH_METRICS, ["node"], prefetch)
        yield from _namespace_families(s)
        yield from _account_families(s)


def _families(
    prefix: str,
    table: tuple[Stat, ...],
    labels: list[str],
    sources: Sequence[tuple[list[str], object]],
) -> Iterator[Metric]:
    """A family per metric of ``table``, with a sample per source: its label values, and
    the object whose attribute the metric reports."""
    for stat in table:
        family = stat.family(prefix + stat.name, stat.doc, labels=labels)
        for label_values, source in sources:
            family.add_metric(label_values, getattr(source, stat.attribute))
        yield family


def _per_unit_families(s: NodeStats) -> Iterator[Metric]:
    for name, doc, total, unit in PER_UNIT_METRICS:
        family = GaugeMetricFamily(f"kvpool_{name}", doc, labels=["node"])
        family.add_metric([s.node_id], getattr(s, total) / max(getattr(s, unit), 1))
        yield family


def _estimates_family(s: NodeStats) -> Metric:
    estimated = GaugeMetricFamily(
        "kvpool_tier_estimated_hit_rate",
        "The hit rate the node estimates it would have with the tier at `scale` times its "
        "capacity (faster tiers as they are), from sampled reuse times.",
        labels=["node", "tier", "scale"],
    )
    for tier in s.tiers:
        for estimate in tier.estimates:
            estimated.add_metric([s.node_id, tier.name, f"{estimate.scale:g}"], estimate.hit_rate)
    return estimated


def _namespace_families(s: NodeStats) -> Iterator[Metric]:
    blocks = GaugeMetricFamily(
        "kvpool_namespace_blocks", "Committed blocks per namespace.", labels=["namespace"]
    )
    used = GaugeMetricFamily(
        "kvpool_namespace_used_bytes", "Bytes per namespace.", labels=["namespace"]
    )
    for ns in s.namespaces:
        blocks.add_metric([ns.namespace_id], ns.num_blocks)
        used.add_metric([ns.namespace_id], ns.used_bytes)
    yield blocks
    yield used


# Each tenant's use of each budget: the attribute is the account's map of budget to value.
ACCOUNT_METRICS = (
    gauge("used", "What each tenant holds of each budget."),
    gauge("limit", "Each tenant's limit of each budget.", attribute="limits"),
    counter("refused", "Requests refused past a tenant's budget."),
)


def _account_families(s: NodeStats) -> Iterator[Metric]:
    """Each tenant's use of each budget (kvpool.store.accounts), its limit and its
    refusals: ``budget`` is the resource's name (``buffer_bytes``, ``parked_keys``, ...)."""
    for stat in ACCOUNT_METRICS:
        labels = ["node", "tenant", "budget"]
        family = stat.family(f"kvpool_tenant_{stat.name}", stat.doc, labels=labels)
        for account in s.accounts:
            for budget, value in getattr(account, stat.attribute).items():
                family.add_metric([s.node_id, account.tenant, budget], value)
        yield family


class NodeMetrics:
    def __init__(self, stats: Callable[[], NodeStats]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(stats))
        self.op_latency = Histogram(
            "kvpool_op_latency_seconds",
            "Time to serve one request, by operation.",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        # The histogram of each op, looked up once (``labels`` takes a lock and builds a
        # key on every call: a measurable share of a small request).
        self._op_latency_of: dict[str, Histogram] = {}

    def observe_op(self, op_name: str, seconds: float) -> None:
        """Count one request of ``op_name`` (lower case) that took ``seconds``."""
        histogram = self._op_latency_of.get(op_name)
        if histogram is None:
            histogram = self._op_latency_of[op_name] = self.op_latency.labels(op_name)
        histogram.observe(seconds)
