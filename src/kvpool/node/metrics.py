"""Prometheus metrics of one node: gauges and counters read from the store on scrape, and
latency histograms observed by the server.  Each daemon has its own registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.protocol.messages import NodeStats

# 50 µs .. 1 s, three buckets a decade.
LATENCY_BUCKETS = (*(m * 10.0**e for e in range(-5, -1) for m in (5, 10, 25)), 1.0)


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], NodeStats]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        labels = ["node"]
        node = [s.node_id]
        families = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
        for kind, name, doc, value in (
            ("gauge", "kvpool_capacity_bytes", "Arena capacity.", s.capacity_bytes),
            (
                "gauge",
                "kvpool_used_bytes",
                "Arena bytes allocated (committed and reserved).",
                s.used_bytes,
            ),
            (
                "gauge",
                "kvpool_reserved_bytes",
                "Arena bytes reserved by writes in flight.",
                s.reserved_bytes,
            ),
            (
                "gauge",
                "kvpool_area_bytes",
                "Free arena bytes that same-host writers hold as write areas.",
                s.area_bytes,
            ),
            ("gauge", "kvpool_blocks", "Committed blocks.", s.num_blocks),
            ("gauge", "kvpool_pinned_blocks", "Blocks pinned by readers.", s.num_pinned),
            ("gauge", "kvpool_connections", "Open client connections.", s.num_connections),
            (
                "gauge",
                "kvpool_strangers",
                "Connections still in their handshake (their own pool).",
                s.num_strangers,
            ),
            (
                "counter",
                "kvpool_strangers_evicted",
                "Connections closed in their handshake to make room for newer ones.",
                s.strangers_evicted,
            ),
            (
                "gauge",
                "kvpool_metadata_bytes",
                "Heap the block index takes (an O(1) estimate).",
                s.metadata_bytes,
            ),
            (
                "gauge",
                "kvpool_metadata_bytes_per_block",
                "Heap the block index takes per committed block.",
                s.metadata_bytes / max(s.num_blocks, 1),
            ),
            (
                "gauge",
                "kvpool_connection_buffer_bytes",
                "Receive buffers of the open connections.",
                s.connection_buffer_bytes,
            ),
            (
                "gauge",
                "kvpool_connection_buffer_bytes_per_connection",
                "Receive buffer bytes per open connection.",
                s.connection_buffer_bytes / max(s.num_connections, 1),
            ),
            (
                "gauge",
                "kvpool_heap_bytes",
                "The daemon's anonymous resident memory (RssAnon): index, buffers and the rest.",
                s.heap_bytes,
            ),
            (
                "counter",
                "kvpool_kthena_written",
                "Owner changes of Kthena's Redis entries written (each once).",
                s.kthena_written,
            ),
            (
                "counter",
                "kvpool_kthena_dropped",
                "Owner changes of Kthena's Redis entries dropped: the queue was full, or "
                "Redis did not take them past the retries.",
                s.kthena_dropped,
            ),
            ("counter", "kvpool_hits", "Blocks found by lookups.", s.hits),
            ("counter", "kvpool_misses", "Blocks not found by lookups.", s.misses),
            ("counter", "kvpool_puts", "Blocks committed.", s.puts),
            ("counter", "kvpool_evictions", "Blocks evicted.", s.evictions),
            (
                "gauge",
                "kvpool_retained_blocks",
                "Blocks retention hints hold at a priority other than the default.",
                s.retained_blocks,
            ),
            (
                "counter",
                "kvpool_retention_refused",
                "Blocks retention hints asked for past their tenant's retained bytes.",
                s.retention_refused,
            ),
            ("counter", "kvpool_bytes_in", "Payload bytes written into the arena.", s.bytes_in),
            ("counter", "kvpool_bytes_out", "Payload bytes read out of the arena.", s.bytes_out),
            (
                "counter",
                "kvpool_corrupt_blocks",
                "Blocks found corrupt (by readers or the scrubber) and dropped.",
                s.corrupt_reports,
            ),
            ("counter", "kvpool_scrubbed_bytes", "Bytes the scrubber re-hashed.", s.scrubbed_bytes),
        ):
            family = families[kind](name, doc, labels=labels)
            family.add_metric(node, value)
            yield family
        yield from _tier_families(s)
        ns_blocks = GaugeMetricFamily(
            "kvpool_namespace_blocks", "Committed blocks per namespace.", labels=["namespace"]
        )
        ns_bytes = GaugeMetricFamily(
            "kvpool_namespace_used_bytes", "Bytes per namespace.", labels=["namespace"]
        )
        for ns in s.namespaces:
            ns_blocks.add_metric([ns.namespace_id], ns.num_blocks)
            ns_bytes.add_metric([ns.namespace_id], ns.used_bytes)
        yield ns_blocks
        yield ns_bytes
        yield from _account_families(s)


TIER_METRICS = (
    ("gauge", "capacity_bytes", "Capacity of the tier.", "capacity_bytes"),
    ("gauge", "used_bytes", "Bytes the tier uses.", "used_bytes"),
    ("gauge", "blocks", "Blocks the tier holds.", "num_blocks"),
    ("gauge", "recovered_blocks", "Blocks found at start (adopted or re-indexed).", "recovered"),
    ("counter", "hits", "Blocks lookups found in the tier.", "hits"),
    ("counter", "reads", "Blocks read out of the tier.", "reads"),
    ("counter", "writes", "Blocks written into the tier.", "writes"),
    ("counter", "refused", "Write-backs the admission policy refused.", "refused"),
    (
        "counter",
        "dropped",
        "Blocks dropped on their way into the tier (gone): its queue was full, or the "
        "object store's upload failed.",
        "dropped",
    ),
    ("counter", "slowed", "Writes held until the write-back caught up (backpressure).", "slowed"),
    ("counter", "promotions", "Blocks copied from the tier back into DRAM.", "promotions"),
    (
        "counter",
        "served",
        "Blocks read from the tier straight into a reply (DRAM had no room).",
        "served",
    ),
    ("counter", "evictions", "Blocks evicted from the tier.", "evictions"),
    ("counter", "corrupt", "Blocks of the tier found corrupt (never served).", "corrupt"),
    ("counter", "errors", "Requests to the tier that failed or ran out of time.", "errors"),
)

PREFETCH_METRICS = (
    ("counter", "issued", "Blocks named by prefetches.", "issued"),
    (
        "counter",
        "started",
        "Prefetched blocks brought up from a lower tier (or joined).",
        "started",
    ),
    ("counter", "completed", "Prefetched blocks brought up into DRAM and verified.", "completed"),
    (
        "counter",
        "refused",
        "Prefetched blocks refused: past the bound in flight or held.",
        "refused",
    ),
    ("counter", "useful", "Prefetched blocks read while held.", "useful"),
    ("counter", "wasted", "Prefetched blocks whose hold lapsed unread.", "wasted"),
    ("gauge", "held_blocks", "Blocks held in DRAM for queued requests.", "held_blocks"),
    ("gauge", "held_bytes", "Bytes held in DRAM for queued requests.", "held_bytes"),
)


def _tier_families(s: NodeStats) -> Iterator[Metric]:
    families = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily}
    for kind, name, doc, attribute in TIER_METRICS:
        family = families[kind](f"kvpool_tier_{name}", doc, labels=["node", "tier"])
        for tier in s.tiers:
            family.add_metric([s.node_id, tier.name], getattr(tier, attribute))
        yield family
    estimated = GaugeMetricFamily(
        "kvpool_tier_estimated_hit_rate",
        "The hit rate the node estimates it would have with the tier at `scale` times its "
        "capacity (faster tiers as they are), from sampled reuse times.",
        labels=["node", "tier", "scale"],
    )
    for tier in s.tiers:
        for estimate in tier.estimates:
            estimated.add_metric([s.node_id, tier.name, f"{estimate.scale:g}"], estimate.hit_rate)
    yield estimated
    if s.prefetch is not None:
        for kind, name, doc, attribute in PREFETCH_METRICS:
            family = families[kind](f"kvpool_prefetch_{name}", doc, labels=["node"])
            family.add_metric([s.node_id], getattr(s.prefetch, attribute))
            yield family


def _account_families(s: NodeStats) -> Iterator[Metric]:
    """Each tenant's use of each budget (kvpool.store.accounts), its limit and its
    refusals: ``budget`` is the resource's name (``buffer_bytes``, ``parked_keys``, ...)."""
    labels = ["node", "tenant", "budget"]
    used = GaugeMetricFamily(
        "kvpool_tenant_used", "What each tenant holds of each budget.", labels=labels
    )
    limit = GaugeMetricFamily(
        "kvpool_tenant_limit", "Each tenant's limit of each budget.", labels=labels
    )
    refused = CounterMetricFamily(
        "kvpool_tenant_refused", "Requests refused past a tenant's budget.", labels=labels
    )
    for account in s.accounts:
        for budget, value in account.used.items():
            used.add_metric([s.node_id, account.tenant, budget], value)
        for budget, value in account.limits.items():
            limit.add_metric([s.node_id, account.tenant, budget], value)
        for budget, value in account.refused.items():
            refused.add_metric([s.node_id, account.tenant, budget], value)
    yield used
    yield limit
    yield refused


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
