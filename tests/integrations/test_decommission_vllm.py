"""Decommission under traffic: a vLLM engine (on a host with no node of its own) saves its
prompts into a 3-node cluster, each block on its home; one node is drained to the other two
(``kvpool drain --to``) while the engine goes on, then it is gone.  The engine's requests
keep hitting, during the handoff and after, on the nodes that stay: without the handoff a
third of the blocks would be lost, and every prompt's prefix with them."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import pytest

from kvpool.harness.process import NodeProcess
from tests.cluster.fabric import free_port
from tests.commands import run_kvpool
from tests.integrations.engine import (
    answers,
    computed_and_cached,
    connector,
    hit_fraction,
    num_as_own,
    prompts,
    run_engine,
)

pytestmark = [pytest.mark.vllm, pytest.mark.cluster]

PROMPTS = prompts(39, 4, words=200)
ROUNDS = 3
NAMES = ("a", "b", "c")


def test_a_drained_node_hands_its_blocks_to_the_nodes_that_stay(model: str, run_dir: Path) -> None:
    ports = {name: free_port() for name in NAMES}
    addresses = {name: f"127.0.0.1:{ports[name]}" for name in NAMES}
    peers = ",".join(addresses.values())
    nodes = {}
    for name in NAMES:
        extra = ["--peers", peers, "--scrub-rate", "0"]
        process = NodeProcess.private(name, "128MiB", run_dir=str(run_dir), extra=extra)
        process.args[process.args.index("--port") + 1] = str(ports[name])
        nodes[name] = process.start()
    drains: list[threading.Thread] = []
    outcome: dict[str, object] = {}

    def drain() -> None:
        # Keyless nodes: an operator's command goes through the node's Unix socket.
        outcome["drain"] = run_kvpool(
            "drain",
            "--address",
            nodes["c"].unix_address,
            "--to",
            f"{addresses['a']},{addresses['b']}",
        )

    def on_pause(tag: str) -> None:
        if tag == "drain":  # the engine goes on while c hands its blocks over
            thread = threading.Thread(target=drain, daemon=True)
            drains.append(thread)
            thread.start()
        else:
            for thread in drains:
                thread.join(60)
            outcome["c_exit"] = nodes["c"].proc.wait(30) if nodes["c"].proc else None

    ask = {"op": "generate", "prompts": PROMPTS, "max_tokens": 8}
    steps: list[dict] = [
        *computed_and_cached("warm", PROMPTS, max_tokens=8),  # the engine's own answers
        {"op": "reset_prefix_cache"},
        {**ask, "name": "base"},
    ]
    steps.append({"op": "pause", "tag": "drain"})
    for i in range(ROUNDS):
        steps += [{"op": "reset_prefix_cache"}, {**ask, "name": f"during-{i}"}]
    steps.append({"op": "pause", "tag": "gone"})
    for i in range(ROUNDS):
        steps += [{"op": "reset_prefix_cache"}, {**ask, "name": f"after-{i}"}]
    # No node on the engine's host: its saves go to the blocks' homes, one copy each.
    config = connector("", peers=peers)
    try:
        results = run_engine(model, steps, connector_config=config, on_pause=on_pause)
    finally:
        for thread in drains:
            thread.join(60)
        for process in nodes.values():
            process.stop()
    drained = outcome["drain"]
    assert drained.returncode == 0, drained.stderr  # type: ignore[attr-defined]
    assert "handed" in drained.stderr and outcome["c_exit"] == 0  # type: ignore[attr-defined]

    hits = {}
    for before, result in itertools.pairwise(results):
        if result["op"] == "generate" and before["op"] == "reset_prefix_cache":
            lengths = result["prompt_tokens"]
            hits[result["name"]] = hit_fraction(before["counters"], result["counters"], lengths)
            assert all(len(ids) == 8 for ids in result["token_ids"])  # every request answered
    base = hits["base"]
    assert base > 0.8, hits
    for name, value in hits.items():
        assert value >= 0.9 * base, (name, hits)
    # And every answer the engine's own: as from its own prefix cache where the pool gave
    # the whole prefix (during the handoff and after it too), as computed where it missed.
    generated = [r for r in results if r["op"] == "generate"]
    own = generated[:2]
    answers(own)  # the second came from the engine's own prefix cache
    num_whole = {r["name"]: num_as_own(r, *own) for r in generated[2:]}
    assert num_whole["base"] > 0 and num_whole[f"after-{ROUNDS - 1}"] > 0, num_whole
