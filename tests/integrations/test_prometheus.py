"""A real Prometheus (Debian's) scrapes a node, the router and a vLLM engine with the
connector, and the figures come back through its query API; the shipped alerting rules and
Grafana dashboard refer only to metrics it saw."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from tests.cluster.fabric import free_port
from tests.integrations.engine import prompts
from tests.integrations.test_router_vllm import complete
from tests.integrations.vllm_server import VllmServer, connector_config
from tests.router.servers import RouterProc

pytestmark = [pytest.mark.vllm]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "kvpool-dashboard.json"
RULES = DEPLOY / "prometheus" / "alerts.yml"


def query(base: str, expr: str) -> list[dict]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def wait_for(base: str, expr: str, timeout: float = 60) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = query(base, expr)
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"Prometheus never answered {expr!r}")


METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*kvpool[a-zA-Z0-9_:]*")


def dashboard_metrics() -> set[str]:
    """Every metric name the dashboard's panel queries name (all of kvpool's contain
    "kvpool"; label matchers are left out first)."""
    dashboard = json.loads(DASHBOARD.read_text())
    names: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = re.sub(r"\{[^}]*\}", "", target["expr"])
            names |= set(METRIC_NAME.findall(expr))
    assert names, "the dashboard names no kvpool metric"
    return names


@pytest.fixture
def prometheus(tmp_path):
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (make system-deps installs it)"
    procs = []

    def start(targets: dict[str, str]) -> str:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        jobs = "\n".join(
            f"  - job_name: {job}\n    metrics_path: {path}\n"
            f"    static_configs:\n      - targets: ['{host}']"
            for job, (host, path) in (
                (job, urllib.parse.urlsplit(url)[1:3]) for job, url in targets.items()
            )
        )
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            f"rule_files: ['{RULES}']\nscrape_configs:\n{jobs}\n"
        )
        with open(tmp_path / "prometheus.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [
                        binary,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={tmp_path / 'data'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(base + "/-/ready", timeout=2):
                    return base
            except OSError:
                if time.monotonic() > deadline or procs[-1].poll() is not None:
                    raise
                time.sleep(0.1)

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def test_prometheus_scrapes_node_router_and_engine(model, start_node, prometheus):
    node = start_node(name="prom", memory="256MiB")
    engine = VllmServer(model, kv_transfer_config=connector_config(node.unix_address, "kv_both"))
    router = None
    try:
        router = RouterProc([engine.url])
        # Ten prompts of ~1,150 tokens outgrow the engine's 32 MiB cache: by the time each
        # comes back with a continuation, its prefix is only in the pool, and loads.
        first = prompts(11, 10, words=250)
        for prompt in first:
            complete(router.url, model, prompt, max_tokens=4)
        for prompt in first:
            complete(router.url, model, prompt + " and then some more words", max_tokens=4)
        base = prometheus(
            {
                "kvpool-node": node.admin_url + "/metrics",
                "kvpool-router": router.url + "/metrics",
                "vllm": engine.url + "/metrics",
            }
        )
        deadline = time.monotonic() + 60
        while len(query(base, "up == 1")) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert {r["metric"]["job"] for r in query(base, "up == 1")} == {
            "kvpool-node",
            "kvpool-router",
            "vllm",
        }
        # Capacity and usage, per node and per tier.
        (capacity,) = wait_for(base, "kvpool_capacity_bytes")
        assert float(capacity["value"][1]) >= 256 << 20
        (used,) = wait_for(base, "kvpool_used_bytes")
        assert float(used["value"][1]) > 0
        tiers = wait_for(base, "kvpool_tier_used_bytes")
        assert {t["metric"]["tier"] for t in tiers} >= {"dram"}
        # Hit rate as the engine saw it, and the node's own lookups.
        (hit_rate,) = wait_for(
            base, "sum(vllm:kvpool_hit_blocks_total) / sum(vllm:kvpool_lookup_blocks_total)"
        )
        assert 0 < float(hit_rate["value"][1]) <= 1
        assert float(wait_for(base, "sum(kvpool_hits_total)")[0]["value"][1]) > 0
        # Load and save latency (the engine's), and the node's per-operation latency.
        for name in ("vllm:kvpool_load_seconds_count", "vllm:kvpool_save_seconds_count"):
            assert float(wait_for(base, f"sum({name})")[0]["value"][1]) > 0, name
        assert wait_for(base, 'kvpool_op_latency_seconds_count{op=~"pin|touch"}')  # reads
        # The router's requests.
        assert float(wait_for(base, "sum(kvpool_router_requests_total)")[0]["value"][1]) >= 12

        # Every panel of the dashboard names metrics Prometheus has.
        scraped = {
            r["metric"]["__name__"]
            for r in query(base, '{__name__=~"kvpool_.*|vllm:kvpool_.*|up"}')
        }
        missing = dashboard_metrics() - scraped
        assert not missing, f"dashboard panels name metrics never scraped: {sorted(missing)}"
        # The alerting rules loaded and evaluate.
        with urllib.request.urlopen(base + "/api/v1/rules", timeout=10) as response:
            groups = json.loads(response.read())["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) >= 4 and all(r["health"] == "ok" for r in rules), rules
    finally:
        if router is not None:
            router.stop()
        engine.stop()
