"""Loads from the pool into a paged cache: one path, layer by layer or in one step.

A :class:`Load` pins a request's blocks (a prefix of them: the leading blocks the pool
holds, checksum-verified) and copies them into the cache's blocks ``block_ids`` with one
indexed copy per step, never a copy per block:

- **layer by layer** (``by_layer``, where the copies may move planes apart: a cache in host
  memory): one step per plane, so that the engine's attention for a layer may start as soon
  as its planes are in place (:meth:`Load.wait_for`);
- **in one step** (a whole-request load, :func:`load_into`, and any load on a GPU's
  streams): all planes at once.

:func:`read_rows` is the other shape a page-based engine asks for (SGLang's generic page
path): each block into a host buffer of the engine's own, one per key, which the engine
then copies into its cache itself.  Rules 1 and 4 hold for it too.

Rules:

1. Blocks the pool lacks end the prefix: ``num_blocks`` is how many leading blocks the load
   delivered in every plane; the rest are the engine's to recompute (``reason`` says why).
2. A pin that ran out while the pages were read delivers nothing (its memory may have been
   reused): checked after each plane copied on the calling thread, and after a stream's
   copies have run.
3. The pin ends only after the copies have run (``Copies.settle``).
4. A pool failure is a miss (:mod:`.guard`): ``num_blocks`` 0, never an exception.
5. ``stop`` ends a load for good: no plane is copied after it returns.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvpool.buffers import byte_view
from kvpool.client.client import Client
from kvpool.client.transactions import ReadTransaction

from .cache import PagedCache, num_of_layout, pool_rows
from .copies import Mark
from .guard import PoolGuard

PIN_RAN_OUT = "the pool's pin ran out mid-load"


class Load:
    """One request's load (see the module's rules).

    ``run`` executes it on a pool thread.  Meanwhile ``planes_done`` counts the planes in
    place (or, on a stream, enqueued before ``done``), ``num_blocks`` how many leading
    blocks the load delivers (known once the blocks are pinned), and ``finished`` says that
    ``run`` has returned.
    """

    def __init__(
        self,
        cache: PagedCache,
        keys: Sequence[bytes],
        block_ids: Sequence[int],
        deadline: float,
        *,
        after: Mark = None,
        by_layer: bool = False,
    ):
        self.cache = cache
        self.keys = list(keys)
        self.block_ids = list(block_ids)
        self.deadline = deadline
        self.after = after  # the engine's stream when the blocks to fill were free
        self.by_layer = by_layer
        self.done: Mark = None  # the copies in the cache, on their stream
        self.waited: Mark = None  # the last mark the engine's stream was told to wait for
        self.cond = threading.Condition()
        self.planes_done = 0
        self.num_blocks = len(self.block_ids)
        self.finished = False
        self.stopped = False
        self.reason = ""
        self.started = time.perf_counter()

    def run(self, client: Client) -> None:
        try:
            with self.cache.guard.call("load") as outcome:
                timeout = max(self.deadline - time.monotonic(), 0.001)
                with client.begin_read(self.keys, prefix=True, timeout=timeout) as lease:
                    self._copy(lease)
        finally:
            with self.cond:
                if outcome.failed:
                    self.num_blocks, self.reason = 0, outcome.reason
                elif self.num_blocks < len(self.block_ids) and not self.reason:
                    missing = len(self.block_ids) - self.num_blocks
                    self.reason = f"{missing} block(s) missing or corrupt"
                self.finished = True
                self.cond.notify_all()

    def _steps(self) -> list[tuple[int, ...]]:
        num_planes = self.cache.layout.num_planes
        if self.by_layer and self.cache.copies.per_plane:
            return [(plane,) for plane in range(num_planes)]
        return [tuple(range(num_planes))]

    def _copy(self, lease: ReadTransaction) -> None:
        copies = self.cache.copies
        # Leading blocks only, and only those of the cache's page size: a block of another
        # size is a miss, never sliced into pages.
        num = num_of_layout(copies.layout, lease, lease.num_prefix)
        with self.cond:
            self.num_blocks = min(self.num_blocks, num)
            self.cond.notify_all()
        if not num:
            return
        ids = torch.tensor(self.block_ids[:num], dtype=torch.long)
        rows = pool_rows(copies.layout, lease, num)
        for planes in self._steps():
            with self.cond:
                if self.stopped:
                    break
                self.done = copies.load(ids, rows, planes, self.after)
                if copies.per_plane and not lease.still_held:
                    self.num_blocks, self.reason = 0, PIN_RAN_OUT
                    break
                self.planes_done = planes[-1] + 1
                self.cond.notify_all()
        copies.settle(self.done)  # before the pin ends
        if not copies.per_plane and not lease.still_held:
            with self.cond:
                self.num_blocks, self.reason = 0, PIN_RAN_OUT

    def wait_for(self, planes: tuple[int, ...]) -> Mark:
        """Until ``planes`` are in place (or enqueued: then the mark the engine's stream
        must wait for), the load ended, or its deadline passed (then it is stopped, and its
        blocks are recomputed)."""
        needed = max(planes) + 1 if planes else 0
        with self.cond:
            while self.planes_done < needed and not self.finished and not self.stopped:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self.stopped = True
                    self.num_blocks, self.reason = 0, "deadline passed"
                    return None
                self.cond.wait(left)
            return self.done if self.planes_done >= needed else None

    def stop(self) -> int:
        """End the load for good; how many leading blocks it delivered in every plane.
        A load on a stream is waited for until its pin is released (or its deadline)."""
        num_planes = self.cache.layout.num_planes
        self.wait_for(tuple(range(num_planes)))
        with self.cond:
            if self.done is not None:
                while not self.finished and time.monotonic() < self.deadline:
                    self.cond.wait(max(self.deadline - time.monotonic(), 0.001))
            self.stopped = True
            if self.planes_done < num_planes or (self.done is not None and not self.finished):
                self.num_blocks = 0
                self.reason = self.reason or "deadline passed"
            return self.num_blocks


def load_into(
    cache: PagedCache,
    client: Client,
    keys: Sequence[bytes],
    block_ids: Sequence[int],
    timeout: float,
    after: Mark = None,
) -> Load:
    """A whole-request load: the layer-by-layer load in one step, run on the calling thread;
    returns it finished (``num_blocks``, ``reason``)."""
    load = Load(cache, keys, block_ids, time.monotonic() + timeout, after=after)
    load.run(client)
    return load


def read_rows(
    guard: PoolGuard, client: Client, keys: Sequence[bytes], rows: Sequence[Any], timeout: float
) -> int:
    """Read the leading blocks of ``keys`` the pool holds into ``rows`` (one writable host
    buffer per key, each a page's size); how many leading rows were filled whole with
    verified bytes (0 on a pool failure).  A block of another size than its row is a miss
    from there on: a shorter one would leave the row's tail as it was."""
    dsts = [byte_view(row, writable=True) for row in rows]
    with guard.call("load") as outcome:
        result = client.get(keys, dsts, prefix=True, timeout=timeout)
    if outcome.failed:
        return 0
    for i in range(result.num_prefix):
        if result.sizes[i] != len(dsts[i]):
            return i
    return result.num_prefix
