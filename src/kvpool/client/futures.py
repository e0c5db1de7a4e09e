"""The pending result of an asynchronous call (:class:`PoolFuture`)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


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
