"""Time bounds: the node's lease limits (how long anything may hold the node's memory), how
long a node that failed is skipped, and how a call's time budget is shared out; and the
node's :class:`Budgets` (how much a tenant, or a peer that has not authenticated, may cost
it).

The owner of a resource clamps what callers ask for.  The node grants a pin, a reservation,
a write area or a prefetch hold at most its :class:`LeaseLimits` bound, whatever a client
requests (``KVPOOL_PIN_LEASE`` and ``KVPOOL_RESERVE_LEASE`` set two of them), so they bound
what a dead or stalled client can hold.  A client that asks for nothing (0) gets the
default.  The node announces its limits in its Welcome
(:class:`kvpool.protocol.messages.Limits`), so a client need keep no copy of its own.

The node's store applies them through its lease ledger (:mod:`kvpool.store.leases`); the
cool-downs and budgets below are the client's, the router's and the write-through's.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.errors import ConfigError

DEFAULT_PIN_LEASE_S = 10.0
DEFAULT_RESERVE_LEASE_S = 30.0
DEFAULT_HOLD_S = 30.0  # a prefetch hold that names no time
MAX_HOLD_S = 120.0  # the longest a prefetch hold keeps blocks for a queued request
MAX_WAIT_S = 60.0  # the longest a lookup or a read waits on the node for blocks
# How often the node reclaims expired leases.
EXPIRE_INTERVAL_S = 0.25


@dataclass(frozen=True)
class LeaseLimits:
    """The node's one set of lease limits: how long each kind of hold lasts at most without
    its holder renewing or ending it.

    - ``pin_s``: a pin (a reader copying blocks);
    - ``reserve_s``: a reservation or a write area (a writer filling memory);
    - ``hold_s``: a prefetch hold (blocks kept in DRAM for a queued request), and
      ``default_hold_s`` for a hold that names no time;
    - ``wait_s``: how long a lookup or a read may wait for blocks still being written or
      promoted.

    A transfer the node streams itself (a PUT it receives, a GET it sends) holds its pin or
    reservation for at most the same bound, and ends one expiry interval before it: the
    memory never changes hands while the node still writes into it or sends from it.
    """

    pin_s: float = DEFAULT_PIN_LEASE_S
    reserve_s: float = DEFAULT_RESERVE_LEASE_S
    hold_s: float = MAX_HOLD_S
    default_hold_s: float = DEFAULT_HOLD_S
    wait_s: float = MAX_WAIT_S

    def validate(self) -> LeaseLimits:
        if min(self.pin_s, self.reserve_s, self.hold_s) <= EXPIRE_INTERVAL_S:
            raise ConfigError(
                f"lease durations must be longer than {EXPIRE_INTERVAL_S} s "
                f"(pin {self.pin_s} s, reserve {self.reserve_s} s, hold {self.hold_s} s)"
            )
        if not 0 < self.default_hold_s <= self.hold_s:
            raise ConfigError(
                f"the default hold ({self.default_hold_s} s) must be within (0, {self.hold_s}] s"
            )
        if self.wait_s < 0:
            raise ConfigError(f"the longest wait ({self.wait_s} s) cannot be negative")
        return self

    def pin(self, requested_s: float = 0.0) -> float:
        """The pin lease granted for ``requested_s`` (0: the bound)."""
        return _clamp(requested_s, self.pin_s, self.pin_s)

    def reserve(self, requested_s: float = 0.0) -> float:
        """The reservation (or write area) lease granted for ``requested_s`` (0: the bound)."""
        return _clamp(requested_s, self.reserve_s, self.reserve_s)

    def hold(self, requested_s: float = 0.0) -> float:
        """The prefetch hold granted for ``requested_s`` (0: the default hold)."""
        return _clamp(requested_s, self.default_hold_s, self.hold_s)

    def wait(self, requested_s: float) -> float:
        """How long a request that asks to wait ``requested_s`` may wait (0: not at all)."""
        return min(max(requested_s, 0.0), self.wait_s)

    @staticmethod
    def transfer_budget(lease_s: float) -> float:
        """How long a transfer the node streams under a lease of ``lease_s`` may take."""
        return max(lease_s - EXPIRE_INTERVAL_S, EXPIRE_INTERVAL_S / 2)


def _clamp(requested_s: float, default_s: float, bound_s: float) -> float:
    return default_s if requested_s <= 0 else min(requested_s, bound_s)


MiB = 1 << 20
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_STRANGERS = 1024
DEFAULT_MAX_STRANGERS_PER_ADDRESS = 64
DEFAULT_HANDSHAKE_S = 2.0
DEFAULT_IDLE_S = 300.0
DEFAULT_TENANT_BUFFER_BYTES = 128 * MiB
DEFAULT_TENANT_PARKED_KEYS = 65536
DEFAULT_LABEL_CHANGES_PER_S = 1.0
# A frame's metadata may take 4 MiB (kvpool.protocol.frames): a tenant's buffer budget holds
# at least one, beside its connections' read-ahead.
MIN_TENANT_BUFFER_BYTES = 8 * MiB


@dataclass(frozen=True)
class Budgets:
    """What a peer may cost the node: the connections and handshakes of the node as a whole,
    and each tenant's share of what its requests hold (the node's account ledger,
    :mod:`kvpool.store.accounts`, charges and refuses against them).

    - ``max_connections``: authenticated connections at once (remote peers get all but a
      sixteenth, which stays the Unix socket's);
    - ``max_strangers``, ``max_strangers_per_address``: connections still in their
      handshake, in a pool of their own (past either cap the oldest goes, not a tenant),
      each cut at ``handshake_s``;
    - ``idle_s``: an authenticated connection that sends nothing this long is closed (its
      client reconnects on its next call);
    - per tenant: ``buffer_bytes`` of receive buffers (its connections' read-ahead and the
      frames being served), ``parked_keys`` named by its lookups that wait, and
      ``label_changes_per_s`` namespace label changes (each one a journal record; bursts
      up to one per namespace it may have).
    """

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_strangers: int = DEFAULT_MAX_STRANGERS
    max_strangers_per_address: int = DEFAULT_MAX_STRANGERS_PER_ADDRESS
    handshake_s: float = DEFAULT_HANDSHAKE_S
    idle_s: float = DEFAULT_IDLE_S
    buffer_bytes: int = DEFAULT_TENANT_BUFFER_BYTES
    parked_keys: int = DEFAULT_TENANT_PARKED_KEYS
    label_changes_per_s: float = DEFAULT_LABEL_CHANGES_PER_S

    @property
    def local_reserved(self) -> int:
        """Authenticated slots remote peers never take: the Unix socket's engines stay
        served whatever arrives over the network."""
        return max(1, self.max_connections // 16)

    def validate(self) -> Budgets:
        if self.max_connections < 2:
            raise ConfigError("--max-connections must be at least 2")
        if not 1 <= self.max_strangers_per_address <= self.max_strangers:
            raise ConfigError(
                "--max-strangers-per-address must be 1 to --max-strangers "
                f"({self.max_strangers_per_address}, {self.max_strangers})"
            )
        if not 0 < self.handshake_s <= 60 or self.idle_s <= 0:
            raise ConfigError("--handshake-timeout must be 0-60 s, --idle-timeout positive")
        if self.buffer_bytes < MIN_TENANT_BUFFER_BYTES:
            raise ConfigError(
                f"--tenant-buffer-bytes must be at least {MIN_TENANT_BUFFER_BYTES >> 20} MiB "
                "(one frame's metadata and a connection's read-ahead)"
            )
        if self.parked_keys < 0 or self.label_changes_per_s <= 0:
            raise ConfigError("--tenant-parked-keys must be >= 0, --tenant-label-rate positive")
        return self


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
