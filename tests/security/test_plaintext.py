"""From the operator's side: what a process reaches in plaintext off loopback is refused at
start unless ``--insecure`` says so, as for what it serves (issue 28, low items).

- the router's engines (prompts and answers cross that hop);
- the node's etcd (membership: a forged member draws other nodes' writes);
- the node's S3 endpoint (every block the object tier holds).

192.0.2.1 is TEST-NET-1 (RFC 5737): never a real host, never loopback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from tests.router.servers import FakeEngine, RouterProc

OFF_LOOPBACK = "192.0.2.1"


def run_kvpool(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """A kvpool command that should stop at start: its exit status and what it said (on
    one line: the console wraps long messages)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def serve(tmp_path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    return run_kvpool(
        "serve",
        "--memory",
        "8MiB",
        "--port",
        "0",
        "--admin-port",
        "0",
        "--run-dir",
        str(tmp_path / "run"),
        *args,
        env=env,
    )


def test_the_router_refuses_a_plaintext_engine_off_loopback():
    engine = f"http://{OFF_LOOPBACK}:8000"
    status, output = run_kvpool("router", "--engine", engine)
    assert status == 2, output
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
    status, output = serve(tmp_path, "--etcd", endpoint)
    assert status == 2, output
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
        status, output = serve(tmp_path, *tier, *args, env=env)
        assert status == 2, output
        assert (
            f"refusing to reach the object store (--object-store-endpoint) at {endpoint}" in output
        )
    # On loopback the check lets it by: the node goes on to reach the bucket (none listens
    # here; tests/node/test_object_tier.py runs the tier against a loopback radosgw).
    status, output = serve(
        tmp_path,
        *tier,
        "--object-store-endpoint",
        "http://127.0.0.1:9",
        env={"AWS_ENDPOINT_URL": ""},
    )
    assert "plaintext" not in output and "object store" in output, output
