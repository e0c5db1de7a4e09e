"""The Kubernetes manifests agree with the code they deploy (no cluster runs here: this
checks what can be checked without one)."""

import tempfile
from pathlib import Path

import yaml

from kvpool.config import CLIENT_ENV, CONNECTOR_ENV, NODE_ENV
from kvpool.router.config import settings_from

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def documents():
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield doc


def containers(doc):
    return doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


def by_kind(kind, name):
    return next(d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def test_every_kvpool_variable_is_one_the_code_reads():
    known = set(NODE_ENV) | set(CLIENT_ENV) | set(CONNECTOR_ENV)
    used = {
        e["name"]
        for d in documents()
        for c in containers(d)
        for e in c.get("env", [])
        if e["name"].startswith("KVPOOL_")
    }
    assert used and used <= known, used - known


def test_engines_share_the_nodes_run_directory():
    node = containers(by_kind("DaemonSet", "kvpool-node"))[0]
    engine = containers(by_kind("Deployment", "vllm-engine"))[0]
    node_env = {e["name"]: e.get("value") for e in node["env"]}
    engine_env = {e["name"]: e.get("value") for e in engine["env"]}
    run_dir = node_env["KVPOOL_RUN_DIR"]
    node_spec = by_kind("DaemonSet", "kvpool-node")["spec"]["template"]["spec"]
    engine_spec = by_kind("Deployment", "vllm-engine")["spec"]["template"]["spec"]
    assert (
        node_spec["volumes"][0]["hostPath"]["path"]
        == engine_spec["volumes"][0]["hostPath"]["path"]
        == run_dir
    )
    assert engine_env["KVPOOL_ADDRESS"].startswith(f"unix:{run_dir}/")
    assert node_env["KVPOOL_ETCD"] == engine_env["KVPOOL_ETCD"]
    assert {p["httpGet"]["path"] for p in (node["readinessProbe"], node["livenessProbe"])} == {
        "/readyz",
        "/healthz",
    }


def test_the_router_config_is_one_the_router_accepts():
    config = by_kind("ConfigMap", "kvpool-router")["data"]["router.toml"]
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(config)
        f.flush()
        settings = settings_from(f.name, {}, [])
    assert settings.policy == "cache_aware" and len(settings.engines) == 2
    assert all(e.node for e in settings.engines)


def test_the_node_keeps_its_contents_across_a_rolling_update():
    daemonset = by_kind("DaemonSet", "kvpool-node")
    spec = daemonset["spec"]["template"]["spec"]
    assert daemonset["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    node = containers(daemonset)[0]
    env = {e["name"]: e.get("value") for e in node["env"]}
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in node["volumeMounts"]}
    # The arena, its journal and the disk tier live on hostPaths, which outlive the pod.
    assert host_paths["kvpool-run"] == mounts["kvpool-run"] == env["KVPOOL_RUN_DIR"]
    assert host_paths["kvpool-disk"] == mounts["kvpool-disk"] == env["KVPOOL_DISK"]
    assert "KVPOOL_FRESH" not in env  # a new pod adopts what the old one left
    assert "--fresh" not in node.get("args", [])
