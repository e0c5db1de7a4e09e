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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.errors import ConfigError
from kvpool.timing import DEFAULT_PIN_LEASE_S, DEFAULT_RESERVE_LEASE_S, LeasePolicy

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
DEFAULT_TIMEOUT_S = 2.0
DEFAULT_CONNECT_TIMEOUT_S = 1.0
DEFAULT_ACCESS_ID = "kvpool"
DEFAULT_ETCD_PREFIX = "/kvpool/nodes/"
DEFAULT_ETCD_TTL_S = 5
DEFAULT_REPLICAS = 1
DEFAULT_OBJECT_STORE_BYTES = 64 * GiB
DEFAULT_OBJECT_REFRESH_S = 2.0
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
    if host in ("localhost", ""):
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


@dataclass(frozen=True)
class NodeConfig:
    """Configuration of one node daemon (``kvpool serve``)."""

    name: str = DEFAULT_NODE_NAME
    run_dir: str = DEFAULT_RUN_DIR
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    host: str = "127.0.0.1"
    port: int = DEFAULT_TCP_PORT
    advertise_host: str = ""
    admin_host: str = "127.0.0.1"
    admin_port: int = DEFAULT_ADMIN_PORT
    access_id: str = DEFAULT_ACCESS_ID
    access_key: str = ""
    host_id: str = field(default_factory=default_host_id)
    high_watermark: float = DEFAULT_HIGH_WATERMARK
    low_watermark: float = DEFAULT_LOW_WATERMARK
    pin_lease_s: float = DEFAULT_PIN_LEASE_S
    reserve_lease_s: float = DEFAULT_RESERVE_LEASE_S
    hugepages: bool = False
    fresh: bool = False  # start empty instead of adopting what the last daemon left
    disk_path: str = ""  # the local disk tier's directory ("" : none)
    disk_bytes: int = 0
    # How fast the node re-hashes the blocks it holds, in bytes a second (0: never): a
    # block damaged in place is dropped (see kvpool.node.sealing).
    scrub_bytes_s: int = DEFAULT_SCRUB_BYTES_S
    peers: tuple[str, ...] = ()
    etcd: str = ""
    etcd_prefix: str = DEFAULT_ETCD_PREFIX
    etcd_ttl_s: int = DEFAULT_ETCD_TTL_S
    replicas: int = DEFAULT_REPLICAS
    kv_events: str = ""  # a ZMQ endpoint to publish KV events on, e.g. tcp://*:5557 ("": off)
    kv_events_replay: str = ""  # a ZMQ ROUTER endpoint that replays them
    kv_events_topic: str = ""
    kv_events_encoding: str = "map"  # "map" (vLLM since mid-2026) or "array" (before)
    # The shared object-store tier below the disk: s3://BUCKET/PREFIX ("": none).
    # Credentials come from the standard AWS variables (AWS_ACCESS_KEY_ID, ...).
    object_store: str = ""
    object_store_endpoint: str = ""  # e.g. http://s3.local:7480 ("": AWS, or AWS_ENDPOINT_URL)
    object_store_region: str = ""
    object_store_bytes: int = DEFAULT_OBJECT_STORE_BYTES
    object_refresh_s: float = DEFAULT_OBJECT_REFRESH_S
    # Tenants (kvpool.tenants): a TOML file of credentials, salts and quotas ("": none).
    tenants_path: str = ""
    # TLS on the data port and the admin HTTP; client certificates verified against
    # tls_client_ca (mutual TLS); other nodes' certificates against tls_ca.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    tls_ca: str = ""
    insecure: bool = False  # plaintext accepted off loopback

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

    @property
    def leases(self) -> LeasePolicy:
        return LeasePolicy(pin_s=self.pin_lease_s, reserve_s=self.reserve_lease_s)

    def validate(self) -> NodeConfig:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.name):
            raise ConfigError(f"node name {self.name!r}: use 1-64 letters, digits, '_', '.', '-'")
        if self.memory_bytes < MIN_ARENA_BYTES:
            raise ConfigError(f"--memory must be at least {format_size(MIN_ARENA_BYTES)}")
        if not 0.0 < self.low_watermark <= self.high_watermark <= 1.0:
            raise ConfigError("watermarks must satisfy 0 < low <= high <= 1")
        self.leases.validate()
        keyed = bool(self.access_key or self.tenants_path)
        if not keyed and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to listen on {self.host} without an access key: set --access-key "
                "(or KVPOOL_ACCESS_KEY) or --tenants, or listen on loopback"
            )
        if not keyed and not is_loopback(self.admin_host):
            raise ConfigError(
                f"refusing to serve the admin HTTP on {self.admin_host} without an access key "
                "(its status names every namespace): set --access-key, or keep it on loopback"
            )
        if self.tenants_path and self.access_key:
            raise ConfigError(
                "--tenants and --access-key together: the cluster's own identity is the "
                "[cluster] section of the tenants file"
            )
        check_plaintext(self.host, bool(self.tls_cert), self.insecure, "the data port")
        check_plaintext(self.admin_host, bool(self.tls_cert), self.insecure, "the admin HTTP")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if len(self.socket_path.as_posix()) > 100:
            raise ConfigError(f"unix socket path too long: {self.socket_path}")
        if self.replicas < 1:
            raise ConfigError("--replicas must be at least 1")
        if bool(self.disk_path) != bool(self.disk_bytes):
            raise ConfigError("the disk tier needs both --disk PATH and --disk-size")
        if self.disk_bytes < 0:
            raise ConfigError("--disk-size must be positive")
        if self.scrub_bytes_s < 0:
            raise ConfigError("--scrub-rate must be 0 (off) or a size a second")
        if self.kv_events_encoding not in ("map", "array"):
            raise ConfigError("--kv-events-encoding must be map or array")
        if self.object_store and not self.disk_path:
            raise ConfigError(
                "--object-store needs --disk: the object tier takes the segments the disk evicts"
            )
        if self.object_store and not self.object_store.startswith("s3://"):
            raise ConfigError(f"--object-store {self.object_store!r}: use s3://BUCKET[/PREFIX]")
        if self.object_store_bytes <= 0 or not 0.1 <= self.object_refresh_s <= 3600:
            raise ConfigError("--object-store-size must be positive, the refresh 0.1-3600 s")
        if self.kv_events_replay and not self.kv_events:
            raise ConfigError("--kv-events-replay needs --kv-events")
        for port in (self.port, self.admin_port):
            if not 0 <= port < 65536:
                raise ConfigError(f"invalid port {port}")
        return self


@dataclass(frozen=True)
class ClientConfig:
    """Configuration of a client (the SDK, the vLLM connector, the router)."""

    address: str = f"unix:{DEFAULT_RUN_DIR}/{DEFAULT_NODE_NAME}/kvpool.sock"
    access_id: str = DEFAULT_ACCESS_ID
    access_key: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    use_shm: bool = True
    host_id: str = field(default_factory=default_host_id)
    peers: tuple[str, ...] = ()
    etcd: str = ""
    etcd_prefix: str = DEFAULT_ETCD_PREFIX
    write_rcache: bool = True
    read_local_only: bool = False
    replicas: int = DEFAULT_REPLICAS
    max_connections: int = 8
    # Threads a same-host put or get copies with, the caller's included (see
    # kvpool.client.copier): one core moves memory slower than the memory can.
    copy_threads: int = DEFAULT_COPY_THREADS
    # Hash every block read from the node's arena, even those the node sealed (see
    # kvpool.client.reads): for hosts where processes that map the arena are not trusted.
    verify_reads: bool = False
    # TLS to nodes' TCP ports: the server verified against tls_ca (else the system's CAs);
    # tls_cert/tls_key presented for mutual TLS.  A Unix socket is never wrapped.
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    def validate(self) -> ClientConfig:
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


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def parse_bool(value: str | bool, name: str = "value") -> bool:
    if isinstance(value, bool):
        return value
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ConfigError(f"{name}: expected a boolean, got {value!r}")


def options_from_env(
    mapping: Mapping[str, tuple[str, object]], environ: Mapping[str, str] | None = None
) -> dict[str, object]:
    """The options ``mapping`` names, parsed from the ``KVPOOL_*`` variables that are set."""
    environ = os.environ if environ is None else environ
    values: dict[str, object] = {}
    for var, (name, parse) in mapping.items():
        if var in environ:
            try:
                values[name] = parse(environ[var])  # type: ignore[operator]
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{var}={environ[var]!r}: {exc}") from exc
    return values


def _split_list(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


# The environment variables a client honours, and how each is parsed.
CLIENT_ENV: dict[str, tuple[str, object]] = {
    "KVPOOL_ADDRESS": ("address", str),
    "KVPOOL_ACCESS_ID": ("access_id", str),
    "KVPOOL_ACCESS_KEY": ("access_key", str),
    "KVPOOL_TIMEOUT": ("timeout_s", float),
    "KVPOOL_CONNECT_TIMEOUT": ("connect_timeout_s", float),
    "KVPOOL_USE_SHM": ("use_shm", parse_bool),
    "KVPOOL_HOST_ID": ("host_id", str),
    "KVPOOL_PEERS": ("peers", _split_list),
    "KVPOOL_ETCD": ("etcd", str),
    "KVPOOL_ETCD_PREFIX": ("etcd_prefix", str),
    "KVPOOL_WRITE_RCACHE": ("write_rcache", parse_bool),
    "KVPOOL_VERIFY_READS": ("verify_reads", parse_bool),
    "KVPOOL_READ_LOCAL_ONLY": ("read_local_only", parse_bool),
    "KVPOOL_REPLICAS": ("replicas", int),
    "KVPOOL_COPY_THREADS": ("copy_threads", int),
    "KVPOOL_TLS": ("tls", parse_bool),
    "KVPOOL_TLS_CA": ("tls_ca", str),
    "KVPOOL_TLS_CERT": ("tls_cert", str),
    "KVPOOL_TLS_KEY": ("tls_key", str),
}


_CLIENT_ALIASES = {"timeout": "timeout_s", "connect_timeout": "connect_timeout_s"}


def client_config_from(
    overrides: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> ClientConfig:
    """A client configuration: defaults, then ``KVPOOL_*`` variables, then ``overrides``."""
    values = options_from_env(CLIENT_ENV, environ)
    known = {f.name for f in dataclasses.fields(ClientConfig)}
    parsers = {name: parse for name, parse in CLIENT_ENV.values()}
    for given, raw in (overrides or {}).items():
        value = raw
        name = _CLIENT_ALIASES.get(given, given)
        if name not in known:
            raise ConfigError(f"unknown client option {given!r}; known: {sorted(known)}")
        parse = parsers.get(name, str)
        if isinstance(value, str) and parse is not str:
            try:
                value = parse(value)  # type: ignore[operator]
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{given}={value!r}: {exc}") from exc
        values[name] = tuple(value) if name == "peers" and isinstance(value, list) else value
    return ClientConfig(**values).validate()  # type: ignore[arg-type]


# The environment variables a node daemon honours (command-line flags win over them).
NODE_ENV: dict[str, tuple[str, object]] = {
    "KVPOOL_NODE_NAME": ("name", str),
    "KVPOOL_RUN_DIR": ("run_dir", str),
    "KVPOOL_MEMORY": ("memory_bytes", parse_size),
    "KVPOOL_HOST": ("host", str),
    "KVPOOL_PORT": ("port", int),
    "KVPOOL_ADVERTISE_HOST": ("advertise_host", str),
    "KVPOOL_ADMIN_HOST": ("admin_host", str),
    "KVPOOL_ADMIN_PORT": ("admin_port", int),
    "KVPOOL_ACCESS_ID": ("access_id", str),
    "KVPOOL_ACCESS_KEY": ("access_key", str),
    "KVPOOL_HOST_ID": ("host_id", str),
    "KVPOOL_PEERS": ("peers", _split_list),
    "KVPOOL_ETCD": ("etcd", str),
    "KVPOOL_ETCD_PREFIX": ("etcd_prefix", str),
    "KVPOOL_REPLICAS": ("replicas", int),
    "KVPOOL_FRESH": ("fresh", parse_bool),
    "KVPOOL_DISK": ("disk_path", str),
    "KVPOOL_DISK_SIZE": ("disk_bytes", parse_size),
    "KVPOOL_SCRUB_RATE": ("scrub_bytes_s", parse_size),
    "KVPOOL_KV_EVENTS": ("kv_events", str),
    "KVPOOL_KV_EVENTS_REPLAY": ("kv_events_replay", str),
    "KVPOOL_KV_EVENTS_TOPIC": ("kv_events_topic", str),
    "KVPOOL_KV_EVENTS_ENCODING": ("kv_events_encoding", str),
    "KVPOOL_OBJECT_STORE": ("object_store", str),
    "KVPOOL_OBJECT_STORE_ENDPOINT": ("object_store_endpoint", str),
    "KVPOOL_OBJECT_STORE_REGION": ("object_store_region", str),
    "KVPOOL_OBJECT_STORE_SIZE": ("object_store_bytes", parse_size),
    "KVPOOL_TENANTS": ("tenants_path", str),
    "KVPOOL_TLS_CERT": ("tls_cert", str),
    "KVPOOL_TLS_KEY": ("tls_key", str),
    "KVPOOL_TLS_CLIENT_CA": ("tls_client_ca", str),
    "KVPOOL_TLS_CA": ("tls_ca", str),
    "KVPOOL_INSECURE": ("insecure", parse_bool),
    # The most a pin or a reservation lasts (kvpool.timing.LeasePolicy), whatever a client
    # asks for: what a dead or stalled client can hold, and the longest a single GET or PUT
    # payload may take to stream.
    "KVPOOL_PIN_LEASE": ("pin_lease_s", float),
    "KVPOOL_RESERVE_LEASE": ("reserve_lease_s", float),
}


def node_config_from(
    overrides: Mapping[str, object] | None = None, environ: Mapping[str, str] | None = None
) -> NodeConfig:
    """A node configuration: defaults, then ``KVPOOL_*`` variables, then ``overrides``
    (entries whose value is ``None`` are ignored)."""
    values = options_from_env(NODE_ENV, environ)
    known = {f.name for f in dataclasses.fields(NodeConfig)}
    for name, value in (overrides or {}).items():
        if value is None:
            continue
        if name not in known:
            raise ConfigError(f"unknown node option {name!r}")
        values[name] = value
    return NodeConfig(**values).validate()  # type: ignore[arg-type]


# The environment variables the engine connectors honour beyond the client's (their
# kv_connector_extra_config keys win over them).
CONNECTOR_ENV: dict[str, tuple[str, object]] = {
    "KVPOOL_LOOKUP_TIMEOUT": ("lookup_timeout", float),
    "KVPOOL_TRANSFER_TIMEOUT": ("transfer_timeout", float),
    "KVPOOL_MIN_LOAD_TOKENS": ("min_load_tokens", int),
    "KVPOOL_MIN_LOAD_BLOCKS": ("min_load_blocks", int),
    "KVPOOL_CONSUMER_WAIT": ("consumer_wait", float),
    "KVPOOL_TRANSFER": ("transfer", str),
    "KVPOOL_TENANT": ("tenant", str),
    "KVPOOL_STATS_INTERVAL": ("stats_interval", float),
    "KVPOOL_HEALTH_INTERVAL": ("health_interval", float),
    "KVPOOL_HEALTH_RECOVER_AFTER": ("health_recover_after", int),
    "KVPOOL_HEALTH_FLAP_WINDOW": ("health_flap_window", float),
    "KVPOOL_HEALTH_MAX_FLAPS": ("health_max_flaps", int),
    "KVPOOL_HEALTH_MAX_SLOW": ("health_max_slow", int),
}
