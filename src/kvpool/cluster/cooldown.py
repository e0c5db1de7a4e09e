"""Nodes that failed lately, left alone for a while: the one cool-down policy of the cluster
client's fan-out, the daemon's write-through and the router's prefix lookups.

A node that fails a call (refused, unreachable, broken) is *down* for ``cooldown_s``: callers
skip it, and its keys are misses, instead of waiting on it again.  A node that is only slow
(it answered after the caller's deadline) is marked down after ``max_slow`` slow answers in a
row, so that one busy moment of a host does not take it out; an answer in time resets the
count.  Times come from ``time.monotonic``.  Not thread-safe by itself: each dictionary
update is atomic in CPython, and a lost update only shortens or lengthens one cool-down.
"""

from __future__ import annotations

import time


class Cooldowns:
    """Which nodes are down, and until when."""

    def __init__(self, cooldown_s: float, max_slow: int = 1):
        self.cooldown_s = cooldown_s
        self.max_slow = max_slow
        self._down_until: dict[str, float] = {}
        self._num_slow: dict[str, int] = {}

    def is_down(self, node: str, now: float | None = None) -> bool:
        """Whether ``node`` is in its cool-down."""
        now = time.monotonic() if now is None else now
        return self._down_until.get(node, 0.0) > now

    def failed(self, node: str) -> None:
        """``node`` failed a call: it is down from now for the cool-down."""
        self._down_until[node] = time.monotonic() + self.cooldown_s
        self._num_slow[node] = 0

    def slow(self, node: str) -> None:
        """``node`` did not answer in time: down once that happened ``max_slow`` times in a
        row."""
        num_slow = self._num_slow.get(node, 0) + 1
        if num_slow >= self.max_slow:
            self.failed(node)
        else:
            self._num_slow[node] = num_slow

    def answered(self, node: str) -> None:
        """``node`` answered in time: its run of slow answers is over."""
        self._num_slow[node] = 0
