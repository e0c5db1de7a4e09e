"""kvpool: a distributed memory pool for LLM KV cache — store instead of recompute.

The public surface is flat: clients, configuration, keys, and the error hierarchy.
"""

from kvpool.client.aio import AsyncClient
from kvpool.client.client import Client, PoolFuture
from kvpool.client.ops import GetResult, PutResult
from kvpool.config import ClientConfig, NodeConfig
from kvpool.errors import (
    AuthenticationError,
    BadRequest,
    ChecksumMismatch,
    ConfigError,
    ConnectError,
    Forbidden,
    FormatError,
    InternalError,
    KVPoolError,
    LeaseExpired,
    NodeUnavailable,
    NoSpace,
    PoolTimeout,
    ProtocolError,
    QuotaExceeded,
    Status,
    StoreError,
    TooLarge,
    TransportError,
    UnsupportedVersion,
    UsageError,
)
from kvpool.formats import RELEASE
from kvpool.keys import Namespace, block_key, chained_hashes

__version__ = RELEASE

__all__ = [
    "AsyncClient",
    "AuthenticationError",
    "BadRequest",
    "ChecksumMismatch",
    "Client",
    "ClientConfig",
    "ConfigError",
    "ConnectError",
    "Forbidden",
    "FormatError",
    "GetResult",
    "InternalError",
    "KVPoolError",
    "LeaseExpired",
    "Namespace",
    "NoSpace",
    "NodeConfig",
    "NodeUnavailable",
    "PoolFuture",
    "PoolTimeout",
    "ProtocolError",
    "PutResult",
    "QuotaExceeded",
    "Status",
    "StoreError",
    "TooLarge",
    "TransportError",
    "UnsupportedVersion",
    "UsageError",
    "__version__",
    "block_key",
    "chained_hashes",
]
