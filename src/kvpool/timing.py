"""The one lease-and-timeout policy: how long pins and reservations last, how long a node
that failed is skipped, and how a call's time budget is shared out.

The owner of a resource clamps what callers ask for: the node grants a pin or a
reservation at most its :class:`LeasePolicy` bound, whatever lease a client requests, so
``KVPOOL_PIN_LEASE`` and ``KVPOOL_RESERVE_LEASE`` bound what a dead or stalled client can
hold.  A client that asks for nothing (0) gets the bound.

Every other module takes these values from here, never from constants of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import ConfigError

DEFAULT_PIN_LEASE_S = 10.0
DEFAULT_RESERVE_LEASE_S = 30.0
# How often the node reclaims expired pins and reservations.
EXPIRE_INTERVAL_S = 0.25


@dataclass(frozen=True)
class LeasePolicy:
    """How long a pin or a reservation lasts without its holder.

    A transfer the node streams itself (a PUT it receives, a GET it sends) holds its pin or
    reservation for at most the same bound, and ends one expiry interval before it: the
    memory never changes hands while the node still writes into it or sends from it.
    """

    pin_s: float = DEFAULT_PIN_LEASE_S
    reserve_s: float = DEFAULT_RESERVE_LEASE_S

    def validate(self) -> LeasePolicy:
        if self.pin_s <= EXPIRE_INTERVAL_S or self.reserve_s <= EXPIRE_INTERVAL_S:
            raise ConfigError(
                f"lease durations must be longer than {EXPIRE_INTERVAL_S} s "
                f"(pin {self.pin_s} s, reserve {self.reserve_s} s)"
            )
        return self

    def pin(self, requested_s: float = 0.0) -> float:
        """The pin lease granted for ``requested_s`` (0: the bound)."""
        return _clamp(requested_s, self.pin_s)

    def reserve(self, requested_s: float = 0.0) -> float:
        """The reservation lease granted for ``requested_s`` (0: the bound)."""
        return _clamp(requested_s, self.reserve_s)

    @staticmethod
    def transfer_budget(lease_s: float) -> float:
        """How long a transfer the node streams under a lease of ``lease_s`` may take."""
        return max(lease_s - EXPIRE_INTERVAL_S, EXPIRE_INTERVAL_S / 2)


def _clamp(requested_s: float, bound_s: float) -> float:
    return bound_s if requested_s <= 0 else min(requested_s, bound_s)


# Cool-downs: how long a node that failed is left alone.
CLIENT_NODE_DOWN_S = 0.5  # a cluster client skips a node that failed a call
WRITE_THROUGH_DOWN_S = 2.0  # a daemon skips a home node that failed a write-through
ROUTER_NODE_DOWN_S = 1.0  # the router skips a pool node it could not ask
# Budgets.
MIN_FAIR_BUDGET_S = 0.05  # a node is marked down only if its call had at least this long
MIN_SECOND_ROUND_S = 0.01  # a read asks non-home nodes only with this much time left
ROUTER_MAX_SLOW_ANSWERS = 3  # slow pool answers in a row before the router skips a node
ROUTER_LOOKUP_BUDGET_S = 1.0  # the most a request waits on the pool to be placed
WRITE_THROUGH_TIMEOUT_S = 5.0  # one write-through batch to one home node
