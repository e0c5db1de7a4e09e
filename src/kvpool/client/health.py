"""Whether the pool is usable right now, so that an engine never waits on a pool that is
down: it reports misses and recomputes instead.

Rules:
- Fail fast: one failed pool call (or probe) makes the monitor unhealthy at once, but a
  slow one (:class:`~kvpool.errors.PoolTimeout`: a busy host, not a dead pool) only after
  ``max_slow`` in a row; a call that succeeds in between ends the run.
- Recover slowly: a background probe runs every ``interval_s``; ``recover_after``
  consecutive successful probes make it healthy again.
- Flapping blocks recovery: after ``max_flaps`` failures that each ended a healthy period
  within ``flap_window_s``, the monitor stays unhealthy until that window has passed
  without such a failure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.config import option
from kvpool.errors import PoolTimeout

log = logging.getLogger("kvpool.health")

DEFAULT_INTERVAL_S = 1.0
DEFAULT_RECOVER_AFTER = 3
DEFAULT_FLAP_WINDOW_S = 30.0
DEFAULT_MAX_FLAPS = 3
DEFAULT_MAX_SLOW = 3


@dataclass(frozen=True)
class HealthPolicy:
    """The rules' numbers (see the module's notes); options of every engine adapter
    (``health_*`` keys and ``KVPOOL_HEALTH_*`` variables)."""

    interval_s: float = option(
        DEFAULT_INTERVAL_S,
        "Seconds between the health probes of an unhealthy pool.",
        key="health_interval",
        parse=float,
    )
    recover_after: int = option(
        DEFAULT_RECOVER_AFTER,
        "Successful probes in a row that make the pool healthy again.",
        key="health_recover_after",
        parse=int,
    )
    flap_window_s: float = option(
        DEFAULT_FLAP_WINDOW_S,
        "Seconds in which health_max_flaps failures block recovery (flapping).",
        key="health_flap_window",
        parse=float,
    )
    max_flaps: int = option(
        DEFAULT_MAX_FLAPS,
        "Failures within health_flap_window that keep the pool unhealthy.",
        key="health_max_flaps",
        parse=int,
    )
    max_slow: int = option(
        DEFAULT_MAX_SLOW,
        "Timed-out calls in a row (a busy host) that make the pool unhealthy.",
        key="health_max_slow",
        parse=int,
    )


class HealthMonitor:
    def __init__(
        self,
        probe: Callable[[], object],
        policy: HealthPolicy | None = None,
        *,
        name: str = "pool",
        clock: Callable[[], float] = time.monotonic,
        on_thread_start: Callable[[], None] | None = None,
    ):
        self.probe = probe
        self.on_thread_start = on_thread_start
        self.policy = policy or HealthPolicy()
        self.name = name
        self.clock = clock
        self._healthy = True
        self._successes = 0
        self._flaps: deque[float] = deque()
        self._slow_in_a_row = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_failures = 0

    @property
    def is_healthy(self) -> bool:
        return self._healthy

    def report_failure(self, reason: object = "") -> None:
        with self._lock:
            self.num_failures += 1
            self._successes = 0
            if isinstance(reason, PoolTimeout) and self._healthy:
                self._slow_in_a_row += 1
                if self._slow_in_a_row < self.policy.max_slow:
                    return
            self._slow_in_a_row = 0
            if self._healthy:
                self._healthy = False
                self._flaps.append(self.clock())
                log.warning(
                    "%s unhealthy: %s; engines recompute until it recovers", self.name, reason
                )

    def report_call(self) -> None:
        """A pool call succeeded: it ends a run of slow ones."""
        self._slow_in_a_row = 0

    def report_success(self) -> None:
        with self._lock:
            self._slow_in_a_row = 0
            if self._healthy:
                return
            self._successes += 1
            now = self.clock()
            while self._flaps and now - self._flaps[0] > self.policy.flap_window_s:
                self._flaps.popleft()
            flapping = len(self._flaps) >= self.policy.max_flaps
            if self._successes >= self.policy.recover_after and not flapping:
                self._healthy = True
                self._successes = 0
                log.warning("%s healthy again", self.name)

    @property
    def is_flapping(self) -> bool:
        now = self.clock()
        recent = [t for t in self._flaps if now - t <= self.policy.flap_window_s]
        return len(recent) >= self.policy.max_flaps

    def check_once(self) -> bool:
        try:
            self.probe()
        except Exception as exc:
            self.report_failure(exc)
        else:
            self.report_success()
        return self._healthy

    def start(self) -> HealthMonitor:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"kvpool-health-{self.name}", daemon=True
            )
            self._thread.start()
        return self

    def _run(self) -> None:
        if self.on_thread_start is not None:
            self.on_thread_start()
        while not self._stop.wait(self.policy.interval_s):
            self.check_once()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.policy.interval_s + 5)
            self._thread = None
