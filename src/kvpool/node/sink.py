"""One thread that drains a bounded queue in batches: the shape of every sink of the node's
block events (the KV event publisher, :mod:`kvpool.node.events`; Kthena's Redis entries,
:mod:`kvpool.node.kthena`).

Rules:

1. ``put`` never blocks (it is called on the event loop and the tiers' threads): past
   ``max_queued`` it refuses the item and says so, and its owner counts what was dropped.
2. The thread hands its owner the items in order, in batches of at most ``max_batch``:
   a batch starts with the first item to arrive and gathers what follows for ``gather_s``
   more (0: what is queued already).  It wakes at least every ``WAKE_S`` (with an empty
   batch when nothing came), so that an owner can do its own work between batches.
3. ``flush`` waits until every item put so far has been handed over and handled;
   ``close`` hands over what is queued, then ends the thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

Item = TypeVar("Item")

WAKE_S = 0.02  # the longest the thread sleeps between batches (rule 2)


class SinkThread(Generic[Item]):
    """A bounded queue and the thread that drains it into ``drain`` (see the module's
    notes).  ``start`` it once its owner is ready to be called."""

    def __init__(
        self,
        name: str,
        drain: Callable[[list[Item]], None],
        *,
        max_queued: int,
        max_batch: int,
        gather_s: float = 0.0,
    ):
        self._drain = drain
        self._max_batch = max_batch
        self._gather_s = gather_s
        self._queue: queue.Queue[Item] = queue.Queue(max_queued)
        self._idle = threading.Event()
        self.is_running = True
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, item: Item) -> bool:
        """Queue ``item``; False when the queue is full (rule 1: it is dropped)."""
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            return False
        self._idle.clear()
        return True

    def flush(self, timeout: float) -> bool:
        """Until every item put so far is handled (rule 3); whether it was in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            waited = min(max(deadline - time.monotonic(), 0.0), WAKE_S)
            if self._idle.wait(waited) and self._queue.empty():
                return True
        return False

    def close(self, timeout: float) -> None:
        """Hand over what is queued, then end the thread (waiting ``timeout`` at most)."""
        self.is_running = False
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while self.is_running or not self._queue.empty():
            items = self._take()
            if not items:
                self._idle.set()
            self._drain(items)

    def _take(self) -> list[Item]:
        try:
            items = [self._queue.get(timeout=WAKE_S)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self._gather_s
        while len(items) < self._max_batch:
            try:
                items.append(self._queue.get(timeout=max(deadline - time.monotonic(), 0.0)))
            except queue.Empty:
                break
        return items
