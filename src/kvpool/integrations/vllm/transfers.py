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
    """One request's load, copied into the paged cache plane after plane on a load thread.

    ``planes_done`` counts the planes in place; ``num_blocks`` is how many leading blocks
    the load delivers (known once the blocks are pinned).  ``stop`` ends it for good: no
    plane is copied after it returns.
    """

    def __init__(self, job: TransferJob, deadline: float):
        self.job = job
        self.deadline = deadline
        self.cond = threading.Condition()
        self.planes_done = 0
        self.num_blocks = len(job.block_ids)
        self.finished = False
        self.stopped = False
        self.reason = ""
        self.started = time.perf_counter()

    def run(self, worker: KVPoolWorker) -> None:
        layout = worker.layout
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
                    for plane in range(layout.num_planes):
                        with self.cond:
                            if self.stopped:
                                break
                            layout.scatter_planes((plane,), ids, rows)
                            if not lease.still_held:  # its memory may have been reused
                                self.num_blocks, num = 0, 0
                                self.reason = "the pool's pin ran out mid-load"
                                break
                            self.planes_done = plane + 1
                            self.cond.notify_all()
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

    def wait_for(self, planes: tuple[int, ...]) -> None:
        """Until ``planes`` are in place, the load ended, or its deadline passed (then it is
        stopped, and its blocks are recomputed)."""
        needed = max(planes) + 1 if planes else 0
        with self.cond:
            while self.planes_done < needed and not self.finished and not self.stopped:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self.stopped = True
                    self.num_blocks, self.reason = 0, "deadline passed"
                    return
                self.cond.wait(left)

    def stop(self, num_planes: int) -> int:
        """End the load for good; how many leading blocks it delivered in every plane."""
        self.wait_for(tuple(range(num_planes)))
        with self.cond:
            self.stopped = True
            if self.planes_done < num_planes:
                self.num_blocks = 0
                self.reason = self.reason or "deadline passed"
            return self.num_blocks


class StepSave:
    """One step's save: reserved while the forward runs, filled plane by plane.

    Copies run under ``lock`` and check ``closed``, so once ``close`` returns nothing reads
    the paged cache for this save any more.
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
                self.rows = (
                    layout.pool_view(extent, len(self.wanted))
                    if extent is not None
                    else layout.batch(len(self.wanted))
                )

    def copy(self, layout: PagedLayout, planes: tuple[int, ...]) -> None:
        with self.lock:
            if self.closed or self.rows is None or self.ids is None:
                return
            todo = tuple(p for p in planes if p not in self.copied)
            if len(todo) == layout.num_planes:
                layout.gather(self.ids, self.rows)  # the whole batch: one indexed copy
            elif todo:
                layout.gather_planes(todo, self.ids, self.rows)
            self.copied.update(todo)

    def close(self, layout: PagedLayout) -> WriteLease | None:
        """Finish the copies and stop; the filled lease (None: nothing to commit)."""
        self.copy(layout, tuple(range(layout.num_planes)))
        with self.lock:
            self.closed = True
            lease, rows = self.lease, self.rows
        if lease is None:
            return None
        if rows is not None and lease.extent() is None:  # scattered slots: one copy each
            flat = rows.view(len(self.wanted), -1).view(torch.uint8)
            for row, i in enumerate(self.wanted):
                view = lease.views[i]
                assert view is not None
                torch.frombuffer(view, dtype=torch.uint8).copy_(flat[row])
        return lease

    def abandon(self) -> None:
        with self.lock:
            self.closed = True
            lease, self.lease = self.lease, None
        if lease is not None:
            lease.abort()
