"""Eviction policies.

The interface (:class:`EvictionPolicy`): ``touch(key)`` when a block is committed or read,
``remove(key)`` when it leaves the store, and ``victims()`` yields candidate keys, the best
victim first.  The caller guarantees it touches only stored keys and removes each key it
touched; it skips candidates it cannot evict (pinned or being written) and removes the
ones it does evict.  An implementation must yield every touched key exactly once per
``victims()`` pass and tolerate ``remove`` during that pass.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from itertools import islice
from typing import Protocol

_HEAD = 256


class EvictionPolicy(Protocol):
    def touch(self, key: bytes) -> None: ...

    def remove(self, key: bytes) -> None: ...

    def victims(self) -> Iterator[bytes]: ...


class LRUPolicy:
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def touch(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[bytes]:
        # Snapshots, so that the caller may remove keys while iterating: first the oldest
        # few (usually enough), then, only if the caller keeps going, all the rest.
        head = list(islice(self._order, _HEAD))
        yield from head
        if len(head) == _HEAD:
            seen = set(head)
            yield from [key for key in list(self._order) if key not in seen]


class NoEviction:
    """Never evicts: a full store refuses new blocks (for tests and pinned-memory modes)."""

    def touch(self, key: bytes) -> None:
        pass

    def remove(self, key: bytes) -> None:
        pass

    def victims(self) -> Iterator[bytes]:
        return iter(())
