"""The Kubernetes manifests: every Kustomize overlay renders with the real ``kubectl
kustomize``, validates in strict mode (``kubernetes-validate`` for the built-in kinds, the
pinned Kthena CRD for ModelServing), and agrees with the code it deploys.  The Helm chart
lints with the real ``helm`` and renders, from each overlay's values file, exactly the
overlay's objects (so every check here holds for it too), validated the same way.  No
cluster runs here: this checks what can be checked without one."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import pytest
import yaml

from kvpool.config import NODE_ENV, env_table
from kvpool.integrations.sglang.config import StorageConfig
from kvpool.integrations.vllm.config import ConnectorConfig
from kvpool.router.config import check_engine, settings_from
from tests.thirdparty import third_party

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
CHART = ROOT / "deploy" / "helm" / "kvpool"
OVERLAYS = ("single-node", "cluster-etcd", "1p1d")
KUBERNETES_VERSION = "1.32"
# Kthena's ModelServing CRD, pinned (see the README beside it), read from the third-party
# directory (tests/thirdparty.py); never copied into the project.
MODELSERVING_CRD = "kthena/workload.serving.volcano.sh_modelservings.yaml"


@functools.cache
def rendered(overlay: str) -> tuple[str, list[dict]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl (with kustomize v5) is needed to render the manifests"
    done = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr  # no deprecated fields
    return done.stdout, [d for d in yaml.safe_load_all(done.stdout) if d]


def documents(overlay: str) -> list[dict]:
    return rendered(overlay)[1]


def containers(doc: dict) -> list[dict]:
    return doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


def by_kind(overlay: str, kind: str, name: str) -> dict:
    return next(
        d
        for d in documents(overlay)
        if d["kind"] == kind and d["metadata"]["name"].startswith(name)
    )


def env_of(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def engine_pods(overlay: str) -> list[tuple[str, dict]]:
    """(name, pod spec) of every engine the overlay runs."""
    out = []
    for doc in documents(overlay):
        if doc["kind"] == "StatefulSet" and doc["metadata"]["name"] == "vllm-engine":
            out.append(("vllm-engine", doc["spec"]["template"]["spec"]))
        if doc["kind"] == "ModelServing":
            for role in doc["spec"]["template"]["roles"]:
                out.append((role["name"], role["entryTemplate"]["spec"]))
    assert out, f"{overlay} runs no engine"
    return out


def strict(schema: object) -> object:
    """Reject unknown fields, as the API server's strict field validation does."""
    if isinstance(schema, dict):
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema.setdefault("additionalProperties", False)
        for value in schema.values():
            strict(value)
    elif isinstance(schema, list):
        for value in schema:
            strict(value)
    return schema


@functools.cache
def modelserving_validator() -> jsonschema.Draft4Validator:
    crd = yaml.safe_load(third_party(MODELSERVING_CRD).read_text())
    (version,) = crd["spec"]["versions"]
    assert crd["spec"]["group"] + "/" + version["name"] == "workload.serving.volcano.sh/v1alpha1"
    return jsonschema.Draft4Validator(strict(version["schema"]["openAPIV3Schema"]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_validates_strictly(overlay):
    validate_strictly(*rendered(overlay))


def validate_strictly(text: str, docs: list[dict]) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kubernetes_validate",
            "--strict",
            "-k",
            KUBERNETES_VERSION,
            "-",
        ],
        input=text,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # Kinds it has no schema for only warn; the one custom resource is checked below.
    warnings = [line for line in output.splitlines() if line.startswith("WARN")]
    assert all("kind ModelServing" in line for line in warnings), warnings
    validator = modelserving_validator()
    for doc in docs:
        if doc["kind"] == "ModelServing":
            errors = [
                f"{'.'.join(map(str, e.path))}: {e.message[:200]}"
                for e in validator.iter_errors(doc)
            ]
            assert not errors, errors
            names = [r["name"] for r in doc["spec"]["template"]["roles"]]
            assert len(names) == len(set(names))  # a CEL rule the schema cannot check


def helm() -> str:
    """The helm binary (``make`` installs it beside the virtual environment's Python)."""
    found = shutil.which("helm") or str(Path(sys.executable).parent / "helm")
    if not os.access(found, os.X_OK):
        message = "helm not found: `make` installs it (deploy/helm/install_helm.py)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


@functools.cache
def helm_rendered(overlay: str) -> tuple[str, list[dict]]:
    values = CHART / f"values-{overlay}.yaml"
    lint = subprocess.run(
        [helm(), "lint", "--strict", str(CHART), "-f", str(values)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    done = subprocess.run(
        [helm(), "template", "kvpool", str(CHART), "-f", str(values)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout, [d for d in yaml.safe_load_all(done.stdout) if d]


def by_identity(docs: list[dict]) -> dict[tuple[str, str, str], dict]:
    """Objects by kind, namespace and name; Kustomize's generated ConfigMap under its plain
    name (Kustomize adds a hash of its content to it, and to the references to it)."""
    text = yaml.safe_dump_all(docs)
    docs = list(yaml.safe_load_all(re.sub(r"\b(kvpool-router)-[a-z0-9]{10}\b", r"\1", text)))
    return {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d for d in docs}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_helm_chart_renders_each_overlays_objects(overlay):
    text, docs = helm_rendered(overlay)
    chart, kustomize = by_identity(docs), by_identity(documents(overlay))
    assert sorted(chart) == sorted(kustomize)
    for identity, doc in kustomize.items():
        assert chart[identity] == doc, identity
    validate_strictly(text, docs)


def test_the_helm_chart_follows_its_values():
    """A value changes what it names, and only that (a check that the comparison above
    compares: the chart is no copy of one rendering)."""
    values = CHART / "values-cluster-etcd.yaml"
    done = subprocess.run(
        [helm(), "template", "kvpool", str(CHART), "-f", str(values), "--set", "node.memory=8GiB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    docs = by_identity([d for d in yaml.safe_load_all(done.stdout) if d])
    node = containers(docs[("DaemonSet", "kvpool", "kvpool-node")])[0]
    assert env_of(node)["KVPOOL_MEMORY"] == "8GiB"
    assert env_of(node)["KVPOOL_ETCD"] == "https://kvpool-etcd.kvpool.svc:2379"


def test_the_modelserving_validator_catches_what_it_should():
    doc = by_kind("1p1d", "ModelServing", "llama-pd")
    validator = modelserving_validator()
    assert not list(validator.iter_errors(doc))
    broken = yaml.safe_load(yaml.safe_dump(doc))
    del broken["spec"]["template"]["roles"][0]["workerReplicas"]
    broken["spec"]["template"]["roles"][1]["replicaz"] = 1
    messages = " ".join(e.message for e in validator.iter_errors(broken))
    assert "workerReplicas" in messages and "replicaz" in messages


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_kvpool_variable_is_one_the_code_reads(overlay):
    known = set(NODE_ENV) | set(env_table(ConnectorConfig, StorageConfig))
    pods = [d["spec"]["template"]["spec"] for d in documents(overlay) if containers(d)]
    pods += [spec for _, spec in engine_pods(overlay)]
    used = {
        e["name"]
        for pod in pods
        for c in pod["containers"]
        for e in c.get("env", [])
        if e["name"].startswith("KVPOOL_")
    }
    assert used and used <= known, used - known


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_share_the_nodes_run_directory(overlay):
    daemonset = by_kind(overlay, "DaemonSet", "kvpool-node")
    node = containers(daemonset)[0]
    node_env = env_of(node)
    run_dir = node_env["KVPOOL_RUN_DIR"]
    node_volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    assert node_volumes["kvpool-run"]["hostPath"]["path"] == run_dir
    assert {p["httpGet"]["path"] for p in (node["readinessProbe"], node["livenessProbe"])} == {
        "/readyz",
        "/healthz",
    }
    for name, pod in engine_pods(overlay):
        engine = pod["containers"][0]
        engine_env = env_of(engine)
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in engine["volumeMounts"]}
        assert volumes["kvpool-run"]["hostPath"]["path"] == run_dir == mounts["kvpool-run"], name
        assert engine_env["KVPOOL_ADDRESS"].startswith(f"unix:{run_dir}/"), name
        # In a cluster, engines and nodes meet in the same etcd; on one server, in none.
        assert engine_env.get("KVPOOL_ETCD") == node_env.get("KVPOOL_ETCD"), name
    if overlay == "single-node":
        assert "KVPOOL_ETCD" not in node_env
    else:
        assert node_env["KVPOOL_ETCD"].startswith("https://kvpool-etcd.")
        assert by_kind(overlay, "StatefulSet", "kvpool-etcd")


def test_prefill_saves_and_decode_loads_in_the_modelserving():
    roles = {
        r["name"]: r
        for r in by_kind("1p1d", "ModelServing", "llama-pd")["spec"]["template"]["roles"]
    }
    assert set(roles) == {"prefill", "decode"}
    for name, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        command = " ".join(roles[name]["entryTemplate"]["spec"]["containers"][0]["args"])
        assert '"kv_connector": "KVPoolConnector"' in command
        assert f'"kv_role": "{kv_role}"' in command
        assert roles[name]["workerReplicas"] == 0
    # The example engines are gone: the ModelServing runs them.
    assert not [d for d in documents("1p1d") if d["metadata"]["name"] == "vllm-engine"]


def router_settings(overlay: str):
    config = by_kind(overlay, "ConfigMap", "kvpool-router")["data"]["router.toml"]
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(config)
        f.flush()
        return settings_from(f.name, {}, [])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_router_config_is_one_the_router_accepts_and_names_real_services(overlay):
    settings = router_settings(overlay)
    services = {d["metadata"]["name"] for d in documents(overlay) if d["kind"] == "Service"}
    for engine in settings.engines:
        check_engine(engine, settings, None)  # plaintext in the cluster: insecure = true
        host = engine.url.split("//", 1)[1].split(":", 1)[0]
        # <pod>.<service>.<namespace>.svc or <service>.<namespace>.svc
        service, namespace, svc = host.split(".")[-3:]
        assert svc == "svc" and namespace == "kvpool", engine.url
        assert service in services, (engine.url, services)
    # The router mounts the generated ConfigMap by its generated name.
    router = by_kind(overlay, "Deployment", "kvpool-router")
    volumes = {v["name"]: v for v in router["spec"]["template"]["spec"]["volumes"]}
    assert (
        volumes["config"]["configMap"]["name"]
        == by_kind(overlay, "ConfigMap", "kvpool-router")["metadata"]["name"]
    )
    roles = sorted(e.role for e in settings.engines)
    if overlay == "1p1d":
        assert roles == ["decode", "prefill"]
    elif overlay == "cluster-etcd":
        assert settings.policy == "cache_aware" and len(settings.engines) == 2
        assert all(e.node for e in settings.engines)
    else:
        assert roles == ["both"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_node_keeps_its_contents_across_a_rolling_update(overlay):
    daemonset = by_kind(overlay, "DaemonSet", "kvpool-node")
    spec = daemonset["spec"]["template"]["spec"]
    assert daemonset["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    node = containers(daemonset)[0]
    env = env_of(node)
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounts = {m["name"]: m["mountPath"] for m in node["volumeMounts"]}
    # The arena, its journal and the disk tier live on hostPaths, which outlive the pod.
    assert host_paths["kvpool-run"] == mounts["kvpool-run"] == env["KVPOOL_RUN_DIR"]
    assert host_paths["kvpool-disk"] == mounts["kvpool-disk"] == env["KVPOOL_DISK"]
    assert "KVPOOL_FRESH" not in env  # a new pod adopts what the old one left
    assert "--fresh" not in node.get("args", [])


# -- what the pods run -------------------------------------------------------------------

INSTALLERS = re.compile(
    r"\b(pip3?|uv pip|conda|mamba|apt-get|apt|apk|yum|dnf|npm)\s+(install|add)\b"
)


def helm_template(*args: str) -> list[dict]:
    done = subprocess.run(
        [helm(), "template", "kvpool", str(CHART), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def every_rendering() -> dict[str, list[dict]]:
    """Every overlay, and the chart with every values file (its defaults too)."""
    out = {f"kustomize {o}": documents(o) for o in OVERLAYS}
    out["helm (defaults)"] = helm_template()
    for values in sorted(CHART.glob("values-*.yaml")):
        out[f"helm -f {values.name}"] = helm_template("-f", str(values))
    return out


def pod_specs(doc: dict) -> list[dict]:
    """The pod specs an object runs: a workload's template, a ModelServing's roles."""
    if doc["kind"] == "ModelServing":
        return [r["entryTemplate"]["spec"] for r in doc["spec"]["template"]["roles"]]
    template = doc.get("spec", {}).get("template", {})
    return [template["spec"]] if "spec" in template and "containers" in template["spec"] else []


def test_no_container_installs_anything_and_no_image_is_latest():
    """A pod runs what its image holds: no container command installs packages at start, and
    every image names a version (never latest, never none)."""
    renderings = every_rendering()
    assert len(renderings) == 3 + 1 + len(list(CHART.glob("values-*.yaml")))
    for name, docs in renderings.items():
        specs = [spec for doc in docs for spec in pod_specs(doc)]
        assert specs, name
        for spec in specs:
            for container in [*spec.get("initContainers", []), *spec["containers"]]:
                image = container["image"]
                repository, _, tag = image.rpartition(":")
                assert repository and "/" not in tag and tag not in ("", "latest"), (name, image)
                words = " ".join([*container.get("command", []), *container.get("args", [])])
                assert not INSTALLERS.search(words), (name, container["name"], words)


def test_the_checks_above_catch_an_install_and_latest():
    assert INSTALLERS.search("pip install kvpool && vllm serve model")
    assert INSTALLERS.search("uv pip install kvpool")
    assert not INSTALLERS.search("vllm serve model --port 8000")
    assert "vllm/vllm-openai:latest".rpartition(":")[2] == "latest"


def test_the_images_are_the_release_and_vllms_a_supported_one():
    """The manifests run kvpool's images at its release; the engine image starts from a
    vLLM of the ``vllm`` extra's range, the one the compatibility check reads; base images
    are pinned."""
    release = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert release
    for name, docs in every_rendering().items():
        for doc in docs:
            for spec in pod_specs(doc):
                for container in [*spec.get("initContainers", []), *spec["containers"]]:
                    repository, _, tag = container["image"].rpartition(":")
                    if repository.startswith("kvpool/"):
                        assert tag == release.group(1), (name, container["image"])
    engine = (ROOT / "deploy" / "engine.Dockerfile").read_text()
    version = re.search(r"^ARG VLLM_VERSION=v(\d+\.\d+\.\d+)$", engine, re.M)
    assert version and "FROM vllm/vllm-openai:${VLLM_VERSION}" in engine
    checked = re.search(r"^VLLM_CHECKED := (.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert checked and checked.group(1) == version.group(1)
    extra = re.search(
        r'^vllm = \["vllm>=(\d+\.\d+),<(\d+\.\d+)"\]', (ROOT / "pyproject.toml").read_text(), re.M
    )
    assert extra
    as_tuple = [tuple(int(p) for p in v.split(".")) for v in (version.group(1), *extra.groups())]
    assert as_tuple[1] <= as_tuple[0][:2] < as_tuple[2]
    node = (ROOT / "deploy" / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)$", node, re.M)
    assert base and base.group(1).rpartition(":")[2] not in ("", "latest")
    assert re.search(r"^USER 10001:10001$", node, re.M)
    for dockerfile in (node, engine):
        entry = "\n".join(
            line for line in dockerfile.splitlines() if line.startswith(("ENTRYPOINT", "CMD"))
        )
        assert not INSTALLERS.search(entry)


def env_values(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_tls_is_served_unless_a_value_says_otherwise():
    """Every overlay and the chart serve TLS on the nodes' ports (the certificate from a
    Secret) and their clients verify it; plaintext only with tls.enabled false."""
    for name, docs in every_rendering().items():
        daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
        node = env_values(containers(daemonset)[0])
        assert node["KVPOOL_TLS_CERT"] and node["KVPOOL_TLS_KEY"], name
        assert "KVPOOL_INSECURE" not in node, name
        assert node.get("KVPOOL_ETCD", "https://").startswith("https://"), name
        for doc in docs:
            for spec in pod_specs(doc):
                for container in spec["containers"]:
                    env = env_values(container)
                    if "KVPOOL_ACCESS_KEY" in env and container["name"] != "kvpool":
                        assert env["KVPOOL_TLS_CA"] and env["KVPOOL_TLS_SERVER_NAME"], name
    plaintext = helm_template("--set", "tls.enabled=false")
    daemonset = next(d for d in plaintext if d["kind"] == "DaemonSet")
    assert env_values(containers(daemonset)[0])["KVPOOL_INSECURE"] == "1"
    assert not [
        d for d in plaintext if d["kind"] == "Secret" and d["metadata"]["name"] == "kvpool-tls"
    ]


def test_the_chart_generates_the_secrets_and_refuses_the_placeholder():
    """With no Secret of the operator's, the chart makes them: a random access key, and a CA
    with the nodes' certificate for the names their clients check.  The examples'
    placeholder key stops the install, naming the value to set."""
    import base64

    from cryptography import x509

    docs = helm_template()
    secrets = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Secret"}
    key = base64.b64decode(secrets["kvpool-access"]["data"]["access-key"]).decode()
    assert (
        len(key) >= 32
        and key
        != base64.b64decode(
            next(d for d in helm_template() if d["kind"] == "Secret")["data"]["access-key"]
        ).decode()
    )  # generated afresh, not a constant of the chart
    tls = {k: base64.b64decode(v) for k, v in secrets["kvpool-tls"]["data"].items()}
    cert = x509.load_pem_x509_certificate(tls["tls.crt"])
    ca = x509.load_pem_x509_certificate(tls["ca.crt"])
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"kvpool-node", "kvpool-router.kvpool.svc", "kvpool-etcd.kvpool.svc"} <= set(
        names.get_values_for_type(x509.DNSName)
    )
    cert.verify_directly_issued_by(ca)
    refused = subprocess.run(
        [helm(), "template", "kvpool", str(CHART), "--set", "accessKey=change-me"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode != 0 and "accessKey" in refused.stderr, refused.stderr
