"""Holds: blocks that requests waiting in a queue will read, kept in DRAM until then.

A prefetch (from the router as soon as it has chosen an engine, or from the connector when
vLLM first sees a request) names the blocks a request will read.  Each is *held*:

- until it is read (``read``: the request ran), or until its deadline passes (the request
  went elsewhere, or was cancelled), whichever comes first;
- eviction skips held blocks (:class:`QueueAwareEviction`): it takes every block no queued
  request needs before any block one does, and a held block not at all before its hold
  lapses;
- bounded: at most ``max_bytes`` are held at once (half the DRAM); a hold past that is
  refused, so holds can never fill the store or stop it from taking writes.

Counters say whether prefetching pays: of the blocks a prefetch brought up from a lower
tier, how many were read while held (*useful*) and how many lapsed or left unread
(*wasted*).

Synchronous, touched from one thread (the daemon's event loop), as the store is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvpool.store.eviction import EvictionPolicy


@dataclass(slots=True)
class _Hold:
    until: float
    size: int
    fetched: bool  # brought up by a prefetch (counts as useful or wasted)


@dataclass(slots=True)
class HoldCounters:
    held: int = 0  # holds granted
    refused: int = 0  # past the bound on held bytes
    useful: int = 0  # prefetched blocks read while held
    wasted: int = 0  # prefetched blocks whose hold lapsed, or that left, unread


class Holds:
    def __init__(self, max_bytes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes = max_bytes
        self.clock = clock
        self.counters = HoldCounters()
        self.held_bytes = 0
        self._holds: dict[bytes, _Hold] = {}

    def __len__(self) -> int:
        return len(self._holds)

    def hold(self, key: bytes, size: int, hold_s: float, *, fetched: bool) -> bool:
        """Keep ``key`` for a queued request for ``hold_s`` (a second hold extends it)."""
        until = self.clock() + hold_s
        current = self._holds.get(key)
        if current is not None:
            current.until = max(current.until, until)
            current.fetched = current.fetched or fetched
            return True
        if self.held_bytes + size > self.max_bytes:
            self.counters.refused += 1
            return False
        self._holds[key] = _Hold(until, size, fetched)
        self.held_bytes += size
        self.counters.held += 1
        return True

    def is_held(self, key: bytes) -> bool:
        hold = self._holds.get(key)
        if hold is None:
            return False
        if hold.until > self.clock():
            return True
        self._drop(key, hold)
        return False

    def read(self, keys: Sequence[bytes]) -> None:
        """The request ran: its blocks need no protection any more."""
        for key in keys:
            hold = self._holds.pop(key, None)
            if hold is not None:
                self.held_bytes -= hold.size
                self.counters.useful += hold.fetched

    def release(self, keys: Sequence[bytes]) -> None:
        """Not needed after all (a cancelled prefetch, a block that left or never came)."""
        for key in keys:
            hold = self._holds.get(key)
            if hold is not None:
                self._drop(key, hold)

    def expire(self) -> int:
        """Drop lapsed holds; how many."""
        now = self.clock()
        lapsed = [(k, h) for k, h in self._holds.items() if h.until <= now]
        for key, hold in lapsed:
            self._drop(key, hold)
        return len(lapsed)

    def _drop(self, key: bytes, hold: _Hold) -> None:
        del self._holds[key]
        self.held_bytes -= hold.size
        self.counters.wasted += hold.fetched


class QueueAwareEviction:
    """An eviction policy that never picks a held block: the inner policy's order among
    the blocks no queued request needs.  The caller guarantees what
    :class:`~kvpool.store.eviction.EvictionPolicy` asks; holds lapse by themselves."""

    def __init__(self, inner: EvictionPolicy, holds: Holds) -> None:
        self.inner = inner
        self.holds = holds

    def touch(self, key: bytes) -> None:
        self.inner.touch(key)

    def remove(self, key: bytes) -> None:
        self.inner.remove(key)

    def victims(self) -> Iterator[bytes]:
        is_held = self.holds.is_held
        return (key for key in self.inner.victims() if not is_held(key))
