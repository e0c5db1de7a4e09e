"""Operations across a cluster: where a client's reads, writes and lookups go.

- Writes go to the local node (which writes them through to the keys' home nodes).
  Without a local node, or when it fails, they go straight to the homes.
- Reads try the local node, then the keys' home nodes in parallel, then the other nodes,
  time allowing.  Blocks read elsewhere are copied into the local node in the
  background (bounded), so the next read is local.
- Lookups ask the local node for its prefix, then every other node which of the rest it
  has (a block can sit on its writer's node before it reaches its home).
- ``read_local_only`` keeps reads and lookups on the local node.

A node that is down or frozen turns its keys into misses; no call outlasts its deadline.
A failing local node is a miss here, never an error: the cluster has other copies.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import takewhile
from typing import Any, TypeVar

from kvpool.cluster.membership import Member
from kvpool.cluster.placement import group_by_home
from kvpool.config import ClientConfig
from kvpool.errors import KVPoolError, NodeUnavailable, PoolTimeout, Status, TransportError
from kvpool.keys import BlockOrigin, EngineRef, Namespace
from kvpool.limits import MIN_SECOND_ROUND_S
from kvpool.protocol.messages import Health, NodeStats
from kvpool.stats import TIER_REMOTE

from .fanout import ClusterView
from .node import NodeClient
from .ops import GetResult, LookupState, PutResult, Retained
from .transactions import ReadTransaction

T = TypeVar("T")

# Blocks read from other nodes that are being copied into the local node, at most.
MAX_LOCAL_COPY_BYTES = 256 << 20
LOCAL_COPY_THREADS = 2


class ClusterClient:
    """The cluster half of a :class:`~kvpool.client.client.Client`."""

    def __init__(self, config: ClientConfig, local: NodeClient | None):
        self.config = config
        self.local = local
        self.view = ClusterView(config, local)
        self._local_copy_lock = threading.Lock()
        self._local_copy_bytes = 0
        self._local_copier: ThreadPoolExecutor | None = None

    def members(self) -> list[Member]:
        """The cluster's members, as the client sees them now."""
        return self.view.members()

    def close(self) -> None:
        if self._local_copier is not None:
            self._local_copier.shutdown(wait=True)
        self.view.close()

    def _local(
        self, call: Callable[[NodeClient, float], T], miss: T, deadline: float
    ) -> tuple[T, bool]:
        """A call to the local node with the time left to ``deadline``; a failing local node
        is a miss.  Returns the result and whether the node answered."""
        if self.local is None:
            return miss, False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return miss, False
        try:
            return call(self.local, remaining), True
        except TransportError:
            return miss, False

    @property
    def _reads_remote(self) -> bool:
        return not self.config.read_local_only

    # -- lookups --------------------------------------------------------------------------

    def lookup_state(
        self,
        keys: Sequence[bytes],
        wait: float,
        wait_absent: bool,
        deadline: float,
        prefetch: float = 0.0,
    ) -> LookupState:
        local, answered = self._local(
            lambda node, t: node.lookup(keys, wait, wait_absent, t - wait, prefetch),
            LookupState(0, False),
            deadline,
        )
        if not self._reads_remote or local.num_prefix == len(keys):
            return local
        rest = list(keys[local.num_prefix :])
        # Past the local prefix, a key counts if any node has it; the key after the prefix
        # is pending if any node is writing it (a producer on another host, say).
        present = [False] * len(rest)
        if answered:
            present, _ = self._local(
                lambda node, t: node.exists(rest, timeout=t), present, deadline
            )
        remote, pending = self._remote_presence(rest, deadline)
        present = [a or b for a, b in zip(present, remote, strict=True)]
        extra = len(list(takewhile(bool, present)))
        is_next_pending = extra < len(rest) and (
            pending[extra] or (extra == 0 and local.is_next_pending)
        )
        tiers = (
            local.tiers + bytes([TIER_REMOTE]) * extra
            if local.tiers or not local.num_prefix
            else b""
        )
        return LookupState(local.num_prefix + extra, is_next_pending, tiers)

    def _remote_presence(self, keys: list[bytes], deadline: float) -> tuple[list[bool], list[bool]]:
        """Which keys another node has, and which another node is writing."""
        # Every live node, not only the homes: a block can sit on its writer's node before
        # it is written through to its home (or when writing through failed).
        groups = self.view.groups(keys, among="all")
        calls = {
            member: _bind(NodeClient.presence, [keys[i] for i in indices])
            for member, indices in groups.items()
        }
        present = [False] * len(keys)
        pending = [False] * len(keys)
        for member, (found, writing) in self.view.answers(calls, deadline):
            for i, is_found, is_writing in zip(groups[member], found, writing, strict=True):
                present[i] = present[i] or is_found
                pending[i] = pending[i] or is_writing
        return present, pending

    def exists(self, keys: Sequence[bytes], deadline: float) -> list[bool]:
        present, _ = self._local(
            lambda node, t: node.exists(keys, timeout=t), [False] * len(keys), deadline
        )
        missing = [i for i, p in enumerate(present) if not p]
        if self._reads_remote and missing:
            remote, _ = self._remote_presence([keys[i] for i in missing], deadline)
            for i, found in zip(missing, remote, strict=True):
                present[i] = found
        return present

    # -- writes ---------------------------------------------------------------------------

    def put(
        self,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        deadline: float,
        origins: Sequence[BlockOrigin | None] | None = None,
    ) -> PutResult:
        result, answered = self._local(
            lambda node, t: node.put(
                keys, views, replicate=self.config.write_rcache, timeout=t, origins=origins
            ),
            PutResult([Status.UNAVAILABLE] * len(keys)),
            deadline,
        )
        if answered:
            return result
        members = {m.node_id: m for m in self.view.members()}
        groups = group_by_home(keys, list(members.values()), 1)
        # Private copies: a call still streaming at the deadline must not read the caller's
        # buffers after this returns (they may be reused, and would be stored as they are).
        copies = [memoryview(bytes(v)) for v in views]
        calls = {
            members[node_id]: _bind(
                NodeClient.put, [keys[i] for i in indices], [copies[i] for i in indices]
            )
            for node_id, indices in groups.items()
        }
        result = PutResult([Status.UNAVAILABLE] * len(keys))
        for member, home_result in self.view.answers(calls, deadline):
            for i, status in zip(groups[member.node_id], home_result.statuses, strict=True):
                result.statuses[i] = status
            result.num_not_kept += home_result.num_not_kept
        return result

    # -- reads ----------------------------------------------------------------------------

    def get(
        self,
        keys: Sequence[bytes],
        dsts: Sequence[memoryview] | None,
        prefix: bool,
        deadline: float,
    ) -> GetResult:
        n = len(keys)
        miss = GetResult([Status.NOT_FOUND] * n, [-1] * n, [None] * n if dsts is None else [])
        result, _ = self._local(
            # With remote reads, every block the local node has: the gaps come from others.
            lambda node, t: node.get(
                keys, dsts, prefix=prefix and not self._reads_remote, timeout=t
            ),
            miss,
            deadline,
        )
        missing = [i for i, s in enumerate(result.statuses) if s is not Status.OK]
        if self._reads_remote and missing:
            self._get_remote(keys, dsts, result, missing, deadline)
        if prefix:
            for i in range(result.num_prefix, n):
                if result.statuses[i] is Status.OK:
                    result.statuses[i] = Status.NOT_FOUND
                    result.sizes[i] = -1
                    if result.values:
                        result.values[i] = None
        return result

    def begin_read(self, keys: Sequence[bytes], prefix: bool, deadline: float) -> ReadTransaction:
        """A read transaction of the local node's blocks, its gaps filled from the other
        nodes into private buffers."""
        read = ReadTransaction.empty(keys)
        if self.local is not None and deadline > time.monotonic():
            with contextlib.suppress(TransportError):
                local_prefix = prefix and not self._reads_remote
                timeout = deadline - time.monotonic()
                read = ReadTransaction.begin(self.local, keys, local_prefix, timeout)
        if not self._reads_remote or read.num_prefix == len(keys):
            return read
        missing = [i for i, view in enumerate(read.views) if view is None]
        n = len(keys)
        fetched = GetResult([Status.NOT_FOUND] * n, [-1] * n, [None] * n)
        self._get_remote(keys, None, fetched, missing, deadline)
        for i in missing:
            value = fetched.values[i]
            if fetched.statuses[i] is Status.OK and value is not None:
                read.adopt(i, memoryview(value))
        return read

    def _get_remote(
        self,
        keys: Sequence[bytes],
        dsts: Sequence[memoryview] | None,
        result: GetResult,
        indices: list[int],
        deadline: float,
    ) -> None:
        """Fetch ``keys[indices]`` from the keys' homes, then what they lack (a block its
        writer has not written through yet, say) from the other nodes, time allowing.

        Every node streams into buffers of its own, never into the caller's: a call still
        running at the deadline, or a second replica, must not write there after (or while)
        the first verified copy is delivered.  Copies land in the caller's thread."""
        fetched_keys, fetched_values = [], []
        for among in ("homes", "others"):
            done = (Status.OK, Status.REFUSED)  # refused: the caller's buffer is too small
            todo = [i for i in indices if result.statuses[i] not in done]
            if not todo or (among == "others" and deadline - time.monotonic() < MIN_SECOND_ROUND_S):
                break
            groups = self.view.groups([keys[i] for i in todo], among=among)
            calls = {
                member: _bind(NodeClient.get, [keys[todo[j]] for j in sub], None)
                for member, sub in groups.items()
            }
            for member, remote in self.view.answers(calls, deadline):
                for j, status, value in zip(
                    groups[member], remote.statuses, remote.values, strict=True
                ):
                    i = todo[j]
                    if status is not Status.OK or value is None or result.statuses[i] is Status.OK:
                        continue
                    if dsts is not None:
                        if len(dsts[i]) < len(value):
                            result.statuses[i] = Status.REFUSED  # the caller's buffer is too small
                            continue
                        dsts[i][: len(value)] = value
                    result.statuses[i] = Status.OK
                    result.sizes[i] = len(value)
                    if result.values:
                        result.values[i] = value
                    fetched_keys.append(keys[i])
                    # The caller may change what it was handed before the copy runs.
                    fetched_values.append(value if dsts is not None else bytes(value))
        if fetched_keys:
            self._copy_to_local(fetched_keys, fetched_values)

    def _copy_to_local(self, keys: list[bytes], values: list[bytes]) -> None:
        """Copy blocks read from other nodes into the local node, in the background, so the
        next read is local (best effort)."""
        local = self.local
        if local is None:
            return
        num_bytes = sum(len(v) for v in values)
        with self._local_copy_lock:
            # Bounded: when the local node is slow, copies are dropped, not queued.
            if self._local_copy_bytes + num_bytes > MAX_LOCAL_COPY_BYTES:
                return
            self._local_copy_bytes += num_bytes
            if self._local_copier is None:
                self._local_copier = ThreadPoolExecutor(
                    LOCAL_COPY_THREADS, thread_name_prefix="kvpool-local-copy"
                )

        def copy_to_local() -> None:
            try:
                with contextlib.suppress(KVPoolError):
                    local.put(keys, [memoryview(v) for v in values], replicate=False)
            finally:
                with self._local_copy_lock:
                    self._local_copy_bytes -= num_bytes

        self._local_copier.submit(copy_to_local)

    # -- the rest -------------------------------------------------------------------------

    def delete(self, keys: Sequence[bytes], deadline: float) -> list[Status]:
        statuses, _ = self._local(
            lambda node, t: node.delete(keys, replicate=False, timeout=t),
            [Status.NOT_FOUND] * len(keys),
            deadline,
        )
        groups = self.view.groups(keys, among="all")  # every node: none forwards it again
        calls = {
            m: _bind(NodeClient.delete, [keys[i] for i in idx], replicate=False)
            for m, idx in groups.items()
        }
        for member, remote in self.view.answers(calls, deadline):
            for i, status in zip(groups[member], remote, strict=True):
                if status is Status.OK:
                    statuses[i] = Status.OK
        return statuses

    def retain(
        self, keys: Sequence[bytes], priority: int, duration_s: float, deadline: float
    ) -> Retained:
        """On the local node and at the keys' homes (where reads find them), as ``delete``
        goes; the counts are summed over the nodes that answered (a block with a copy on
        two nodes counts twice)."""
        total = Retained()
        local, _ = self._local(
            lambda node, t: node.retain(keys, priority, duration_s, timeout=t), None, deadline
        )
        groups = self.view.groups(keys, among="all")
        calls = {
            m: _bind(NodeClient.retain, [keys[i] for i in idx], priority, duration_s)
            for m, idx in groups.items()
        }
        answers = [r for _, r in self.view.answers(calls, deadline)]
        for response in [local, *answers]:
            if response is not None:
                total.num_retained += response.num_retained
                total.num_refused += response.num_refused
                total.num_missing += response.num_missing
        return total

    def describe(
        self, namespace: Namespace, engine: EngineRef | None, deadline: float, saving: str = ""
    ) -> None:
        label = namespace.describe()
        calls = {
            m: _bind(NodeClient.describe, namespace.id, label, engine=engine, saving=saving)
            for m in self.view.members()
        }
        self.view.answers(calls, deadline)

    def stats(self, deadline: float) -> list[tuple[str, NodeStats | None]]:
        """Every member's statistics, ``None`` for a node that did not answer."""
        calls = {m: _bind(NodeClient.stats) for m in self.view.members()}
        results = self.view.fan_out(calls, deadline)
        return [
            (m.tcp_address, None if isinstance(r, BaseException) else r)
            for m, r in sorted(results.items(), key=lambda mr: mr[0].node_id)
        ]

    def health(self, deadline: float) -> Health:
        """The health of the first member that answers (raises if none does)."""
        calls = {m: _bind(NodeClient.health) for m in self.view.members()}
        answers = self.view.answers(calls, deadline)
        if answers:
            return answers[0][1]
        if deadline <= time.monotonic():
            raise PoolTimeout("no member of the cluster answered in time")
        raise NodeUnavailable("no member of the cluster answered")


def _bind(method: Callable[..., T], *args: Any, **kwargs: Any) -> Callable[[NodeClient, float], T]:
    """``method(node, *args, **kwargs, timeout=t)`` as a fan-out call."""
    return lambda node, timeout: method(node, *args, **kwargs, timeout=timeout)
