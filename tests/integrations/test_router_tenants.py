"""The router with tenants: every request names its tenant's credential, and cache-aware
routing looks only at that tenant's blocks, so a prompt another tenant has cached neither
attracts the request nor shows in the route's explanation."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvpool import Namespace
from kvpool.router.prefix import PromptHasher
from tests.conftest import NodeFactory
from tests.router.servers import FakeEngine, RouterProc
from tests.security.tenants import CLUSTER, TenantsFile, client

pytestmark = [pytest.mark.vllm]  # vLLM's block hashing

PROMPT = "the tenants of a shared pool must not see each other's prompts " * 8


def ask(url: str, credential: tuple[str, str] | None) -> tuple[int, str]:
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 2}).encode(),
        headers={"Content-Type": "application/json"},
    )
    if credential is not None:
        request.add_header("Authorization", f"Bearer {credential[0]}:{credential[1]}")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()
            return response.status, response.headers.get("x-kvpool-route", "")
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_cache_aware_routing_sees_only_the_requests_tenant(
    model: str, start_node: NodeFactory, tmp_path: Path
) -> None:
    tenants = TenantsFile(tmp_path / "tenants.toml")
    alpha = tenants.add("alpha")[0]
    beta = tenants.add("beta")[0]
    tenants.write()
    node = start_node("routed", extra=["--tenants", str(tenants.path)])
    # Alpha's engine has computed the prompt: its blocks are in the pool, under alpha.
    namespace = Namespace(model="tiny-llama", block_size=16)
    hasher = PromptHasher(model, 16)
    hashes = hasher.block_hashes(hasher.token_ids("/v1/completions", {"prompt": PROMPT}))
    with client(node.tcp_address, alpha, use_shm=False) as a:
        assert a.put([namespace.key(h) for h in hashes], [b"kv" * 512] * len(hashes)).all_stored
        a.describe(namespace)

    # Two engines per tenant (with one, the policy has nothing to score), all on the node.
    engines = {name: [FakeEngine(f"{name}-1"), FakeEngine(f"{name}-2")] for name in tenants.tenants}
    router = RouterProc(
        [
            f"{e.url},node={node.tcp_address},tenants={name}"
            for name, pair in engines.items()
            for e in pair
        ],
        "--policy",
        "cache_aware",
        "--tokenizer",
        model,
        "--block-size",
        "16",
        "--model",
        "tiny-llama",
        "--tenants",
        str(tenants.path),
        env={"KVPOOL_ACCESS_ID": CLUSTER[0], "KVPOOL_ACCESS_KEY": CLUSTER[1]},
    )
    try:
        assert ask(router.url, None)[0] == 401
        assert ask(router.url, (beta[0], "not-the-key-at-all"))[0] == 401
        status, route = ask(router.url, alpha)
        assert status == 200 and f"prefix={len(hashes)}/{len(hashes)}" in route
        status, route = ask(router.url, beta)
        assert status == 200 and f"prefix=0/{len(hashes)}" in route
        # The credential was the router's to check: engines never see it.
        seen = [entry["headers"] for pair in engines.values() for e in pair for entry in e.log()]
        assert seen and not any("Authorization" in h or "authorization" in h for h in seen)
    finally:
        router.stop()
        for pair in engines.values():
            for engine in pair:
                engine.stop()
