"""A client's view of a cluster: the members, a connection pool per node, and calls fanned
out to several nodes in parallel under one deadline.

A node that fails a call is marked down for a short cool-down, during which calls skip it
(its keys are misses); a node that stops answering never holds a caller past its deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any, TypeVar

from kvpool.cluster.membership import EtcdMembership, Member, Membership, membership_for
from kvpool.cluster.placement import Placement
from kvpool.config import Address, ClientConfig
from kvpool.errors import KVPoolError, TransportError

from .node import NodeClient

T = TypeVar("T")

DOWN_COOLDOWN_S = 0.5
FAN_OUT_THREADS = 16
ETCD_SYNC_TIMEOUT_S = 5.0


class ClusterView:
    def __init__(self, config: ClientConfig, local: NodeClient | None):
        membership = membership_for(config.peers, config.etcd, config.etcd_prefix, config.timeout_s)
        assert membership is not None
        self.membership: Membership = membership
        if isinstance(membership, EtcdMembership):
            membership.start()
            membership.wait_synced(ETCD_SYNC_TIMEOUT_S)
        self.config = config
        self.local = local
        self._local_address: str | None = None
        self._clients: dict[str, NodeClient] = {}
        self._down_until: dict[str, float] = {}
        self._placement = Placement([], config.replicas)
        self._lock = threading.Lock()
        self._executor = ThreadPoolExecutor(FAN_OUT_THREADS, thread_name_prefix="kvpool-fanout")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.membership.stop()
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    # -- members --------------------------------------------------------------------------

    def members(self) -> list[Member]:
        return self.membership.members()

    @property
    def local_id(self) -> str:
        """The member id of the local node ("" if none, or it is not a member)."""
        if self.local is None:
            return ""
        if self._local_address is None:
            try:
                self._local_address = str(Address.parse(self.local.welcome.tcp_address))
            except KVPoolError:
                return ""
        for member in self.members():
            if member.tcp_address == self._local_address:
                return member.node_id
        return ""

    def client(self, member: Member) -> NodeClient:
        with self._lock:
            client = self._clients.get(member.tcp_address)
            if client is None:
                client = NodeClient(member.tcp_address, self.config)
                self._clients[member.tcp_address] = client
            return client

    def is_down(self, member: Member) -> bool:
        return time.monotonic() < self._down_until.get(member.tcp_address, 0.0)

    def mark_down(self, member: Member) -> None:
        self._down_until[member.tcp_address] = time.monotonic() + DOWN_COOLDOWN_S

    # -- fan-out --------------------------------------------------------------------------

    def placement(self, members: Sequence[Member]) -> Placement:
        """The placement of the current members (remembered while they do not change)."""
        node_ids = tuple(sorted(m.node_id for m in members))
        placement = self._placement
        if placement.node_ids != node_ids:
            placement = self._placement = Placement(members, self.config.replicas)
        return placement

    def groups(self, keys: Sequence[bytes]) -> dict[Member, list[int]]:
        """Indices of ``keys`` per home node that is not the local node and not down."""
        members = {m.node_id: m for m in self.members()}
        out: dict[Member, list[int]] = {}
        placement = self.placement(list(members.values()))
        for node_id, indices in placement.group(keys, skip=self.local_id).items():
            member = members[node_id]
            if not self.is_down(member):
                out[member] = indices
        return out

    def fan_out(
        self, calls: dict[Member, Callable[[NodeClient, float], T]], deadline: float
    ) -> dict[Member, T | BaseException]:
        """Run one call per node in parallel; each gets the time left to ``deadline``.  A
        node that fails or does not answer in time yields its exception."""
        if not calls:
            return {}
        futures: dict[Future[T], Member] = {}
        for member, call in calls.items():
            remaining = deadline - time.monotonic()
            client = self.client(member)
            futures[self._executor.submit(call, client, max(remaining, 0.001))] = member
        done, _ = wait_futures(futures, timeout=max(deadline - time.monotonic(), 0))
        results: dict[Member, T | BaseException] = {}
        for future, member in futures.items():
            if future in done:
                exc = future.exception()
                if exc is None:
                    results[member] = future.result()
                    continue
                results[member] = exc
            else:
                results[member] = TransportError(
                    "no answer before the deadline", node=member.node_id
                )
            if isinstance(results[member], TransportError):
                self.mark_down(member)
        return results

    def each_result(self, results: dict[Member, Any]) -> list[tuple[Member, Any]]:
        return [(m, r) for m, r in results.items() if not isinstance(r, BaseException)]
