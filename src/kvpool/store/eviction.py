"""Eviction policies.

The interface (:class:`EvictionPolicy`): ``touch(key)`` when a block becomes evictable
(committed, or its last pin dropped) or is read, ``remove(key)`` when it leaves the store or
stops being evictable (pinned), and ``victims()`` yields candidate keys, the best victim
first.  The caller touches only stored keys and removes each key it touched.  A candidate
the caller neither removes nor touches before asking for the next one (a block a queued
request holds) is moved behind the others, so that no pass, and no later one, visits it
again before the rest: an eviction of k blocks visits O(k) entries, never the whole index.

Blocks fall into *groups* (a tenant's keys, when the store has quotas: ``regroup``), each
its own LRU list, so that a pass limited to some groups (``victims(allowed)``, e.g. one
tenant's own blocks) never walks another group's entries.  An implementation yields every
key of the allowed groups at most once per ``victims()`` pass and tolerates ``remove`` and
``touch`` during that pass.
"""

from __future__ import annotations

import heapq
import sys
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Protocol

Group = Hashable
GroupOf = Callable[[bytes], Group]
Allowed = Callable[[Group], bool]  # whether a pass may take blocks of a group now


class EvictionPolicy(Protocol):
    def touch(self, key: bytes) -> None: ...

    def remove(self, key: bytes) -> None: ...

    def victims(self, allowed: Allowed | None = None) -> Iterator[bytes]: ...

    def regroup(self, group_of: GroupOf | None) -> None: ...

    def adopt(self, keys: list[bytes]) -> None: ...


def _one_group(key: bytes) -> Group:
    return None


class LRUPolicy:
    """Least recently used first, one LRU list per group, merged by recency."""

    def __init__(self) -> None:
        self._group_of: GroupOf = _one_group
        self._grouped = False  # more than one group: entries carry their recency (a number)
        self._groups: dict[Group, OrderedDict[bytes, int | None]] = {None: OrderedDict()}
        self._clock = 0
        self.num_visited = 0  # candidates yielded, ever (what an eviction costs)

    def __len__(self) -> int:
        return sum(len(order) for order in self._groups.values())

    def __sizeof__(self) -> int:
        return object.__sizeof__(self) + sum(map(sys.getsizeof, self._groups.values()))

    def touch(self, key: bytes) -> None:
        group = self._group_of(key)
        order = self._groups.get(group)
        if order is None:
            order = self._groups[group] = OrderedDict()
        if self._grouped:
            self._clock += 1
            order[key] = self._clock
        else:
            order[key] = None
        order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        order = self._groups.get(self._group_of(key))
        if order is not None:
            order.pop(key, None)

    def adopt(self, keys: list[bytes]) -> None:
        """Touch ``keys`` in order (the blocks of a warm restart, oldest first), in bulk."""
        if self._grouped:
            for key in keys:
                self.touch(key)
        else:
            for key in keys:
                self._groups[None].pop(key, None)
            self._groups[None].update(dict.fromkeys(keys))

    def regroup(self, group_of: GroupOf | None) -> None:
        """Sort the entries into new groups, keeping their order (at a reload of the
        tenants, not on the request path: it visits every entry once)."""
        keys = self.ordered_keys()
        self._group_of = group_of or _one_group
        self._grouped = group_of is not None
        self._groups = {None: OrderedDict()}
        self._clock = 0
        for key in keys:
            self.touch(key)

    def ordered_keys(self) -> list[bytes]:
        """Every key, least recent first."""
        if not self._grouped:
            return list(self._groups[None])
        merged = heapq.merge(*(order.items() for order in self._groups.values()), key=_recency)
        return [key for key, _ in merged]

    def _head(self, allowed: Allowed | None) -> tuple[bytes, OrderedDict[bytes, int | None]] | None:
        """The least recent key of the groups ``allowed`` admits now, and its list."""
        best: tuple[bytes, OrderedDict[bytes, int | None]] | None = None
        best_recency = 0
        for group, order in self._groups.items():
            if not order or (allowed is not None and not allowed(group)):
                continue
            key = next(iter(order))
            recency = order[key] or 0
            if best is None or recency < best_recency:
                best, best_recency = (key, order), recency
        return best

    def victims(self, allowed: Allowed | None = None) -> Iterator[bytes]:
        # Always the head of a list: the caller removes it (evicted) or it is moved behind
        # the others (kept), so no pass rescans what it skipped.  At most one visit per
        # entry held at the start, so that a pass over blocks all kept ends.
        budget = len(self)
        while budget > 0:
            head = self._head(allowed)
            if head is None:
                return
            key, order = head
            budget -= 1
            self.num_visited += 1
            yield key
            if key in order and next(iter(order)) == key:
                self.touch(key)  # kept: behind the others


def _recency(item: tuple[bytes, int | None]) -> int:
    return item[1] or 0


class NoEviction:
    """Never evicts: a full store refuses new blocks (for tests and pinned-memory modes)."""

    def touch(self, key: bytes) -> None:
        pass

    def remove(self, key: bytes) -> None:
        pass

    def victims(self, allowed: Allowed | None = None) -> Iterator[bytes]:
        return iter(())

    def regroup(self, group_of: GroupOf | None) -> None:
        pass

    def adopt(self, keys: list[bytes]) -> None:
        pass
