"""Identical or a miss, proven on the bytes: the blocks an engine loads from the pool are,
byte for byte, the blocks the saver computed in its own paged KV cache, in every family
kvpool claims and in both transfer modes.

Greedy outputs cannot tell a wrong byte from a kernel's own run-to-run variation; the paged
cache can.  Each engine here runs its engine core and worker in the runner's process, so
:mod:`kvpool.harness.paged` reads the blocks vLLM's prefix cache holds for each prompt (per
KV cache group; a recurrent state group's on its state tensors only).  One engine per family
and mode, on its own node:

1. ``save``: the prompts, computed on an empty pool (as the engine alone computes them) and
   saved; their blocks read.
2. ``again``: the same prompts from the engine's own prefix cache: what the engine alone
   answers a prompt it has seen (the reference for a load, see test_families_vllm.py).
3. ``clear_kv_cache``: vLLM's prefix cache emptied and the whole paged cache zeroed, so that
   a block that a load did not write reads as zeros, not as the saver's bytes left behind.
4. ``load``: the prompts again, their prefixes loaded from the pool; their blocks read.

Each block the load wrote (those before the loaded token count) must equal the saver's
block of the same group and index; a block of the other prompt must not (the control: the
check can fail); and vLLM's null block (what a request's blocks before a sliding window or
a recurrent state's last point to) must still be all zeros: a load never writes it.  An
engine whose attention backend kvpool declines (:mod:`kvpool.integrations.vllm.backends`)
must load nothing, answer as computed, and say why.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvpool.integrations.vllm.backends import DECLINED_LOG, declined_reason
from tests.integrations.engine import connector, prompts

pytestmark = pytest.mark.vllm

PROMPTS = prompts(21, 2, words=150)  # ~1,000 tokens each
MAX_TOKENS = 8

# family -> what its KV cache groups are (vLLM's specs), for the check that each was compared
FAMILIES: dict[str, set[str]] = {
    "llama": {"FullAttentionSpec"},
    "deepseek-v3": {"MLAAttentionSpec"},  # DeepSeek-V3's shape, real MLA head sizes
    "gemma3": {"SlidingWindowSpec", "FullAttentionSpec"},
    "qwen3-next": {"MambaSpec", "FullAttentionSpec"},
    # One group of another kind than full attention: every layer sliding ...
    "gemma3-sliding": {"SlidingWindowSpec"},
    # ... every layer a recurrent state (a pure state-space model's cache).
    "qwen3-next-linear": {"MambaSpec"},
}


def _pass(tag: str, read: bool) -> list[dict[str, Any]]:
    return [
        {
            "op": "generate",
            "name": f"{tag}{i}",
            "prompts": [p],
            "max_tokens": MAX_TOKENS,
            "read_blocks": read,
        }
        for i, p in enumerate(PROMPTS)
    ]


def _by_tag(results: list[dict[str, Any]], tag: str) -> list[dict[str, Any]]:
    return [r for r in results if r["name"].startswith(tag)]


def _blocks(result: dict[str, Any]) -> dict[tuple[int, int], tuple[str, list[str]]]:
    """(group, block index) -> (the group's spec, its layers' digests), of the one prompt."""
    return {(g, i): (kind, digests) for g, i, kind, digests in result["blocks"][0]}


@pytest.mark.parametrize("transfer", ["layerwise", "whole"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loaded_blocks_are_the_savers_bytes(family, transfer, family_model, start_node, engines):
    model = family_model(family)
    node = start_node(name=f"bytes-{family}-{transfer}", memory="128MiB")
    # Lookups may take 2 s: a busy machine must not turn a hit into a miss.
    config = connector(node.unix_address, transfer=transfer, lookup_timeout=2.0)
    steps = [
        {"op": "attention_backends"},
        *_pass("save", True),
        *_pass("again", False),
        {"op": "clear_kv_cache"},
        *_pass("load", True),
    ]
    results = engines.run(model, steps, connector_config=config)
    saved, again, loaded = (_by_tag(results, tag) for tag in ("save", "again", "load"))
    backends = results[0]["attention_backends"]

    if declined_reason(backends):
        # An engine kvpool loads nothing into (vLLM's reference MLA kernels, on a host
        # without AMX): a miss every time, the engine's own answers, one line saying why.
        assert [r["num_cached_tokens"][0] for r in loaded] == [0] * len(PROMPTS)
        assert [r["token_ids"] for r in loaded] == [r["token_ids"] for r in saved]
        assert DECLINED_LOG in results[0]["log"]
        return

    # Identical: the load answers as the engine alone answers from its own prefix cache.
    assert [r["token_ids"] for r in loaded] == [r["token_ids"] for r in again]
    seen: set[str] = set()
    controls = 0
    for i, (save, load) in enumerate(zip(saved, loaded, strict=True)):
        bs = load["block_size"]
        num_loaded = load["num_cached_tokens"][0] // bs
        loadable = (load["prompt_tokens"][0] - 1) // bs
        assert num_loaded >= 0.9 * loadable, (i, num_loaded, loadable)
        before, after = _blocks(save), _blocks(load)
        other = _blocks(saved[1 - i])
        written = {key: value for key, value in after.items() if key[1] < num_loaded}
        assert written, f"prompt {i}: no loaded block in vLLM's prefix cache"
        for key, (kind, digests) in written.items():
            assert key in before, f"prompt {i}: block {key} loaded, never saved"
            assert digests == before[key][1], f"prompt {i}: block {key} ({kind}) differs"
            # The control: the same group and index of the other prompt differs.
            if key in other:
                assert digests != other[key][1], f"prompt {i}: block {key} equals the other's"
                controls += 1
            seen.add(kind)
    assert [r["null_block_bytes"] for r in loaded] == [0] * len(PROMPTS)
    assert seen == FAMILIES[family], seen
    assert controls > 0
