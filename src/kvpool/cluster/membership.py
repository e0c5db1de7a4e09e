"""Cluster membership: who the nodes are.

- :class:`StaticMembership`: a fixed list of node addresses (``--peers``); each member's id
  is its address.  Liveness is left to the callers' deadlines and circuit breakers.
- :class:`EtcdMembership`: nodes register ``<prefix><node id>`` under an etcd lease that
  they keep alive; a node that stops heartbeating disappears when its lease expires (its
  TTL bounds how long), and a joining node appears at once.  Clients and daemons watch the
  prefix (and re-read it periodically, in case a watch breaks).

A :class:`Member` is what a node publishes about itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

import msgspec

from kvpool.config import Address
from kvpool.errors import ConfigError

log = logging.getLogger("kvpool.cluster")

RESYNC_INTERVAL_S = 2.0


class Member(msgspec.Struct, frozen=True):
    node_id: str
    tcp_address: str
    admin_url: str = ""
    host_id: str = ""
    started_at: float = 0.0


_member_decoder = msgspec.json.Decoder(Member)


class Membership:
    """The interface: ``members()`` is a snapshot; ``start()`` / ``stop()`` run watchers."""

    def members(self) -> list[Member]:
        raise NotImplementedError

    def start(self) -> Membership:
        return self

    def stop(self) -> None:
        pass


class StaticMembership(Membership):
    def __init__(self, peers: tuple[str, ...] | list[str]):
        self._members = [Member(node_id=_normalize(p), tcp_address=_normalize(p)) for p in peers]

    def members(self) -> list[Member]:
        return list(self._members)


def _normalize(address: str) -> str:
    return str(Address.parse(address))


def _etcd_client(endpoint: str, timeout: float, ca: str = "") -> object:
    """An etcd client; an ``https://`` endpoint verified against ``ca`` (else the system's
    CAs)."""
    from etcd3gw.client import Etcd3Client

    url = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    if not url.hostname:
        raise ConfigError(f"not an etcd endpoint: {endpoint!r}")
    return Etcd3Client(
        host=url.hostname,
        port=url.port or 2379,
        protocol=url.scheme or "http",
        ca_cert=ca or None,
        timeout=timeout,
        api_path="/v3/",
    )


class EtcdMembership(Membership):
    """Members under ``prefix`` in etcd, kept current by a watch and a periodic re-read."""

    def __init__(
        self,
        endpoint: str,
        prefix: str,
        *,
        timeout: float = 2.0,
        on_change: Callable[[list[Member]], None] | None = None,
        ca: str = "",
    ):
        self.endpoint = endpoint
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.timeout = timeout
        self.on_change = on_change
        self._client = _etcd_client(endpoint, timeout, ca)
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._cancel_watch: Callable[[], None] | None = None
        self._watch_lock = threading.Lock()
        self.is_synced = False
        # Registration (daemons only).
        self._registered: Member | None = None
        self._ttl = 0
        self._lease: object = None

    # -- watching -------------------------------------------------------------------------

    def members(self) -> list[Member]:
        with self._lock:
            return sorted(self._members.values(), key=lambda m: m.node_id)

    def start(self) -> EtcdMembership:
        self.resync()
        for target in (self._resync_loop, self._watch_loop):
            thread = threading.Thread(target=target, name="kvpool-etcd", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def resync(self) -> bool:
        try:
            pairs = self._client.get_prefix(self.prefix)  # type: ignore[attr-defined]
        except Exception as exc:
            log.debug("etcd read failed: %s", exc)
            return False
        members = {}
        for value, _ in pairs:
            try:
                member = _member_decoder.decode(value)
            except msgspec.DecodeError:
                continue
            members[member.node_id] = member
        self._replace(members)
        self.is_synced = True
        return True

    def _replace(self, members: dict[str, Member]) -> None:
        with self._lock:
            changed = members != self._members
            self._members = members
        if changed:
            log.info("cluster members: %s", ", ".join(sorted(members)) or "none")
            if self.on_change is not None:
                self.on_change(self.members())

    def _resync_loop(self) -> None:
        while not self._stop.wait(RESYNC_INTERVAL_S):
            self.resync()

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            try:
                events, cancel = self._client.watch_prefix(self.prefix)  # type: ignore[attr-defined]
                # The watch streams on a thread of etcd3gw's that only its cancel ends (a
                # process would not exit past it): a stop that came while it was being
                # created must still cancel it.
                with self._watch_lock:
                    self._cancel_watch = cancel
                    stopped = self._stop.is_set()
                if stopped:
                    cancel()
                    break
                for event in events:
                    if self._stop.is_set():
                        break
                    self._apply(event)
            except Exception as exc:
                log.debug("etcd watch broke: %s", exc)
            if self._stop.wait(1.0):
                break
            self.resync()

    def _apply(self, event: dict[str, Any]) -> None:
        kv: dict[str, Any] = event.get("kv") or {}
        key = kv.get("key", b"")
        node_id = (key.decode() if isinstance(key, bytes) else str(key))[len(self.prefix) :]
        with self._lock:
            members = dict(self._members)
        if event.get("type") == "DELETE":
            members.pop(node_id, None)
        else:
            try:
                members[node_id] = _member_decoder.decode(kv.get("value", b""))
            except (msgspec.DecodeError, TypeError):
                return
        self._replace(members)

    # -- registering (daemons) ------------------------------------------------------------

    def register(self, member: Member, ttl: int) -> None:
        """Publish ``member`` under a lease of ``ttl`` seconds and keep it alive."""
        self._registered = member
        self._ttl = ttl
        self._put_with_new_lease()
        thread = threading.Thread(
            target=self._keepalive_loop, name="kvpool-etcd-lease", daemon=True
        )
        thread.start()
        self._threads.append(thread)

    def _put_with_new_lease(self) -> None:
        assert self._registered is not None
        self._lease = self._client.lease(self._ttl)  # type: ignore[attr-defined]
        key = self.prefix + self._registered.node_id
        self._client.put(key, msgspec.json.encode(self._registered), lease=self._lease)  # type: ignore[attr-defined]

    def _keepalive_loop(self) -> None:
        interval = max(self._ttl / 3, 0.2)
        while not self._stop.wait(interval):
            try:
                if self._lease is None or self._lease.refresh() <= 0:  # type: ignore[attr-defined]
                    log.warning("etcd lease expired; registering again")
                    self._put_with_new_lease()
            except Exception as exc:
                log.debug("etcd keepalive failed: %s", exc)
                self._lease = None

    def stop(self) -> None:
        with self._watch_lock:
            self._stop.set()
            cancel = self._cancel_watch
        if cancel is not None:
            try:
                cancel()
            except Exception as exc:  # the watch thread may already be gone
                log.debug("cancelling the etcd watch: %s", exc)
        if self._lease is not None:
            try:
                self._lease.revoke()  # type: ignore[attr-defined]
            except Exception as exc:
                log.debug("revoking the etcd lease: %s", exc)
        for thread in self._threads:
            thread.join(timeout=3)

    def wait_synced(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_synced and time.monotonic() < deadline:
            if not self.resync():
                time.sleep(0.1)
        return self.is_synced


def membership_for(
    peers: tuple[str, ...], etcd: str, prefix: str, timeout: float = 2.0, ca: str = ""
) -> Membership | None:
    """The membership a configuration names, or ``None`` for a single node (``ca``: the CA
    an ``https://`` etcd's certificate is verified against)."""
    if etcd:
        return EtcdMembership(etcd, prefix, timeout=timeout, ca=ca)
    if peers:
        return StaticMembership(peers)
    return None
