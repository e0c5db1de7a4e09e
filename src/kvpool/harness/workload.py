"""The multi-turn chat workload of ``kvpool demo`` and of the vLLM benchmark: conversations
interleaved turn by turn, replayed against engines with and without a KV connector, with
time to first token per turn.

Each configuration runs in its own engine process (:mod:`.runner`) on the tiny model, with a
deliberately small engine KV cache, so that a conversation's history has left the engine's
own prefix cache by the time its next turn comes — the situation the pool is for.

The reference for the answers is the engine alone with a KV cache that keeps every
conversation (:data:`OWN`): each turn's history comes from its own prefix cache.  An engine
that loads that history from the pool must answer exactly as it does.  The engine that lost
its history (:data:`NO_POOL`) computes it again, which on some CPUs (AVX-512 without AMX)
answers differently in vLLM alone: it is the baseline for time to first token, not for the
answers.
"""

from __future__ import annotations

import builtins
import keyword
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .engine import EngineFailed, EngineProcess

BLOCK_SIZE = 32
MAX_MODEL_LEN = 3072
# Room for one max-length sequence and little more: the history of the workload does not fit.
ENGINE_KV_CACHE_BYTES = 13 << 20
# float32, not the model's bfloat16: vLLM's CPU matmuls in bfloat16 are not batch-invariant
# (a token's KV differs in the last bits depending on how many tokens share its forward), so
# greedy outputs of a run whose cache hits differ can drift apart even when every loaded
# block is exact.  In float32 they do not, and on AVX2-only CPUs float32 is also faster.
ENGINE_DTYPE = "float32"
# The engine alone, with room for the whole workload's history (the tiny model's KV is 4 KiB
# a token in float32: 8 conversations of 3,072 tokens take 96 MiB).
OWN_KV_CACHE_BYTES = 256 << 20

NO_POOL = "nopool"  # the engine alone, its small cache: the baseline for TTFT
OWN = "own"  # the engine alone, a cache that keeps every history: the reference answers


@dataclass(frozen=True)
class Workload:
    """Conversations about a document each (unique per conversation, like a file under
    review), then short follow-up turns: the history grows, the new part stays small."""

    num_conversations: int = 8
    num_turns: int = 4
    document_words: int = 250
    words_per_turn: int = 25
    system_words: int = 40
    reply_tokens: int = 16
    seed: int = 0

    def conversations(self) -> tuple[str, list[list[str]]]:
        rng = random.Random(self.seed)
        vocabulary = sorted(set(keyword.kwlist) | {n for n in dir(builtins) if n.isidentifier()})

        def text(num_words: int) -> str:
            return " ".join(rng.choice(vocabulary) for _ in range(num_words))

        system = "You review Python code. " + text(self.system_words)
        conversations = []
        for _ in range(self.num_conversations):
            turns = [text(self.words_per_turn) for _ in range(self.num_turns)]
            turns[0] = f"Review this code:\n{text(self.document_words)}\n\n{turns[0]}"
            conversations.append(turns)
        return system, conversations


@dataclass
class RunResult:
    name: str
    turns: list[dict[str, Any]]
    counters: dict[str, float]
    ready_s: float
    log: str = ""

    def ttfts(self, *, skip_first_turn: bool = True) -> list[float]:
        return [
            t["ttft_ms"]
            for t in self.turns
            if t["ttft_ms"] is not None and (t["turn"] > 0 or not skip_first_turn)
        ]

    @property
    def hit_rate(self) -> float:
        """Prompt tokens the pool served, over the tokens the engine's own cache missed."""
        queries = self.counters.get("external_queries", 0.0)
        return self.counters.get("external_hits", 0.0) / queries if queries else 0.0


@dataclass
class Comparison:
    workload: Workload
    runs: dict[str, RunResult] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Per run: TTFT median and p90; per run with a connector, its hit rate and whether
        its answers are the reference's (``outputs_identical_<run>``, with :data:`OWN`)."""
        out: dict[str, Any] = {
            "conversations": self.workload.num_conversations,
            "turns": self.workload.num_turns,
        }
        reference = self.runs.get(OWN)
        if reference is not None:
            out["own_kept_history"] = all(
                t["cached_tokens"] > 0 for t in reference.turns if t["turn"] > 0
            )
        for name, run in self.runs.items():
            ttfts = run.ttfts()
            out[f"ttft_ms_median_{name}"] = round(statistics.median(ttfts), 2) if ttfts else None
            out[f"ttft_ms_p90_{name}"] = round(_percentile(ttfts, 0.9), 2) if ttfts else None
            if name not in (NO_POOL, OWN):
                out[f"hit_rate_{name}"] = round(run.hit_rate, 4)
                if reference is not None:
                    out[f"outputs_identical_{name}"] = _outputs(run) == _outputs(reference)
        if "pool" in self.runs:
            out["hit_rate"] = out["hit_rate_pool"]
            out["outputs_identical"] = out.get("outputs_identical_pool")
            if out.get("ttft_ms_median_nopool") and out.get("ttft_ms_median_pool"):
                out["speedup_median"] = round(
                    out["ttft_ms_median_nopool"] / out["ttft_ms_median_pool"], 2
                )
        return out

    def per_turn(self) -> list[dict[str, Any]]:
        rows = []
        for turn in range(self.workload.num_turns):
            row: dict[str, Any] = {"turn": turn + 1}
            for name, run in self.runs.items():
                values = [
                    t["ttft_ms"]
                    for t in run.turns
                    if t["turn"] == turn and t["ttft_ms"] is not None
                ]
                row[name] = round(statistics.median(values), 1) if values else None
                cached = [
                    t["cached_tokens"] / t["prompt_tokens"] for t in run.turns if t["turn"] == turn
                ]
                row[f"{name}_cached"] = round(statistics.mean(cached), 3) if cached else 0.0
            prompts = [
                t["prompt_tokens"]
                for t in next(iter(self.runs.values())).turns
                if t["turn"] == turn
            ]
            row["prompt_tokens"] = round(statistics.mean(prompts)) if prompts else 0
            rows.append(row)
        return rows


def _outputs(run: RunResult) -> list[list[int]]:
    return [t["token_ids"] for t in run.turns]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def kvpool_connector(address: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": address, **extra},
    }


def example_connector(path: str) -> dict[str, Any]:
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": path},
    }


def run_workload(
    name: str,
    model: str,
    workload: Workload,
    connector: dict[str, Any] | None,
    *,
    engine: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    warmup_s: float = 0.0,
    timeout: float = 1800,
) -> RunResult:
    system, conversations = workload.conversations()
    engine_args = {
        "block_size": BLOCK_SIZE,
        "max_model_len": MAX_MODEL_LEN,
        "kv_cache_memory_bytes": ENGINE_KV_CACHE_BYTES,
        "dtype": ENGINE_DTYPE,
        **(engine or {}),
    }
    steps = [
        *([{"op": "sleep", "seconds": warmup_s}] if warmup_s else []),
        {
            "op": "chat",
            "name": name,
            "system": system,
            "conversations": conversations,
            "max_tokens": workload.reply_tokens,
        },
    ]
    try:
        with EngineProcess(model, engine=engine_args, connector=connector, env=env) as process:
            results = process.run(steps, timeout=timeout)
            log = "".join(process.log)
    except EngineFailed as exc:
        raise RuntimeError(f"the {name} engine failed: {exc}") from exc
    chat = next(r for r in results if r["op"] == "chat")
    return RunResult(name, chat["turns"], chat["counters"], process.ready["seconds"], log)


def compare(
    model: str,
    workload: Workload,
    configs: dict[str, dict[str, Any] | None],
    progress: Callable[[str], None] = lambda _: None,
) -> Comparison:
    """``workload`` on an engine per config (a connector, or None), and on the engine alone
    with a cache that keeps every history (:data:`OWN`, the reference answers)."""
    comparison = Comparison(workload)
    for name, connector in {**configs, OWN: None}.items():
        progress(name)
        engine = {"kv_cache_memory_bytes": OWN_KV_CACHE_BYTES} if name == OWN else None
        comparison.runs[name] = run_workload(name, model, workload, connector, engine=engine)
    return comparison
