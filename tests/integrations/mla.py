"""The tiny MLA model (DeepSeek-V3's shape) in real vLLM: its engine settings, prompts and
reference answers, shared by the MLA tests (prefill/decode through the router, the guide's
EMS connector).

vLLM's CPU MLA kernels are not batch-invariant: the same prompt can give other greedy tokens
alone than in a batch (near-ties flip with the batch's composition).  So every MLA test asks
one prompt at a time (one per generate step, or one request at a time over HTTP), and the
reference does the same: then an engine without a connector answers a prompt identically
fresh and from its own prefix cache, and an engine that loads the prefix from the pool must
answer exactly so.
"""

from __future__ import annotations

from typing import Any

from tests.integrations.engine import BLOCK_SIZE, prompts, run_engine

PROMPTS = prompts(9, 2, words=250)
MAX_TOKENS = 12
# As the servers and the connector's engines run it: bf16 (the model's), eager.
ENGINE = {"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory_bytes": 64 << 20}
# The guide's flags for its engines: as engine arguments, and as a server's command line.
GUIDE_ENGINE = {**ENGINE, "enable_prefix_caching": False, "disable_hybrid_kv_cache_manager": True}
SERVER_ARGS = [
    "--block-size",
    str(BLOCK_SIZE),
    "--max-model-len",
    "2048",
    "--enforce-eager",
    "--dtype",
    "bfloat16",
    "--kv-cache-memory-bytes",
    str(64 << 20),
    "--seed",
    "0",
    "--no-enable-prefix-caching",
    "--disable-hybrid-kv-cache-manager",
]


def generate(name: str, batch: list[str]) -> dict[str, Any]:
    return {"op": "generate", "name": name, "prompts": batch, "max_tokens": MAX_TOKENS}


def one_at_a_time(batch: list[str]) -> list[dict[str, Any]]:
    """Generate steps that ask the prompts of ``batch`` one by one (``p0``, ``p1``, ...)."""
    return [generate(f"p{i}", [prompt]) for i, prompt in enumerate(batch)]


def answers(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The token ids, texts and prompt lengths of :func:`one_at_a_time`'s steps, in order."""
    steps = [r for r in results if r["op"] == "generate"]
    return {
        "token_ids": [r["token_ids"][0] for r in steps],
        "texts": [r["texts"][0] for r in steps],
        "prompt_tokens": [r["prompt_tokens"][0] for r in steps],
    }


def reference_answers(model: str) -> dict[str, Any]:
    """What one engine without a connector answers to :data:`PROMPTS`, one at a time."""
    return answers(run_engine(model, one_at_a_time(PROMPTS), engine=ENGINE))


def full_blocks(prompt_tokens: list[int]) -> int:
    """The tokens of a batch's full blocks that a load can serve (all but the last token's)."""
    return sum(((n - 1) // BLOCK_SIZE) * BLOCK_SIZE for n in prompt_tokens)
