"""A rolling upgrade under traffic: a 3-node cluster of the previous release (built from
git) serves a vLLM engine of the previous release; each node in turn is stopped and this
release started on its directories and port while the engine keeps asking.  Every request
succeeds, greedy outputs stay the engine's own (as computed where a round missed, as
from its own prefix cache where it loaded the whole prefix), and the hit rate is back above 90%
of what it was within a minute of each step.

One engine process for the whole test (about 30 s to start on 2 cores); it keeps saving and
loading the same prompts, round after round, while the nodes are replaced behind it."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest

from kvpool import Client
from kvpool.formats import RELEASE
from kvpool.harness.process import NodeProcess
from kvpool.harness.releases import release_env
from tests.cluster.fabric import free_port
from tests.integrations.engine import (
    answers,
    computed_and_cached,
    connector,
    hit_fraction,
    num_as_own,
    prompts,
    run_engine,
)
from tests.releases import previous_src

pytestmark = [pytest.mark.vllm, pytest.mark.cluster]

PROMPTS = prompts(38, 4, words=200)
# Rounds per step.  A round that misses takes ~0.7 s on 2 cores, one that hits ~0.1 s: the
# connector's health monitor sees its node back a few seconds after the replacement (3 good
# probes, 1 s apart), and the rounds must outlast that.
ROUNDS = 40
RECOVERY_S = 60.0
NAMES = ("a", "b", "c")


def _round(tag: str, i: int) -> list[dict]:
    ask = {"op": "generate", "prompts": PROMPTS, "max_tokens": 8}
    # The pause after it tells the test when it ended (its wall clock).
    reset = {"op": "reset_prefix_cache"}
    return [reset, {**ask, "name": f"{tag}-{i}"}, {"op": "pause", "tag": f"{tag}-{i}"}]


def test_rolling_upgrade_under_traffic(model: str, run_dir: Path, tmp_path: Path) -> None:
    previous = previous_src(tmp_path / "releases")
    ports = {name: free_port() for name in NAMES}
    peers = ",".join(f"127.0.0.1:{ports[n]}" for n in NAMES)

    def node(name: str, env: dict[str, str] | None) -> NodeProcess:
        extra = ["--peers", peers, "--scrub-rate", "0"]
        process = NodeProcess.private(name, "128MiB", run_dir=str(run_dir), extra=extra, env=env)
        process.args[process.args.index("--port") + 1] = str(ports[name])
        return process.start()

    nodes = {name: node(name, release_env(previous)) for name in NAMES}
    replaced: dict[str, float] = {}  # name -> when its replacement began
    ended: dict[str, float] = {}  # round -> when it ended
    errors: list[BaseException] = []
    worker: list[threading.Thread] = []
    releases: dict[str, str] = {}

    def replace(name: str) -> None:
        try:
            assert nodes[name].stop() == 0
            nodes[name] = node(name, None)  # this release, on the same files and port
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    def on_pause(tag: str) -> None:
        if tag in NAMES:  # replaced while the engine goes on with its next rounds
            for thread in worker:
                thread.join(30)
            replaced[tag] = time.monotonic()
            thread = threading.Thread(target=replace, args=(tag,), daemon=True)
            worker.append(thread)
            thread.start()
        elif tag == "end":
            for thread in worker:
                thread.join(30)
            for name, process in nodes.items():
                with Client(process.tcp_address, use_shm=False, timeout=10) as client:
                    releases[name] = client.stats().release
        else:
            ended[tag] = time.monotonic()

    # The engine's own answers first: computed, then from its own prefix cache.
    steps: list[dict] = computed_and_cached("warm", PROMPTS, max_tokens=8)
    steps += _round("base", 0)
    for name in NAMES:
        steps.append({"op": "pause", "tag": name})
        for i in range(ROUNDS):
            steps += _round(name, i)
    steps.append({"op": "pause", "tag": "end"})
    config = connector(nodes["a"].unix_address, peers=peers)
    try:
        results = run_engine(
            model,
            steps,
            connector_config=config,
            on_pause=on_pause,
            env=release_env(previous),  # an engine pod not upgraded yet
        )
    finally:
        for thread in worker:
            thread.join(30)
        for process in nodes.values():
            process.stop()
    assert not errors, errors
    assert releases == dict.fromkeys(NAMES, RELEASE)

    # Each round: the counters after its generate, less those after the reset before it.
    rounds: dict[str, dict] = {}
    hits: dict[str, float] = {}
    for before, result in itertools.pairwise(results):
        if result["op"] == "generate" and before["op"] == "reset_prefix_cache":
            rounds[result["name"]] = result
            lengths = result["prompt_tokens"]
            hits[result["name"]] = hit_fraction(before["counters"], result["counters"], lengths)
    generated = [r for r in results if r["op"] == "generate"]
    assert all(len(ids) == 8 for r in generated for ids in r["token_ids"])  # all answered
    answers(generated[:2])  # the second came from the engine's own prefix cache
    base = hits["base-0"]
    assert base > 0.8, hits
    loaded = rounds["base-0"]
    for name in NAMES:
        seen = [round(hits[f"{name}-{i}"], 2) for i in range(ROUNDS)]
        # Back for good: the rounds after the last that missed (a round may still hit
        # before the node's SIGTERM lands).
        missed = [i for i in range(ROUNDS) if hits[f"{name}-{i}"] < 0.9 * base]
        back = missed[-1] + 1 if missed else 0
        assert back < ROUNDS, (name, seen)
        took = ended[f"{name}-{back}"] - replaced[name]
        assert took < RECOVERY_S, (name, took, seen)
        print(f"replaced {name}: hits back after {took:.1f} s")
    # Every round's answers: the same prefix loaded answers alike, the whole prefix as the
    # engine's own prefix cache does, a miss as computed.
    num_whole = 0
    for name, result in rounds.items():
        for j, cached in enumerate(result["num_cached_tokens"]):
            if cached == loaded["num_cached_tokens"][j]:
                assert result["token_ids"][j] == loaded["token_ids"][j], (name, j)
        num_whole += num_as_own(result, *generated[:2])
    assert num_whole >= len(rounds), num_whole  # a round's whole prefixes, mostly
