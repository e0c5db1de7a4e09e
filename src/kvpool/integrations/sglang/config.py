"""The backend's configuration, read once from SGLang's
``--hicache-storage-backend-extra-config`` (and the ``KVPOOL_*`` environment).

Keys of the extra config (all optional but SGLang's own):

==================  ======================================================  ============
key                 meaning                                                 default
==================  ======================================================  ============
backend_name,       SGLang's, for the dynamic backend (``"kvpool"``,        (required)
module_path,        ``"kvpool.integrations.sglang"``,
class_name          ``"KVPoolStorage"``)
interface_v1        SGLang's: 1 moves pages straight between its host pool  0
                    and the pool's memory (``batch_get_v1``/``_set_v1``)
allocator           SGLang's host pool allocator (``"shm"``: a memfd);       ""
                    kvpool's copies are the same either way
address, access_*,  the client's (see ``kvpool.Client``), as for vLLM's     local node
timeout, use_shm,   connector
verify_reads,
peers, etcd, ...
tenant              isolates one tenant's pages                             ""
transfer_timeout    deadline of one batch of pages, seconds                 10.0
health_*            interval, recover_after, flap_window, max_flaps,        1, 3, 30, 3,
                    max_slow                                                3
==================  ======================================================  ============

An unknown key is refused at start, so that a misspelt one does not silently do nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpool.client.health import HealthPolicy
from kvpool.config import (
    CLIENT_ENV,
    CONNECTOR_ENV,
    ClientConfig,
    client_config_from,
    options_from_env,
)
from kvpool.errors import ConfigError

log = logging.getLogger("kvpool.sglang")

DEFAULT_TRANSFER_TIMEOUT_S = 10.0

# SGLang's own keys of the extra config: read by SGLang, not by kvpool.
SGLANG_KEYS = frozenset(
    {"backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size"}
)
_CLIENT_KEYS = {name for name, _ in CLIENT_ENV.values()} | {"timeout", "connect_timeout"}
_HEALTH_FIELDS = {
    "health_interval": ("interval_s", float),
    "health_recover_after": ("recover_after", int),
    "health_flap_window": ("flap_window_s", float),
    "health_max_flaps": ("max_flaps", int),
    "health_max_slow": ("max_slow", int),
}


@dataclass(frozen=True)
class StorageConfig:
    client: ClientConfig
    tenant: str = ""
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
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
    values = options_from_env(CONNECTOR_ENV, environ)
    client_options: dict[str, object] = {}
    for key, value in (extra or {}).items():
        if key in SGLANG_KEYS:
            continue
        if key in _CLIENT_KEYS:
            client_options[key] = value
        elif key in ("tenant", "transfer_timeout") or key in _HEALTH_FIELDS:
            values[key] = value
        else:
            raise ConfigError(f"unknown kvpool key {key!r} in the HiCache storage extra config")
    # Strings (a boolean, a comma-separated list of peers) are parsed as the environment
    # variables of the same options are.
    client = client_config_from(client_options, environ)
    try:
        health = HealthPolicy(
            **{
                name: parse(values[key])
                for key, (name, parse) in _HEALTH_FIELDS.items()
                if key in values
            }
        )
        config = StorageConfig(
            client=client,
            tenant=str(values.get("tenant", "")),
            transfer_timeout_s=float(
                values.get("transfer_timeout", DEFAULT_TRANSFER_TIMEOUT_S)  # type: ignore[arg-type]
            ),
            health=health,
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid HiCache storage extra config: {exc}") from exc
    return config.validate()
