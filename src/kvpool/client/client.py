"""The public clients: :class:`Client` (blocking, thread-safe) and :class:`AsyncClient`.

Both speak to the node on this host (the *local* node) through shared memory when they
can, and take the same values:

- ``keys``: raw bytes, ``namespace id + block hash`` (see :mod:`kvpool.keys`);
- ``values`` / ``buffers``: anything with the buffer protocol (bytes, bytearray, numpy
  arrays) or CPU torch tensors, C-contiguous.

Every call has a deadline (``timeout``, default from the config).  Outcomes that are not
errors come back as values (:class:`PutResult`, :class:`GetResult`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from itertools import takewhile
from typing import Any, Generic, TypeVar

from kvpool.cluster.placement import group_by_home
from kvpool.config import ClientConfig, client_config_from
from kvpool.errors import (
    KVPoolError,
    NodeUnavailable,
    PoolTimeout,
    Status,
    TransportError,
    UsageError,
)
from kvpool.keys import Namespace
from kvpool.protocol.messages import Health, NodeStats

from . import ops
from .cluster import ClusterView
from .leases import ReadLease, WriteLease
from .node import AsyncNodeClient, NodeClient
from .ops import GetResult, LookupState, PutResult

T = TypeVar("T")

_BACKGROUND_THREADS = 4
# Blocks read from other nodes that are being copied into the local node, at most.
MAX_PROMOTING_BYTES = 256 << 20
# A read asks the nodes other than the keys' homes only with at least this much time left.
MIN_SECOND_ROUND_S = 0.01


class PoolFuture(Generic[T]):
    """The pending result of an asynchronous save or load."""

    def __init__(self, future: concurrent.futures.Future[T]):
        self._future = future

    def ready(self) -> bool:
        """Whether the operation has finished (successfully or not)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> T:
        """The result, waiting up to ``timeout``; raises what the operation raised."""
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[PoolFuture[T]], Any]) -> None:
        self._future.add_done_callback(lambda _: fn(self))


def _config(
    address: str | None, config: ClientConfig | None, options: dict[str, Any]
) -> ClientConfig:
    if config is not None and options:
        raise UsageError("pass either config= or keyword options, not both")
    if config is None:
        if address is not None:
            options["address"] = address
        return client_config_from(options)
    return config.replace(address=address) if address is not None else config.validate()


def _presence_call(
    keys: list[bytes],
) -> Callable[[NodeClient, float], tuple[list[bool], list[bool]]]:
    return lambda node, timeout: node.presence(keys, timeout=timeout)


def _put_call(
    keys: list[bytes], views: list[memoryview]
) -> Callable[[NodeClient, float], PutResult]:
    return lambda node, timeout: node.put(keys, views, replicate=True, timeout=timeout)


def _get_call(
    keys: list[bytes], dsts: list[memoryview] | None
) -> Callable[[NodeClient, float], GetResult]:
    return lambda node, timeout: node.get(keys, dsts, timeout=timeout)


def _delete_call(keys: list[bytes]) -> Callable[[NodeClient, float], list[Any]]:
    return lambda node, timeout: node.delete(keys, timeout=timeout)


class Client:
    """A blocking, thread-safe kvpool client.

    ``Client()`` connects to the default local node; ``Client("host:9400")`` to another;
    keyword options override ``KVPOOL_*`` environment variables (see
    :class:`~kvpool.config.ClientConfig`).

    With ``peers=`` or ``etcd=`` it sees a whole cluster: writes go to the local node (which
    writes them through to their home nodes); reads try the local node, then the keys' home
    nodes in parallel, then the other nodes; lookups ask every node in parallel (unless
    ``read_local_only``).  A node that is down or frozen
    turns its keys into misses; it never makes a call outlast its deadline.  Without a local
    node (``address=""``), writes go straight to the home nodes.
    """

    def __init__(
        self, address: str | None = None, *, config: ClientConfig | None = None, **options: Any
    ):
        self.config = _config(address, config, options)
        self.local: NodeClient | None = (
            NodeClient(self.config.address, self.config) if self.config.address else None
        )
        self.cluster: ClusterView | None = None
        if self.config.peers or self.config.etcd:
            self.cluster = ClusterView(self.config, self.local)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._promote_lock = threading.Lock()
        self._promoting_bytes = 0

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self.cluster is not None:
            self.cluster.close()
        if self.local is not None:
            self.local.close()

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (timeout if timeout is not None else self.config.timeout_s)

    def _remote(self) -> ClusterView | None:
        return None if self.config.read_local_only else self.cluster

    def _local_or_miss(
        self, call: Callable[[NodeClient, float], T], miss: T, deadline: float
    ) -> tuple[T, bool]:
        """A call to the local node with the time left to ``deadline``; in a cluster a
        failing local node is a miss.  Returns the result and whether the node answered."""
        if self.local is None:
            return miss, False
        remaining = deadline - time.monotonic()
        try:
            if remaining <= 0:
                raise PoolTimeout("deadline passed before the local node was asked")
            return call(self.local, remaining), True
        except TransportError:
            if self.cluster is None:
                raise
            return miss, False

    # -- blocks ---------------------------------------------------------------------------

    def lookup(
        self,
        keys: Sequence[bytes],
        *,
        wait: float = 0.0,
        wait_absent: bool = False,
        timeout: float | None = None,
    ) -> int:
        """The length of the longest stored prefix of ``keys`` (anywhere in the cluster).

        With ``wait`` > 0, keys that are being written are awaited up to ``wait`` seconds
        (and, with ``wait_absent``, keys nobody has started writing yet).
        """
        return self.lookup_state(
            keys, wait=wait, wait_absent=wait_absent, timeout=timeout
        ).num_prefix

    def lookup_state(
        self,
        keys: Sequence[bytes],
        *,
        wait: float = 0.0,
        wait_absent: bool = False,
        timeout: float | None = None,
    ) -> LookupState:
        """Like :meth:`lookup`, and whether the key after the prefix is being written."""
        deadline = self._deadline(timeout) + wait
        local, answered = self._local_or_miss(
            lambda node, t: node.lookup(keys, wait=wait, wait_absent=wait_absent, timeout=t - wait),
            LookupState(0, False),
            deadline,
        )
        cluster = self._remote()
        if cluster is None or local.num_prefix == len(keys):
            return local
        rest = list(keys[local.num_prefix :])
        # Past the local prefix, a key counts if any node has it; the key after the prefix
        # is pending if any node is writing it (a producer on another host, say).
        present = [False] * len(rest)
        if answered:
            present, _ = self._local_or_miss(
                lambda node, t: node.exists(rest, timeout=t), present, deadline
            )
        remote, pending = self._remote_presence(cluster, rest, deadline)
        present = [a or b for a, b in zip(present, remote, strict=True)]
        extra = len(list(takewhile(bool, present)))
        is_next_pending = extra < len(rest) and (
            pending[extra] or (extra == 0 and local.is_next_pending)
        )
        return LookupState(local.num_prefix + extra, is_next_pending)

    def _remote_presence(
        self, cluster: ClusterView, keys: list[bytes], deadline: float
    ) -> tuple[list[bool], list[bool]]:
        """Which keys another node has, and which another node is writing."""
        # Every live node, not only the homes: a block can sit on its writer's node before
        # it is written through to its home (or when writing through failed).
        groups = cluster.groups(keys, among="all")
        calls = {
            member: _presence_call([keys[i] for i in indices]) for member, indices in groups.items()
        }
        present = [False] * len(keys)
        pending = [False] * len(keys)
        for member, (found, writing) in cluster.each_result(cluster.fan_out(calls, deadline)):
            for i, is_found, is_writing in zip(groups[member], found, writing, strict=True):
                present[i] = present[i] or is_found
                pending[i] = pending[i] or is_writing
        return present, pending

    def exists(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        """Whether each key is stored (anywhere in the cluster)."""
        deadline = self._deadline(timeout)
        present, _ = self._local_or_miss(
            lambda node, t: node.exists(keys, timeout=t), [False] * len(keys), deadline
        )
        cluster = self._remote()
        missing = [i for i, p in enumerate(present) if not p]
        if cluster is not None and missing:
            remote, _ = self._remote_presence(cluster, [keys[i] for i in missing], deadline)
            for i, found in zip(missing, remote, strict=True):
                present[i] = found
        return present

    def put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PutResult:
        """Store one block per key: on the local node, written through to the keys' homes."""
        views = ops.check_buffers(keys, values, writable=False)
        assert views is not None
        deadline = self._deadline(timeout)
        result, answered = self._local_or_miss(
            lambda node, t: node.put(keys, views, replicate=self.config.write_rcache, timeout=t),
            PutResult([Status.UNAVAILABLE] * len(keys)),
            deadline,
        )
        if answered or self.cluster is None:
            if self.local is None:
                raise UsageError("no local node and no cluster to write to")
            return result
        return self._put_to_homes(self.cluster, keys, views, deadline)

    def _put_to_homes(
        self,
        cluster: ClusterView,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        deadline: float,
    ) -> PutResult:
        members = {m.node_id: m for m in cluster.members()}
        groups = group_by_home(keys, list(members.values()), 1)
        # Private copies: a call still streaming at the deadline must not read the caller's
        # buffers after this returns (they may be reused, and would be stored as they are).
        copies = [memoryview(bytes(v)) for v in views]
        calls = {
            members[node_id]: (_put_call([keys[i] for i in indices], [copies[i] for i in indices]))
            for node_id, indices in groups.items()
        }
        statuses = [Status.UNAVAILABLE] * len(keys)
        for member, result in cluster.fan_out(calls, deadline).items():
            if isinstance(result, BaseException):
                continue
            for i, status in zip(groups[member.node_id], result.statuses, strict=True):
                statuses[i] = status
        return PutResult(statuses)

    def get(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Any] | None = None,
        *,
        prefix: bool = False,
        timeout: float | None = None,
    ) -> GetResult:
        """Load blocks into ``buffers`` (one per key, at least the block's size), or return
        them as ``GetResult.values`` when no buffers are given.  Only verified bytes are
        delivered; with ``prefix``, loading stops at the first missing block."""
        dsts = ops.check_buffers(keys, buffers, writable=True)
        deadline = self._deadline(timeout)
        miss = GetResult(
            [Status.NOT_FOUND] * len(keys),
            [-1] * len(keys),
            [None] * len(keys) if dsts is None else [],
        )
        cluster = self._remote()
        result, _ = self._local_or_miss(
            lambda node, t: node.get(keys, dsts, prefix=prefix and cluster is None, timeout=t),
            miss,
            deadline,
        )
        missing = [i for i, s in enumerate(result.statuses) if s is not Status.OK]
        if cluster is not None and missing:
            self._get_remote(cluster, keys, dsts, result, missing, deadline)
        if prefix:
            cut = result.num_prefix
            for i in range(cut, len(keys)):
                if result.statuses[i] is Status.OK:
                    result.statuses[i] = Status.NOT_FOUND
                    result.sizes[i] = -1
                    if result.values:
                        result.values[i] = None
        return result

    def _get_remote(
        self,
        cluster: ClusterView,
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
            groups = cluster.groups([keys[i] for i in todo], among=among)
            calls = {
                member: _get_call([keys[todo[j]] for j in sub], None)
                for member, sub in groups.items()
            }
            for member, remote in cluster.each_result(cluster.fan_out(calls, deadline)):
                assert remote.values is not None
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
                    # The caller may change what it was handed before the promotion runs.
                    fetched_values.append(value if dsts is not None else bytes(value))
        if fetched_keys and self.local is not None:
            self._promote(fetched_keys, fetched_values)

    def _promote(self, keys: list[bytes], values: list[bytes]) -> None:
        """Copy blocks read from other nodes into the local node, in the background, so the
        next read is local (best effort)."""
        local = self.local
        assert local is not None
        num_bytes = sum(len(v) for v in values)
        with self._promote_lock:
            # Bounded: when the local node is slow, promotions are dropped, not queued.
            if self._promoting_bytes + num_bytes > MAX_PROMOTING_BYTES:
                return
            self._promoting_bytes += num_bytes

        def promote() -> None:
            try:
                with contextlib.suppress(KVPoolError):
                    local.put(keys, [memoryview(v) for v in values], replicate=False)
            finally:
                with self._promote_lock:
                    self._promoting_bytes -= num_bytes

        self._background().submit(promote)

    def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[Any]:
        deadline = self._deadline(timeout)
        statuses, _ = self._local_or_miss(
            lambda node, t: node.delete(keys, timeout=t), [Status.NOT_FOUND] * len(keys), deadline
        )
        if self.cluster is not None:
            groups = self.cluster.groups(keys, among="all")
            calls = {member: _delete_call([keys[i] for i in idx]) for member, idx in groups.items()}
            for member, remote in self.cluster.each_result(self.cluster.fan_out(calls, deadline)):
                for i, status in zip(groups[member], remote, strict=True):
                    if status is Status.OK:
                        statuses[i] = Status.OK
        return statuses

    # -- zero-copy leases -------------------------------------------------------------------

    def reserve(
        self, keys: Sequence[bytes], sizes: Sequence[int], *, timeout: float | None = None
    ) -> WriteLease:
        """Reserve space for blocks and hand out writable views to fill in place (arena
        memory on the node's host, private buffers elsewhere); ``commit()`` publishes them.
        Keys already stored or being written get no view."""
        if self.local is None:
            return WriteLease.buffered(keys, sizes, lambda ks, vs, t: self.put(ks, vs, timeout=t))
        return WriteLease.open(self.local, keys, sizes, self.config.write_rcache, timeout)

    def acquire(
        self, keys: Sequence[bytes], *, prefix: bool = True, timeout: float | None = None
    ) -> ReadLease:
        """Pin stored blocks and hand out read-only, checksum-verified views of them until
        ``release()``; with ``prefix``, only the leading run of present keys.  In a cluster,
        blocks the local node lacks are fetched from their homes into private buffers."""
        deadline = self._deadline(timeout)
        cluster = self._remote()
        # In a cluster, pin every block the local node has, not just its leading run: the
        # gaps are filled from the other nodes.
        local_prefix = prefix and cluster is None
        if self.local is None:
            lease = ReadLease.empty(keys)
        else:
            try:
                lease = ReadLease.open(self.local, keys, local_prefix, timeout)
            except TransportError:
                if self.cluster is None:
                    raise
                lease = ReadLease.empty(keys)
        if cluster is None or lease.num_prefix == len(keys):
            return lease
        missing = [i for i, view in enumerate(lease.views) if view is None]
        fetched = GetResult([Status.NOT_FOUND] * len(keys), [-1] * len(keys), [None] * len(keys))
        self._get_remote(cluster, keys, None, fetched, missing, deadline)
        for i in missing:
            value = fetched.values[i]
            if fetched.statuses[i] is Status.OK and value is not None:
                lease.adopt(i, memoryview(value))
        return lease

    # -- asynchronous save and load --------------------------------------------------------

    def _background(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                _BACKGROUND_THREADS, thread_name_prefix="kvpool-io"
            )
        return self._executor

    def _submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> PoolFuture[T]:
        return PoolFuture(self._background().submit(fn, *args, **kwargs))

    def put_async(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PoolFuture[PutResult]:
        """Start a put; the values must stay unchanged until the future is ready."""
        return self._submit(self.put, list(keys), list(values), timeout=timeout)

    def get_async(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Any] | None = None,
        *,
        prefix: bool = False,
        timeout: float | None = None,
    ) -> PoolFuture[GetResult]:
        """Start a get into ``buffers``."""
        return self._submit(
            self.get,
            list(keys),
            None if buffers is None else list(buffers),
            prefix=prefix,
            timeout=timeout,
        )

    # -- nodes ----------------------------------------------------------------------------

    def _require_local(self) -> NodeClient:
        if self.local is None:
            raise UsageError("this client has no local node (address='')")
        return self.local

    def describe(self, namespace: Namespace, *, timeout: float | None = None) -> None:
        """Tell the node a namespace's human-readable label (shown by ``kvpool status``);
        without a local node, every member."""
        if self.local is not None or self.cluster is None:
            self._require_local().describe(namespace.id, namespace.describe(), timeout=timeout)
            return
        label = namespace.describe()
        calls = {
            m: (lambda node, t: node.describe(namespace.id, label, timeout=t))
            for m in self.cluster.members()
        }
        self.cluster.fan_out(calls, self._deadline(timeout))

    def stats(self, *, timeout: float | None = None) -> NodeStats:
        """The local node's statistics."""
        return self._require_local().stats(timeout=timeout)

    def cluster_stats(self, *, timeout: float | None = None) -> list[tuple[str, NodeStats | None]]:
        """Every member's statistics, ``None`` for a node that did not answer."""
        if self.cluster is None:
            return [(str(self._require_local().address), self.stats(timeout=timeout))]
        calls = {m: (lambda node, t: node.stats(timeout=t)) for m in self.cluster.members()}
        results = self.cluster.fan_out(calls, self._deadline(timeout))
        return [
            (m.tcp_address, None if isinstance(r, BaseException) else r)
            for m, r in sorted(results.items(), key=lambda mr: mr[0].node_id)
        ]

    def health(self, *, timeout: float | None = None) -> Health:
        """The local node's health; without a local node, that of the first member of the
        cluster that answers (raises if none does)."""
        if self.local is not None or self.cluster is None:
            return self._require_local().health(timeout=timeout)
        calls = {m: (lambda node, t: node.health(timeout=t)) for m in self.cluster.members()}
        results = self.cluster.fan_out(calls, self._deadline(timeout))
        answers = self.cluster.each_result(results)
        if answers:
            return answers[0][1]
        raise NodeUnavailable("no member of the cluster answered")

    @property
    def uses_shm(self) -> bool:
        """Whether this client copies through the local node's shared-memory arena."""
        return self.local is not None and self.local.has_shm


class AsyncClient:
    """An asyncio kvpool client of one node (no cluster); the operations of :class:`Client`,
    awaitable."""

    def __init__(
        self, address: str | None = None, *, config: ClientConfig | None = None, **options: Any
    ):
        self.config = _config(address, config, options)
        if self.config.peers or self.config.etcd or not self.config.address:
            raise UsageError(
                "AsyncClient talks to one node; use Client for a cluster (peers= or etcd=)"
            )
        self.local = AsyncNodeClient(self.config.address, self.config)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.local.close()

    async def lookup(
        self,
        keys: Sequence[bytes],
        *,
        wait: float = 0.0,
        wait_absent: bool = False,
        timeout: float | None = None,
    ) -> int:
        state = await self.local.lookup(keys, wait=wait, wait_absent=wait_absent, timeout=timeout)
        return state.num_prefix

    async def exists(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        return await self.local.exists(keys, timeout=timeout)

    async def put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PutResult:
        views = ops.check_buffers(keys, values, writable=False)
        assert views is not None
        return await self.local.put(
            keys, views, replicate=self.config.write_rcache, timeout=timeout
        )

    async def get(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Any] | None = None,
        *,
        prefix: bool = False,
        timeout: float | None = None,
    ) -> GetResult:
        dsts = ops.check_buffers(keys, buffers, writable=True)
        return await self.local.get(keys, dsts, prefix=prefix, timeout=timeout)

    async def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[Any]:
        return await self.local.delete(keys, timeout=timeout)

    async def describe(self, namespace: Namespace) -> None:
        await self.local.describe(namespace.id, namespace.describe())

    async def stats(self, *, timeout: float | None = None) -> NodeStats:
        return await self.local.stats(timeout=timeout)

    async def health(self, *, timeout: float | None = None) -> Health:
        return await self.local.health(timeout=timeout)
