"""Prometheus metrics of one node: gauges and counters read from the store on scrape, and
latency histograms observed by the server.  Each daemon has its own registry."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvpool.protocol.messages import NodeStats

LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    1.0,
)


class _StatsCollector(Collector):
    def __init__(self, stats: Callable[[], NodeStats]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        labels = ["node"]
        node = [s.node_id]
        for name, doc, value in (
            ("kvpool_capacity_bytes", "Arena capacity.", s.capacity_bytes),
            ("kvpool_used_bytes", "Arena bytes allocated (committed and reserved).", s.used_bytes),
            (
                "kvpool_reserved_bytes",
                "Arena bytes reserved by writes in flight.",
                s.reserved_bytes,
            ),
            ("kvpool_blocks", "Committed blocks.", s.num_blocks),
            ("kvpool_pinned_blocks", "Blocks pinned by readers.", s.num_pinned),
            ("kvpool_connections", "Open client connections.", s.num_connections),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(node, value)
            yield gauge
        for name, doc, value in (
            ("kvpool_hits", "Blocks found by lookups.", s.hits),
            ("kvpool_misses", "Blocks not found by lookups.", s.misses),
            ("kvpool_puts", "Blocks committed.", s.puts),
            ("kvpool_evictions", "Blocks evicted.", s.evictions),
            ("kvpool_bytes_in", "Payload bytes written into the arena.", s.bytes_in),
            ("kvpool_bytes_out", "Payload bytes read out of the arena.", s.bytes_out),
            ("kvpool_corrupt_blocks", "Blocks readers found corrupt.", s.corrupt_reports),
        ):
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(node, value)
            yield counter
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
