"""The rendered pod specs run as the kubelet would run them (tests/deploy/kubelet.py): the
node DaemonSet's init container and daemon under the image's user on hostPath directories
the kubelet created as root:root 0755, TLS from the Secret; an engine container's
environment and connector configuration (as root, vLLM's image's user) putting and reading
blocks through the node's socket and shared arena; and, for the 1P1D overlay, etcd over
TLS, nodes joining it, and the ModelServing's prefill and decode engines reaching the pool
by their own configuration."""

from __future__ import annotations

import json
import os
import secrets
import ssl
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvpool import Client
from tests.cluster.fabric import Fabric
from tests.deploy.kubelet import Pod
from tests.deploy.test_manifests import documents, pod_specs
from tests.security.pki import Authority

pytestmark = pytest.mark.cluster

PROBE = Path(__file__).with_name("probe.py")
NAMES = ("kvpool-node", "kvpool-router.kvpool.svc", "kvpool-etcd.kvpool.svc")


@pytest.fixture
def cluster_secrets(tmp_path: Path) -> dict[str, dict[str, bytes]]:
    """The Secrets an operator creates (README, "Kubernetes"): a random access key, and a
    CA with the certificate for the names the clients check."""
    if os.geteuid() != 0:
        message = "running pods as the kubelet does (users, namespaces) needs root"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    ca = Authority(tmp_path, "cluster")
    issued = ca.issue("kvpool-node", filename="nodes", names=NAMES)
    return {
        "kvpool-access": {"access-key": secrets.token_hex(32).encode()},
        "kvpool-tls": {
            "tls.crt": issued.cert.read_bytes(),
            "tls.key": issued.key.read_bytes(),
            "ca.crt": ca.path.read_bytes(),
        },
    }


@pytest.fixture
def server_root() -> Iterator[Path]:
    """A server's filesystem, where its hostPaths are (on tmpfs: the arena's /dev/shm)."""
    root = Path(tempfile.mkdtemp(prefix="kvpool-server-", dir="/dev/shm"))
    root.chmod(0o755)
    yield root
    import shutil

    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def family_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The suite's tiny Llama (its tokenizer, as a model hub serves one)."""
    from tests.integrations.conftest import tiny_model

    return Path(tiny_model(tmp_path_factory, "llama"))


def spec_of(overlay: str, kind: str, name: str) -> dict:
    doc = next(
        d
        for d in documents(overlay)
        if d["kind"] == kind and d["metadata"]["name"].startswith(name)
    )
    return doc


def ready(url: str, process, timeout: float = 90) -> None:
    """Until ``url`` answers 200 over HTTPS (a kubelet's probe does not check the
    certificate), while ``process`` runs."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"exited {process.returncode}: {process.stdout.read()}")
        try:
            with urllib.request.urlopen(url, timeout=2, context=context) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready in {timeout} s")


def probe(pod: Pod, container: str, **probe_env: str) -> dict:
    """The engine container's configuration put to work in its place (tests/deploy/probe.py)."""
    import sys

    process = pod.start(container, argv=[sys.executable, str(PROBE)], probe_env=probe_env)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 0, output
    return json.loads(output.strip().splitlines()[-1])


def stop(process) -> None:
    process.terminate()
    try:
        process.wait(30)
    finally:
        if process.stdout is not None:
            process.stdout.close()


def start_node(pod: Pod):
    """The DaemonSet's pod: its init containers in order, each to its end, then the
    daemon, until its probe passes."""
    for init in pod.spec.get("initContainers", []):
        pod.run(init["name"], init=True)
    node = pod.start("kvpool")
    ready(f"https://{pod.host.ip}:9401/readyz", node)
    return node


def test_the_node_daemonset_starts_as_written_and_an_engine_uses_it(
    cluster_secrets, server_root
) -> None:
    fabric = Fabric()
    node = None
    try:
        host = fabric.add_host("a")
        daemonset = spec_of("single-node", "DaemonSet", "kvpool-node")
        (spec,) = pod_specs(daemonset)
        pod = Pod(spec, host, server_root, name="kvpool-node-a", secrets=cluster_secrets)
        node = start_node(pod)
        run_dir = server_root / "dev/shm/kvpool"
        for directory in (run_dir, server_root / "var/lib/kvpool/disk"):
            st = directory.stat()  # made the daemon's by the init container
            assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (10001, 10001, 0o750)
        socket = run_dir / host.name / "kvpool.sock"
        assert socket.exists() and socket.stat().st_uid == 10001  # the daemon is not root
        # `kubectl exec ds/kvpool-node -- kvpool status`: a client in the node's container.
        status = pod.start("kvpool", argv=["kvpool", "status"])
        said, _ = status.communicate(timeout=60)
        assert status.returncode == 0 and "up" in said, said

        # An engine on the same server, as vLLM's image runs it (root).
        (engine,) = pod_specs(spec_of("single-node", "StatefulSet", "vllm-engine"))
        engine_pod = Pod(engine, host, server_root, name="vllm-engine-0", secrets=cluster_secrets)
        seen = probe(engine_pod, "vllm")
        assert seen["uid"] == 0 and seen["connector"] == "KVPoolConnector", seen
        assert seen["address"] == f"unix:{socket}", seen
        assert seen["stored"] and seen["read_back"] and seen["shared_arena"], seen

        # Over the pod network, TLS, checked for the certificate's name (not the pod IP).
        tls = cluster_secrets["kvpool-tls"]
        ca = server_root / "ca.crt"
        ca.write_bytes(tls["ca.crt"])
        key = cluster_secrets["kvpool-access"]["access-key"].decode()
        options = {"use_shm": False, "timeout": 10, "access_key": key, "tls_ca": str(ca)}
        with Client(f"{host.ip}:9400", tls_server_name="kvpool-node", **options) as client:
            assert client.put([b"\x02" * 32], [b"over tls" * 512]).all_stored
            assert bytes(client.get([b"\x02" * 32]).values[0]) == b"over tls" * 512
    finally:
        if node is not None:
            stop(node)
        fabric.close()


def test_without_its_init_container_the_node_refuses_the_kubelets_directories(
    cluster_secrets, server_root
) -> None:
    """The check above can fail: the DaemonSet without its init container (the security
    settings the chart adds) leaves the kubelet's root:root 0755 directories, where the
    daemon's user can create nothing, and it does not start."""
    fabric = Fabric()
    try:
        host = fabric.add_host("b")
        (spec,) = pod_specs(spec_of("single-node", "DaemonSet", "kvpool-node"))
        spec = yaml.safe_load(yaml.safe_dump(spec))
        del spec["initContainers"]
        pod = Pod(spec, host, server_root, secrets=cluster_secrets)
        node = pod.start("kvpool")
        output, _ = node.communicate(timeout=60)
        assert node.returncode == 2, output  # refused with a message, no traceback
        assert "cannot create the node directory" in output and "init container" in output
        assert "Traceback" not in output, output
    finally:
        fabric.close()


def test_the_1p1d_overlay_etcd_nodes_and_modelserving_engines_as_written(
    cluster_secrets, server_root, tmp_path
) -> None:
    """etcd from its StatefulSet (TLS), a node on each of two servers from the DaemonSet
    joining it over TLS, and the ModelServing's prefill and decode engines, each on its
    own server, reaching the pool with their own configuration: the prefill's block is
    read by the decode engine."""
    fabric = Fabric()
    processes = []
    try:
        etcd_host, a, b = (fabric.add_host(n) for n in ("etcd", "a", "b"))
        services = {"kvpool-etcd.kvpool.svc": etcd_host.ip}
        (etcd_spec,) = pod_specs(spec_of("1p1d", "StatefulSet", "kvpool-etcd"))
        etcd = Pod(
            etcd_spec,
            etcd_host,
            tmp_path / "etcd-server",
            secrets=cluster_secrets,
            claims=("data",),
        )
        processes.append(etcd.start("etcd"))
        (node_spec,) = pod_specs(spec_of("1p1d", "DaemonSet", "kvpool-node"))
        roots = {}
        for host in (a, b):
            roots[host.name] = root = server_root / host.name
            root.mkdir()
            root.chmod(0o755)
            node_pod = Pod(node_spec, host, root, secrets=cluster_secrets, hosts=services)
            processes.append(start_node(node_pod))
        modelserving = spec_of("1p1d", "ModelServing", "llama-pd")
        roles = {
            r["name"]: r["entryTemplate"]["spec"] for r in modelserving["spec"]["template"]["roles"]
        }
        seen = {}
        told = {
            "prefill": {"KVPOOL_PROBE_WRITE": "prefill"},
            "decode": {"KVPOOL_PROBE_READ": "prefill"},
        }
        for role, host in (("prefill", a), ("decode", b)):
            engine = Pod(
                roles[role], host, roots[host.name], name=f"llama-pd-{role}-0",
                secrets=cluster_secrets, hosts=services,
            )  # fmt: skip
            seen[role] = probe(engine, "vllm", **told[role])
        # The decode engine, on another server, reads what the prefill engine put: through
        # etcd's membership and the nodes' TLS (the block's home, or the prefill's node).
        assert seen["decode"]["read_other"] is True, seen
        assert seen["prefill"]["role"] == "kv_producer" and seen["decode"]["role"] == "kv_consumer"
        for role in seen.values():
            assert role["etcd"] == "https://kvpool-etcd.kvpool.svc:2379", role
            assert role["stored"] and role["read_back"] and role["shared_arena"], role
            assert role["kthena_pod"].endswith(".kvpool"), role  # $(POD_NAME).$(POD_NAMESPACE)
    finally:
        for process in reversed(processes):
            stop(process)
        fabric.close()


def test_the_router_deployment_starts_as_written_and_answers(
    cluster_secrets, server_root, family_tokenizer
) -> None:
    """The router's Deployment (single-node): its command in the engine image, as 10001,
    its ConfigMap's router.toml, HTTPS from the Secret, the tokenizer its config names in
    its emptyDir cache (put there as a first start would have fetched it: this machine
    reaches no model hub).  A stand-in engine answers where the config's Service name
    resolves (vLLM needs a GPU); the router becomes ready and serves a completion over
    HTTPS."""
    import shutil
    import subprocess
    import sys

    fabric = Fabric()
    processes = []
    try:
        host = fabric.add_host("r")
        engine_host = fabric.add_host("e")  # the engine's pod, where its Service resolves
        services = {"vllm-engine-0.vllm-engine.kvpool.svc": engine_host.ip}
        engine = [*engine_host.prefix, sys.executable, "-m", "tests.router.fake_engine"]
        engine += ["--port", "8000", "--host", engine_host.ip]
        processes.append(
            subprocess.Popen(engine, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
        deployment = spec_of("single-node", "Deployment", "kvpool-router")
        (spec,) = pod_specs(deployment)
        config_map = spec_of("single-node", "ConfigMap", "kvpool-router")
        volume = next(v for v in spec["volumes"] if "configMap" in v)
        pod = Pod(
            spec,
            host,
            server_root,
            name="kvpool-router-0",
            secrets=cluster_secrets,
            config_maps={volume["configMap"]["name"]: config_map["data"]},
            hosts=services,
            offline={"HF_HUB_OFFLINE": "1"},  # the tokenizer is in its cache, put there below
        )
        dirs = pod.volume_dirs()
        model = "meta-llama/Llama-3.1-8B-Instruct"
        cache = dirs["hf-cache"] / "hub" / ("models--" + model.replace("/", "--"))
        (cache / "refs").mkdir(parents=True)
        (cache / "refs" / "main").write_text("0" * 40)
        shutil.copytree(family_tokenizer, cache / "snapshots" / ("0" * 40))
        for path in [cache, *cache.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        router = pod.start("router")
        processes.append(router)
        ready(f"https://{host.ip}:8000/health", router, timeout=120)
        context = ssl.create_default_context(cafile=None)
        context.load_verify_locations(cadata=cluster_secrets["kvpool-tls"]["ca.crt"].decode())
        context.check_hostname = False  # its certificate is for kvpool-router.kvpool.svc
        body = json.dumps({"model": model, "prompt": "def main():", "max_tokens": 4}).encode()
        request = urllib.request.Request(
            f"https://{host.ip}:8000/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            assert response.status == 200
            assert json.loads(response.read())["choices"]
    finally:
        for process in reversed(processes):
            stop(process)
        fabric.close()
