"""The one cool-down policy for nodes that failed (kvpool.cluster.cooldown)."""

from __future__ import annotations

import time

from kvpool.cluster.cooldown import Cooldowns


def test_a_failed_node_is_down_for_the_cooldown_then_back():
    down = Cooldowns(0.2)
    assert not down.is_down("a")
    down.failed("a")
    assert down.is_down("a")
    assert not down.is_down("b")
    assert not down.is_down("a", now=time.monotonic() + 0.3)


def test_a_slow_node_is_down_only_after_max_slow_answers_in_a_row():
    down = Cooldowns(10.0, max_slow=3)
    down.slow("a")
    down.slow("a")
    assert not down.is_down("a")
    down.answered("a")  # an answer in time ends the run
    down.slow("a")
    down.slow("a")
    assert not down.is_down("a")
    down.slow("a")
    assert down.is_down("a")


def test_with_one_slow_answer_allowed_a_slow_node_is_down_at_once():
    down = Cooldowns(10.0)
    down.slow("a")
    assert down.is_down("a")
