"""Saves from a paged cache into the pool.

Two shapes, both moving a batch with one indexed copy per step, never a copy per block:

- :class:`Save`, a save that overlaps the engine's forward: pool space is reserved first
  (on a pool thread, while the forward runs), the cache's pages are copied into it plane by
  plane as layers finish (or all at once at ``close``), and checksumming and committing
  finish off the engine's thread.  Lifecycle: ``reserve`` → ``copy``\\* → ``close`` (on the
  engine's thread: after it, nothing reads the cache for this save) → ``commit``, or
  ``abandon`` at any point.
- :func:`save_from`, a save whose caller reuses the blocks at once: the pages are copied
  out into a host batch before it returns, and :func:`put_batch` writes the batch into the
  pool later, on a pool thread.
- :func:`save_now`, a whole save on the calling thread from a cache in host memory that
  stays unchanged until it returns (a page-based engine's host pool, SGLang's): the
  :class:`Save` lifecycle run at once, so the pages are copied straight into pool memory.
- :func:`put_rows`, blocks the engine hands over as host buffers of its own, one per key
  (SGLang's generic page path): a plain put.

Keys the pool already holds, or is being given by another writer, get no space: they are
not copied.  A pool failure is a skipped save (:mod:`.guard`), never an exception in the
engine.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvpool.client.client import Client
from kvpool.client.ops import PutResult
from kvpool.client.transactions import WriteTransaction
from kvpool.errors import Status
from kvpool.keys import BlockOrigin

from .cache import PagedCache
from .copies import Mark
from .guard import PoolGuard


class Save:
    """One step's save (see the module's notes).

    Copies run under ``lock`` and check ``closed``, so once ``close`` returns nothing reads
    the paged cache for this save any more (on a stream: nothing the engine's stream does
    not wait for).
    """

    def __init__(
        self,
        cache: PagedCache,
        keys: list[bytes],
        block_ids: list[int],
        started: float,
        origins: list[BlockOrigin | None] | None = None,
        retention: list[tuple[int, float]] | None = None,
    ):
        self.cache = cache
        self.keys = keys
        self.origins = origins
        self.retention = retention  # per key, (priority, duration_s): given once committed
        self.block_ids = block_ids
        self.started = started
        self.lock = threading.Lock()
        self.lease: WriteTransaction | None = None
        self.wanted: list[int] = []  # indices of the blocks the pool wants (has space for)
        self.rows: torch.Tensor | None = None
        self.ids: torch.Tensor | None = None
        self.copied: set[int] = set()
        self.closed = False
        self.copied_out: Mark = None  # the rows are filled once this has run
        self.in_place = False  # the rows are the arena's memory (else a host batch)

    def reserve(self, client: Client, timeout: float) -> None:
        """Reserve the pool space (on a pool thread); a save already closed gives it back."""
        layout = self.cache.layout
        lease = client.begin_write(
            self.keys, [layout.block_bytes] * len(self.keys), timeout=timeout
        )
        with self.lock:
            if self.closed:  # too late: the step is over
                lease.abort()
                return
            self.lease = lease
            self.wanted = [i for i, view in enumerate(lease.views) if view is not None]
            if self.wanted:
                self.ids = torch.tensor([self.block_ids[i] for i in self.wanted], dtype=torch.long)
                extent = lease.extent() if len(self.wanted) == len(self.keys) else None
                self.in_place = extent is not None
                self.rows = (
                    layout.pool_view(extent, len(self.wanted))
                    if extent is not None
                    else layout.batch(len(self.wanted))
                )

    def copy(self, planes: tuple[int, ...]) -> None:
        """Copy ``planes`` of the blocks out, where the copies move planes apart."""
        if self.cache.copies.per_plane:
            self._copy(planes, None)

    def _copy(self, planes: tuple[int, ...], after: Mark) -> None:
        copies = self.cache.copies
        with self.lock:
            if self.closed or self.rows is None or self.ids is None:
                return
            todo = tuple(p for p in planes if p not in self.copied)
            if todo:
                gathered, self.copied_out = copies.save(self.ids, self.rows, todo, after)
                copies.engine_waits(gathered)
            self.copied.update(todo)

    def close(self) -> WriteTransaction | None:
        """Finish the copies out of the cache and stop; the lease to commit (None: nothing
        to commit).  Called on the engine's thread, after the forward."""
        copies = self.cache.copies
        self._copy(tuple(range(copies.layout.num_planes)), copies.mark())
        with self.lock:
            self.closed = True
            return self.lease

    def commit(self, timeout: float) -> PutResult:
        """Once closed, on a pool thread: until the blocks are in pool memory, then publish
        them.  The lease is given back if this fails."""
        lease = self.lease
        assert lease is not None and self.closed
        try:
            self._deliver(lease)
            return lease.commit(timeout=timeout, origins=self.origins)
        except BaseException:
            lease.abort()
            raise

    def _deliver(self, lease: WriteTransaction) -> None:
        """The copies have run, and blocks held apart in the arena are filled from the host
        batch, one copy each."""
        self.cache.copies.settle(self.copied_out)
        rows = self.rows
        if rows is None or self.in_place:
            return
        flat = rows.view(len(self.wanted), -1).view(torch.uint8)
        for row, i in enumerate(self.wanted):
            view = lease.views[i]
            assert view is not None
            torch.frombuffer(view, dtype=torch.uint8).copy_(flat[row])

    def abandon(self) -> None:
        with self.lock:
            self.closed = True
            lease, self.lease = self.lease, None
        if lease is not None:
            lease.abort()


@dataclass
class CopiedBlocks:
    """Blocks copied out of a cache into a host batch: readable once ``copied`` settled."""

    batch: torch.Tensor
    copied: Mark


def save_from(cache: PagedCache, block_ids: Sequence[int]) -> CopiedBlocks:
    """Copy blocks ``block_ids`` out of the cache (one indexed copy); once this returns the
    engine may reuse them."""
    copies = cache.copies
    batch = copies.layout.batch(len(block_ids))
    ids = torch.tensor(list(block_ids), dtype=torch.long)
    gathered, copied = copies.save(ids, batch, None, copies.mark())
    copies.settle(gathered)
    return CopiedBlocks(batch, copied)


class BatchSaved(NamedTuple):
    """What a save did: how many blocks the pool holds now (stored, or there already), the
    reason when none is, the blocks its evictions lost
    (:attr:`PutResult.num_not_kept <kvpool.client.ops.PutResult.num_not_kept>`), and per
    key whether the pool holds it (empty when the save failed as a whole)."""

    num_stored: int
    reason: str
    num_not_kept: int = 0
    stored: tuple[bool, ...] = ()


def _saved(result: PutResult) -> BatchSaved:
    stored = tuple(s in (Status.OK, Status.EXISTS) for s in result.statuses)
    return BatchSaved(result.num_stored, "", result.num_not_kept, stored)


def put_batch(
    cache: PagedCache, client: Client, keys: Sequence[bytes], blocks: CopiedBlocks, timeout: float
) -> BatchSaved:
    """Write blocks copied out by :func:`save_from` into the pool (on a pool thread)."""
    cache.copies.settle(blocks.copied)
    rows = blocks.batch.view(torch.uint8).numpy()
    return put_rows(cache.guard, client, keys, list(rows), timeout)


def put_rows(
    guard: PoolGuard, client: Client, keys: Sequence[bytes], rows: Sequence[Any], timeout: float
) -> BatchSaved:
    """Write one host buffer per key into the pool (any buffer the client takes: numpy
    arrays, CPU tensors, bytes)."""
    with guard.call("save") as outcome:
        result = client.put(keys, rows, timeout=timeout)
    if outcome.failed:
        return BatchSaved(0, outcome.reason)
    return _saved(result)


def save_now(
    cache: PagedCache,
    client: Client,
    keys: Sequence[bytes],
    block_ids: Sequence[int],
    timeout: float,
) -> BatchSaved:
    """Save blocks ``block_ids`` of a cache in host memory under ``keys``, on the calling
    thread: the :class:`Save` lifecycle at once (reserve, copy into the reserved pool
    memory, commit).  The caller keeps the blocks unchanged until it returns.  Keys the
    pool holds already count as stored; a pool failure stores nothing (:mod:`.guard`)."""
    save = Save(cache, list(keys), list(block_ids), time.perf_counter())
    result: PutResult | None = None
    with cache.guard.call("save") as outcome:
        save.reserve(client, timeout)
        if save.close() is not None:
            result = save.commit(timeout)
    if outcome.failed or result is None:
        save.abandon()
        return BatchSaved(0, outcome.reason or "nothing reserved")
    return _saved(result)
