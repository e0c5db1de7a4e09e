"""From the operator's side: what a process reaches in plaintext off loopback is refused at
start unless ``--insecure`` says so, as for what it serves (issue 28, low items).

- the router's engines (prompts and answers cross that hop);
- the node's etcd (membership: a forged member draws other nodes' writes);
- the node's S3 endpoint (every block the object tier holds).

192.0.2.1 is TEST-NET-1 (RFC 5737): never a real host, never loopback.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.commands import run_kvpool, said, serve
from tests.router.servers import FakeEngine, RouterProc

OFF_LOOPBACK = "192.0.2.1"


def test_the_router_refuses_a_plaintext_engine_off_loopback():
    engine = f"http://{OFF_LOOPBACK}:8000"
    done = run_kvpool("router", "--engine", engine)
    output = said(done)
    assert done.returncode == 2, output
    assert f"refusing to reach an engine at {engine} in plaintext" in output
    assert "--insecure" in output and "https://" in output


def test_the_router_takes_loopback_https_or_insecure_engines_and_refuses_plaintext_at_run_time():
    local = FakeEngine("local")
    # A loopback engine by name: plaintext is fine on this host.
    loopback = local.url.replace("127.0.0.1", "localhost")
    router = RouterProc([loopback])
    try:
        request = urllib.request.Request(
            router.url + "/v1/completions",
            json.dumps({"model": "m", "prompt": "hi", "max_tokens": 2}).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
            assert response.headers["x-kvpool-engine"] == loopback
        # Added at run time: the same rule.
        add = urllib.request.Request(
            router.url + "/admin/engines",
            json.dumps({"url": f"http://{OFF_LOOPBACK}:8000"}).encode(),
            {"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(add, timeout=60)
        with refused.value as error:
            assert error.code == 400
            assert "in plaintext" in json.loads(error.read())["error"]
    finally:
        router.stop()
        local.stop()
    # TLS to the engine, or the operator's --insecure: the router starts.
    for engine, extra in (
        (f"https://{OFF_LOOPBACK}:8000", ()),
        (f"http://{OFF_LOOPBACK}:8000", ("--insecure",)),
    ):
        router = RouterProc([engine], *extra)
        router.stop()


@pytest.mark.parametrize("endpoint", [f"http://{OFF_LOOPBACK}:2379", f"{OFF_LOOPBACK}:2379"])
def test_the_node_refuses_plaintext_etcd_off_loopback(tmp_path, endpoint):
    done = serve(tmp_path / "run", "--etcd", endpoint)
    output = said(done)
    assert done.returncode == 2, output
    assert f"refusing to reach etcd (--etcd) at {endpoint} in plaintext" in output
    assert "--insecure" in output


def test_the_node_joins_a_loopback_etcd_in_plaintext(tmp_path, start_node):
    from tests.cluster.fabric import Etcd

    etcd = Etcd("127.0.0.1")
    try:
        node = start_node("etcd-member", extra=["--etcd", etcd.endpoint])
        assert node.proc.poll() is None
    finally:
        etcd.close()


def test_the_node_refuses_a_plaintext_object_store_off_loopback(tmp_path):
    tier = ["--disk", str(tmp_path / "disk"), "--disk-size", "8MiB", "--object-store", "s3://b/p"]
    endpoint = f"http://{OFF_LOOPBACK}:7480"
    for args, env in (
        (["--object-store-endpoint", endpoint], None),
        ([], {"AWS_ENDPOINT_URL": endpoint}),  # as AWS's own clients read it
    ):
        done = serve(tmp_path / "run", *tier, *args, env=env)
        output = said(done)
        assert done.returncode == 2, output
        assert (
            f"refusing to reach the object store (--object-store-endpoint) at {endpoint}" in output
        )
    # On loopback the check lets it by: the node goes on to reach the bucket (none listens
    # here; tests/node/test_object_tier.py runs the tier against a loopback radosgw).
    done = serve(
        tmp_path / "run",
        *tier,
        "--object-store-endpoint",
        "http://127.0.0.1:9",
        env={"AWS_ENDPOINT_URL": ""},
    )
    output = said(done)
    assert "plaintext" not in output and "object store" in output, output
