"""TLS on every listener, with real certificates, real processes and real sockets: the
data port (optionally mutual), the admin HTTP and the router; reloading on change; and
plaintext refused off loopback."""

from __future__ import annotations

import http.client
import shutil
import socket
import ssl
import time
import urllib.request
from pathlib import Path

import pytest

from kvpool import Client, ConnectError, KVPoolError
from tests.commands import run_kvpool, serve
from tests.conftest import NodeFactory
from tests.router.servers import FakeEngine, RouterProc
from tests.security.pki import Authority


@pytest.fixture
def pki(tmp_path: Path) -> dict:
    ca, rogue = Authority(tmp_path, "kvpool"), Authority(tmp_path, "rogue")
    return {
        "ca": ca,
        "rogue": rogue,
        "server": ca.issue("node"),
        "client": ca.issue("engine"),
        "rogue_client": rogue.issue("intruder"),
    }


def tls_client(node, pki, client_cert=None, ca=None, **options) -> Client:
    cert = client_cert or pki["client"]
    return Client(
        node.tcp_address,
        use_shm=False,
        timeout=5,
        tls_ca=str(ca or pki["ca"].path),
        tls_cert=str(cert.cert),
        tls_key=str(cert.key),
        **options,
    )


def test_mutual_tls_on_the_data_port_and_the_admin(start_node: NodeFactory, pki, tmp_path):
    server = pki["server"]
    # The node serves files it re-reads: copies, so that the test can replace them.
    cert, key = tmp_path / "serving.pem", tmp_path / "serving-key.pem"
    shutil.copy(server.cert, cert)
    shutil.copy(server.key, key)
    node = start_node(
        "tls",
        extra=[
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
            "--tls-client-ca",
            str(pki["ca"].path),
        ],
    )
    blocks = [bytes([i]) * (2 << 20) for i in range(4)]
    names = [b"tls-block-%d-0123456789" % i for i in range(4)]
    with tls_client(node, pki) as c:
        assert c.put(names, blocks).all_stored
        assert [bytes(v) for v in c.get(names).values] == blocks

    # Plaintext to a TLS port, a certificate from another CA, no certificate, and a node
    # the client cannot verify: each refused, clearly, and the node serves on.
    with Client(node.tcp_address, use_shm=False, timeout=3) as plain, pytest.raises(KVPoolError):
        plain.lookup(names)
    with (
        tls_client(node, pki, client_cert=pki["rogue_client"]) as rogue,
        pytest.raises(KVPoolError),
    ):
        rogue.lookup(names)
    anonymous = Client(node.tcp_address, use_shm=False, timeout=3, tls_ca=str(pki["ca"].path))
    with anonymous, pytest.raises(KVPoolError):
        anonymous.lookup(names)
    with (
        tls_client(node, pki, ca=pki["rogue"].path) as doubting,
        pytest.raises(ConnectError, match="TLS"),
    ):
        doubting.lookup(names)
    with tls_client(node, pki) as c:
        assert c.lookup(names) == 4
    # The Unix socket stays local and in the clear (it never leaves the host).
    with Client(node.unix_address, timeout=5) as local:
        assert local.lookup(names) == 4

    # The admin HTTP is HTTPS on the same certificate, mutual too.
    context = ssl.create_default_context(cafile=str(pki["ca"].path))
    context.load_cert_chain(pki["client"].cert, pki["client"].key)
    with urllib.request.urlopen(
        node.admin_url.replace("http:", "https:") + "/healthz", context=context, timeout=5
    ) as response:
        assert response.read() == b"ok\n"

    # A new certificate written over the old files is served to new connections within
    # seconds, without a restart; open connections keep working.
    assert served_serial_mtls(node.tcp_address, pki) == server.serial
    renewed = pki["ca"].issue("node", filename="renewed")
    with tls_client(node, pki) as kept:
        assert kept.lookup(names) == 4
        shutil.copy(renewed.key, key)
        shutil.copy(renewed.cert, cert)
        deadline = time.monotonic() + 10
        while served_serial_mtls(node.tcp_address, pki) != renewed.serial:
            assert time.monotonic() < deadline, "the renewed certificate was not served"
            time.sleep(0.05)
        assert kept.lookup(names) == 4
    with tls_client(node, pki) as c:
        assert [bytes(v) for v in c.get(names).values] == blocks


def served_serial_mtls(address: str, pki) -> int:
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=str(pki["ca"].path))
    context.load_cert_chain(pki["client"].cert, pki["client"].key)
    with (
        socket.create_connection((host, int(port)), timeout=5) as sock,
        context.wrap_socket(sock, server_hostname=host) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


def test_plaintext_is_refused_off_loopback(tmp_path, pki):
    key = ["--access-key", "a-key-of-sixteen-chars"]
    refused = serve(tmp_path, "--host", "0.0.0.0", *key)
    assert refused.returncode == 2
    assert "refusing to serve the data port on 0.0.0.0 in plaintext" in refused.stderr
    assert "--tls-cert" in refused.stderr and "--insecure" in refused.stderr
    refused = serve(tmp_path, "--admin-host", "0.0.0.0", *key)
    assert refused.returncode == 2 and "admin HTTP on 0.0.0.0 in plaintext" in refused.stderr
    router = run_kvpool("router", "--host", "0.0.0.0", "--engine", "http://127.0.0.1:1")
    assert router.returncode != 0 and "router on 0.0.0.0 in plaintext" in router.stderr


def test_the_router_serves_https(pki):
    engine = FakeEngine("tls-engine")
    router = RouterProc(
        [engine.url],
        "--tls-cert",
        str(pki["server"].cert),
        "--tls-key",
        str(pki["server"].key),
    )
    try:
        context = ssl.create_default_context(cafile=str(pki["ca"].path))
        url = router.url.replace("http:", "https:")
        with urllib.request.urlopen(url + "/health", context=context, timeout=10) as response:
            assert response.status == 200
        with pytest.raises((OSError, http.client.HTTPException)):  # plaintext to HTTPS
            urllib.request.urlopen(router.url + "/health", timeout=5).read()
    finally:
        router.stop()
        engine.stop()


def test_a_cluster_certificate_is_checked_for_its_name_not_the_address(
    start_node: NodeFactory, pki
):
    """One certificate for every node of a cluster whose nodes are reached by IP (pods):
    valid for the name "kvpool-node" only.  A client that names it (tls_server_name,
    KVPOOL_TLS_SERVER_NAME) connects by IP; one that does not, or names another, is refused
    (the name is checked, not skipped)."""
    cluster = pki["ca"].issue("kvpool-node", filename="cluster", names=("kvpool-node",))
    node = start_node(
        "tls-name", extra=["--tls-cert", str(cluster.cert), "--tls-key", str(cluster.key)]
    )
    options = {"use_shm": False, "timeout": 5, "tls_ca": str(pki["ca"].path)}
    with Client(node.tcp_address, tls_server_name="kvpool-node", **options) as client:
        assert client.health().ok
    for wrong in ("", "someone-else"):
        with (
            Client(node.tcp_address, tls_server_name=wrong, **options) as client,
            pytest.raises(ConnectError),
        ):
            client.health()
