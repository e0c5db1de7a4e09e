"""A client's view of a cluster: the members, a connection pool per node, and calls fanned
out to several nodes in parallel under one deadline.

A node that fails a call is marked down for a short cool-down, during which calls skip it
(its keys are misses); a node that stops answering never holds a caller past its deadline.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Literal, TypeVar

from kvpool.cluster.cooldown import Cooldowns
from kvpool.cluster.membership import EtcdMembership, Member, Membership, membership_for
from kvpool.cluster.placement import Placement
from kvpool.config import Address, ClientConfig
from kvpool.errors import ConfigError, KVPoolError, PoolTimeout, TransportError
from kvpool.limits import CLIENT_NODE_DOWN_S, MIN_FAIR_BUDGET_S

from .node import NodeClient

T = TypeVar("T")
log = logging.getLogger(__name__)

FAN_OUT_THREADS = 16
ETCD_SYNC_TIMEOUT_S = 5.0


class ClusterView:
    def __init__(self, config: ClientConfig, local: NodeClient | None):
        membership = membership_for(
            config.peers, config.etcd, config.etcd_prefix, config.timeout_s, ca=config.tls_ca
        )
        if membership is None:
            raise ConfigError("a cluster needs peers or etcd")
        self.membership: Membership = membership
        if isinstance(membership, EtcdMembership):
            membership.start()
            membership.wait_synced(ETCD_SYNC_TIMEOUT_S)
        self.config = config
        self.local = local
        self._local_address: str | None = None
        self._clients: dict[str, NodeClient] = {}
        self._down = Cooldowns(CLIENT_NODE_DOWN_S)
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
            # Only from a handshake already made: asking here could outlast the caller's
            # deadline.  Until then the local node is treated like any other member.
            welcome = self.local.last_welcome
            if welcome is None:
                return ""
            try:
                self._local_address = str(Address.parse(welcome.tcp_address))
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
        return self._down.is_down(member.tcp_address)

    def mark_down(self, member: Member) -> None:
        self._down.failed(member.tcp_address)

    # -- fan-out --------------------------------------------------------------------------

    def placement(self, members: Sequence[Member]) -> Placement:
        """The placement of the current members (remembered while they do not change)."""
        node_ids = tuple(sorted(m.node_id for m in members))
        placement = self._placement
        if placement.node_ids != node_ids:
            placement = self._placement = Placement(members, self.config.replicas)
        return placement

    def groups(
        self, keys: Sequence[bytes], among: Literal["homes", "all", "others"] = "homes"
    ) -> dict[Member, list[int]]:
        """Indices of ``keys`` per node to ask: each key's home nodes, every node, or every
        node but a key's homes; never the local node nor a node marked down."""
        members = {m.node_id: m for m in self.members()}
        local_id = self.local_id
        placement = self.placement(list(members.values()))
        by_node: dict[str, list[int]]
        if among == "homes":
            by_node = placement.group(keys, skip=local_id)
        else:
            by_node = {node_id: [] for node_id in members if node_id != local_id}
            for index, key in enumerate(keys):
                homes = placement.homes(key) if among == "others" else ()
                for node_id, indices in by_node.items():
                    if node_id not in homes:
                        indices.append(index)
        return {
            members[node_id]: indices
            for node_id, indices in by_node.items()
            if indices and not self.is_down(members[node_id])
        }

    def fan_out(
        self, calls: dict[Member, Callable[[NodeClient, float], T]], deadline: float
    ) -> dict[Member, T | BaseException]:
        """Run one call per node in parallel; each gets the time left to ``deadline``.  A
        node that fails or does not answer in time yields its exception."""
        if not calls:
            return {}
        futures: dict[Future[T | BaseException], tuple[Member, list[float]]] = {}
        for member, call in calls.items():
            budget: list[float] = []
            job = functools.partial(_run_until, call, self.client(member), deadline, budget)
            futures[self._executor.submit(job)] = (member, budget)
        done, _ = wait_futures(futures, timeout=max(deadline - time.monotonic(), 0))
        results: dict[Member, T | BaseException] = {}
        for future, (member, budget) in futures.items():
            if future in done:
                results[member] = future.result()
            else:
                future.cancel()  # one still queued never starts
                results[member] = TransportError(
                    "no answer before the deadline", node=member.node_id
                )
            # A node is marked down only when it had a fair chance to answer: not when the
            # caller's own deadline was (nearly) spent before its call started.
            fair = bool(budget) and budget[0] >= MIN_FAIR_BUDGET_S
            if fair and isinstance(results[member], TransportError):
                self.mark_down(member)
        return results

    def answers(
        self, calls: dict[Member, Callable[[NodeClient, float], T]], deadline: float
    ) -> list[tuple[Member, T]]:
        """:meth:`fan_out`, keeping only the nodes that answered."""
        results = self.fan_out(calls, deadline)
        return [(m, r) for m, r in results.items() if not isinstance(r, BaseException)]


def _run_until(
    call: Callable[[NodeClient, float], T],
    client: NodeClient,
    deadline: float,
    budget: list[float],
) -> T | BaseException:
    """Run ``call`` with the time left to ``deadline`` when it *starts* (a call that waited
    in the queue gets less, and one that starts too late does not touch the node); notes
    that time in ``budget``.  Failures come back as values: nothing raises into callers."""
    remaining = deadline - time.monotonic()
    budget.append(remaining)
    if remaining <= 0:
        return PoolTimeout("deadline passed before the call started")
    try:
        return call(client, remaining)
    except Exception as exc:
        if not isinstance(exc, KVPoolError):
            log.exception("call to %s failed", client.name)
        return exc
