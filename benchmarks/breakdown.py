"""Where a same-node call goes: one client, 8 MiB batches of 2 MiB blocks, each piece timed
alone (medians of 64 calls): put, get, a lookup round trip, memcpy into pre-faulted memory,
the fused copy and xxh3 hash, and the hash alone; and the same memcpy and fused copy over
the client's copy threads (``*_threads_ms``, :mod:`kvpool.client.copier`), as a put and a
get make them.

And the ceiling of any write that another process acknowledges: the same memcpy followed by
one round trip of a few bytes over a Unix socket to a process that echoes them, and that
round trip alone (``bare_round_trip_ms``, back to back).  On a VM whose idle vCPUs halt,
waking the other side costs far more after a copy than back to back.

    .venv/bin/python -m benchmarks.breakdown
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from kvpool import buffers
from kvpool import checksum as ck
from kvpool.client.client import Client
from kvpool.client.copier import Copier
from kvpool.config import MiB
from kvpool.harness.process import NodeProcess
from kvpool.keys import Namespace

BLOCK = 2 * MiB
BLOCKS = 4
CALLS = 64


def _median_ms(fn: Callable[[int], object]) -> float:
    times = []
    for i in range(CALLS):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


_ECHO = """
import socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
while data := sock.recv(64):
    sock.sendall(data)
"""


def _round_trip(sock: socket.socket) -> None:
    sock.sendall(b"x" * 32)
    got = 0
    while got < 32:
        got += len(sock.recv(64))


def main() -> None:
    rng = np.random.default_rng(1)
    src = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(BLOCKS)]
    dst = [np.zeros(BLOCK, dtype=np.uint8) for _ in range(BLOCKS)]
    target = np.ones(CALLS * BLOCKS * BLOCK, dtype=np.uint8)  # faulted in
    ns = Namespace(model="kvpool-breakdown")
    node = NodeProcess.private(f"breakdown-{os.getpid()}", 1400 * MiB, ephemeral=True)
    with node, Client(node.unix_address, use_shm=True, timeout=60) as client:

        def keys(i: int) -> list[bytes]:
            return [ns.key(f"{i}-{j}".encode()) for j in range(BLOCKS)]

        def piece(i: int, j: int) -> np.ndarray:
            start = (i * BLOCKS + j) * BLOCK
            return target[start : start + BLOCK]

        out = {
            "put_ms": _median_ms(lambda i: client.put(keys(i), src)),
            "get_ms": _median_ms(lambda i: client.get(keys(i), dst)),
            "lookup_ms": _median_ms(lambda i: client.lookup(keys(i))),
            "memcpy_ms": _median_ms(
                lambda i: [np.copyto(piece(i, j), src[j]) for j in range(BLOCKS)]
            ),
            "fused_copy_hash_ms": _median_ms(
                lambda i: [
                    buffers.copy_with_checksum(memoryview(piece(i, j)), memoryview(src[j]))
                    for j in range(BLOCKS)
                ]
            ),
            "hash_ms": _median_ms(lambda i: [ck.checksum(s) for s in src]),
        }
        copier = Copier(client.config.copy_threads)
        views = [memoryview(s) for s in src]
        for name, hashed in (("memcpy_threads_ms", False), ("fused_copy_hash_threads_ms", True)):
            out[name] = _median_ms(
                lambda i, hashed=hashed: copier.copy(
                    [memoryview(piece(i, j)) for j in range(BLOCKS)], views, hashed
                )
            )
        copier.close()
        out["copy_threads"] = client.config.copy_threads
    ours, theirs = socket.socketpair()
    echo = subprocess.Popen(
        [sys.executable, "-c", _ECHO, str(theirs.fileno())], pass_fds=[theirs.fileno()]
    )
    theirs.close()
    try:
        out["memcpy_then_round_trip_ms"] = _median_ms(
            lambda i: ([np.copyto(piece(i, j), src[j]) for j in range(BLOCKS)], _round_trip(ours))
        )
        out["bare_round_trip_ms"] = _median_ms(lambda i: _round_trip(ours))
    finally:
        ours.close()
        echo.wait(timeout=10)
    print(" ".join(f"{k}={v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
