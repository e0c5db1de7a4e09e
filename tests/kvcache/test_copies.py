"""The GPU path's copies (:class:`StreamCopies`) against a real node, on CPU tensors, driven
through the vLLM connector's worker half.

CUDA cannot run on this machine, so its runtime is replaced by a stand-in that runs each
copy at once and logs every stream call (the one test double here).  What that leaves to
check, and these tests do: the copy code itself (staging in bounded chunks, one indexed copy
per chunk, whole batches, blocks held apart in the arena), the registration of the arena
as the client maps it, and the order the module promises between the engine's stream, the
worker's streams and the pool (unpin, commit).  The copies on a real GPU are measured by
``benchmarks/gpu_path.py`` when one is lent.
"""

import itertools
import threading
from contextlib import contextmanager

import pytest
import torch

from kvpool.client.transactions import ReadTransaction, WriteTransaction
from kvpool.integrations.vllm import worker as worker_module
from kvpool.integrations.vllm.metadata import KVPoolMetadata, TransferJob
from kvpool.kvcache import copies as streams
from kvpool.kvcache.layouts import PagedLayout
from tests.integrations.test_worker import LAYERS, NS, caches, drain, hashes, step, worker


class RecordingRuntime:
    """Streams are names, events are numbered marks; each call is logged."""

    def __init__(self, log):
        self.log = log
        self.streams = itertools.cycle(["load", "save"])  # each worker's two
        self.marks = 0
        self.local = threading.local()
        self.engine = threading.get_ident()  # the thread that drives the steps

    def current(self):
        default = "engine" if threading.get_ident() == self.engine else "pool-thread"
        return getattr(self.local, "stream", default)

    def stream(self):
        return next(self.streams)

    @contextmanager
    def on(self, stream):
        before = self.current()
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = before

    def record(self, stream):
        self.marks += 1
        mark = (stream or self.current(), self.marks)
        self.log.append(("record", *mark))
        return mark

    def wait(self, stream, mark):
        self.log.append(("wait", stream or self.current(), mark))

    def synchronize(self, mark):
        self.log.append(("sync", mark))

    def register(self, address, num_bytes):
        self.log.append(("register", address, num_bytes))
        return True

    def unregister(self, address):
        self.log.append(("unregister", address))


@pytest.fixture
def log(monkeypatch):
    """Every stream call, copy, unpin and commit, in order; workers get stream copies."""
    entries = []
    runtime = RecordingRuntime(entries)
    monkeypatch.setattr(
        worker_module, "copies_for", lambda layout: streams.StreamCopies(layout, runtime)
    )
    for name in ("gather_rows", "scatter_rows"):
        real = getattr(PagedLayout, name)

        def spy(layout, *args, _real=real, _name=name):
            entries.append((_name, runtime.current(), len(args[0])))
            return _real(layout, *args)

        monkeypatch.setattr(PagedLayout, name, spy)
    real_end, real_commit = ReadTransaction.end, WriteTransaction.commit

    def end(lease):
        entries.append(("unpin",))
        real_end(lease)

    def commit(lease, *args, **kwargs):
        entries.append(("commit",))
        return real_commit(lease, *args, **kwargs)

    monkeypatch.setattr(ReadTransaction, "end", end)
    monkeypatch.setattr(WriteTransaction, "commit", commit)
    return entries


def position(entries, entry):
    return entries.index(entry)


def test_the_arena_is_registered_once_at_start(node, log):
    w = worker(node, caches(1))
    registered = [e for e in log if e[0] == "register"]
    assert len(registered) == 1 and registered[0][2] == 64 << 20  # the node's arena
    step(w, KVPoolMetadata(saves=[TransferJob("r1", [1, 2], hashes(2))]))
    drain(w)
    assert [e for e in log if e[0] == "register"] == registered  # not again per call
    w.shutdown()


@pytest.mark.parametrize("transfer", ["layerwise", "whole"])
def test_a_save_on_its_stream_then_a_load_on_another(node, log, monkeypatch, transfer):
    src, dst = caches(1), caches(2)
    saver = worker(node, src, transfer=transfer)
    block_bytes = saver.pool.layout.block_bytes
    monkeypatch.setattr(streams, "STAGING_BYTES", 2 * block_bytes)  # 5 blocks: 3 chunks
    ids = [3, 7, 9, 11, 14]
    step(saver, KVPoolMetadata(saves=[TransferJob("r1", ids, hashes(5))]))
    drain(saver)

    # The save: no copy per layer; after the forward, one gather per chunk on the save
    # stream, which waited for the engine's mark; the engine waits for the last gather only.
    gathers = [e for e in log if e[0] == "gather_rows"]
    assert [e[1:] for e in gathers] == [("save", 2), ("save", 2), ("save", 1)]
    first_gather = position(log, gathers[0])
    engine_mark = next(e for e in reversed(log[:first_gather]) if e[:2] == ("record", "engine"))
    assert ("wait", "save", engine_mark[1:]) in log[:first_gather]
    gathered = log[position(log, gathers[-1]) + 1]
    assert gathered[:2] == ("record", "save")
    copied = log[position(log, gathered) + 1]
    assert copied[:2] == ("record", "save")
    assert ("wait", "engine", gathered[1:]) in log  # before the step ends ...
    assert ("wait", "engine", copied[1:]) not in log  # ... but never for the copy out
    assert position(log, ("sync", copied[1:])) < position(log, ("commit",))

    del log[:]
    loader = worker(node, dst, transfer=transfer)
    job = TransferJob("r2", [0, 1, 2, 4, 5], hashes(5))
    seen = {}

    def attention(name):
        log.append(("attention", name))
        seen[name] = torch.equal(dst[name][job.block_ids], src[name][ids])

    step(loader, KVPoolMetadata(loads=[job]), on_layer=attention)
    if transfer == "whole":  # off the step: the request waits for it
        deadline = 10.0
        while not loader.get_finished(set())[1] and deadline > 0:
            threading.Event().wait(0.01)
            deadline -= 0.01
    assert loader.get_block_ids_with_load_errors() == set()
    for name in LAYERS:
        assert torch.equal(dst[name][job.block_ids], src[name][ids])

    scatters = [e for e in log if e[0] == "scatter_rows"]
    assert [e[1:] for e in scatters] == [("load", 2), ("load", 2), ("load", 1)]
    first = position(log, scatters[0])
    start_mark = next(e for e in log[:first] if e[:2] == ("record", "engine"))
    assert ("wait", "load", start_mark[1:]) in log[:first]
    # The load's stream records its mark right after its last copy: the next call on that
    # stream (the engine's thread logs beside it: "whole" loads run off the step).
    after = log[position(log, scatters[-1]) + 1 :]
    done = next(e for e in after if e[0] in ("record", "wait", "scatter_rows") and e[1] == "load")
    assert done[:2] == ("record", "load")
    # The pool's pin ends only after the copies ran.
    assert position(log, ("sync", done[1:])) < position(log, ("unpin",))
    if transfer == "layerwise":
        # The engine's stream, not its thread, waits for the load, before the first layer.
        assert seen and all(seen.values())
        wait = position(log, ("wait", "engine", done[1:]))
        assert wait < position(log, ("attention", LAYERS[0]))
    # The engine's stream is never synchronised: only the worker's marks are.
    assert all(e[1][0] in ("load", "save") for e in log if e[0] == "sync")
    saver.shutdown()
    loader.shutdown()


def test_blocks_held_apart_in_the_arena_are_filled_after_the_copy(node, log):
    """A save of which the pool wants some blocks only: the rows are a host batch, copied
    into the blocks' slots on the commit thread once the stream's copy has run."""
    src = caches(1)
    saver = worker(node, src)
    step(saver, KVPoolMetadata(saves=[TransferJob("r0", [2], hashes(1))]))
    drain(saver)
    del log[:]
    step(saver, KVPoolMetadata(saves=[TransferJob("r1", [2, 5, 6], hashes(3))]))
    drain(saver)
    assert [e[1:] for e in log if e[0] == "gather_rows"] == [("save", 2)]
    got = saver.pool.client.get(NS.keys(hashes(3)))
    for value, block in zip(got.values, [2, 5, 6], strict=True):
        expected = torch.cat([src[name][block].flatten() for name in LAYERS])
        assert torch.equal(torch.frombuffer(value, dtype=torch.float32), expected)
    saver.shutdown()


def test_the_gpu_benchmark_runs_its_whole_path_on_a_cpu():
    """``benchmarks/gpu_path.py`` on a small model on CPU tensors: what it will measure on a
    GPU works here (a save, a layer-by-layer load, the suffix read from the loaded pages)."""
    import argparse

    from benchmarks.gpu_path import run

    result = run(argparse.Namespace(device="cpu", small=True, tokens=512, rounds=1))
    assert result["kvpool"]["load_errors"] == 0
    assert result["kvpool"]["save_GBps"] > 0 and result["kvpool"]["load_GBps"] > 0
    # The suffix attended to the loaded prefix: a cache without it gives ~0.2 here.
    assert result["ttft"]["logits_rel_err"] < 1e-4


def test_a_restarted_nodes_new_arena_replaces_the_registration(start_node, log):
    from tests.client.test_restart import free_port

    port = free_port()
    first = start_node(name="restart", extra=["--port", str(port)])
    src = caches(1)
    # No health probe while the node is down: one would have the save below skipped.
    w = worker(first, src, health_interval=3600)
    [(_, old_address, _)] = [e for e in log if e[0] == "register"]
    first.stop()
    start_node(name="restart", extra=["--port", str(port)])
    step(w, KVPoolMetadata(saves=[TransferJob("r1", [1], hashes(1))]))
    drain(w)
    registered = [e for e in log if e[0] == "register"]
    assert len(registered) == 2  # the restarted node's arena is a new one (a new id)
    unregister = position(log, ("unregister", old_address))
    assert unregister > position(log, registered[1])
    # Not while a copy of ours might still touch it: both streams were drained first.
    syncs = [e[1][0] for e in log[:unregister] if e[0] == "sync"]
    assert syncs[-2:] == ["load", "save"]
    got = w.pool.client.get(NS.keys(hashes(1)))
    assert got.values[0] is not None
    w.shutdown()


def test_a_load_that_fails_half_way_drains_its_stream_before_the_pin_ends(node, log, monkeypatch):
    src, dst = caches(1), caches(2)
    saver = worker(node, src)
    monkeypatch.setattr(streams, "STAGING_BYTES", saver.pool.layout.block_bytes)  # a chunk a block
    step(saver, KVPoolMetadata(saves=[TransferJob("r1", [3, 7], hashes(2))]))
    drain(saver)
    loader = worker(node, dst)
    real = PagedLayout.scatter_rows
    calls = []

    def fails_second(layout, ids, rows):
        calls.append(len(ids))
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory (the test's)")
        real(layout, ids, rows)

    monkeypatch.setattr(PagedLayout, "scatter_rows", fails_second)
    del log[:]
    step(loader, KVPoolMetadata(loads=[TransferJob("r2", [0, 1], hashes(2))]))
    assert loader.get_block_ids_with_load_errors() == {0, 1}  # recomputed, both
    syncs = [i for i, e in enumerate(log) if e[0] == "sync" and e[1][0] == "load"]
    assert syncs and syncs[0] < position(log, ("unpin",))
    saver.shutdown()
    loader.shutdown()
