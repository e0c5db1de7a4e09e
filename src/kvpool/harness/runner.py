"""Run a vLLM engine (offline ``LLM``) through a plan of steps and report each as one JSON
line: the engine side of ``kvpool demo``, the benchmarks and the tests.

    python -m kvpool.harness.runner plan.json

The plan::

    {"model": "<dir>", "engine": {...LLM keyword arguments...},
     "connector": null | {"kv_connector": ..., "kv_role": ..., ...},
     "steps": [{"op": "generate", "name": "...", "prompts": [...], "max_tokens": 16},
               {"op": "chat", "name": "...", "conversations": [[user turns], ...],
                "max_tokens": 16, "system": "..."},
               {"op": "reset_prefix_cache"},
               {"op": "pause", "tag": "..."}]}

Each step prints ``KVPOOL_RESULT {json}``; ``pause`` prints ``KVPOOL_PAUSE tag`` and waits
for a line on stdin (so a test can kill or corrupt the pool between steps).  Every result
carries the external prefix-cache counters vLLM keeps (tokens queried / hit in the pool).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

RESULT_PREFIX = "KVPOOL_RESULT "
PAUSE_PREFIX = "KVPOOL_PAUSE "

ENGINE_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM reserves one more CPU core when a KV connector is configured; on a small machine
    # that changes the worker's thread count, and with it the floating-point reduction order
    # and greedy outputs.  Reserving one core either way keeps runs comparable.
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
}


def omp_binding(num_ranks: int) -> dict[str, str]:
    """The environment that lets ``num_ranks`` vllm-cpu workers (tensor, pipeline or data
    parallel ranks) share one NUMA node.

    vllm-cpu binds each rank's OpenMP threads to a NUMA node of its own and refuses to
    start more ranks than the machine has nodes ("Not enough allowed NUMA nodes to bind
    threads of 2 local CPUWorkers").  Given explicit CPU lists it binds rank ``i`` to the
    ``i``-th: here, an equal share of this process's CPUs each (ranks share CPUs when there
    are fewer CPUs than ranks).  ``VLLM_CPU_NUM_OF_RESERVED_CPU`` only applies to automatic
    binding, so it has no effect then.
    """
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = max(len(cpus) // num_ranks, 1)
    shares = [cpus[(rank * per_rank) % len(cpus) :][:per_rank] for rank in range(num_ranks)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, s)) for s in shares)}


def _emit(prefix: str, payload: Any) -> None:
    sys.stdout.write(prefix + (payload if isinstance(payload, str) else json.dumps(payload)) + "\n")
    sys.stdout.flush()


def _counters(llm: Any) -> dict[str, float]:
    wanted = {
        "vllm:external_prefix_cache_queries": "external_queries",
        "vllm:external_prefix_cache_hits": "external_hits",
        "vllm:prefix_cache_queries": "local_queries",
        "vllm:prefix_cache_hits": "local_hits",
        "vllm:kvpool_blocks_loaded": "kvpool_blocks_loaded",
        "vllm:kvpool_blocks_saved": "kvpool_blocks_saved",
        "vllm:kvpool_load_errors": "kvpool_load_errors",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for metric in llm.get_metrics():
        if metric.name in wanted:
            out[wanted[metric.name]] += float(getattr(metric, "value", 0) or 0)
    return out


def _ttft_ms(output: Any) -> float | None:
    metrics = getattr(output, "metrics", None)
    latency = getattr(metrics, "first_token_latency", 0.0) if metrics is not None else 0.0
    return round(latency * 1e3, 3) if latency else None


def _generate(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=int(step.get("max_tokens", 16)), ignore_eos=True
    )
    started = time.perf_counter()
    outputs = llm.generate(step["prompts"], params, use_tqdm=False)
    return {
        "texts": [o.outputs[0].text for o in outputs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "num_cached_tokens": [o.num_cached_tokens for o in outputs],
        "prompt_tokens": [len(o.prompt_token_ids or ()) for o in outputs],
        "ttft_ms": [_ttft_ms(o) for o in outputs],
        "seconds": round(time.perf_counter() - started, 3),
        # The engine's own: vLLM may override the one asked for (16 for CPU MLA kernels).
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
    }


def _chat(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    """Multi-turn conversations, interleaved turn by turn, one request at a time, so that
    each time to first token is one request's own."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=int(step.get("max_tokens", 16)), ignore_eos=True
    )
    tokenizer = llm.get_tokenizer()
    conversations = step["conversations"]
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": step.get("system", "")}] for _ in conversations
    ]
    turns: list[dict[str, Any]] = []
    num_turns = max(len(c) for c in conversations)
    for turn in range(num_turns):
        for index, user_turns in enumerate(conversations):
            if turn >= len(user_turns):
                continue
            history = histories[index]
            history.append({"role": "user", "content": user_turns[turn]})
            prompt = tokenizer.apply_chat_template(
                history, tokenize=False, add_generation_prompt=True
            )
            (output,) = llm.generate([prompt], params, use_tqdm=False)
            reply = output.outputs[0].text
            history.append({"role": "assistant", "content": reply})
            turns.append(
                {
                    "conversation": index,
                    "turn": turn,
                    "prompt_tokens": len(output.prompt_token_ids or ()),
                    "cached_tokens": output.num_cached_tokens,
                    "ttft_ms": _ttft_ms(output),
                    "token_ids": list(output.outputs[0].token_ids),
                    "prompt_token_ids": list(output.prompt_token_ids or ()),
                }
            )
    return {"turns": turns}


def run(plan: dict[str, Any]) -> None:
    engine: dict[str, Any] = {
        "enforce_eager": True,
        "disable_log_stats": False,
        "seed": 0,
        **plan.get("engine", {}),
    }
    num_ranks = int(engine.get("tensor_parallel_size", 1)) * int(
        engine.get("pipeline_parallel_size", 1)
    )
    binding = omp_binding(num_ranks) if num_ranks > 1 else {}
    for key, value in {**ENGINE_ENV, **binding}.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    if plan.get("connector"):
        engine["kv_transfer_config"] = plan["connector"]
    started = time.perf_counter()
    llm = LLM(model=plan["model"], **engine)
    _emit(RESULT_PREFIX, {"op": "ready", "seconds": round(time.perf_counter() - started, 3)})
    for step in plan["steps"]:
        op = step["op"]
        result: dict[str, Any] = {"op": op, "name": step.get("name", op)}
        if op == "generate":
            result.update(_generate(llm, step))
        elif op == "chat":
            result.update(_chat(llm, step))
        elif op == "reset_prefix_cache":
            result["ok"] = bool(llm.reset_prefix_cache())
        elif op == "pause":
            _emit(PAUSE_PREFIX, str(step.get("tag", "")))
            sys.stdin.readline()
        elif op == "sleep":
            time.sleep(float(step.get("seconds", 1)))
        else:
            raise ValueError(f"unknown step {op!r}")
        result["counters"] = _counters(llm)
        _emit(RESULT_PREFIX, result)


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    run(plan)


if __name__ == "__main__":
    main()
