"""Tenants: who may connect, what each one sees, and how much DRAM each may hold.

A tenants file (TOML, ``kvpool serve --tenants FILE``) names the cluster's own identity and
every tenant::

    [cluster]                    # nodes between themselves, and operators' tools
    access_id = "cluster"
    key = "..."

    [tenants.alpha]
    salt = "..."                 # a secret of 16+ characters, the same on every node
    quota = "4GiB"               # DRAM, reservations included
    max_connections = 64         # at once (default 256)
    retained = "1GiB"            # held above the default retention priority (default:
                                 # a quarter of the quota; kvpool.retention)
    keys = { "alpha-1" = "...", "alpha-2" = "..." }   # access id -> key

The node binds the tenant to the authenticated connection and *scopes* every key the client
names: the key's namespace id (its first 16 bytes) becomes ``tag + HMAC(salt, namespace
id)``.  The 4-byte tag (a digest of the salt) tells the store whose block a key is, for
quotas; the keyed digest makes the same prompt in two tenants two different keys, and no
tenant can name a key of another, so neither reads nor lookups cross tenants.  The block
hash that follows is kept, so a key's home node is the same scoped or not.

The file is read again when it changes (:meth:`Registry.reload`): adding, rotating or
revoking a key needs no restart.  Secrets never leave the node; errors name the file and
the field, never a value.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
import logging
import os
import re
import tomllib
from base64 import b64decode
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.config import parse_size
from kvpool.errors import BadRequest, ConfigError
from kvpool.keys import NAMESPACE_ID_BYTES

log = logging.getLogger("kvpool.tenants")

TAG_BYTES = 4
MIN_SECRET_CHARS = 16
MAX_SECRET_CHARS = 256
MAX_TENANTS = 1024
MAX_KEYS_PER_TENANT = 64
DEFAULT_MAX_CONNECTIONS = 256
MAX_TENANTS_FILE_BYTES = 1 << 20
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_SCOPE_CACHE = 1024  # namespace ids remembered per tenant
MAX_NAMESPACES_PER_REQUEST = 64
RETAINED_SHARE = 0.25  # of its quota, a tenant's retention hints may hold by default


@dataclass(frozen=True)
class Credential:
    access_id: str
    key: str
    tenant: Tenant | None  # None: the cluster's own identity, which sees everything


@dataclass(frozen=True, eq=False)
class Tenant:
    name: str
    salt: bytes
    quota_bytes: int
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    retained_bytes: int = -1  # -1: RETAINED_SHARE of the quota
    tag: bytes = b""
    _scoped: dict[bytes, bytes] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        tag = hashlib.blake2b(self.salt, digest_size=TAG_BYTES, person=b"kvpool-tag").digest()
        object.__setattr__(self, "tag", tag)
        if self.retained_bytes < 0:
            object.__setattr__(self, "retained_bytes", int(self.quota_bytes * RETAINED_SHARE))

    def scope_namespace(self, namespace_id: bytes) -> bytes:
        scoped = self._scoped.get(namespace_id)
        if scoped is None:
            digest = hmac.new(self.salt, namespace_id, hashlib.sha256).digest()
            scoped = self.tag + digest[: NAMESPACE_ID_BYTES - TAG_BYTES]
            if len(self._scoped) >= _SCOPE_CACHE:  # the least recently used goes
                del self._scoped[next(iter(self._scoped))]
            self._scoped[namespace_id] = scoped
        else:  # most recently used: last in the dict's order
            del self._scoped[namespace_id]
            self._scoped[namespace_id] = scoped
        return scoped

    def scope(self, key: bytes) -> bytes:
        return self.scope_namespace(key[:NAMESPACE_ID_BYTES]) + key[NAMESPACE_ID_BYTES:]

    def scope_all(self, keys: Sequence[bytes]) -> list[bytes]:
        """Every key scoped; a request that names more than MAX_NAMESPACES_PER_REQUEST
        namespaces is refused (each new one costs an HMAC on the node's event loop, and
        a real request names one, or one per KV cache group)."""
        namespace_to_scoped: dict[bytes, bytes] = {}
        scoped_keys = []
        for key in keys:
            namespace_id = key[:NAMESPACE_ID_BYTES]
            scoped = namespace_to_scoped.get(namespace_id)
            if scoped is None:
                if len(namespace_to_scoped) >= MAX_NAMESPACES_PER_REQUEST:
                    raise BadRequest(
                        f"a request names more than {MAX_NAMESPACES_PER_REQUEST} namespaces"
                    )
                scoped = namespace_to_scoped[namespace_id] = self.scope_namespace(namespace_id)
            scoped_keys.append(scoped + key[NAMESPACE_ID_BYTES:])
        return scoped_keys

    def owns(self, key_or_namespace: bytes) -> bool:
        return key_or_namespace[:TAG_BYTES] == self.tag

    def same_as(self, other: Tenant | None) -> bool:
        return (
            other is not None
            and (self.name, self.salt, self.quota_bytes)
            == (
                other.name,
                other.salt,
                other.quota_bytes,
            )
            and self.max_connections == other.max_connections
            and self.retained_bytes == other.retained_bytes
        )


@dataclass(frozen=True)
class TenantsFile:
    cluster: Credential | None
    tenants: dict[str, Tenant]
    credentials: dict[str, Credential]


def load(path: Path) -> TenantsFile:
    """Read and check a tenants file; :class:`ConfigError` names what is wrong."""
    try:
        stat = path.stat()
        if stat.st_size > MAX_TENANTS_FILE_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_TENANTS_FILE_BYTES} bytes")
        _check_private(path, stat)
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the tenants file {path}: {exc.strerror}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    unknown = set(data) - {"cluster", "tenants"}
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {sorted(unknown)}")
    credentials: dict[str, Credential] = {}
    cluster = None
    if "cluster" in data:
        section = _table(data["cluster"], f"{path} [cluster]")
        access_id = _name(section.get("access_id"), f"{path} [cluster] access_id")
        cluster = Credential(access_id, _secret(section.get("key"), f"{path} [cluster] key"), None)
        credentials[access_id] = cluster
    tenants: dict[str, Tenant] = {}
    raw_tenants = _table(data.get("tenants", {}), f"{path} [tenants]")
    if len(raw_tenants) > MAX_TENANTS:
        raise ConfigError(f"{path}: more than {MAX_TENANTS} tenants")
    tags: dict[bytes, str] = {}
    for name, raw in raw_tenants.items():
        where = f"{path} [tenants.{name}]"
        _name(name, where)
        section = _table(raw, where)
        unknown = set(section) - {"salt", "quota", "max_connections", "retained", "keys"}
        if unknown:
            raise ConfigError(f"{where}: unknown field(s) {sorted(unknown)}")
        if "quota" not in section:
            raise ConfigError(f'{where}: quota is required (e.g. quota = "4GiB")')
        raw_quota = section["quota"]
        if not isinstance(raw_quota, str | int) or isinstance(raw_quota, bool):
            raise ConfigError(f'{where}: quota must be a size, e.g. "4GiB"')
        quota = parse_size(raw_quota)
        if quota <= 0:
            raise ConfigError(f"{where}: quota must be positive")
        connections = section.get("max_connections", DEFAULT_MAX_CONNECTIONS)
        if not isinstance(connections, int) or not 1 <= connections <= 65536:
            raise ConfigError(f"{where}: max_connections must be 1-65536")
        retained = _retained(section.get("retained"), quota, where)
        tenant = Tenant(
            name,
            _secret(section.get("salt"), f"{where} salt").encode(),
            quota,
            connections,
            retained,
        )
        if tenant.tag in tags:
            raise ConfigError(f"{where}: its salt's tag collides with {tags[tenant.tag]}'s")
        tags[tenant.tag] = name
        tenants[name] = tenant
        keys = _table(section.get("keys", {}), f"{where} keys")
        if len(keys) > MAX_KEYS_PER_TENANT:
            raise ConfigError(f"{where}: more than {MAX_KEYS_PER_TENANT} keys")
        for access_id, key in keys.items():
            _name(access_id, f"{where} keys")
            if access_id in credentials:
                raise ConfigError(f"{where}: access id {access_id!r} is used twice")
            credentials[access_id] = Credential(access_id, _secret(key, f"{where} keys"), tenant)
    return TenantsFile(cluster, tenants, credentials)


def _retained(raw: object, quota: int, where: str) -> int:
    """A tenant's ``retained``: a size up to its quota (absent: RETAINED_SHARE of it)."""
    if raw is None:
        return int(quota * RETAINED_SHARE)
    if not isinstance(raw, str | int) or isinstance(raw, bool):
        raise ConfigError(f'{where}: retained must be a size, e.g. "1GiB"')
    retained = parse_size(raw)
    if not 0 <= retained <= quota:
        raise ConfigError(f"{where}: retained must be between 0 and the quota")
    return retained


class Registry:
    """The tenants file as last read, and whether it changed since."""

    def __init__(self, path: Path):
        self.path = path
        self.current = load(path)
        self._stamp = _stamp(path)
        self._tags_of: TenantsFile | None = None  # the file _names was built from
        self._names: dict[bytes, str] = {}

    def credential(self, access_id: str) -> Credential | None:
        return self.current.credentials.get(access_id)

    def tenant_name(self, key: bytes) -> str | None:
        """Whose a scoped key is, by its tag: a tenant's name, or None (thread-safe: the
        file as last read)."""
        current = self.current
        if self._tags_of is not current:
            self._names = {t.tag: name for name, t in current.tenants.items()}
            self._tags_of = current
        return self._names.get(key[:TAG_BYTES])

    def reload(self) -> bool:
        """Read the file again if it changed; whether it did.  A file that became invalid
        leaves the last good one in place (and says so in the log)."""
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            self.current = load(self.path)
        except ConfigError as exc:
            log.error("tenants file not reloaded (the last good one stays): %s", exc)
            return False
        log.info("tenants file %s reloaded", self.path)
        return True

    def authenticate(self, authorization: str) -> Credential | None:
        """The credential an HTTP ``Authorization`` header proves (:func:`authenticate`)."""
        return authenticate(authorization, self.credential)


def authenticate(
    authorization: str, credential_of: Callable[[str], Credential | None]
) -> Credential | None:
    """The credential an HTTP ``Authorization`` header proves: ``Basic`` (browsers,
    Prometheus) or ``Bearer ID:KEY`` (what OpenAI clients send as their API key), checked
    against ``credential_of(access_id)`` in constant time."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "basic":
        try:
            token = b64decode(token.strip(), validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
    elif scheme.lower() != "bearer":
        return None
    access_id, _, key = token.strip().partition(":")
    credential = credential_of(access_id)
    if credential is None or not hmac.compare_digest(credential.key.encode(), key.encode()):
        return None
    return credential


def _check_private(path: Path, stat: os.stat_result) -> None:
    """The file holds every tenant's keys: refuse one that another user owns (who could
    change it) or that anyone but its owner may read or write."""
    if stat.st_uid != os.geteuid():
        raise ConfigError(f"{path}: owned by uid {stat.st_uid}, not this daemon's user")
    if stat.st_mode & 0o077:
        raise ConfigError(
            f"{path}: readable or writable by group or others (mode {stat.st_mode & 0o777:o});"
            " chmod 600 it"
        )


def _stamp(path: Path) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (0, 0, 0)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _table(value: object, where: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a table")
    return value


def _name(value: object, where: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ConfigError(f"{where}: use 1-64 letters, digits, '_', '.', '-'")
    return value


def _secret(value: object, where: str) -> str:
    if not isinstance(value, str) or not MIN_SECRET_CHARS <= len(value) <= MAX_SECRET_CHARS:
        raise ConfigError(f"{where}: a secret of {MIN_SECRET_CHARS}-{MAX_SECRET_CHARS} characters")
    return value
