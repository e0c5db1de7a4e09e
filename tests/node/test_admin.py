import urllib.request

import msgspec

from kvpool.protocol.messages import NodeStats
from tests.helpers import content, key


def fetch(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers.get("Content-Type"), response.read().decode()


def test_health_readiness_metrics_and_status(node, client):
    client.put([key(i) for i in range(3)], [content(key(i), 5000) for i in range(3)])
    client.lookup([key(0), key(1), key(9)])
    client.get([key(0)])
    base = node.admin_url
    assert fetch(base + "/healthz")[0] == 200
    assert fetch(base + "/readyz")[0] == 200
    status, ctype, metrics = fetch(base + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    for name in (
        "kvpool_capacity_bytes",
        "kvpool_used_bytes",
        "kvpool_blocks",
        "kvpool_hits_total",
        "kvpool_misses_total",
        "kvpool_evictions_total",
        "kvpool_bytes_in_total",
        "kvpool_bytes_out_total",
        "kvpool_op_latency_seconds_bucket",
    ):
        assert name in metrics, name
    assert 'kvpool_blocks{node="node"} 3.0' in metrics
    assert 'kvpool_hits_total{node="node"} 2.0' in metrics
    assert 'kvpool_misses_total{node="node"} 1.0' in metrics
    assert 'op="put"' in metrics or 'op="commit"' in metrics
    _, ctype, body = fetch(base + "/v1/status")
    stats = msgspec.json.decode(body, type=NodeStats)
    assert ctype == "application/json"
    assert stats.num_blocks == 3 and stats.capacity_bytes == 64 << 20 and stats.hits == 2
    assert stats.namespaces and stats.namespaces[0].num_blocks == 3
    status, ctype, page = fetch(base + "/")
    assert status == 200 and "kvpool node" in page
