"""The tiny MLA model (DeepSeek-V3's shape) in real vLLM: its engine settings, prompts and
reference answers, shared by the MLA tests (prefill/decode through the router, the guide's
EMS connector).

What an engine that loads an MLA prefix from the pool must answer: what the engine alone
answers.  Two properties of vLLM's own MLA kernels on CPUs, seen with no connector at all:

- they are not batch-invariant: a prompt can give other greedy tokens alone than in a batch
  (near-ties flip with the batch's composition).  So every MLA test asks one prompt at a time
  (one per generate step, or one request at a time over HTTP).
- on a host with AMX (vLLM's AMX_MLA kernels, its own prefix cache on), continuing a cached
  prefix runs another kernel path than a fresh prefill, and can give other greedy tokens: of
  :data:`PROMPTS`, the first answers differently from its third token on when the engine asks
  it again from its own prefix cache; the second answers the same.  A request that loads its
  prefix from the pool is such a continuation, so its reference is ``again``: what the engine
  alone answers the second time it is asked a prompt.

Elsewhere vLLM runs its reference MLA kernels (CPU_MLA: no prefix cache of its own), which
continue a prefix they did not compute wrongly (docs/declined-backends.md): kvpool loads
nothing into such an engine (``declined``), and the reference for every request is the
engine's fresh answer.
"""

from __future__ import annotations

from typing import Any

from kvpool.integrations.vllm.backends import declined_reason
from tests.integrations.engine import (
    BLOCK_SIZE,
    EnginePool,
    kept_own_prefix,
    prompts,
)

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


def token_ids(results: list[dict[str, Any]]) -> list[list[int]]:
    """The answers of :func:`one_at_a_time`'s steps, in order."""
    return [r["token_ids"][0] for r in results if r["op"] == "generate"]


def reference_answers(model: str, engines: EnginePool) -> dict[str, Any]:
    """Per prompt of :data:`PROMPTS`, asked one at a time by one engine without a connector
    (the session's shared one): ``fresh`` and ``again`` (token ids; ``again`` is what an
    engine that loads the prompt's prefix from the pool must answer), ``again_texts``,
    ``prompt_tokens``, the engine's ``attention_backends`` and ``declined`` (why kvpool loads
    nothing into it, "" when it does)."""
    steps: list[dict[str, Any]] = [{"op": "attention_backends"}]
    for i, prompt in enumerate(PROMPTS):
        steps += [generate(f"fresh{i}", [prompt]), generate(f"again{i}", [prompt])]
    results = {r["name"]: r for r in engines.run(model, steps, engine=ENGINE)}
    backends = results["attention_backends"]["attention_backends"]
    declined = declined_reason(backends)
    # Where kvpool loads, vLLM keeps a prefix cache of its own: ``again`` continues it.
    kind = "fresh" if declined else "again"
    answers = [results[f"{kind}{i}"] for i in range(len(PROMPTS))]
    if not declined:
        assert kept_own_prefix(answers), f"{backends}: no MLA prefix cache of vLLM's own"
    return {
        "fresh": [results[f"fresh{i}"]["token_ids"][0] for i in range(len(PROMPTS))],
        "again": [r["token_ids"][0] for r in answers],
        "again_texts": [r["texts"][0] for r in answers],
        "prompt_tokens": [r["prompt_tokens"][0] for r in answers],
        "attention_backends": backends,
        "declined": declined,
    }


def full_blocks(prompt_tokens: list[int]) -> int:
    """The tokens of a batch's full blocks that a load can serve (all but the last token's)."""
    return sum(((n - 1) // BLOCK_SIZE) * BLOCK_SIZE for n in prompt_tokens)
