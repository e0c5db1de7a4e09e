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
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from kvpool.config import ClientConfig, client_config_from
from kvpool.errors import UsageError
from kvpool.keys import Namespace
from kvpool.protocol.messages import Health, NodeStats

from . import ops
from .leases import ReadLease, WriteLease
from .node import AsyncNodeClient, NodeClient
from .ops import GetResult, LookupState, PutResult

T = TypeVar("T")

_BACKGROUND_THREADS = 4


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


class Client:
    """A blocking, thread-safe kvpool client.

    ``Client()`` connects to the default local node; ``Client("host:9400")`` to another;
    keyword options override ``KVPOOL_*`` environment variables (see
    :class:`~kvpool.config.ClientConfig`).
    """

    def __init__(
        self, address: str | None = None, *, config: ClientConfig | None = None, **options: Any
    ):
        self.config = _config(address, config, options)
        self.local = NodeClient(self.config.address, self.config)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self.local.close()

    # -- blocks ---------------------------------------------------------------------------

    def lookup(
        self,
        keys: Sequence[bytes],
        *,
        wait: float = 0.0,
        wait_absent: bool = False,
        timeout: float | None = None,
    ) -> int:
        """The length of the longest stored prefix of ``keys``.

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
        return self.local.lookup(keys, wait=wait, wait_absent=wait_absent, timeout=timeout)

    def exists(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        """Whether each key is stored."""
        return self.local.exists(keys, timeout=timeout)

    def put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PutResult:
        """Store one block per key."""
        views = ops.check_buffers(keys, values, writable=False)
        assert views is not None
        return self.local.put(keys, views, replicate=self.config.write_rcache, timeout=timeout)

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
        return self.local.get(keys, dsts, prefix=prefix, timeout=timeout)

    def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[Any]:
        return self.local.delete(keys, timeout=timeout)

    # -- zero-copy leases -------------------------------------------------------------------

    def reserve(
        self, keys: Sequence[bytes], sizes: Sequence[int], *, timeout: float | None = None
    ) -> WriteLease:
        """Reserve space for blocks and hand out writable views to fill in place (arena
        memory on the node's host, private buffers elsewhere); ``commit()`` publishes them.
        Keys already stored or being written get no view."""
        return WriteLease.open(self.local, keys, sizes, self.config.write_rcache, timeout)

    def acquire(
        self, keys: Sequence[bytes], *, prefix: bool = True, timeout: float | None = None
    ) -> ReadLease:
        """Pin stored blocks and hand out read-only, checksum-verified views of them until
        ``release()``; with ``prefix``, only the leading run of present keys."""
        return ReadLease.open(self.local, keys, prefix, timeout)

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

    # -- node -----------------------------------------------------------------------------

    def describe(self, namespace: Namespace, *, timeout: float | None = None) -> None:
        """Tell the node a namespace's human-readable label (shown by ``kvpool status``)."""
        self.local.describe(namespace.id, namespace.describe(), timeout=timeout)

    def stats(self, *, timeout: float | None = None) -> NodeStats:
        return self.local.stats(timeout=timeout)

    def health(self, *, timeout: float | None = None) -> Health:
        return self.local.health(timeout=timeout)

    @property
    def uses_shm(self) -> bool:
        """Whether this client copies through the node's shared-memory arena."""
        return self.local.has_shm


class AsyncClient:
    """An asyncio kvpool client; the same operations as :class:`Client`, awaitable."""

    def __init__(
        self, address: str | None = None, *, config: ClientConfig | None = None, **options: Any
    ):
        self.config = _config(address, config, options)
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
