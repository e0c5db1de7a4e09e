"""``AsyncClient``: :class:`~kvpool.client.client.Client` for asyncio code, cluster included.

It is the blocking client run on a bounded pool of threads, not a second client stack:
there is one implementation of every call, and the two cannot drift apart.  That costs a
thread hop per call (tens of microseconds), and gains little to lose: a call's work is
socket I/O and memory copies that release the GIL, which an event loop would have had to
push to threads anyway.  Each call's deadline starts when it is awaited, so time spent
waiting for a free thread counts against it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Concatenate, ParamSpec, TypeVar

from kvpool.config import ClientConfig
from kvpool.errors import PoolTimeout

from .client import Client

T = TypeVar("T")
P = ParamSpec("P")


def _awaitable(
    method: Callable[Concatenate[Client, P], T],
) -> Callable[Concatenate[AsyncClient, P], Coroutine[Any, Any, T]]:
    """``Client.method``, run on the client's threads and awaited."""

    @functools.wraps(method)
    async def call(self: AsyncClient, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(method, args, kwargs)

    return call


class AsyncClient:
    """An asyncio kvpool client: the operations of :class:`Client`, awaitable, with the
    same options and arguments."""

    def __init__(
        self, address: str | None = None, *, config: ClientConfig | None = None, **options: Any
    ):
        self.sync = Client(address, config=config, **options)
        self.config = self.sync.config
        self._threads = ThreadPoolExecutor(
            self.config.max_connections, thread_name_prefix="kvpool-async"
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._close)

    def _close(self) -> None:
        self._threads.shutdown(wait=True)
        self.sync.close()

    async def _run(self, method: Callable[..., T], args: Any, kwargs: dict[str, Any]) -> T:
        timeout = kwargs.get("timeout")
        deadline = time.monotonic() + (timeout if timeout is not None else self.config.timeout_s)

        def call() -> T:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolTimeout("deadline passed waiting for a free client thread")
            return method(self.sync, *args, **{**kwargs, "timeout": remaining})

        return await asyncio.get_running_loop().run_in_executor(self._threads, call)

    lookup = _awaitable(Client.lookup)
    lookup_state = _awaitable(Client.lookup_state)
    exists = _awaitable(Client.exists)
    put = _awaitable(Client.put)
    get = _awaitable(Client.get)
    delete = _awaitable(Client.delete)
    describe = _awaitable(Client.describe)
    stats = _awaitable(Client.stats)
    cluster_stats = _awaitable(Client.cluster_stats)
    health = _awaitable(Client.health)
