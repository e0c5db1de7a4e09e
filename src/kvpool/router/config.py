"""The router's configuration: flags, or a TOML / JSON file with the same names.

A file::

    policy = "cache_aware"        # round_robin | least_load | session | cache_aware
    tokenizer = "/models/llama"   # the model's tokenizer (cache_aware, and prefetch)
    block_size = 16
    [[engines]]
    url = "https://10.0.0.2:8000" # http:// only on loopback, unless insecure = true
    role = "both"                 # both | prefill | decode
    node = "10.0.0.2:9400"        # the kvpool node on the engine's host
    tenants = ["alpha"]           # with a tenants file: the one tenant it serves

Engines given as flags read ``URL[,role=...][,node=...][,tenants=alpha]``; at run time
``POST /admin/engines`` takes the same fields as JSON.  Every engine, whichever way it came,
passes :func:`check_engine`.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.config import Setting, check_plaintext, check_plaintext_endpoint, parse_size
from kvpool.errors import ConfigError
from kvpool.tenants import TenantsFile

from .engines import ROLES, Engine


@dataclass
class RouterSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round_robin"
    prefill_policy: str = "least_load"
    tokenizer: str = ""
    model: str = ""
    block_size: int = 16
    hash_algo: str = "sha256"
    cache_weight: float = 1.0
    load_weight: float = 0.5
    max_load_gap: float = 4.0
    health_interval: float = 1.0
    max_attempts: int = 3  # tries of one request (on other engines, or the only one)
    read_timeout: float = 300.0  # an engine silent this long (even before its first byte) failed
    connect_timeout: float = 2.0
    prefill_timeout: float = 120.0
    models_timeout: float = 10.0
    drain_timeout: float = 60.0  # a removed engine's requests are waited for this long
    session_header: str = "x-session-id"
    # With a tokenizer: once an engine is chosen, its node starts bringing the prompt's
    # blocks held only in lower tiers into DRAM, held this long for it (0: no prefetch).
    prefetch_hold: float = 60.0
    # HTTPS (certificate and key files, reloaded on change); plaintext only on loopback
    # unless insecure, for the router's listener and for the engines it reaches.
    tls_cert: str = ""
    tls_key: str = ""
    insecure: bool = False
    # A tenants file (kvpool.tenants): requests must carry a tenant's credential; the
    # router reaches the nodes as the cluster (KVPOOL_ACCESS_ID / KVPOOL_ACCESS_KEY).
    tenants: str = ""
    # A completion's body: at most this many bytes (a long prompt is a few MiB of text),
    # read and parsed for at most ``max_parsing`` requests of one tenant at a time (of
    # everyone's, without tenants), off the event loop, each body within
    # ``body_timeout`` seconds.
    max_body_bytes: int = 4 << 20
    max_parsing: int = 4
    body_timeout: float = 30.0
    engines: list[Engine] = field(default_factory=list)


ENGINE_FIELDS = ("url", "role", "node", "name", "tenants")


def parse_engine(spec: str) -> Engine:
    """``URL`` or ``URL,role=prefill,node=host:port,tenants=alpha`` (several tenants:
    ``alpha+beta``)."""
    url, *options = [part.strip() for part in spec.split(",") if part.strip()]
    values: dict[str, object] = {"url": url}
    for option in options:
        name, sep, value = option.partition("=")
        if not sep or name == "url" or name not in ENGINE_FIELDS:
            raise ConfigError(
                f"engine option {option!r}: use role=..., node=..., name=... or tenants=..."
            )
        values[name] = value.split("+") if name == "tenants" else value
    return engine_from(values)


def engine_from(spec: dict[str, object]) -> Engine:
    """An engine from its fields (a flag, a config file's ``[[engines]]``, or the JSON of
    ``POST /admin/engines``); :class:`ConfigError` names what is wrong."""
    unknown = set(spec) - set(ENGINE_FIELDS)
    if unknown:
        raise ConfigError(f"unknown engine field(s) {sorted(unknown)}: {', '.join(ENGINE_FIELDS)}")
    url = spec.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"engine URL {url!r} must start with http:// or https://")
    role = spec.get("role", "both")
    if role not in ROLES:
        raise ConfigError(f"engine role {role!r}: one of {', '.join(ROLES)}")
    tenants = spec.get("tenants", [])
    if isinstance(tenants, str):
        tenants = [tenants]
    if not isinstance(tenants, list) or not all(isinstance(t, str) and t for t in tenants):
        raise ConfigError("engine tenants: a list of tenant names")
    return Engine(
        url=url,
        role=role,
        node=str(spec.get("node", "")),
        name=str(spec.get("name", "")),
        tenants=frozenset(tenants),
    )


def check_engine(engine: Engine, settings: RouterSettings, tenants: TenantsFile | None) -> None:
    """Whether the router may send requests to ``engine``: the one place that decides, for
    the engines it starts with and those added at run time (:class:`ConfigError` if not).

    - Prompts and answers cross the hop to the engine: ``http://`` only to an engine on
      loopback, unless ``--insecure`` (the router's own listener follows the same rule).
    - With a tenants file, an engine serves exactly one tenant, named in the file.  An
      engine saves and loads the pool under the one credential its connector was given,
      and vLLM's GPU prefix cache is shared by every request it runs: an engine shared by
      two tenants would give each the other's KV (and the timing of its prompts).  kvpool's
      connector has no credential per request, so a shared engine is refused.
    - Without a tenants file there are no tenants to tell apart: ``tenants`` is refused
      rather than silently ignored.
    """
    check_plaintext_endpoint(engine.url, settings.insecure, "an engine")
    if tenants is None:
        if engine.tenants:
            raise ConfigError(
                f"engine {engine.url}: tenants need the router's --tenants file (which "
                "authenticates each request's tenant)"
            )
        return
    if len(engine.tenants) != 1:
        raise ConfigError(
            f"engine {engine.url}: with --tenants, an engine serves exactly one tenant "
            f"(tenants=NAME), not {len(engine.tenants)}: its pool credential and its GPU "
            "prefix cache are shared by every request it runs"
        )
    unknown = sorted(engine.tenants - set(tenants.tenants))
    if unknown:
        raise ConfigError(f"engine {engine.url}: no tenant {unknown[0]!r} in the tenants file")


def load_file(path: str) -> dict[str, Any]:
    text = Path(path).read_text()
    try:
        data = json.loads(text) if path.endswith(".json") else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of settings")
    return data


def settings_from(
    file: str | None, overrides: dict[str, Any], engine_specs: list[str]
) -> RouterSettings:
    values: dict[str, Any] = load_file(file) if file else {}
    engines = [
        engine_from(e) if isinstance(e, dict) else parse_engine(str(e))
        for e in values.pop("engines", [])
    ]
    engines += [parse_engine(spec) for spec in engine_specs]
    known = set(RouterSettings.__dataclass_fields__) - {"engines"}
    for name in values:
        if name not in known:
            raise ConfigError(f"unknown router setting {name!r}")
    values.update({k: v for k, v in overrides.items() if v is not None})
    settings = RouterSettings(**values, engines=engines)
    if not settings.engines:
        raise ConfigError("no engines: give --engine URL (repeatable) or a config file")
    if settings.policy == "cache_aware" and not settings.tokenizer:
        raise ConfigError("the cache_aware policy needs --tokenizer (the model's tokenizer)")
    if not 0 <= settings.prefetch_hold <= 600:
        raise ConfigError("--prefetch-hold must be 0-600 seconds")
    if not 1024 <= settings.max_body_bytes <= 32 << 20:
        raise ConfigError("--max-body must be 1 KiB to 32 MiB")
    if settings.max_parsing < 1 or settings.body_timeout <= 0:
        raise ConfigError("--max-parsing must be at least 1, --body-timeout positive")
    if bool(settings.tls_cert) != bool(settings.tls_key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    check_plaintext(settings.host, bool(settings.tls_cert), settings.insecure, "the router")
    return settings


# The settings `kvpool router` takes as flags (of RouterSettings' fields, by key), declared
# once: its --help and the configuration reference come from them.
ROUTER_SETTINGS = (
    Setting("host", "--host", "Listen address."),
    Setting("port", "--port", "Listen port.", int),
    Setting("policy", "--policy", "round_robin, least_load, session or cache_aware."),
    Setting(
        "tokenizer", "--tokenizer", "The model's tokenizer (cache_aware routing, and prefetch)."
    ),
    Setting(
        "prefetch_hold",
        "--prefetch-hold",
        "With --tokenizer: the chosen engine's node brings the prompt's blocks up from its "
        "lower tiers and holds them this many seconds (0: no prefetch).",
        float,
    ),
    Setting("model", "--model", "The model name the engines' pool namespaces carry."),
    Setting("block_size", "--block-size", "The engines' KV block size.", int),
    Setting("cache_weight", "--cache-weight", "cache_aware: weight of the prefix share.", float),
    Setting("load_weight", "--load-weight", "cache_aware: weight of the load share.", float),
    Setting(
        "read_timeout",
        "--read-timeout",
        "Seconds an engine may stay silent before it counts as failed.",
        float,
    ),
    Setting("tenants", "--tenants", "A tenants file: requests carry ID:KEY as a bearer token."),
    Setting(
        "max_body_bytes",
        "--max-body",
        "The largest request body, e.g. 4MiB (the credential is checked before it is read).",
        parse_size,
    ),
    Setting(
        "max_parsing",
        "--max-parsing",
        "Request bodies one tenant may have read and parsed at once.",
        int,
    ),
    Setting("tls_cert", "--tls-cert", "TLS certificate (PEM): HTTPS."),
    Setting("tls_key", "--tls-key", "Its private key (PEM)."),
    Setting(
        "insecure",
        "--insecure",
        "Accept plaintext off loopback (the router's port, and http:// engines).",
        is_switch=True,
    ),
)
