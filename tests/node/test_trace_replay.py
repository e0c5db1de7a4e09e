"""A Mooncake-format trace replayed against a real node (benchmarks/traces.py, at small
scale): the node's hit rate under ``--eviction lru`` is the in-process LRU's of the same
capacity, and every other policy does at least as well.

The trace is synthetic (benchmarks/trace_models.synthetic_trace: conversations shaped like
Mooncake's published trace), so that the suite needs no file from outside the project.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmarks.trace_models import Trace, lru, synthetic_trace
from benchmarks.traces import replay_node

from kvpool.config import EVICTION_POLICIES

NUM_REQUESTS = 1500
CAPACITY_BLOCKS = 600


@pytest.fixture(scope="module")
def trace() -> Trace:
    return synthetic_trace(NUM_REQUESTS, seed=3)


@pytest.fixture(scope="module")
def lru_rate(trace: Trace) -> float:
    return lru(trace, CAPACITY_BLOCKS).token_rate


def test_a_node_under_lru_hits_what_an_lru_of_its_capacity_hits(
    trace: Trace, lru_rate: float, run_dir: Path
) -> None:
    node = replay_node(trace, CAPACITY_BLOCKS, "lru", str(run_dir))
    assert 0.05 < lru_rate < 0.5  # the capacity is one where eviction matters
    assert abs(node["tokens"] - lru_rate) <= 0.005, (node["tokens"], lru_rate)
    assert node["held_blocks"] <= CAPACITY_BLOCKS


@pytest.mark.parametrize("policy", [p for p in EVICTION_POLICIES if p != "lru"])
def test_every_other_policy_hits_at_least_as_much_as_lru(
    trace: Trace, lru_rate: float, run_dir: Path, policy: str
) -> None:
    node = replay_node(trace, CAPACITY_BLOCKS, policy, str(run_dir))
    assert node["tokens"] >= lru_rate, (node["tokens"], lru_rate)
