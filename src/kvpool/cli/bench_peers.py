"""What ``kvpool bench`` measures kvpool against, in the same run: a memcpy into a
shared-memory mapping (same node), a plain Python socket stream between two processes
(TCP), and Redis (Debian's ``redis-server``, no persistence)."""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvpool.config import MiB
from kvpool.harness.process import wait_until


@contextlib.contextmanager
def shm_buffer(num_bytes: int) -> Iterator[np.ndarray]:
    with tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as f:
        f.truncate(num_bytes)
        array = np.frombuffer(mmap.mmap(f.fileno(), num_bytes), dtype=np.uint8)
        array[:] = 1  # fault every page in, as the daemon's arena is
        yield array  # unmapped when the last view of it is gone


def _stream_sink(port_queue: Any) -> None:
    """A plain socket peer: receives or sends batches on request (the TCP ceiling)."""
    server = socket.create_server(("127.0.0.1", 0))
    port_queue.put(server.getsockname()[1])
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(256 * MiB))
    header = bytearray(17)
    while True:
        view = memoryview(header)
        got = 0
        while got < 17:
            n = conn.recv_into(view[got:])
            if not n:
                return
            got += n
        op, num_bytes, block = (
            header[0],
            int.from_bytes(header[1:9], "little"),
            int.from_bytes(header[9:17], "little"),
        )
        if op == 0:  # receive num_bytes, then acknowledge
            got = 0
            while got < num_bytes:
                got += conn.recv_into(buf[got:num_bytes])
            conn.sendall(b"k")
        else:  # send num_bytes in blocks
            for start in range(0, num_bytes, block):
                conn.sendall(buf[start : min(start + block, num_bytes)])


class StreamCeiling:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        self.proc = ctx.Process(target=_stream_sink, args=(queue,), daemon=True)
        self.proc.start()
        port = queue.get(timeout=30)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, blocks: list[np.ndarray]) -> None:
        total = sum(b.nbytes for b in blocks)
        self.sock.sendall(
            bytes([0]) + total.to_bytes(8, "little") + blocks[0].nbytes.to_bytes(8, "little")
        )
        for block in blocks:
            self.sock.sendall(block.data)
        self.sock.recv(1)

    def recv(self, blocks: list[np.ndarray]) -> None:
        total = sum(b.nbytes for b in blocks)
        self.sock.sendall(
            bytes([1]) + total.to_bytes(8, "little") + blocks[0].nbytes.to_bytes(8, "little")
        )
        for block in blocks:
            view = block.data
            got = 0
            while got < len(view):
                got += self.sock.recv_into(view[got:])

    def close(self) -> None:
        self.sock.close()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()


# -- redis --------------------------------------------------------------------------------


class RedisPeer:
    def __init__(self) -> None:
        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--protected-mode",
                "yes",
                "--proto-max-bulk-len",
                "1gb",
                "--client-query-buffer-limit",
                "2gb",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.client = redis.Redis(host="127.0.0.1", port=self.port)

        def ping() -> bool:
            try:
                return bool(self.client.ping())
            except redis.ConnectionError:
                return False

        if not wait_until(ping, 10):
            self.close()
            raise RuntimeError("redis-server did not start")

    def put(self, keys: list[bytes], blocks: list[np.ndarray]) -> None:
        self.client.mset({k: b.data for k, b in zip(keys, blocks, strict=True)})

    def get(self, keys: list[bytes]) -> None:
        self.client.mget(keys)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
