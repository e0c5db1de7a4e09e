"""A cluster of real daemons on simulated hosts (network namespaces) with tenants and
mutual TLS everywhere: nodes write through to each other as the cluster's identity over
TLS, a tenant reads its blocks from any node, and another tenant finds none of them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvpool import Client, Namespace, Status
from kvpool.cluster.placement import homes
from tests.cluster.fabric import Fabric
from tests.security.pki import Authority
from tests.security.tenants import CLUSTER, TenantsFile

pytestmark = pytest.mark.cluster

NS = Namespace(model="tiny", dtype="float32")


@pytest.fixture
def fabric():
    f = Fabric()
    yield f
    f.close()


def test_tenants_and_mutual_tls_across_hosts(fabric: Fabric, tmp_path: Path) -> None:
    tenants = TenantsFile(tmp_path / "tenants.toml")
    alpha = tenants.add("alpha")[0]
    beta = tenants.add("beta")[0]
    tenants.write()
    ca = Authority(tmp_path, "cluster")
    hosts = [fabric.add_host(name) for name in ("a", "b")]
    peers = [h.tcp_address for h in hosts]
    certs = {h.name: ca.issue(f"node-{h.name}", ips=(h.ip,)) for h in hosts}
    for host in hosts:
        cert = certs[host.name]
        host.start_node(
            peers=peers,
            keyed=False,
            extra=[
                "--tenants",
                str(tenants.path),
                "--tls-cert",
                str(cert.cert),
                "--tls-key",
                str(cert.key),
                "--tls-client-ca",
                str(ca.path),
                "--tls-ca",
                str(ca.path),
            ],
        )
    engine = ca.issue("engine")

    def tenant_client(host, credential, **extra: object) -> Client:
        options = host.client_options(
            **extra,
            peers=tuple(peers),
            access_id=credential[0],
            access_key=credential[1],
            tls_ca=str(ca.path),
            tls_cert=str(engine.cert),
            tls_key=str(engine.key),
            timeout=10,
        )
        return Client(**options)

    keys = [NS.key(f"turn-{i}".encode()) for i in range(40)]
    values = [bytes([i]) * 65536 for i in range(40)]
    with tenant_client(hosts[0], alpha) as writer:
        assert writer.put(keys, values).all_stored
        members = writer.cluster.members()
    # Node a writes each block through to its home, as the cluster, over mutual TLS, under
    # the tenant's scoped key; the tenant's own view of the key finds the same home.
    homed_at_b = [k for k in keys if homes(k, members)[0].tcp_address == hosts[1].tcp_address]
    assert homed_at_b
    with tenant_client(hosts[1], alpha, read_local_only=True) as local:
        deadline = time.monotonic() + 20
        while not all(local.exists(homed_at_b)):
            assert time.monotonic() < deadline, "write-through between nodes did not arrive"
            time.sleep(0.02)
    with tenant_client(hosts[1], alpha) as reader:
        assert reader.lookup(keys) == 40
        assert [bytes(v) for v in reader.get(keys).values] == values
    with tenant_client(hosts[1], beta) as other:
        assert other.lookup(keys) == 0
        assert other.get(keys).statuses == [Status.NOT_FOUND] * 40
        assert other.stats().num_blocks == 0
    # Node b holds some of alpha's blocks it was sent by node a: as alpha's, scoped.
    with Client(
        **hosts[1].client_options(
            address=f"tcp://{hosts[1].tcp_address}",
            access_id=CLUSTER[0],
            access_key=CLUSTER[1],
            tls_ca=str(ca.path),
            tls_cert=str(engine.cert),
            tls_key=str(engine.key),
            use_shm=False,
        )
    ) as operator:
        stats = operator.stats()
        assert stats.num_blocks > 0
        assert all(row.namespace_id != NS.id.hex() for row in stats.namespaces)
