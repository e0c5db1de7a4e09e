"""The backend's configuration, read once from SGLang's
``--hicache-storage-backend-extra-config`` (and the ``KVPOOL_*`` environment).

Keys of the extra config: SGLang's own (``backend_name``, ``module_path``, ``class_name``:
the dynamic backend, ``"kvpool"``, ``"kvpool.integrations.sglang"``, ``"KVPoolStorage"``;
``interface_v1``: 1 moves pages straight between its host pool and the pool's memory;
``allocator``, ``tp_lcm_size``), which kvpool leaves to SGLang, and kvpool's options,
declared once beside their fields: the client's (:class:`~kvpool.config.ClientConfig`), the
backend's (:class:`StorageConfig`: ``tenant``, ``transfer_timeout``) and the health
policy's (``health_*``); docs/configuration.md lists them, generated from the declarations.
An unknown key is refused at start, so that a misspelt one does not silently do nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.client.health import HealthPolicy
from kvpool.config import DEFAULT_TRANSFER_TIMEOUT_S, ClientConfig, config_from, option
from kvpool.errors import ConfigError

log = logging.getLogger("kvpool.sglang")

# SGLang's own keys of the extra config: read by SGLang, not by kvpool.
SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size"}
)


@dataclass(frozen=True)
class StorageConfig:
    """The backend's own options, beside its client's and its health policy's."""

    client: ClientConfig
    tenant: str = option("", "Isolates one tenant's pages (its namespaces).")
    transfer_timeout_s: float = option(
        DEFAULT_TRANSFER_TIMEOUT_S, "Deadline of one batch of pages, seconds.", parse=float
    )
    health: HealthPolicy = field(default_factory=HealthPolicy)

    def validate(self) -> StorageConfig:
        if self.transfer_timeout_s <= 0:
            raise ConfigError("transfer_timeout must be positive")
        return self

    def describe(self) -> str:
        c = self.client
        return (
            f"address={c.address} timeout={c.timeout_s}s "
            f"transfer_timeout={self.transfer_timeout_s}s verify_reads={c.verify_reads} "
            f"peers={list(c.peers)} etcd={c.etcd or '-'} tenant={self.tenant or '-'} "
            f"auth={'on' if c.access_key else 'off'}"
        )


def storage_config(
    extra: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
) -> StorageConfig:
    """The effective configuration: defaults, then ``KVPOOL_*`` variables, then the extra
    config's keys."""
    return config_from(
        StorageConfig,
        extra,
        environ,
        where="HiCache storage extra config",
        ignore=SGLANG_KEYS,
    )
