"""The tiny MLA model (DeepSeek-V3's shape) in real vLLM: its engine settings, prompts and
reference answers, shared by the MLA tests (prefill/decode through the router, the guide's
EMS connector).

The reference of a loaded prefix.  On this CPU backend (AMX_MLA) vLLM's own continuation of
a cached MLA prefix runs another kernel path than a fresh prefill, and its greedy tokens may
differ from the fresh ones: the engine's numerics, not the pool's.  A request that loads its
prefix from the pool is such a continuation, so it is compared with what one engine without
a connector answers the second time it sees a prompt, with its own prefix cache on.  Each
prompt is asked alone (as a server gets it), fresh and then again.
"""

from __future__ import annotations

from typing import Any

from tests.integrations.engine import BLOCK_SIZE, prompts, run_engine

PROMPTS = prompts(9, 2, words=250)
MAX_TOKENS = 12
# As the servers and the connector's engines run it: bf16 (the model's), eager.
ENGINE = {"dtype": "bfloat16", "max_model_len": 2048, "kv_cache_memory_bytes": 64 << 20}
# The guide's flags for its engines, as a server's command line.
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


def reference_answers(model: str) -> dict[str, Any]:
    """Per prompt: ``fresh`` and ``again`` (token ids and texts), and ``cached``, the
    tokens the second request took from the engine's own prefix cache."""
    steps = []
    for i, prompt in enumerate(PROMPTS):
        steps += [generate(f"fresh{i}", [prompt]), generate(f"again{i}", [prompt])]
    results = {r["name"]: r for r in run_engine(model, steps, engine=ENGINE)}
    out: dict[str, Any] = {"fresh": [], "again": [], "fresh_texts": [], "again_texts": []}
    out["cached"] = []
    out["prompt_tokens"] = []
    for i in range(len(PROMPTS)):
        fresh, again = results[f"fresh{i}"], results[f"again{i}"]
        out["fresh"].append(fresh["token_ids"][0])
        out["again"].append(again["token_ids"][0])
        out["fresh_texts"].append(fresh["texts"][0])
        out["again_texts"].append(again["texts"][0])
        out["cached"].append(again["num_cached_tokens"][0])
        out["prompt_tokens"].append(again["prompt_tokens"][0])
    return out


def full_blocks(prompt_tokens: list[int]) -> int:
    """The tokens of a batch's full blocks that a load can serve (all but the last token's)."""
    return sum(((n - 1) // BLOCK_SIZE) * BLOCK_SIZE for n in prompt_tokens)
