import base64
import urllib.error
import urllib.request

import msgspec
import pytest

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


def test_a_keyed_node_asks_for_its_key_on_the_admin_http_too(start_node):
    """From the attacker's side: a node whose data port needs its access key (and may
    therefore serve off loopback) must not hand its status (every namespace) or its
    metrics to a caller without that key."""
    node = start_node(name="keyed-admin", extra=["--access-key", "a-key-of-sixteen-chars"])
    wrong = {"Authorization": "Basic " + base64.b64encode(b"kvpool:wrong").decode()}
    for path in ("/v1/status", "/metrics", "/"):
        for header in ({}, wrong):
            request = urllib.request.Request(node.admin_url + path, headers=header)
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            refused.value.close()  # its response's socket
            assert refused.value.code == 401, path
    assert fetch(node.admin_url + "/healthz")[0] == 200  # probes stay open
    good = base64.b64encode(b"kvpool:a-key-of-sixteen-chars").decode()
    request = urllib.request.Request(
        node.admin_url + "/v1/status", headers={"Authorization": "Basic " + good}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        assert msgspec.json.decode(response.read(), type=NodeStats).node_id == "keyed-admin"


def _gauge(metrics: str, name: str) -> float:
    (line,) = [line for line in metrics.splitlines() if line.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


def test_memory_per_block_and_per_connection_in_status_and_metrics(node, client):
    """The operator sees what the node's bookkeeping costs: the index's heap per block held
    (it grows with the blocks), the connections' receive buffers, and the daemon's heap."""
    base = node.admin_url
    empty = msgspec.json.decode(fetch(base + "/v1/status")[2], type=NodeStats)
    keys = [key(i) for i in range(2000)]
    for start in range(0, len(keys), 250):
        batch = keys[start : start + 250]
        assert client.put(batch, [content(k, 64) for k in batch]).all_stored
    stats = msgspec.json.decode(fetch(base + "/v1/status")[2], type=NodeStats)
    assert stats.num_blocks == 2000
    grown = stats.metadata_bytes - empty.metadata_bytes
    assert 2000 * 50 < grown < 2000 * 2000, grown  # tens to hundreds of bytes a block
    assert stats.heap_bytes > stats.metadata_bytes > 0
    assert stats.num_connections >= 1
    assert stats.connection_buffer_bytes >= 4096 * stats.num_connections
    _, _, metrics = fetch(base + "/metrics")
    per_block = _gauge(metrics, "kvpool_metadata_bytes_per_block")
    assert 50 < per_block < 2000, per_block
    assert _gauge(metrics, "kvpool_connection_buffer_bytes_per_connection") >= 4096
    assert _gauge(metrics, "kvpool_heap_bytes") > 0
