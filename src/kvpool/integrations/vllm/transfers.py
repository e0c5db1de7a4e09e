"""What one step moves, in flight: a layer-by-layer load, a save filled plane by plane, and
the placement of the threads that run them (see :mod:`.worker` for when each happens)."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING

import torch

from kvpool.client.leases import ReadLease, WriteLease
from kvpool.errors import KVPoolError
from kvpool.keys import BlockOrigin

from .layouts import PagedLayout
from .metadata import TransferJob
from .streams import Copies, Mark

if TYPE_CHECKING:
    from .worker import KVPoolWorker

log = logging.getLogger("vllm.kvpool")  # under vLLM's logging configuration


def leave_engine_cpus() -> None:
    """Move the calling thread off the CPUs the engine's forward runs on.

    vLLM's CPU worker binds its forward thread to its cores, and threads inherit the binding
    of the thread that starts them: left alone, every pool thread (loads, saves, commits,
    health probes) would take turns with the forward on its own cores, and lengthen every
    step.  Called first thing in each pool thread; where the forward is not bound (GPU
    engines) or no other CPU is allowed, nothing changes.
    """
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        inherited = os.sched_getaffinity(0)
        spare = set(range(os.cpu_count() or 1)) - inherited
        if spare:
            os.sched_setaffinity(0, spare)
    except OSError:  # a cpuset that allows none of them: stay where we are
        pass


def pool_rows(layout: PagedLayout, lease: ReadLease | WriteLease, num: int) -> torch.Tensor:
    """The first ``num`` blocks of a lease as a ``[num, block_elems]`` tensor: over the
    pool's memory when they are adjacent there, else a staged copy (reads only)."""
    extent = lease.extent(num) if isinstance(lease, ReadLease) else lease.extent()
    if extent is not None:
        return layout.pool_view(extent, num)
    return layout.stage(lease.views[:num])


class LayerwiseLoad:
    """One request's load, copied into the paged cache plane after plane on a load thread
    (all planes at once, on the copies' own stream, when they cannot move apart).

    ``planes_done`` counts the planes in place (or, on a stream, enqueued before ``done``);
    ``num_blocks`` is how many leading blocks the load delivers (known once the blocks are
    pinned).  ``stop`` ends it for good: no plane is copied after it returns.
    """

    def __init__(self, job: TransferJob, deadline: float, after: Mark = None):
        self.job = job
        self.deadline = deadline
        self.after = after  # the engine's stream at the step's start
        self.done: Mark = None  # the copies in the cache, on their stream
        self.waited: Mark = None  # the last mark the engine's stream was told to wait for
        self.cond = threading.Condition()
        self.planes_done = 0
        self.num_blocks = len(job.block_ids)
        self.finished = False
        self.stopped = False
        self.reason = ""
        self.started = time.perf_counter()

    def run(self, worker: KVPoolWorker) -> None:
        layout, copies = worker.layout, worker.copies
        assert layout is not None
        try:
            keys = worker.namespace.keys(self.job.block_hashes)
            timeout = max(self.deadline - time.monotonic(), 0.001)
            with worker.client.acquire(keys, prefix=True, timeout=timeout) as lease:
                num = lease.num_prefix
                with self.cond:
                    self.num_blocks = min(self.num_blocks, num)
                    self.cond.notify_all()
                if num:
                    ids = torch.tensor(self.job.block_ids[:num], dtype=torch.long)
                    rows = pool_rows(layout, lease, num)
                    steps = (
                        [(plane,) for plane in range(layout.num_planes)]
                        if copies.per_plane
                        else [tuple(range(layout.num_planes))]
                    )
                    for planes in steps:
                        with self.cond:
                            if self.stopped:
                                break
                            self.done = copies.load(layout, ids, rows, planes, self.after)
                            if copies.per_plane and not lease.still_held:
                                self.num_blocks, num = 0, 0  # its memory may have been reused
                                self.reason = "the pool's pin ran out mid-load"
                                break
                            self.planes_done = planes[-1] + 1
                            self.cond.notify_all()
                    copies.settle(self.done)  # before the pin ends
                    if not copies.per_plane and not lease.still_held:
                        with self.cond:
                            self.num_blocks, num = 0, 0
                            self.reason = "the pool's pin ran out mid-load"
            worker.health.report_call()
            if num < len(self.job.block_ids) and not self.reason:
                self.reason = f"{len(self.job.block_ids) - num} block(s) missing or corrupt"
        except KVPoolError as exc:
            worker.health.report_failure(exc)
            self._fail(f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # never let a pool problem fail the engine: recompute
            log.exception("kvpool: load failed")
            self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            with self.cond:
                self.finished = True
                self.cond.notify_all()

    def _fail(self, reason: str) -> None:
        with self.cond:
            self.num_blocks, self.reason = 0, reason
            self.cond.notify_all()

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

    def stop(self, num_planes: int) -> int:
        """End the load for good; how many leading blocks it delivered in every plane.
        A load on a stream is waited for until its pin is released (or its deadline)."""
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


class StepSave:
    """One step's save: reserved while the forward runs, filled plane by plane (or all
    planes at once, on the copies' own stream, when they cannot move apart).

    Copies run under ``lock`` and check ``closed``, so once ``close`` returns nothing reads
    the paged cache for this save any more (on a stream: nothing the engine's stream does
    not wait for).  ``deliver``, on the commit thread, finishes what pool memory needs.
    """

    def __init__(
        self,
        keys: list[bytes],
        block_ids: list[int],
        started: float,
        origins: list[BlockOrigin] | None = None,
    ):
        self.keys = keys
        self.origins = origins
        self.block_ids = block_ids
        self.started = started
        self.lock = threading.Lock()
        self.lease: WriteLease | None = None
        self.wanted: list[int] = []  # indices of the blocks the pool wants (has space for)
        self.rows: torch.Tensor | None = None
        self.ids: torch.Tensor | None = None
        self.copied: set[int] = set()
        self.closed = False
        self.copied_out: Mark = None  # the rows are filled once this has run
        self.in_place = False  # the rows are the arena's memory (else a host batch)

    def reserve(self, worker: KVPoolWorker) -> None:
        layout = worker.layout
        assert layout is not None
        lease = worker.client.reserve(
            self.keys, [layout.block_bytes] * len(self.keys), timeout=worker.config.lookup_timeout_s
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

    def copy(self, copies: Copies, layout: PagedLayout, planes: tuple[int, ...]) -> None:
        """Copy ``planes`` of the blocks out, where the copies move planes apart."""
        if copies.per_plane:
            self._copy(copies, layout, planes, None)

    def _copy(
        self, copies: Copies, layout: PagedLayout, planes: tuple[int, ...], after: Mark
    ) -> None:
        with self.lock:
            if self.closed or self.rows is None or self.ids is None:
                return
            todo = tuple(p for p in planes if p not in self.copied)
            if todo:
                gathered, self.copied_out = copies.save(layout, self.ids, self.rows, todo, after)
                copies.engine_waits(gathered)
            self.copied.update(todo)

    def close(self, copies: Copies, layout: PagedLayout) -> WriteLease | None:
        """Finish the copies out of the cache and stop; the lease to deliver and commit
        (None: nothing to commit).  Called on the engine's thread, after the forward."""
        self._copy(copies, layout, tuple(range(layout.num_planes)), copies.mark())
        with self.lock:
            self.closed = True
            return self.lease

    def deliver(self, copies: Copies) -> None:
        """Until the blocks are in pool memory: the copies have run, and blocks held apart
        in the arena are filled from the host batch, one copy each."""
        copies.settle(self.copied_out)
        lease, rows = self.lease, self.rows
        if lease is None or rows is None or self.in_place:
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
