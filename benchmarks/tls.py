"""What TLS costs on the TCP path: put and get of 2 MiB blocks through a node with TLS,
beside the same through a node without, in one run, each beside its ceiling measured in
the same run (a plain socket stream, and a TLS socket stream of the same bytes between two
processes, Python's ``ssl`` on both ends, as the node and the client use it).  Also what a
tenant's socket-only path costs on the same host: the Unix socket beside the shared arena.

Both nodes run on this host on loopback, one client thread, batches of 4 blocks (8 MiB);
rounds alternate the four cases so that drift on a busy host hits them alike.

    .venv/bin/python -m benchmarks.tls [--rounds 7] [--batches 8] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import ssl
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from tests.security.pki import Authority

from kvpool import Client
from kvpool.cli.bench_peers import _stream_sink
from kvpool.harness.process import NodeProcess

MiB = 1 << 20
BLOCK = 2 * MiB
BATCH = 4


def _tls_sink(port_queue: Any, cert: str, key: str) -> None:
    """The TLS ceiling's peer: ``_stream_sink``'s protocol over a TLS server socket."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    original = socket.create_server

    def create_server(*args: Any, **kwargs: Any) -> socket.socket:
        return _TlsListener(original(*args, **kwargs), context)

    socket.create_server = create_server  # type: ignore[assignment]
    _stream_sink(port_queue)


class _TlsListener:
    def __init__(self, sock: socket.socket, context: ssl.SSLContext):
        self.sock, self.context = sock, context

    def getsockname(self) -> Any:
        return self.sock.getsockname()

    def accept(self) -> tuple[ssl.SSLSocket, Any]:
        conn, peer = self.sock.accept()
        return self.context.wrap_socket(conn, server_side=True), peer


class Stream:
    """A socket stream of the same batches (the ceiling), plain or over TLS."""

    def __init__(self, tls: tuple[str, str, str] | None):
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        target, args = (_stream_sink, (queue,)) if tls is None else (_tls_sink, (queue, *tls[:2]))
        self.proc = ctx.Process(target=target, args=args, daemon=True)
        self.proc.start()
        port = queue.get(timeout=30)
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = ssl.create_default_context(cafile=tls[2]).wrap_socket(
                sock, server_hostname="127.0.0.1"
            )
        self.sock = sock

    def put(self, blocks: list[np.ndarray]) -> None:
        total = sum(b.nbytes for b in blocks)
        header = bytes([0]) + total.to_bytes(8, "little") + BLOCK.to_bytes(8, "little")
        self.sock.sendall(header)
        for block in blocks:
            self.sock.sendall(block.data)
        self.sock.recv(1)

    def get(self, blocks: list[np.ndarray]) -> None:
        total = sum(b.nbytes for b in blocks)
        self.sock.sendall(bytes([1]) + total.to_bytes(8, "little") + BLOCK.to_bytes(8, "little"))
        for block in blocks:
            view, got = block.data, 0
            while got < len(view):
                got += self.sock.recv_into(view[got:])

    def close(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.join(5)


def _rate(seconds: float, num_bytes: int) -> float:
    return num_bytes / seconds / 1e9


def run(rounds: int, batches: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvpool-bench-tls-"))
    ca = Authority(work, "bench")
    leaf = ca.issue("node")
    memory = f"{(batches * BATCH * BLOCK) // MiB * 2 + 64}MiB"
    plain = NodeProcess.private("bench-plain", memory, run_dir=str(work), ephemeral=True)
    secure = NodeProcess.private(
        "bench-tls",
        memory,
        run_dir=str(work),
        ephemeral=True,
        extra=["--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key)],
    )
    rng = np.random.default_rng(0)
    payload = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(BATCH)]
    sinks = [np.empty(BLOCK, dtype=np.uint8) for _ in range(BATCH)]
    results: dict[str, list[float]] = {}
    with plain, secure:
        clients = {
            "plain": Client(plain.tcp_address, use_shm=False, timeout=30),
            "tls": Client(secure.tcp_address, use_shm=False, timeout=30, tls_ca=str(ca.path)),
            # Same host: the shared arena, and the Unix socket a tenant is served over.
            "shm": Client(plain.unix_address, timeout=30),
            "unix": Client(plain.unix_address, use_shm=False, timeout=30),
        }
        streams = {
            "plain": Stream(None),
            "tls": Stream((str(leaf.cert), str(leaf.key), str(ca.path))),
        }
        batch_bytes = BATCH * BLOCK
        try:
            for r in range(rounds):
                for name, c in clients.items():
                    keys = [
                        [f"tls-bench-{name}-{r}-{b}-{i}-0123456789".encode() for i in range(BATCH)]
                        for b in range(batches)
                    ]
                    start = time.perf_counter()
                    for batch in keys:
                        assert c.put(batch, payload).all_stored
                    results.setdefault(f"{name} put", []).append(
                        _rate(time.perf_counter() - start, batches * batch_bytes)
                    )
                    start = time.perf_counter()
                    for batch in keys:
                        assert c.get(batch, sinks).num_found == BATCH
                    results.setdefault(f"{name} get", []).append(
                        _rate(time.perf_counter() - start, batches * batch_bytes)
                    )
                    c.delete([k for batch in keys for k in batch])
                    stream = streams.get(name)
                    if stream is None:
                        continue
                    for op, fn in (("put", stream.put), ("get", stream.get)):
                        start = time.perf_counter()
                        for _ in range(batches):
                            fn(payload if op == "put" else sinks)
                        results.setdefault(f"{name} {op} ceiling", []).append(
                            _rate(time.perf_counter() - start, batches * batch_bytes)
                        )
        finally:
            for c in clients.values():
                c.close()
            for s in streams.values():
                s.close()
    medians = {k: round(statistics.median(v), 3) for k, v in results.items()}
    report: dict[str, Any] = {"block_bytes": BLOCK, "batch_blocks": BATCH, "rounds": rounds}
    report["gbps"] = medians
    for op in ("put", "get"):
        report[f"tls/plain {op}"] = round(medians[f"tls {op}"] / medians[f"plain {op}"], 3)
        for name in ("plain", "tls"):
            report[f"{name} {op} / ceiling"] = round(
                medians[f"{name} {op}"] / medians[f"{name} {op} ceiling"], 3
            )
        report[f"unix/shm {op}"] = round(medians[f"unix {op}"] / medians[f"shm {op}"], 3)
    report["cpus"] = os.cpu_count()
    report["openssl"] = ssl.OPENSSL_VERSION
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args.rounds, args.batches)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    gbps = report["gbps"]
    print(
        f"TLS on the TCP path, {BLOCK // MiB} MiB blocks, batches of {BATCH}, "
        f"{args.rounds} rounds ({report['openssl']}, {report['cpus']} CPUs)"
    )
    for op in ("put", "get"):
        print(
            f"  {op}: plain {gbps[f'plain {op}']:.2f} GB/s "
            f"({report[f'plain {op} / ceiling']:.2f}x its socket ceiling "
            f"{gbps[f'plain {op} ceiling']:.2f}); TLS {gbps[f'tls {op}']:.2f} GB/s "
            f"({report[f'tls {op} / ceiling']:.2f}x its TLS-socket ceiling "
            f"{gbps[f'tls {op} ceiling']:.2f}); TLS/plain {report[f'tls/plain {op}']:.2f}"
        )
        print(
            f"  {op}, same host: shared arena {gbps[f'shm {op}']:.2f} GB/s, Unix socket (a "
            f"tenant's path) {gbps[f'unix {op}']:.2f} GB/s ({report[f'unix/shm {op}']:.2f}x)"
        )


if __name__ == "__main__":
    main()
