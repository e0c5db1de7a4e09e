"""The public blocking client, :class:`Client` (thread-safe).

It speaks to the node on this host (the *local* node) through shared memory when it can,
and takes these values:

- ``keys``: raw bytes, ``namespace id + block hash`` (see :mod:`kvpool.keys`);
- ``values`` / ``buffers``: anything with the buffer protocol (bytes, bytearray, numpy
  arrays) or CPU torch tensors, C-contiguous.

Every call has a deadline (``timeout``, default from the config).  Outcomes that are not
errors come back as values (:class:`PutResult`, :class:`GetResult`).  With ``peers=`` or
``etcd=`` the client sees a whole cluster; where its calls go is the business of
:mod:`kvpool.client.routing`.  :class:`~kvpool.client.aio.AsyncClient` is this client,
awaitable.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from typing import Any, TypedDict, TypeVar, Unpack

from kvpool.config import ClientConfig, client_config_from
from kvpool.errors import ConfigError, Status, TransportError, UsageError
from kvpool.keys import BlockOrigin, EngineRef, Namespace
from kvpool.limits import LeaseLimits
from kvpool.protocol.messages import Health, NodeStats, PrefetchResponse
from kvpool.retention import check_duration, check_priority

from . import ops
from .futures import PoolFuture
from .node import NodeClient
from .ops import GetResult, LookupState, PutResult, Retained
from .routing import ClusterClient
from .transactions import ReadTransaction, WriteTransaction
from .writer import Writer

T = TypeVar("T")

_BACKGROUND_THREADS = 4


class LookupOptions(TypedDict, total=False):
    """:meth:`Client.lookup`'s options: :meth:`Client.lookup_state`'s, but ``prefetch``."""

    wait: float
    wait_absent: bool
    timeout: float | None


class GetOptions(TypedDict, total=False):
    """:meth:`Client.get_async`'s options: :meth:`Client.get`'s."""

    prefix: bool
    timeout: float | None


def make_config(
    address: str | None, config: ClientConfig | None, options: dict[str, Any]
) -> ClientConfig:
    if config is not None and options:
        raise UsageError("pass either config= or keyword options, not both")
    if config is None:
        if address is not None:
            options["address"] = address
        return client_config_from(options)
    return config.replace(address=address) if address is not None else config.validate()


class Client:
    """A blocking, thread-safe kvpool client.

    ``Client()`` connects to the default local node; ``Client("host:9400")`` to another;
    keyword options override ``KVPOOL_*`` environment variables (see
    :class:`~kvpool.config.ClientConfig`).  ``on_arena_mapped``: see :meth:`on_arena_mapped`.

    With ``peers=`` or ``etcd=`` it sees a whole cluster: writes go to the local node (which
    writes them through to their home nodes); reads try the local node, then the keys' home
    nodes in parallel, then the other nodes; lookups ask every node in parallel (unless
    ``read_local_only``).  A node that is down or frozen turns its keys into misses; it
    never makes a call outlast its deadline.  Without a local node (``address=""``), writes
    go straight to the home nodes.  Every kind of write and read takes these routes: puts
    and gets, the writer's puts, and write and read transactions (``begin_write`` /
    ``begin_read``, also named ``reserve`` / ``acquire``).

    Why so many methods (31): this is the SDK's public interface, an operation a method
    (lookup, put, get, delete, retain, prefetch, the transactions and their aliases, the
    async forms, stats, health, ...); each routes through :mod:`.routing` and the
    connection's operations (:mod:`.ops`), which hold the logic.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        config: ClientConfig | None = None,
        on_arena_mapped: Callable[[memoryview, memoryview | None], None] | None = None,
        **options: Any,
    ):
        self.config = make_config(address, config, options)
        self.local: NodeClient | None = (
            NodeClient(self.config.address, self.config) if self.config.address else None
        )
        if on_arena_mapped is not None:
            self.on_arena_mapped(on_arena_mapped)
        self.cluster: ClusterClient | None = None
        if self.config.peers or self.config.etcd:
            self.cluster = ClusterClient(self.config, self.local)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

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

    def on_arena_mapped(self, hook: Callable[[memoryview, memoryview | None], None]) -> None:
        """Call ``hook(arena, old)`` whenever the client maps the local node's arena (at
        the first call, and after the node restarts), before any operation uses it: e.g.
        to register it with a GPU runtime.  Nothing happens without a local node."""
        if self.local is not None:
            self.local.on_arena_mapped(hook)

    def _deadline(self, timeout: float | None) -> float:
        return time.monotonic() + (timeout if timeout is not None else self.config.timeout_s)

    def _require_local(self) -> NodeClient:
        if self.local is None:
            raise UsageError("this client has no local node (address='')")
        return self.local

    # -- blocks ---------------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], **options: Unpack[LookupOptions]) -> int:
        """The length of the longest stored prefix of ``keys`` (anywhere in the cluster).

        With ``wait`` > 0, keys that are being written are awaited up to ``wait`` seconds
        (and, with ``wait_absent``, keys nobody has started writing yet).
        """
        return self.lookup_state(keys, **options).num_prefix

    def lookup_state(
        self,
        keys: Sequence[bytes],
        *,
        wait: float = 0.0,
        wait_absent: bool = False,
        prefetch: float = 0.0,
        timeout: float | None = None,
    ) -> LookupState:
        """Like :meth:`lookup`, and whether the key after the prefix is being written.

        With ``prefetch`` > 0 (seconds), the local node also starts bringing the blocks of
        the prefix that are only in its lower tiers into DRAM, and keeps them there that
        long for the read to come (see :meth:`prefetch`).
        """
        if self.cluster is not None:
            return self.cluster.lookup_state(
                keys, wait, wait_absent, self._deadline(timeout) + wait, prefetch
            )
        return self._require_local().lookup(keys, wait, wait_absent, timeout, prefetch)

    def prefetch(
        self,
        keys: Sequence[bytes],
        *,
        hold: float = 0.0,
        cancel: bool = False,
        timeout: float | None = None,
    ) -> PrefetchResponse:
        """Ask the local node to bring ``keys`` into its DRAM now (from its disk, the
        object store or other nodes), for a request that will read them soon, and keep
        them there until read or for ``hold`` seconds (0: the node's default hold; the node
        grants at most its longest, see :meth:`limits`).  Returns at once with what the
        node did; ``cancel`` releases an earlier prefetch."""
        return self._require_local().prefetch(keys, hold, cancel, timeout)

    def exists(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        """Whether each key is stored (anywhere in the cluster)."""
        if self.cluster is not None:
            return self.cluster.exists(keys, self._deadline(timeout))
        return self._require_local().exists(keys, timeout=timeout)

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        *,
        timeout: float | None = None,
        origins: Sequence[BlockOrigin | None] | None = None,
    ) -> PutResult:
        """Store one block per key: on the local node, written through to the keys' homes.
        ``origins``, per key: what the block was computed from (token ids and the parent's
        hash), which the node's KV events tell routers; the local node keeps them."""
        views = ops.check_buffers(keys, values, writable=False) or []
        return self._put_views(keys, views, self._deadline(timeout), origins)

    def _put_views(
        self,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        deadline: float,
        origins: Sequence[BlockOrigin | None] | None,
    ) -> PutResult:
        """Where every write of this client's is published: the cluster's routing, or the
        local node (the one routed path for puts, private buffers and the writer)."""
        if self.cluster is not None:
            return self.cluster.put(keys, views, deadline, origins)
        timeout = max(deadline - time.monotonic(), 0.0)
        return self._require_local().put(
            keys, views, replicate=self.config.write_rcache, timeout=timeout, origins=origins
        )

    def _send_buffers(
        self,
        keys: list[bytes],
        views: list[memoryview],
        timeout: float | None,
        origins: list[BlockOrigin | None] | None,
    ) -> PutResult:
        return self._put_views(keys, views, self._deadline(timeout), origins)

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
        if self.cluster is not None:
            return self.cluster.get(keys, dsts, prefix, self._deadline(timeout))
        return self._require_local().get(keys, dsts, prefix=prefix, timeout=timeout)

    def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[Status]:
        if self.cluster is not None:
            return self.cluster.delete(keys, self._deadline(timeout))
        # The node deletes what it wrote through to the keys' homes, as it wrote it.
        local = self._require_local()
        return local.delete(keys, replicate=self.config.write_rcache, timeout=timeout)

    def retain(
        self,
        keys: Sequence[bytes],
        priority: int,
        duration_s: float = 0.0,
        *,
        timeout: float | None = None,
    ) -> Retained:
        """Ask the pool to keep the blocks of ``keys`` it holds now at ``priority`` (0-100;
        the default is 35) for ``duration_s`` (0: until they leave), a prefix's leaves first
        (:mod:`kvpool.retention`).  Advisory: what a tenant may hold above the default is
        bounded, and the answer counts the blocks refused past it."""
        try:
            check_priority(priority)
            check_duration(duration_s)
        except ConfigError as exc:
            raise UsageError(str(exc)) from exc
        if self.cluster is not None:
            return self.cluster.retain(keys, priority, duration_s, self._deadline(timeout))
        response = self._require_local().retain(keys, priority, duration_s, timeout=timeout)
        return Retained(response.num_retained, response.num_refused, response.num_missing)

    # -- transactions: fill or read blocks where they lie ---------------------------------

    def begin_write(
        self, keys: Sequence[bytes], sizes: Sequence[int], *, timeout: float | None = None
    ) -> WriteTransaction:
        """Stage blocks and hand out writable views to fill in place (arena memory on the
        node's host, private buffers elsewhere); ``commit()`` publishes them, ``abort()``
        gives the space back (see :mod:`kvpool.client.transactions`).  Keys already stored
        or being written get no view.  Private buffers are published as a put is: through
        the cluster's routing, when there is a cluster."""
        if self.local is not None:
            try:
                return WriteTransaction.begin(
                    self.local, keys, sizes, self.config.write_rcache, timeout, self._send_buffers
                )
            except TransportError:
                if self.cluster is None:
                    raise  # in a cluster a failing local node is a miss: the homes take it
        return WriteTransaction.buffered(keys, sizes, self._send_buffers)

    def begin_read(
        self, keys: Sequence[bytes], *, prefix: bool = True, timeout: float | None = None
    ) -> ReadTransaction:
        """Hand out read-only, checksum-verified views of stored blocks until ``end()``;
        with ``prefix``, only the leading run of present keys (see
        :mod:`kvpool.client.transactions`).  In a cluster, blocks the local node lacks are
        fetched from their homes into private buffers."""
        if self.cluster is not None:
            return self.cluster.begin_read(keys, prefix, self._deadline(timeout))
        return ReadTransaction.begin(self._require_local(), keys, prefix, timeout)

    def reserve(
        self, keys: Sequence[bytes], sizes: Sequence[int], *, timeout: float | None = None
    ) -> WriteTransaction:
        """:meth:`begin_write`, by its older name."""
        return self.begin_write(keys, sizes, timeout=timeout)

    def acquire(
        self, keys: Sequence[bytes], *, prefix: bool = True, timeout: float | None = None
    ) -> ReadTransaction:
        """:meth:`begin_read`, by its older name (its ``release()`` is ``end()``)."""
        return self.begin_read(keys, prefix=prefix, timeout=timeout)

    def writer(self, *, timeout: float | None = None) -> Writer:
        """A stream of puts to the local node whose commits overlap the next put's copy
        (see :mod:`kvpool.client.writer`); close it, or use it as a context manager.  In a
        cluster, a put the local node cannot take goes through the cluster's routing."""
        route = None if self.cluster is None else self._put_views
        if route is None:
            self._require_local()
        timeout_s = timeout if timeout is not None else self.config.timeout_s
        return Writer(self.local, self.config.write_rcache, timeout_s, route)

    # -- asynchronous save and load --------------------------------------------------------

    def _submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> PoolFuture[T]:
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                _BACKGROUND_THREADS, thread_name_prefix="kvpool-io"
            )
        return PoolFuture(self._executor.submit(fn, *args, **kwargs))

    def put_async(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PoolFuture[PutResult]:
        """Start a put; the values must stay unchanged until the future is ready."""
        return self._submit(self.put, list(keys), list(values), timeout=timeout)

    def get_async(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Any] | None = None,
        **options: Unpack[GetOptions],
    ) -> PoolFuture[GetResult]:
        """Start a get into ``buffers`` (options: :meth:`get`'s)."""
        return self._submit(
            self.get, list(keys), None if buffers is None else list(buffers), **options
        )

    # -- nodes ----------------------------------------------------------------------------

    def describe(
        self,
        namespace: Namespace,
        *,
        engine: EngineRef | None = None,
        saving: str = "",
        timeout: float | None = None,
    ) -> None:
        """Tell the node a namespace's human-readable label (shown by ``kvpool status``);
        without a local node, every member.  ``engine``: the engine (pod and model, as a
        router names them) that loads the namespace's blocks from that node, for the
        routers the node tells where blocks are (:mod:`kvpool.node.kthena`); a node keeps
        it for a while, so an engine says it again every
        :data:`~kvpool.keys.ENGINE_REFRESH_S`.  ``saving``: when the engine that writes
        the namespace saves ("eager" or "evicting"), shown by ``kvpool status``."""
        if self.local is None and self.cluster is not None:
            self.cluster.describe(namespace, engine, self._deadline(timeout), saving)
            return
        label = namespace.describe()
        local = self._require_local()
        local.describe(namespace.id, label, engine=engine, saving=saving, timeout=timeout)

    def limits(self, *, timeout: float | None = None) -> LeaseLimits:
        """The local node's lease limits: the longest pin, reservation, prefetch hold and
        wait it grants, whatever a call asks for (the node decides; see
        :class:`~kvpool.limits.LeaseLimits`)."""
        return self._require_local().limits(timeout)

    def stats(self, *, timeout: float | None = None) -> NodeStats:
        """The local node's statistics."""
        return self._require_local().stats(timeout=timeout)

    def cluster_stats(self, *, timeout: float | None = None) -> list[tuple[str, NodeStats | None]]:
        """Every member's statistics, ``None`` for a node that did not answer."""
        if self.cluster is not None:
            return self.cluster.stats(self._deadline(timeout))
        return [(str(self._require_local().address), self.stats(timeout=timeout))]

    def health(self, *, timeout: float | None = None) -> Health:
        """The local node's health; without a local node, that of the first member of the
        cluster that answers (raises if none does)."""
        if self.local is None and self.cluster is not None:
            return self.cluster.health(self._deadline(timeout))
        return self._require_local().health(timeout=timeout)

    @property
    def uses_shm(self) -> bool:
        """Whether this client copies through the local node's shared-memory arena."""
        return self.local is not None and self.local.has_shm
