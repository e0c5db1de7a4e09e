"""Typed configuration of the node daemon and the client, and the one place that reads
``KVPOOL_*`` environment variables.

Configuration objects are frozen dataclasses with named default constants; ``validate()``
raises :class:`~kvpool.errors.ConfigError`, never ``assert``.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import re
import socket
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np

from kvpool.errors import ConfigError
from kvpool.limits import Budgets, LeaseLimits

C = TypeVar("C")

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

DEFAULT_NODE_NAME = "default"
DEFAULT_RUN_DIR = "/dev/shm/kvpool"
DEFAULT_TCP_PORT = 9400
DEFAULT_ADMIN_PORT = 9401
DEFAULT_MEMORY_BYTES = 1 * GiB
DEFAULT_HIGH_WATERMARK = 0.95
DEFAULT_LOW_WATERMARK = 0.90
DEFAULT_EVICTION = "lru"
# The eviction policies a node can run (kvpool.store.eviction's EVICTION_POLICIES names them).
EVICTION_POLICIES = ("lru", "learned")
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_TRANSFER_TIMEOUT_S = 10.0  # an engine adapter's load or save (vLLM's, SGLang's)
DEFAULT_CONNECT_TIMEOUT_S = 1.0
DEFAULT_ACCESS_ID = "kvpool"
DEFAULT_ETCD_PREFIX = "/kvpool/nodes/"
DEFAULT_ETCD_TTL_S = 5
DEFAULT_REPLICAS = 1
DEFAULT_OBJECT_STORE_BYTES = 64 * GiB
DEFAULT_OBJECT_REFRESH_S = 2.0
DEFAULT_OBJECT_READ_TIMEOUT_S = 2.0
# Threads a same-host put or get copies with by default, the caller's included.
DEFAULT_COPY_THREADS = min(4, os.cpu_count() or 1)
MAX_COPY_THREADS = 64
DEFAULT_SCRUB_BYTES_S = 64 * MiB  # a 64 GiB arena in about 17 minutes
PAGE_BYTES = 4096
MIN_ARENA_BYTES = 1 * MiB
AREA_SHARE = 8  # a write area (kvpool.store.areas) is at most this fraction of the arena


def pages(num_bytes: int) -> int:
    """How many arena pages a block of ``num_bytes`` takes (at least one)."""
    return max(1, -(-num_bytes // PAGE_BYTES))


def page_bytes(num_bytes: int) -> int:
    """The arena bytes a block of ``num_bytes`` takes: whole pages, at least one."""
    return pages(num_bytes) * PAGE_BYTES


def pages_of(sizes: np.ndarray) -> np.ndarray:
    """:func:`pages` of each of an array of sizes (int64): a request's blocks at once."""
    return np.maximum(1, -(-sizes // PAGE_BYTES))


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(text: str | int) -> int:
    """``"4GiB"``, ``"512M"``, ``"1.5g"`` or ``4096`` as a number of bytes (binary units)."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(text)
    if not match:
        raise ConfigError(f"not a size: {text!r} (try 4GiB, 512MiB or a number of bytes)")
    number, unit, _ = match.groups()
    return int(float(number) * (1 << (10 * _SIZE_UNITS[unit.lower()])))


def format_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Address:
    """Where a node listens: a Unix socket path or a TCP host and port."""

    kind: str  # "unix" | "tcp"
    path: str = ""
    host: str = ""
    port: int = 0

    @classmethod
    def parse(cls, text: str) -> Address:
        """``unix:/path``, ``unix:///path``, ``tcp://host:port`` or ``host:port``."""
        text = text.strip()
        if text.startswith("unix:"):
            path = text[len("unix:") :]
            if path.startswith("//"):
                path = path[2:]
            if not path:
                raise ConfigError(f"empty unix socket path in {text!r}")
            return cls("unix", path=path)
        if text.startswith("tcp://"):
            text = text[len("tcp://") :]
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"not an address: {text!r} (use host:port or unix:/path)")
        host = host.strip("[]") or "127.0.0.1"
        return cls("tcp", host=host, port=int(port))

    def __str__(self) -> str:
        return f"unix:{self.path}" if self.kind == "unix" else f"{self.host}:{self.port}"


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` is reachable from this host only.  An empty host binds
    every interface, as ``0.0.0.0`` does: not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_host_id() -> str:
    """The identity of this host, for deciding whether a node's arena is mappable here."""
    return os.environ.get("KVPOOL_HOST_ID") or socket.gethostname()


def check_plaintext(host: str, tls: bool, insecure: bool, what: str) -> None:
    """Plaintext only on loopback, unless the operator says ``--insecure``."""
    if not tls and not insecure and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve {what} on {host} in plaintext: give --tls-cert and --tls-key "
            "(TLS), or --insecure to accept plaintext on this network"
        )


def check_plaintext_endpoint(url: str, insecure: bool, what: str) -> None:
    """The same rule for an endpoint a process reaches (an engine, etcd, an S3 endpoint):
    ``http://`` (or no scheme) only to a loopback host, unless the operator says
    ``--insecure``; ``https://`` anywhere."""
    parsed = urlparse(url if "://" in url else f"http://{url}")
    if parsed.scheme == "https" or insecure or is_loopback(parsed.hostname or ""):
        return
    raise ConfigError(
        f"refusing to reach {what} at {url} in plaintext: use an https:// endpoint (TLS), "
        "or --insecure to accept plaintext on this network"
    )


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


MAX_SECRET_FILE_BYTES = 4096


def read_secret_file(path: str, what: str) -> str:
    """A secret kept in a file (not on a command line, where every local user reads it in
    the process list): its text, without the trailing newline.  Refused when others may
    read or write it, as the tenants file is."""
    try:
        with open(path, "rb") as file:
            stat = os.fstat(file.fileno())
            if stat.st_mode & 0o077:
                raise ConfigError(
                    f"{what} {path}: readable or writable by group or others "
                    f"(mode {stat.st_mode & 0o777:o}); chmod 600 it"
                )
            data = file.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from exc
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise ConfigError(f"{what} {path}: larger than {MAX_SECRET_FILE_BYTES} bytes")
    try:
        secret = data.decode().rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {path}: not UTF-8 text") from exc
    if not secret:
        raise ConfigError(f"{what} {path} is empty")
    return secret


def parse_bool(value: str | bool, name: str = "value") -> bool:
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name}: expected a boolean, got {value!r}")


def _split_list(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


# -- the options of the SDK and of the engines' adapters ---------------------------------
#
# Each field of a client's, an engine adapter's or its health policy's configuration
# declares, once, how it is given (:class:`Option`, in the field's metadata): its key in an
# engine's extra config (``kv_connector_extra_config``, SGLang's extra config) and among the
# SDK's keyword arguments, its ``KVPOOL_*`` variable, its help and its parser.
# :func:`config_from` is the one function that reads a configuration from them; the docs'
# tables are generated from them (``kvpool.cli.reference``).

OPTION = "kvpool.option"  # the key of a field's Option in its metadata


@dataclass(frozen=True)
class Option:
    """How one field of a client's or an engine adapter's configuration is given: ``key``
    in an engine's extra config and the SDK's keywords (default: the field's name less a
    ``_s`` suffix), ``env`` its ``KVPOOL_*`` variable (default: ``KVPOOL_`` and the key),
    ``help`` what the docs say, ``parse`` how a string is read (the variable's, or a string
    in an extra config)."""

    key: str
    env: str
    help: str
    parse: Callable[[str], object] = str


def option(
    default: object = dataclasses.MISSING,
    help: str = "",
    *,
    key: str = "",
    env: str = "",
    parse: Callable[[str], object] = str,
    factory: Callable[[], object] | None = None,
) -> Any:
    """A dataclass field declared with its :class:`Option`."""
    metadata = {OPTION: Option(key, env, help, parse)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class DeclaredOption:
    """An option of a configuration class, resolved: its field, key, variable, help,
    parser and default."""

    field: str
    key: str
    env: str
    help: str
    parse: Callable[[str], object]
    default: object


def options_of(cls: type) -> list[DeclaredOption]:
    """The options ``cls`` declares, in field order."""
    found = []
    for f in dataclasses.fields(cls):
        declared = f.metadata.get(OPTION)
        if declared is None:
            continue
        key = declared.key or f.name.removesuffix("_s")
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        found.append(
            DeclaredOption(
                f.name,
                key,
                declared.env or "KVPOOL_" + key.upper(),
                declared.help,
                declared.parse,
                default,
            )
        )
    return found


def sections_of(cls: type) -> dict[str, type]:
    """The fields of ``cls`` that are configurations of their own with options (a
    connector's client and health policy): field -> class."""
    hints = typing.get_type_hints(cls)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(cls)
        if OPTION not in f.metadata
        and isinstance(hints.get(f.name), type)
        and dataclasses.is_dataclass(hints[f.name])
        and options_of(hints[f.name])
    }


def config_from(
    cls: type[C],
    given: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    where: str,
    ignore: frozenset[str] = frozenset(),
) -> C:
    """``cls``'s configuration: its defaults, then its options' ``KVPOOL_*`` variables, then
    ``given`` (an engine's extra config, the SDK's keywords; by key, or by field name), a
    string parsed as its variable would be; sections (:func:`sections_of`) read from the
    same ``given`` and environment.  A key no option of ``cls`` or its sections takes is a
    :class:`ConfigError` naming ``where``, unless in ``ignore`` (another's keys)."""
    environ = os.environ if environ is None else environ
    remaining = {k: v for k, v in (given or {}).items() if k not in ignore}
    values = _read_options(cls, remaining, environ, where)
    for name, section in sections_of(cls).items():
        values[name] = _read_section(section, remaining, environ, where)
    if remaining:
        raise ConfigError(
            f"unknown {where} key(s) {', '.join(sorted(map(repr, remaining)))}; known: "
            f"{', '.join(sorted(o.key for o in _all_options(cls)))}"
        )
    config = cls(**values)
    validate = getattr(config, "validate", None)
    return typing.cast(C, validate()) if validate is not None else config


def _read_section(
    cls: type, remaining: dict[str, object], environ: Mapping[str, str], where: str
) -> object:
    values = _read_options(cls, remaining, environ, where)
    for name, section in sections_of(cls).items():
        values[name] = _read_section(section, remaining, environ, where)
    config = cls(**values)
    validate = getattr(config, "validate", None)
    return validate() if validate is not None else config


def _all_options(cls: type) -> list[DeclaredOption]:
    return [
        *options_of(cls),
        *(o for section in sections_of(cls).values() for o in _all_options(section)),
    ]


def _read_options(
    cls: type, remaining: dict[str, object], environ: Mapping[str, str], where: str
) -> dict[str, object]:
    """The values of ``cls``'s own options that are set, taking their keys out of
    ``remaining``."""
    values: dict[str, object] = {}
    for declared in options_of(cls):
        if declared.env in environ:
            values[declared.field] = _parsed(declared, environ[declared.env], declared.env)
        for name in (declared.key, declared.field):
            if name in remaining:
                value = remaining.pop(name)
                if isinstance(value, str):
                    value = _parsed(declared, value, f"{where} {name}")
                values[declared.field] = value
    return values


def _parsed(declared: DeclaredOption, text: str, source: str) -> object:
    try:
        return declared.parse(text)
    except (TypeError, ValueError, ConfigError) as exc:
        raise ConfigError(f"{source}={text!r}: {exc}") from exc


def env_table(*classes: type) -> dict[str, DeclaredOption]:
    """The ``KVPOOL_*`` variables ``classes`` (and their sections) honour."""
    return {o.env: o for cls in classes for o in _all_options(cls)}


# -- the node's settings ------------------------------------------------------------------
#
# Each field of the node's configuration declares, once, how an operator gives it: its
# command-line flag, its environment variable, its help and the parser of its text
# (:class:`Setting`, in the field's metadata).  ``node_config_from`` reads the variables from
# them and ``kvpool serve`` builds its options from them (``kvpool.cli.options``).

SETTING = "kvpool.setting"  # the key of a field's Setting in its metadata


@dataclass(frozen=True)
class Setting:
    """How an operator gives one field of the node's configuration.

    ``key`` names it in :func:`node_config_from`'s overrides (and is the name of the
    command's parameter); ``flag`` is its command-line option and ``env`` its ``KVPOOL_*``
    variable (by default ``KVPOOL_`` and the flag's words).  A switch (``is_switch``) is a
    flag without a value that turns it on.
    """

    key: str
    flag: str
    help: str
    parse: Callable[[str], object] = str
    env: str = ""
    is_switch: bool = False

    @property
    def env_var(self) -> str:
        return self.env or "KVPOOL_" + self.flag.removeprefix("--").upper().replace("-", "_")

    def parse_text(self, text: str, source: str) -> object:
        """The value of ``text`` as given in ``source`` (a variable or a flag)."""
        if self.is_switch:
            return parse_bool(text, source)
        try:
            return self.parse(text)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}={text!r}: {exc}") from exc


def setting(
    default: Any,
    flag: str,
    help: str,
    *,
    key: str = "",
    parse: Callable[[str], object] = str,
    env: str = "",
    is_switch: bool = False,
    factory: Callable[[], object] | None = None,
) -> Any:
    """A dataclass field that an operator sets with ``flag`` or its variable (``key``
    defaults to the flag's words joined by ``_``)."""
    key = key or flag.removeprefix("--").replace("-", "_")
    metadata = {SETTING: Setting(key, flag, help, parse, env, is_switch)}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


# Access keys that are examples, not secrets: a node given one refuses to start.
PLACEHOLDER_KEYS = frozenset({"change-me", "changeme", "change_me", "replace-me"})


@dataclass(frozen=True)
class TLSConfig:
    """TLS on the data port and the admin HTTP; client certificates verified against
    ``client_ca`` (mutual TLS); other nodes' certificates against ``ca``."""

    cert: str = setting(
        "", "--tls-cert", "TLS certificate (PEM) for the data port and admin HTTP.", key="tls_cert"
    )
    key: str = setting("", "--tls-key", "Its private key (PEM).", key="tls_key")
    client_ca: str = setting(
        "",
        "--tls-client-ca",
        "Require client certificates signed by this CA (mTLS).",
        key="tls_client_ca",
    )
    ca: str = setting(
        "", "--tls-ca", "The CA of other nodes' certificates (node to node).", key="tls_ca"
    )
    server_name: str = setting(
        "",
        "--tls-server-name",
        "The name other nodes' certificates carry, checked in place of their address (one "
        "certificate for nodes reached by IP, e.g. pods).",
        key="tls_server_name",
    )
    insecure: bool = setting(
        False,
        "--insecure",
        "Accept plaintext off loopback (the node's ports, etcd, the S3 endpoint).",
        is_switch=True,
    )

    def validate(self) -> TLSConfig:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if self.client_ca and not self.cert:
            raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        return self

    def check_plaintext(self, host: str, what: str) -> None:
        """Plaintext only on loopback, unless the operator says ``--insecure``."""
        check_plaintext(host, bool(self.cert), self.insecure, what)


@dataclass(frozen=True)
class DiskConfig:
    """The local disk tier below the arena (``kvpool.tiers.disk``); off without a path."""

    path: str = setting(
        "", "--disk", "A directory for the local disk tier (e.g. on NVMe).", key="disk_path"
    )
    capacity: int = setting(
        0,
        "--disk-size",
        "How much of it the disk tier may use, e.g. 500GiB.",
        key="disk_bytes",
        parse=parse_size,
    )

    def validate(self) -> DiskConfig:
        if bool(self.path) != bool(self.capacity):
            raise ConfigError("the disk tier needs both --disk PATH and --disk-size")
        if self.capacity < 0:
            raise ConfigError("--disk-size must be positive")
        return self


@dataclass(frozen=True)
class ObjectStoreConfig:
    """The shared object-store tier below the disk (``kvpool.tiers.objects``); off without a
    URL.  Credentials come from the standard AWS variables (``AWS_ACCESS_KEY_ID``, ...)."""

    url: str = setting(
        "",
        "--object-store",
        "The shared object-store tier below the disk, s3://BUCKET/PREFIX "
        "(credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY).",
        key="object_store",
    )
    capacity: int = setting(
        DEFAULT_OBJECT_STORE_BYTES,
        "--object-store-size",
        "What the bucket may hold, e.g. 2TiB (oldest go first).",
        key="object_store_bytes",
        parse=parse_size,
    )
    endpoint: str = setting(  # "" : AWS's, or AWS_ENDPOINT_URL
        "", "--object-store-endpoint", "The S3 endpoint, e.g. http://rgw.local:7480."
    )
    region: str = setting(  # "" : AWS_REGION / AWS_DEFAULT_REGION, else us-east-1
        "", "--object-store-region", "The S3 region."
    )
    refresh_s: float = setting(
        DEFAULT_OBJECT_REFRESH_S,
        "--object-refresh",
        "Seconds between reads of the bucket's index.",
        key="object_refresh_s",
        parse=float,
    )
    read_timeout_s: float = setting(
        DEFAULT_OBJECT_READ_TIMEOUT_S,
        "--object-read-timeout",
        "Seconds a read from the bucket may take before it counts as a miss.",
        key="object_read_timeout_s",
        parse=float,
    )

    @property
    def endpoint_url(self) -> str:
        """The S3 endpoint the tier reaches: the configured one, else ``AWS_ENDPOINT_URL``
        (as AWS clients read it), else AWS's own (``""``, HTTPS)."""
        return self.endpoint or os.environ.get("AWS_ENDPOINT_URL", "")

    def validate(self) -> ObjectStoreConfig:
        if self.url and not self.url.startswith("s3://"):
            raise ConfigError(f"--object-store {self.url!r}: use s3://BUCKET[/PREFIX]")
        if self.capacity <= 0 or not 0.1 <= self.refresh_s <= 3600:
            raise ConfigError("--object-store-size must be positive, the refresh 0.1-3600 s")
        if self.read_timeout_s <= 0:
            raise ConfigError("--object-read-timeout must be positive")
        return self


KV_EVENT_ENCODINGS = ("map", "array")


@dataclass(frozen=True)
class EventsConfig:
    """KV events in vLLM's format (``kvpool.node.events``); off without an endpoint."""

    endpoint: str = setting(  # e.g. tcp://127.0.0.1:5557 (bound)
        "",
        "--kv-events",
        "Publish KV events (vLLM's format) on this ZMQ endpoint, e.g. tcp://127.0.0.1:5557.",
        key="kv_events",
    )
    replay_endpoint: str = setting(
        "",
        "--kv-events-replay",
        "A ZMQ ROUTER endpoint that replays KV events.",
        key="kv_events_replay",
    )
    topic: str = setting(
        "",
        "--kv-events-topic",
        "The KV events' topic, e.g. kv@<pod>@<model>.",
        key="kv_events_topic",
    )
    encoding: str = setting(
        "map",
        "--kv-events-encoding",
        "map (vLLM since mid-2026) or array (earlier vLLM releases).",
        key="kv_events_encoding",
    )

    token_ids: bool = setting(
        False,
        "--kv-events-token-ids",
        "Put each block's token ids in its BlockStored event (they are the prompt's text).",
        key="kv_events_token_ids",
        is_switch=True,
    )
    curve_key: str = setting(
        "",
        "--kv-events-curve-key",
        "The KV event sockets' CURVE secret key file (zmq.auth.create_certificates).",
        key="kv_events_curve_key",
    )
    clients: str = setting(
        "",
        "--kv-events-clients",
        "A TOML file of the CURVE public keys that may subscribe (docs/guides/events.md).",
        key="kv_events_clients",
    )

    def validate(self) -> EventsConfig:
        if self.encoding not in KV_EVENT_ENCODINGS:
            raise ConfigError("--kv-events-encoding must be map or array")
        if self.replay_endpoint and not self.endpoint:
            raise ConfigError("--kv-events-replay needs --kv-events")
        if bool(self.curve_key) != bool(self.clients):
            raise ConfigError("CURVE needs both --kv-events-curve-key and --kv-events-clients")
        return self

    def check_transport(self, insecure: bool, tenants: bool) -> None:
        """Who may subscribe: anybody who reaches the sockets, unless they are CURVE's.
        Without CURVE, only loopback or ``ipc://`` (this host), and no tenants (whose
        engines may run on this host); ``insecure`` accepts either."""
        if not self.endpoint or self.curve_key or insecure:
            return
        for endpoint in filter(None, (self.endpoint, self.replay_endpoint)):
            scheme, _, rest = endpoint.partition("://")
            host = rest.rpartition(":")[0].strip("[]")
            local = scheme == "ipc" or (scheme == "tcp" and is_loopback(host))
            if not local:
                raise ConfigError(
                    f"refusing to publish KV events on {endpoint} in the open: anybody who "
                    "reaches it reads every block the node holds; give --kv-events-curve-key "
                    "and --kv-events-clients (CURVE), bind loopback, or --insecure"
                )
            if tenants:
                raise ConfigError(
                    "with --tenants, KV events need CURVE (--kv-events-curve-key and "
                    "--kv-events-clients): any local process could read every tenant's "
                    "blocks; or --insecure"
                )


DEFAULT_KTHENA_BLOCK_SIZE = 16  # Kthena's defaultBlockSizeToHash
MAX_KTHENA_BLOCK_SIZE = 4096


@dataclass(frozen=True)
class KthenaConfig:
    """Kthena's cache-aware router scoring what the pool holds (``kvpool.node.kthena``);
    off without a Redis URL."""

    redis_url: str = setting(
        "",
        "--kthena-redis",
        "Write Kthena's KV cache entries (matrix:kv:block:...) for the engines that load from "
        "this node to this Redis, e.g. redis://127.0.0.1:6379/0; a password belongs in "
        "KVPOOL_KTHENA_REDIS, not the flag.",
        key="kthena_redis",
    )
    block_size: int = setting(
        DEFAULT_KTHENA_BLOCK_SIZE,
        "--kthena-block-size",
        "Kthena's blockSizeToHash (its kvcache-aware plugin's argument): tokens per block.",
        key="kthena_block_size",
        parse=int,
    )
    insecure: bool = setting(
        False,
        "--kthena-insecure",
        "Accept plaintext (redis://) to Kthena's Redis off loopback, the node's own ports "
        "staying TLS (Kthena's in-cluster Redis speaks plaintext).",
        key="kthena_insecure",
        is_switch=True,
    )

    def validate(self) -> KthenaConfig:
        if not 1 <= self.block_size <= MAX_KTHENA_BLOCK_SIZE:
            raise ConfigError(f"--kthena-block-size must be 1 to {MAX_KTHENA_BLOCK_SIZE}")
        if self.redis_url and urlparse(self.redis_url).scheme not in ("redis", "rediss", "unix"):
            raise ConfigError("--kthena-redis takes a redis://, rediss:// or unix:// URL")
        return self

    def check_transport(self, insecure: bool) -> None:
        """Kthena's Redis learns which prompts' blocks are where: ``redis://`` only to a
        loopback host, unless ``--insecure``; ``rediss://`` (TLS) and ``unix://`` anywhere."""
        parsed = urlparse(self.redis_url)
        plaintext_ok = insecure or self.insecure or is_loopback(parsed.hostname or "")
        if parsed.scheme == "redis" and not plaintext_ok:
            raise ConfigError(
                f"refusing to reach Kthena's Redis at {parsed.hostname} in plaintext: use "
                "rediss:// (TLS), or --kthena-insecure (or --insecure) to accept plaintext "
                "on this network"
            )


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster the node joins (``kvpool.node.peers``): static peers or etcd;
    alone without either."""

    peers: tuple[str, ...] = setting(
        (),
        "--peers",
        "Static cluster: comma-separated host:port of every node.",
        parse=_split_list,
    )
    etcd: str = setting(
        "",
        "--etcd",
        "etcd endpoint for cluster membership, e.g. https://etcd:2379 (http:// only on "
        "loopback, or with --insecure).",
    )
    etcd_prefix: str = setting(
        DEFAULT_ETCD_PREFIX, "--etcd-prefix", "The etcd prefix the nodes register under."
    )
    etcd_ttl_s: int = setting(
        DEFAULT_ETCD_TTL_S,
        "--etcd-ttl",
        "Seconds a node's etcd registration outlives its last renewal.",
        key="etcd_ttl_s",
        parse=int,
    )
    replicas: int = setting(
        DEFAULT_REPLICAS, "--replicas", "Home copies kept of each block in a cluster.", parse=int
    )

    @property
    def is_clustered(self) -> bool:
        return bool(self.peers or self.etcd)

    def validate(self) -> ClusterConfig:
        if self.replicas < 1:
            raise ConfigError("--replicas must be at least 1")
        if self.etcd_ttl_s < 1:
            raise ConfigError("--etcd-ttl must be at least 1 s")
        return self


# LeaseLimits (kvpool.limits) is the store's: its settings are declared here, by field.
LEASE_SETTINGS: dict[str, Setting] = {
    # The most a pin or a reservation lasts, whatever a client asks for: what a dead or
    # stalled client can hold, and the longest a single GET or PUT payload may take to stream.
    "pin_s": Setting(
        "pin_lease_s", "--pin-lease", "Seconds a pin lasts at most (what a client may hold).", float
    ),
    "reserve_s": Setting(
        "reserve_lease_s",
        "--reserve-lease",
        "Seconds a reservation lasts at most (an unfinished write is reclaimed after it).",
        float,
    ),
}


# Budgets (kvpool.limits): what a tenant, or a peer that has not authenticated, may cost the
# node; declared here by field, as the lease limits are.
BUDGET_SETTINGS: dict[str, Setting] = {
    "max_connections": Setting(
        "max_connections",
        "--max-connections",
        "Authenticated connections at once (a sixteenth stays the Unix socket's).",
        int,
    ),
    "max_strangers": Setting(
        "max_strangers",
        "--max-strangers",
        "Connections still in their handshake, at once (past it the oldest is closed).",
        int,
    ),
    "max_strangers_per_address": Setting(
        "max_strangers_per_address",
        "--max-strangers-per-address",
        "The same, from one address.",
        int,
    ),
    "handshake_s": Setting(
        "handshake_s",
        "--handshake-timeout",
        "Seconds a connection has to authenticate.",
        float,
    ),
    "idle_s": Setting(
        "idle_s",
        "--idle-timeout",
        "Seconds an authenticated connection may stay silent before it is closed.",
        float,
    ),
    "buffer_bytes": Setting(
        "tenant_buffer_bytes",
        "--tenant-buffer-bytes",
        "Receive-buffer bytes a tenant's connections may hold at once, e.g. 128MiB.",
        parse_size,
    ),
    "parked_keys": Setting(
        "tenant_parked_keys",
        "--tenant-parked-keys",
        "Keys a tenant's waiting lookups may name at once (past it a lookup answers now).",
        int,
    ),
    "label_changes_per_s": Setting(
        "tenant_label_rate",
        "--tenant-label-rate",
        "Namespace label changes a second a tenant may make (each is a journal record).",
        float,
    ),
}

# The settings of the sections declared apart from their classes, by section class.
SECTION_SETTINGS: dict[type, dict[str, Setting]] = {
    LeaseLimits: LEASE_SETTINGS,
    Budgets: BUDGET_SETTINGS,
}


@dataclass(frozen=True)
class NodeConfig:
    """Configuration of one node daemon (``kvpool serve``): who it is, its arena and its
    listeners, and one typed section for each part it runs (:class:`TLSConfig`,
    :class:`DiskConfig`, :class:`ObjectStoreConfig`, :class:`EventsConfig`, :class:`KthenaConfig`,
    :class:`ClusterConfig`, the store's :class:`~kvpool.limits.LeaseLimits` and the node's
    :class:`~kvpool.limits.Budgets`).

    ``validate()`` checks each section, then what concerns more than one."""

    name: str = setting(
        DEFAULT_NODE_NAME,
        "--name",
        "Node name (also its directory under --run-dir).",
        env="KVPOOL_NODE_NAME",
    )
    run_dir: str = setting(
        DEFAULT_RUN_DIR, "--run-dir", "Where the arena and the Unix socket live."
    )
    host_id: str = setting(
        None, "--host-id", "Host identity (defaults to the hostname).", factory=default_host_id
    )
    fresh: bool = setting(  # start empty instead of adopting what the last daemon left
        False,
        "--fresh",
        "Start empty: drop what an earlier daemon left (arena and disk).",
        is_switch=True,
    )
    memory_bytes: int = setting(
        DEFAULT_MEMORY_BYTES,
        "--memory",
        "Arena size, e.g. 4GiB.",
        key="memory_bytes",
        parse=parse_size,
    )
    hugepages: bool = setting(
        False, "--hugepages", "Ask for transparent huge pages on the arena.", is_switch=True
    )
    high_watermark: float = setting(
        DEFAULT_HIGH_WATERMARK,
        "--high-watermark",
        "The arena's share in use at which eviction starts (0-1).",
        parse=float,
    )
    low_watermark: float = setting(
        DEFAULT_LOW_WATERMARK,
        "--low-watermark",
        "The share eviction brings it back down to (0-1).",
        parse=float,
    )
    eviction: str = setting(
        DEFAULT_EVICTION,
        "--eviction",
        "Which blocks leave DRAM first: " + ", ".join(EVICTION_POLICIES) + ".",
    )
    # How fast the node re-hashes the blocks it holds, in bytes a second (0: never): a
    # block damaged in place is dropped (see kvpool.node.sealing).
    scrub_bytes_s: int = setting(
        DEFAULT_SCRUB_BYTES_S,
        "--scrub-rate",
        "Bytes a second the node re-verifies what it holds (0: off), e.g. 64MiB.",
        key="scrub_bytes_s",
        parse=parse_size,
    )
    host: str = setting("127.0.0.1", "--host", "TCP listen address.")
    port: int = setting(DEFAULT_TCP_PORT, "--port", "TCP port (0: any free port).", parse=int)
    advertise_host: str = setting(
        "", "--advertise-host", "Address other nodes use to reach this one."
    )
    admin_host: str = setting("127.0.0.1", "--admin-host", "Admin HTTP listen address.")
    admin_port: int = setting(
        DEFAULT_ADMIN_PORT, "--admin-port", "Admin HTTP port (0: any free port).", parse=int
    )
    access_id: str = setting(
        DEFAULT_ACCESS_ID, "--access-id", "Access id clients authenticate with."
    )
    access_key: str = setting(
        "",
        "--access-key",
        "Access key (HMAC secret); prefer --access-key-file or KVPOOL_ACCESS_KEY "
        "(a flag shows in the process list).",
    )
    access_key_file: str = setting(
        "",
        "--access-key-file",
        "A file (mode 600) holding the access key: kept out of the process list.",
    )
    # Tenants (kvpool.tenants): a TOML file of credentials, salts and quotas ("": none).
    tenants_path: str = setting(
        "",
        "--tenants",
        "A tenants file (TOML): credentials, salts and quotas; reloaded.",
        key="tenants_path",
    )
    leases: LeaseLimits = field(default_factory=LeaseLimits)
    budgets: Budgets = field(default_factory=Budgets)
    tls: TLSConfig = field(default_factory=TLSConfig)
    disk: DiskConfig = field(default_factory=DiskConfig)
    objects: ObjectStoreConfig = field(default_factory=ObjectStoreConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    kthena: KthenaConfig = field(default_factory=KthenaConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def node_dir(self) -> Path:
        return Path(self.run_dir) / self.name

    @property
    def arena_path(self) -> Path:
        return self.node_dir / "arena"

    @property
    def socket_path(self) -> Path:
        return self.node_dir / "kvpool.sock"

    @property
    def journal_path(self) -> Path:
        return self.node_dir / "index"

    @property
    def directory_path(self) -> Path:
        return self.node_dir / "directory"

    @property
    def tcp_address(self) -> str:
        return f"{self.advertise_host or self.host}:{self.port}"

    def validate(self) -> NodeConfig:
        self._validate_node()
        self._read_access_key()
        self._validate_access()
        self.leases.validate()
        self.budgets.validate()
        self.tls.validate()
        self.tls.check_plaintext(self.host, "the data port")
        self.tls.check_plaintext(self.admin_host, "the admin HTTP")
        self.disk.validate()
        self.objects.validate()
        if self.objects.url and not self.disk.path:
            raise ConfigError(
                "--object-store needs --disk: the object tier takes the segments the disk evicts"
            )
        self.events.validate()
        self.events.check_transport(self.tls.insecure, bool(self.tenants_path))
        self.kthena.validate()
        if self.kthena.redis_url:
            self.kthena.check_transport(self.tls.insecure)
        self.cluster.validate()
        self._validate_endpoints()
        return self

    def _validate_endpoints(self) -> None:
        """What the node reaches (etcd, the S3 endpoint) carries the pool's membership and
        blocks: plaintext only on loopback, unless ``--insecure``, as for what it serves."""
        insecure = self.tls.insecure
        if self.cluster.etcd:
            check_plaintext_endpoint(self.cluster.etcd, insecure, "etcd (--etcd)")
        if self.objects.url and self.objects.endpoint_url:
            check_plaintext_endpoint(
                self.objects.endpoint_url, insecure, "the object store (--object-store-endpoint)"
            )

    def _validate_node(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ConfigError(f"node name {self.name!r}: use 1-64 letters, digits, '_', '.', '-'")
        if self.memory_bytes < MIN_ARENA_BYTES:
            raise ConfigError(f"--memory must be at least {format_size(MIN_ARENA_BYTES)}")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError("watermarks must satisfy 0 < low <= high <= 1")
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(
                f"--eviction {self.eviction!r}: one of {', '.join(EVICTION_POLICIES)}"
            )
        if self.scrub_bytes_s < 0:
            raise ConfigError("--scrub-rate must be 0 (off) or a size a second")
        if len(self.socket_path.as_posix()) > 100:
            raise ConfigError(f"unix socket path too long: {self.socket_path}")
        for port in (self.port, self.admin_port):
            if not 0 <= port < 65536:
                raise ConfigError(f"invalid port {port}")

    def _read_access_key(self) -> None:
        if not self.access_key_file:
            return
        key = read_secret_file(self.access_key_file, "the access key file")
        if self.access_key and self.access_key != key:  # (equal: validated once before)
            raise ConfigError("--access-key and --access-key-file together: give one")
        object.__setattr__(self, "access_key", key)  # frozen: set once, while validating

    def _validate_access(self) -> None:
        if self.access_key.lower() in PLACEHOLDER_KEYS:
            raise ConfigError(
                f"the access key is the placeholder {self.access_key!r} of an example "
                "manifest: set KVPOOL_ACCESS_KEY (or --access-key-file) to a secret of your "
                "own, e.g. `openssl rand -hex 32` in the Secret kvpool-access (the Helm "
                "chart's value `accessKey`; left empty, the chart generates one)"
            )
        keyed = bool(self.access_key or self.tenants_path)
        if not keyed and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to listen on {self.host or 'every interface'} without an access "
                "key: set --access-key "
                "(or KVPOOL_ACCESS_KEY) or --tenants, or listen on loopback"
            )
        if not keyed and not is_loopback(self.admin_host):
            raise ConfigError(
                f"refusing to serve the admin HTTP on {self.admin_host or 'every interface'} "
                "without an access key "
                "(its status names every namespace): set --access-key, or keep it on loopback"
            )
        if self.tenants_path and self.access_key:
            raise ConfigError(
                "--tenants and --access-key together: the cluster's own identity is the "
                "[cluster] section of the tenants file"
            )


@dataclass(frozen=True)
class ClientConfig:
    """Configuration of a client (the SDK, the vLLM connector, the router).  Each field an
    operator gives is an :class:`Option`: a keyword of ``Client(...)``, a key of an engine's
    extra config, a ``KVPOOL_*`` variable (docs/configuration.md lists them, from here)."""

    address: str = option(
        f"unix:{DEFAULT_RUN_DIR}/{DEFAULT_NODE_NAME}/kvpool.sock",
        "The local node: unix:PATH (its socket), or HOST:PORT over TCP; empty with peers or "
        "etcd (no node on this host).",
    )
    access_id: str = option(DEFAULT_ACCESS_ID, "The access id it authenticates with.")
    access_key: str = option(
        "", "The access key (HMAC secret); prefer access_key_file where the config is logged."
    )
    access_key_file: str = option(
        "",
        "A file (mode 600) holding the access key: kept out of an engine's command line and "
        "logs, where kv_connector_extra_config lands.",
    )
    timeout_s: float = option(
        DEFAULT_TIMEOUT_S, "Seconds a call may take (its deadline).", parse=float
    )
    connect_timeout_s: float = option(
        DEFAULT_CONNECT_TIMEOUT_S, "Seconds a connection may take to open.", parse=float
    )
    use_shm: bool = option(
        True, "Map the node's arena when it is on this host (copies, not the socket).",
        parse=parse_bool,
    )  # fmt: skip
    host_id: str = option(
        help="This host's identity (the arena is mapped only where the node's is the same).",
        factory=default_host_id,
    )
    peers: tuple[str, ...] = option(
        (), "A static cluster: host:port,... of every node.", parse=_split_list
    )
    etcd: str = option("", "A cluster in etcd: https://host:2379.")
    etcd_prefix: str = option(DEFAULT_ETCD_PREFIX, "The etcd prefix the cluster's nodes are under.")
    write_rcache: bool = option(
        True,
        "Also write each block to its home node (so that any node finds it).",
        parse=parse_bool,
    )
    read_local_only: bool = option(
        False, "Read only from the local node, never from home nodes.", parse=parse_bool
    )
    replicas: int = option(
        DEFAULT_REPLICAS, "Home nodes each block is written through to.", parse=int
    )
    max_connections: int = option(
        8, "Connections open at most to one node.", env="KVPOOL_CLIENT_CONNECTIONS", parse=int
    )
    # Threads a same-host put or get copies with, the caller's included (see
    # kvpool.client.copier): one core moves memory slower than the memory can.
    copy_threads: int = option(
        DEFAULT_COPY_THREADS,
        "Threads a same-host put or get copies with (CPUs, at most 4, by default).",
        parse=int,
    )
    # Hash every block read from the node's arena, even those the node sealed (see
    # kvpool.client.reads): for hosts where processes that map the arena are not trusted.
    verify_reads: bool = option(
        False,
        "Hash every block read from the node's arena, even those the node sealed.",
        parse=parse_bool,
    )
    # TLS to nodes' TCP ports: the server verified against tls_ca (else the system's CAs);
    # tls_cert/tls_key presented for mutual TLS.  A Unix socket is never wrapped.
    tls: bool = option(
        False, "TLS to the nodes' TCP ports (verified against the system's CAs).", parse=parse_bool
    )
    tls_ca: str = option("", "The CA the nodes' certificates are verified against (TLS).")
    tls_cert: str = option("", "A client certificate (PEM) for mutual TLS.")
    tls_key: str = option("", "Its private key (PEM).")
    # The name the nodes' certificates carry, checked in place of the address's host (one
    # certificate for every node of a cluster whose nodes are reached by IP: pods).
    tls_server_name: str = option(
        "",
        "The name the nodes' certificates carry, checked in place of the address's host "
        "(one certificate for nodes reached by IP, e.g. pods).",
    )

    def validate(self) -> ClientConfig:
        if isinstance(self.peers, list):
            object.__setattr__(self, "peers", tuple(self.peers))  # frozen: once, validating
        if self.access_key_file:
            key = read_secret_file(self.access_key_file, "the access key file")
            object.__setattr__(self, "access_key", key)
            object.__setattr__(self, "access_key_file", "")
        if self.address:
            Address.parse(self.address)
        elif not self.peers and not self.etcd:
            raise ConfigError("no address: give the local node's address, or peers / etcd")
        for peer in self.peers:
            Address.parse(peer)
        if self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ConfigError("timeouts must be positive")
        if self.max_connections < 1:
            raise ConfigError("max_connections must be at least 1")
        if not 1 <= self.copy_threads <= MAX_COPY_THREADS:
            raise ConfigError(f"copy_threads must be 1 to {MAX_COPY_THREADS}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("a client certificate (tls_cert) needs its key (tls_key)")
        return self

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.tls_ca or self.tls_cert)

    def replace(self, **changes: object) -> ClientConfig:
        return dataclasses.replace(self, **changes).validate()  # type: ignore[arg-type]


def client_config_from(
    overrides: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> ClientConfig:
    """A client configuration: defaults, then ``KVPOOL_*`` variables, then ``overrides``
    (by key, e.g. ``timeout``, or by field, ``timeout_s``)."""
    return config_from(ClientConfig, overrides, environ, where="client option")


def node_sections() -> dict[str, Any]:
    """:class:`NodeConfig`'s sections, by field name: the class each is made of."""
    return {
        f.name: f.default_factory
        for f in dataclasses.fields(NodeConfig)
        if SETTING not in f.metadata
    }


def node_settings() -> list[tuple[str, str, Setting]]:
    """Every setting of the node: ``(section, field, setting)``, the section ``""`` for
    :class:`NodeConfig`'s own fields, in the order ``kvpool serve --help`` lists them."""
    found = [
        ("", f.name, f.metadata[SETTING])
        for f in dataclasses.fields(NodeConfig)
        if SETTING in f.metadata
    ]
    for section, section_type in node_sections().items():
        declared = SECTION_SETTINGS.get(section_type)
        if declared is not None:
            found.extend((section, name, s) for name, s in declared.items())
        else:
            found.extend(
                (section, f.name, f.metadata[SETTING]) for f in dataclasses.fields(section_type)
            )
    return found


# The environment variables a node daemon honours (command-line flags win over them).
NODE_ENV: dict[str, Setting] = {s.env_var: s for _, _, s in node_settings()}


def node_config_from(
    overrides: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> NodeConfig:
    """A node configuration: defaults, then ``KVPOOL_*`` variables, then ``overrides`` by
    :attr:`Setting.key` (entries whose value is ``None`` are ignored; text is parsed as the
    variable's would be)."""
    environ = os.environ if environ is None else environ
    by_key = {s.key: (section, name, s) for section, name, s in node_settings()}
    values: dict[str, object] = {}
    for var, given in NODE_ENV.items():
        if var in environ:
            values[given.key] = given.parse_text(environ[var], var)
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in by_key:
            raise ConfigError(f"unknown node option {key!r}")
        given = by_key[key][2]
        values[key] = given.parse_text(value, given.flag) if isinstance(value, str) else value
    sections: dict[str, dict[str, object]] = {}
    for key, value in values.items():
        section, name, _ = by_key[key]
        sections.setdefault(section, {})[name] = value
    top = sections.pop("", {})
    types = node_sections()
    parts = {section: types[section](**fields) for section, fields in sections.items()}
    return NodeConfig(**top, **parts).validate()  # type: ignore[arg-type]
