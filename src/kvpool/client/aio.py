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
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kvpool.config import ClientConfig
from kvpool.errors import PoolTimeout, Status
from kvpool.keys import Namespace
from kvpool.protocol.messages import Health, NodeStats

from .client import Client
from .ops import GetResult, LookupState, PutResult

T = TypeVar("T")


class AsyncClient:
    """An asyncio kvpool client: the operations of :class:`Client`, awaitable, with the
    same options."""

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

    async def _run(self, method: Callable[..., T], *args: Any, timeout: float | None) -> T:
        budget = timeout if timeout is not None else self.config.timeout_s
        deadline = time.monotonic() + budget

        def call() -> T:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolTimeout("deadline passed waiting for a free client thread")
            return method(*args, timeout=remaining)

        return await asyncio.get_running_loop().run_in_executor(self._threads, call)

    async def lookup(
        self,
        keys: Sequence[bytes],
        *,
        wait: float = 0.0,
        wait_absent: bool = False,
        timeout: float | None = None,
    ) -> int:
        state = await self.lookup_state(keys, wait=wait, wait_absent=wait_absent, timeout=timeout)
        return state.num_prefix

    async def lookup_state(
        self,
        keys: Sequence[bytes],
        *,
        wait: float = 0.0,
        wait_absent: bool = False,
        timeout: float | None = None,
    ) -> LookupState:
        def lookup(timeout: float) -> LookupState:
            return self.sync.lookup_state(keys, wait=wait, wait_absent=wait_absent, timeout=timeout)

        return await self._run(lookup, timeout=timeout)

    async def exists(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[bool]:
        return await self._run(self.sync.exists, keys, timeout=timeout)

    async def put(
        self, keys: Sequence[bytes], values: Sequence[Any], *, timeout: float | None = None
    ) -> PutResult:
        return await self._run(self.sync.put, keys, values, timeout=timeout)

    async def get(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[Any] | None = None,
        *,
        prefix: bool = False,
        timeout: float | None = None,
    ) -> GetResult:
        def get(timeout: float) -> GetResult:
            return self.sync.get(keys, buffers, prefix=prefix, timeout=timeout)

        return await self._run(get, timeout=timeout)

    async def delete(self, keys: Sequence[bytes], *, timeout: float | None = None) -> list[Status]:
        return await self._run(self.sync.delete, keys, timeout=timeout)

    async def describe(self, namespace: Namespace, *, timeout: float | None = None) -> None:
        await self._run(self.sync.describe, namespace, timeout=timeout)

    async def stats(self, *, timeout: float | None = None) -> NodeStats:
        return await self._run(self.sync.stats, timeout=timeout)

    async def cluster_stats(
        self, *, timeout: float | None = None
    ) -> list[tuple[str, NodeStats | None]]:
        return await self._run(self.sync.cluster_stats, timeout=timeout)

    async def health(self, *, timeout: float | None = None) -> Health:
        return await self._run(self.sync.health, timeout=timeout)
