"""The one exception hierarchy of kvpool, and the wire status codes that map onto it.

::

    KVPoolError
    ├── ConfigError                  bad configuration, refused at start
    │   └── FormatError              a file of a format this release does not read
    ├── ProtocolError                a peer broke the wire protocol
    │   ├── UnsupportedVersion       handshake: no common protocol version
    │   ├── AuthenticationError      handshake: wrong access id or key
    │   ├── BadRequest               malformed frame or message
    │   ├── TooLarge                 a size or count over its bound
    │   └── Forbidden                the connection's identity may not do this
    ├── TransportError               the pool could not be reached in time
    │   ├── ConnectError             connecting failed
    │   ├── PoolTimeout              a deadline passed
    │   └── NodeUnavailable          the node closed, restarts or shuts down
    └── StoreError                   the store refused an operation
        ├── NoSpace                  the arena is full of pinned or reserved blocks
        │   └── QuotaExceeded        a tenant's quota is full of its own unevictable blocks
        ├── LeaseExpired             a pin or reservation outlived its lease
        ├── ChecksumMismatch         bytes do not match their checksum
        └── InternalError            the server hit a bug; it keeps serving

    UsageError (not a KVPoolError)   a programmer mistake in calling the SDK

Expected outcomes are values, not exceptions: a miss, an existing key, a pending key and a
refused admission come back as :class:`Status` values per key.  Each error status has
exactly one exception class (``Status.error_class``), and ``error_for_status`` is the one
place that turns a wire status into an exception.
"""

from __future__ import annotations

import enum


class KVPoolError(Exception):
    """Base class of every error kvpool raises on purpose."""

    def __init__(self, message: str, *, node: str | None = None, key: bytes | None = None):
        self.node = node
        self.key = key
        context = []
        if node:
            context.append(f"node={node}")
        if key is not None:
            context.append(f"key={key.hex()[:32]}")
        super().__init__(f"{message} ({', '.join(context)})" if context else message)


class ConfigError(KVPoolError):
    """A configuration value is invalid; raised before anything starts."""


class FormatError(ConfigError):
    """A node's file is of a format version this release does not read, or its version
    stamp is damaged: refused at start (:mod:`kvpool.formats`)."""


class ProtocolError(KVPoolError):
    """A peer sent something that breaks the wire protocol."""


class UnsupportedVersion(ProtocolError):
    """The peers share no protocol version."""


class AuthenticationError(ProtocolError):
    """The access id or key was refused."""


class BadRequest(ProtocolError):
    """A frame or message is malformed."""


class TooLarge(ProtocolError):
    """A size or count exceeds its bound."""


class Forbidden(ProtocolError):
    """The connection's identity may not do this (e.g. a tenant asking for the arena)."""


class TransportError(KVPoolError):
    """The pool could not be reached, or did not answer in time."""


class ConnectError(TransportError):
    """Connecting to a node failed."""


class PoolTimeout(TransportError):
    """An operation ran past its deadline."""


class NodeUnavailable(TransportError):
    """The node closed the connection, is restarting or shutting down."""


class StoreError(KVPoolError):
    """The store refused an operation."""


class NoSpace(StoreError):
    """No memory can be freed: what is left is pinned or being written."""


class QuotaExceeded(NoSpace):
    """The tenant's quota is full of its own blocks that cannot be evicted."""


class LeaseExpired(StoreError):
    """A pin or reservation was used after its lease expired."""


class ChecksumMismatch(StoreError):
    """A block's bytes do not match its checksum; the block is never served."""


class InternalError(StoreError):
    """The server failed unexpectedly while serving a request (it stays up)."""


class UsageError(Exception):
    """The SDK was called wrongly (a bug in the caller, not a pool condition)."""


class Status(enum.IntEnum):
    """Per-request and per-key status codes on the wire."""

    OK = 0
    NOT_FOUND = 1  # a miss: a value, not an error
    EXISTS = 2  # a put of a key that is already stored: a value
    PENDING = 3  # the key is being written: a value
    REFUSED = 4  # admission refused (e.g. a block larger than the arena): a value
    NO_SPACE = 10
    LEASE_EXPIRED = 11
    CHECKSUM_MISMATCH = 12
    INTERNAL = 13
    OVER_QUOTA = 14  # the tenant's quota is full of its own unevictable blocks
    BAD_REQUEST = 20
    TOO_LARGE = 21
    UNSUPPORTED_VERSION = 22
    UNAUTHORIZED = 23
    FORBIDDEN = 24
    UNAVAILABLE = 30

    @property
    def is_error(self) -> bool:
        return self >= Status.NO_SPACE

    @property
    def error_class(self) -> type[KVPoolError] | None:
        return _STATUS_TO_ERROR.get(self)


# Each wire code's status (a request's statuses decoded together: ``Status(code)`` per key
# cost ~0.5 µs each).
STATUS_OF_CODE: dict[int, Status] = {int(status): status for status in Status}

_STATUS_TO_ERROR: dict[Status, type[KVPoolError]] = {
    Status.NO_SPACE: NoSpace,
    Status.LEASE_EXPIRED: LeaseExpired,
    Status.CHECKSUM_MISMATCH: ChecksumMismatch,
    Status.INTERNAL: InternalError,
    Status.OVER_QUOTA: QuotaExceeded,
    Status.FORBIDDEN: Forbidden,
    Status.BAD_REQUEST: BadRequest,
    Status.TOO_LARGE: TooLarge,
    Status.UNSUPPORTED_VERSION: UnsupportedVersion,
    Status.UNAUTHORIZED: AuthenticationError,
    Status.UNAVAILABLE: NodeUnavailable,
}

_ERROR_TO_STATUS: dict[type[KVPoolError], Status] = {v: k for k, v in _STATUS_TO_ERROR.items()}


def error_for_status(
    status: int, message: str = "", *, node: str | None = None, key: bytes | None = None
) -> KVPoolError:
    """The exception for an error status received from ``node``."""
    try:
        code = Status(status)
    except ValueError:
        return ProtocolError(f"unknown status code {status}: {message}", node=node, key=key)
    cls = code.error_class or ProtocolError
    return cls(message or code.name.lower().replace("_", " "), node=node, key=key)


def status_for_error(exc: BaseException) -> Status:
    """The wire status that reports ``exc`` to a peer."""
    for cls in type(exc).__mro__:
        if cls in _ERROR_TO_STATUS:
            return _ERROR_TO_STATUS[cls]
    if isinstance(exc, ProtocolError):
        return Status.BAD_REQUEST
    return Status.INTERNAL
