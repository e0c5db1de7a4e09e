"""The one place where a pool failure becomes a miss.

An engine never fails because of the pool: whatever a pool call raises, the blocks it was
to move are missed (a load's are recomputed, a save's stay computable), and the failure is
data, the reason a caller reports.  :meth:`PoolGuard.call` wraps a pool call:

1. A pool error (:class:`~kvpool.errors.KVPoolError`: a timeout, a node that is down, a
   refused call) is reported to the health monitor (:mod:`kvpool.client.health`, the
   client's), which marks the pool unhealthy (at once, or after a run of slow calls), so
   that callers skip the pool until it recovers.
2. Anything else is a bug, in the copies or in the caller's data: it is logged with its
   traceback, and the pool's health is left as it is.
3. A call that returns is reported as a call (it ends a run of slow ones).

Without a health monitor (the EMS SDK, whose connector keeps its own), rule 1 only turns the
failure into a reason, and rule 3 reports nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvpool.client.health import HealthMonitor
from kvpool.errors import KVPoolError


@dataclass
class Outcome:
    """What a guarded call came to: ``reason`` is empty when it succeeded."""

    reason: str = ""

    @property
    def failed(self) -> bool:
        return bool(self.reason)


class PoolGuard:
    def __init__(self, health: HealthMonitor | None, log: logging.Logger):
        self.health = health
        self.log = log

    @property
    def is_healthy(self) -> bool:
        """Whether the pool is worth a call now (always, without a health monitor)."""
        return self.health is None or self.health.is_healthy

    @contextmanager
    def call(self, what: str) -> Iterator[Outcome]:
        """Run the block as one pool call named ``what``; a failure ends the block and
        becomes the outcome's reason (see the module's rules), never an exception."""
        outcome = Outcome()
        try:
            yield outcome
        except Exception as exc:
            outcome.reason = self.failed(exc, what)
        else:
            if self.health is not None:
                self.health.report_call()

    def failed(self, exc: Exception, what: str) -> str:
        """Record ``exc``, raised by the pool call ``what``; the reason to report."""
        if isinstance(exc, KVPoolError):
            if self.health is not None:
                self.health.report_failure(exc)
        else:
            self.log.error("kvpool: %s failed", what, exc_info=exc)
        return f"{type(exc).__name__}: {exc}"
