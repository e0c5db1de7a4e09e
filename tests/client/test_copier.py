"""The copier: a batch copied over several threads lands whole, hashed as it lands, and no
thread is still copying once the call returns, even when a piece fails."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from kvpool import buffers
from kvpool import checksum as ck
from kvpool.client import copier as copier_module
from kvpool.client.copier import Copier

MiB = 1 << 20


def batch(sizes: list[int]) -> tuple[list[memoryview], list[memoryview]]:
    rng = np.random.default_rng(len(sizes))
    srcs = [memoryview(rng.integers(0, 256, n, dtype=np.uint8)) for n in sizes]
    dsts = [memoryview(np.zeros(n, dtype=np.uint8)) for n in sizes]
    return srcs, dsts


def threads_copying(monkeypatch, piece_s: float = 0.0) -> set[str]:
    """The names of the threads that copy pieces from here on, each piece taking at least
    ``piece_s``."""
    threads: set[str] = set()

    def recorded(real):
        def run(dst, src):
            threads.add(threading.current_thread().name)
            time.sleep(piece_s)
            return real(dst, src)

        return run

    monkeypatch.setattr(buffers, "copy", recorded(buffers.copy))
    monkeypatch.setattr(buffers, "copy_with_checksum", recorded(buffers.copy_with_checksum))
    return threads


def test_a_batch_lands_whole_and_hashed_over_several_threads(monkeypatch):
    sizes = [2 * MiB, 3 * MiB + 17, 2 * MiB, 5 * MiB]
    srcs, dsts = batch(sizes)
    threads = threads_copying(monkeypatch, 0.01)  # long enough that helpers get pieces
    copier = Copier(3)
    try:
        got = copier.copy(dsts, srcs, hashed=[True, False, True, False])
        assert [bytes(d) for d in dsts] == [bytes(s) for s in srcs]
        assert got == [ck.checksum(srcs[0]), None, ck.checksum(srcs[2]), None]
        assert len(threads) == 3
    finally:
        copier.close()


def test_skipped_blocks_stay_untouched_and_small_batches_stay_on_the_caller(monkeypatch):
    srcs, dsts = batch([256 << 10, 256 << 10, 256 << 10])
    threads = threads_copying(monkeypatch)
    copier = Copier(4)
    try:
        got = copier.copy([dsts[0], None, dsts[2]], [srcs[0], srcs[1], None])
        assert got == [None, None, None]
        assert bytes(dsts[0]) == bytes(srcs[0])
        assert not any(any(d) for d in dsts[1:])
        assert threads == {threading.current_thread().name}
    finally:
        copier.close()


def test_a_failed_piece_is_raised_once_nothing_is_copying_any_more(monkeypatch):
    """The caller's piece fails while a helper is in the middle of its own: the call waits
    for that piece to end, gives up the rest, and raises the failure."""
    srcs, dsts = batch([8 * MiB])
    caller = threading.current_thread()
    helper_copying = threading.Event()
    finished: list[int] = []
    failed: list[int] = []
    real_copy = buffers.copy

    def copy(dst, src):
        if threading.current_thread() is caller and not failed:
            assert helper_copying.wait(10)
            failed.append(1)
            raise RuntimeError("a piece failed")
        if threading.current_thread() is not caller:
            helper_copying.set()
            time.sleep(0.05)
        real_copy(dst, src)
        finished.append(1)

    monkeypatch.setattr(buffers, "copy", copy)
    copier = Copier(2)
    try:
        with pytest.raises(RuntimeError, match="a piece failed"):
            copier.copy(dsts, srcs)
        done = len(finished)
        time.sleep(0.2)
        assert done >= 1 and len(finished) == done  # nobody copies after the call
        assert done == 1  # the helper's piece; the rest were given up
    finally:
        copier.close()


def test_a_batch_of_many_small_blocks_stays_on_the_caller(monkeypatch):
    """Blocks under GIL_FREE_BYTES are copied holding the GIL: threads would only take
    turns."""
    srcs, dsts = batch([buffers.GIL_FREE_BYTES // 2] * 128)  # 4 MiB in all
    threads = threads_copying(monkeypatch)
    copier = Copier(4)
    try:
        copier.copy(dsts, srcs)
        assert threads == {threading.current_thread().name}
        assert [bytes(d) for d in dsts] == [bytes(s) for s in srcs]
    finally:
        copier.close()


def test_a_mismatched_pair_is_refused_before_anything_is_copied():
    srcs, dsts = batch([4 * MiB, 4 * MiB])
    with pytest.raises(ValueError, match="copy of"):
        Copier(2).copy([dsts[0], dsts[1][:-1]], srcs)
    assert not any(bytes(dsts[0]))


def test_the_default_thread_count_is_bounded():
    assert 1 <= copier_module.DEFAULT_COPY_THREADS <= 4


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_copies_over_threads_of_its_own():
    """Threads do not survive fork: a child's copier starts its own, and copies whole."""
    srcs, dsts = batch([4 * MiB, 4 * MiB])
    copier = Copier(2)
    try:
        copier.copy(dsts, srcs)  # the parent's helper thread is started
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what it copied, and on how many threads
            code = 1
            try:
                threads: set[str] = set()
                real_copy = buffers.copy

                def record(dst, src):
                    threads.add(threading.current_thread().name)
                    time.sleep(0.01)
                    real_copy(dst, src)

                buffers.copy = record
                fresh = [memoryview(np.zeros(len(s), np.uint8)) for s in srcs]
                copier.copy(fresh, srcs)
                whole = [bytes(d) for d in fresh] == [bytes(s) for s in srcs]
                os.write(writer, f"{len(threads)} {whole}".encode())
                code = 0
            finally:
                os._exit(code)
        os.close(writer)
        with os.fdopen(reader) as pipe:
            report = pipe.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert report == "2 True"
    finally:
        copier.close()


def test_a_long_batch_between_arena_views_lands_whole_with_its_dropped_blocks_skipped():
    # A long prompt's blocks: arena views on both sides (a put's slots, a get's blocks),
    # measured without being made; a dropped block is skipped, a short one refused.
    from kvpool.buffers import ArenaViews

    n, size = 300, 4096
    rng = np.random.default_rng(5)
    source = memoryview(rng.integers(0, 256, n * size, dtype=np.uint8).tobytes())
    target = memoryview(bytearray(2 * n * size))
    offsets = [size * i for i in range(n)]
    srcs = ArenaViews(source, offsets, [size] * n)
    dsts = ArenaViews(target, [2 * size * i for i in range(n)], [size] * n)
    dsts[7] = None
    got = Copier(2).copy(dsts, srcs, hashed=True)
    for i in range(n):
        landed = bytes(target[2 * size * i : 2 * size * i + size])
        if i == 7:
            assert got[i] is None and landed == bytes(size)
        else:
            assert landed == bytes(srcs[i]) and got[i] == ck.checksum(srcs[i])
    dsts[8] = target[: size - 1]
    with pytest.raises(ValueError, match="into a buffer of 4095"):
        Copier(2).copy(dsts, srcs)
