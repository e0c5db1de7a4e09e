"""The two-level replay (benchmarks/two_level.py) at small scale: engines' prefix caches above
the node's store, on the synthetic agent trace, so that the suite needs no file from outside
the project."""

from __future__ import annotations

import pytest
from benchmarks.trace_models import Trace
from benchmarks.two_level import (
    AUTO_OTHERS_SHARE,
    EAGER,
    EVICTING,
    EngineCache,
    Outcome,
    Setup,
    agent_trace,
    replay_two_level,
)

NUM_REQUESTS = 2000
ENGINE_BLOCKS = 1500  # less than the sessions in flight hold
WINDOW = 50


@pytest.fixture(scope="module")
def trace() -> Trace:
    return agent_trace(NUM_REQUESTS, seed=1)


def one_engine(trace: Trace, save: str) -> Outcome:
    """One engine, and a pool the size of its cache."""
    setup = Setup(1, ENGINE_BLOCKS, ENGINE_BLOCKS, "round-robin", save, "lru", WINDOW)
    return replay_two_level(trace, setup)


def four_engines(trace: Trace, routing: str) -> Outcome:
    """Four engines, ``auto``, and a pool that holds every block."""
    setup = Setup(4, ENGINE_BLOCKS, 20 * ENGINE_BLOCKS, routing, "auto", "lru", WINDOW)
    return replay_two_level(trace, setup)


def test_a_finished_request_leaves_its_last_block_first() -> None:
    cache = EngineCache(3)
    assert cache.serve([1, 2, 3]) == []
    assert cache.serve([4]) == [(3, 2)]  # the leaf, with its parent; its root stays
    assert cache.num_prefix([1, 2, 3]) == 2


def test_the_agent_trace_is_seeded_and_chained(trace: Trace) -> None:
    assert agent_trace(NUM_REQUESTS, seed=1) == trace
    assert agent_trace(NUM_REQUESTS, seed=2) != trace
    parent_of: dict[int, int | None] = {}
    for request in trace.requests:
        assert len(request.hash_ids) == -(-request.input_length // trace.block_tokens)
        for i, block in enumerate(request.hash_ids):
            parent = request.hash_ids[i - 1] if i else None
            assert parent_of.setdefault(block, parent) == parent  # one id, one whole prefix


def test_saving_on_eviction_gives_a_pool_of_the_engines_size_what_eager_duplicates(
    trace: Trace,
) -> None:
    eager = one_engine(trace, "eager")
    evicting = one_engine(trace, "evicting")
    assert eager.engine.token_rate == evicting.engine.token_rate  # the pool is below it
    assert eager.engine.token_rate < 0.85  # the engine evicts what comes back
    assert eager.pool_rate < 0.05  # it mostly holds what the engine holds
    assert evicting.pool_rate > 2 * eager.pool_rate, (evicting.pool_rate, eager.pool_rate)


def test_auto_with_one_engine_saves_on_eviction(trace: Trace) -> None:
    auto = one_engine(trace, "auto")
    assert auto.decisions
    assert {d.mode for d in auto.decisions} == {EVICTING}
    assert all(d.others_share == 0 for d in auto.decisions)


def test_auto_follows_its_rule_with_several_engines(trace: Trace) -> None:
    spread = four_engines(trace, "round-robin")
    assert len(spread.decisions) >= 4
    for d in spread.decisions:
        assert d.mode == (EAGER if d.others_share >= AUTO_OTHERS_SHARE else EVICTING), d
    # Round robin deals a session's calls over every engine: the pool mainly passes on
    # blocks another engine saved.
    num_eager = sum(d.mode == EAGER for d in spread.decisions)
    assert num_eager >= 0.75 * len(spread.decisions)
    # Cache-aware routing keeps a session on its engine: what it loads it saved itself.
    sticky = four_engines(trace, "prefix")
    assert sticky.decisions
    assert all(d.mode == EVICTING for d in sticky.decisions)
