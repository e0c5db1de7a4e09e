"""``kvpool bench``: put and get throughput and latency, each beside its ceiling measured in
the same run.

- same-node (``path=shm``): the client copies through the node's arena; the ceiling is a
  memcpy of the same blocks into a shared-memory mapping, on one thread.  The client copies
  over ``copy_threads`` threads (:mod:`kvpool.client.copier`), so a second ceiling is the
  same memcpy over that many threads (``threads_ceiling_gbps``).
- TCP (``path=tcp``): the client streams over a TCP socket; the ceiling is a plain Python
  socket stream of the same blocks between two processes (sendall / recv_into).
- Redis, when ``redis-server`` is installed, over TCP with pipelined SET / MGET: the remote
  store existing KV-cache systems use.

Each call moves one batch (``--batch`` bytes of blocks), like an engine saving or loading a
request's blocks; latency percentiles are per call.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvpool.buffers import byte_view
from kvpool.client.client import Client
from kvpool.client.copier import Copier
from kvpool.client.futures import PoolFuture
from kvpool.client.ops import PutResult
from kvpool.client.writer import Writer
from kvpool.config import MiB, format_size
from kvpool.harness.process import NodeProcess
from kvpool.keys import Namespace

from .bench_peers import RedisPeer, StreamCeiling, shm_buffer

LOOKUP_KEYS = 1000
LOOKUP_ROUNDS = 2000
WARMUP_CALLS = 2
ROUNDS = 5


@dataclass
class BenchOptions:
    block_sizes: list[int]
    total_bytes: int = 512 * MiB
    batch_bytes: int = 32 * MiB
    with_redis: bool = True
    address: str | None = None


@dataclass
class Case:
    system: str
    op: str
    path: str
    block_bytes: int
    gbps: float
    ceiling_gbps: float
    ratio: float
    p50_ms: float
    p99_ms: float
    vs_redis: float | None = None
    threads_ceiling_gbps: float | None = None  # shm: memcpy over the client's copy threads
    threads_ratio: float | None = None


@dataclass
class Report:
    machine: dict[str, Any]
    cases: list[Case] = field(default_factory=list)
    lookup: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timed(calls: int, fn: Callable[[int], Any]) -> list[float]:
    for i in range(min(WARMUP_CALLS, calls)):
        fn(i)
    times = []
    for i in range(calls):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return times


# -- ceilings -----------------------------------------------------------------------------


# -- the run ------------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def run_cases(options: BenchOptions, progress: Callable[[str], None] = lambda _: None) -> Report:
    report = Report(machine=_machine())
    ns = Namespace(model="kvpool-bench", extra=secrets.token_hex(8))
    with contextlib.ExitStack() as stack:
        if options.address is None:
            # Room for every block of the largest case, through its three ways of putting
            # at once (an arena up to 2 GiB is populated as a client maps it).
            data_bytes = max(_shape(options, size)[3] for size in options.block_sizes)
            arena_bytes = int(3 * data_bytes * 1.1) + 128 * MiB
            node = NodeProcess.private(f"bench-{os.getpid()}", arena_bytes, ephemeral=True)
            stack.enter_context(node)
            shm_address, tcp_address = node.unix_address, node.tcp_address
        else:
            shm_address = tcp_address = options.address
        redis_peer: RedisPeer | None = None
        if options.with_redis:
            try:
                redis_peer = RedisPeer()
                stack.callback(redis_peer.close)
            except (FileNotFoundError, ImportError):
                report.notes.append(
                    "Redis baseline skipped: redis-server is not installed "
                    "(apt-get install redis-server)."
                )
            except RuntimeError as exc:
                report.notes.append(f"Redis baseline skipped: {exc}.")
        stream = StreamCeiling()
        stack.callback(stream.close)
        shm_client = stack.enter_context(Client(shm_address, use_shm=True, timeout=60))
        tcp_client = stack.enter_context(Client(tcp_address, use_shm=False, timeout=60))
        if not shm_client.uses_shm:
            report.notes.append(
                "The same-node case could not map the arena; it streamed over the socket."
            )
        for block_bytes in options.block_sizes:
            _run_size(
                report,
                options,
                ns,
                block_bytes,
                shm_client,
                tcp_client,
                stream,
                redis_peer,
                progress,
            )
        progress("lookup")
        report.lookup = _lookup_case(shm_client, ns)
    return report


def _interleaved(
    rounds: int, calls: int, fns: dict[str, Callable[[int], Any]]
) -> dict[str, list[list[float]]]:
    """Time each function ``calls`` times per round, the functions taking turns round by
    round (in alternating order), so that a noisy machine weighs on all of them alike."""
    counters = dict.fromkeys(fns, 0)

    def call(name: str) -> float:
        index = counters[name]
        counters[name] += 1
        start = time.perf_counter()
        fns[name](index)
        return time.perf_counter() - start

    for name in fns:
        for _ in range(WARMUP_CALLS):
            call(name)
    times: dict[str, list[list[float]]] = {name: [] for name in fns}
    order = list(fns)
    for r in range(rounds):
        for name in order if r % 2 == 0 else reversed(order):
            times[name].append([call(name) for _ in range(calls)])
    return times


def _case(
    system: str,
    op: str,
    path: str,
    block_bytes: int,
    batch_bytes: int,
    ours: list[list[float]],
    ceiling: list[list[float]],
) -> Case:
    ours_gbps = [batch_bytes * len(r) / sum(r) / 1e9 for r in ours]
    ceiling_gbps = [batch_bytes * len(r) / sum(r) / 1e9 for r in ceiling]
    ratios = [o / c for o, c in zip(ours_gbps, ceiling_gbps, strict=True)]
    flat = [t for r in ours for t in r]
    return Case(
        system,
        op,
        path,
        block_bytes,
        gbps=round(statistics.median(ours_gbps), 3),
        ceiling_gbps=round(statistics.median(ceiling_gbps), 3),
        ratio=round(statistics.median(ratios), 3),
        p50_ms=round(_percentile(flat, 0.5) * 1e3, 3),
        p99_ms=round(_percentile(flat, 0.99) * 1e3, 3),
    )


def _shm_case(
    op: str,
    path: str,
    block_bytes: int,
    batch_bytes: int,
    ours: list[list[float]],
    times: dict[str, list[list[float]]],
) -> Case:
    """A same-node case beside memcpy on one thread, and on the client's copy threads."""
    case = _case("kvpool", op, path, block_bytes, batch_bytes, ours, times["memcpy"])
    threads = _case("kvpool", op, path, block_bytes, batch_bytes, ours, times["memcpy_threads"])
    case.threads_ceiling_gbps, case.threads_ratio = threads.ceiling_gbps, threads.ratio
    return case


def _shape(options: BenchOptions, block_bytes: int) -> tuple[int, int, int, int]:
    """Blocks per call, bytes per call, timed calls per round, and the bytes all calls
    write, for one block size."""
    per_call = max(1, options.batch_bytes // block_bytes)
    batch_bytes = per_call * block_bytes
    calls = max(2, options.total_bytes // (batch_bytes * ROUNDS))
    return per_call, batch_bytes, calls, batch_bytes * (WARMUP_CALLS + ROUNDS * calls)


class _Blocks:
    """One block size's workload: the blocks a call writes, the buffers a call reads into,
    and the keys of every call of every path."""

    def __init__(self, options: BenchOptions, ns: Namespace, block_bytes: int):
        self.per_call, self.batch_bytes, self.calls, _ = _shape(options, block_bytes)
        self.num_calls = WARMUP_CALLS + ROUNDS * self.calls
        self.block_bytes = block_bytes
        self.ns = ns
        rng = np.random.default_rng(block_bytes)
        self.src = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(self.per_call)]
        self.dst = [np.zeros(block_bytes, dtype=np.uint8) for _ in range(self.per_call)]

    def keys_of(self, tag: str, call: int) -> list[bytes]:
        prefix = f"{tag}-{self.block_bytes}-{call}"
        return [self.ns.key(f"{prefix}-{i}".encode()) for i in range(self.per_call)]

    def put_with(self, client: Client, tag: str) -> Callable[[int], None]:
        def put(call: int) -> None:
            result = client.put(self.keys_of(tag, call), self.src)
            if not result.all_stored:
                raise RuntimeError(f"bench put failed: {result.statuses[:4]}")

        return put

    def pipelined_with(self, writer: Writer) -> Callable[[int], None]:
        pending: list[PoolFuture[PutResult]] = []

        def put(call: int) -> None:
            pending.append(writer.put(self.keys_of("pipelined", call), self.src))
            if (call + 1 - WARMUP_CALLS) % self.calls == 0:  # a round's last call: its replies
                writer.flush()
                if not all(f.result().all_stored for f in pending):
                    raise RuntimeError("bench pipelined put failed")
                pending.clear()

        return put

    def get_with(self, client: Client, tag: str) -> Callable[[int], None]:
        def get(call: int) -> None:
            result = client.get(self.keys_of(tag, call % self.num_calls), self.dst)
            if result.num_found != self.per_call:
                raise RuntimeError(f"bench get missed blocks: {result.statuses[:4]}")

        return get

    def delete(self, client: Client, tag: str) -> None:
        keys = [k for call in range(self.num_calls) for k in self.keys_of(tag, call)]
        client.delete(keys, timeout=60)


class _MemcpyCeilings:
    """memcpy of a call's blocks into and out of shared memory, on one thread and over the
    client's copy threads.  The target spans as much shared memory as the pool's data does,
    so that neither side profits from blocks still in the CPU cache."""

    def __init__(self, blocks: _Blocks, target: np.ndarray, copier: Copier):
        self.blocks = blocks
        self.target = target
        self.copier = copier
        self.src_views = [byte_view(s) for s in blocks.src]
        self.dst_views = [byte_view(d) for d in blocks.dst]

    def slots(self, call: int) -> list[np.ndarray]:
        b = self.blocks
        base = (call % b.num_calls) * b.batch_bytes
        size = b.block_bytes
        return [self.target[base + i * size : base + (i + 1) * size] for i in range(b.per_call)]

    def copy_in(self, call: int) -> None:
        for s, d in zip(self.blocks.src, self.slots(call), strict=True):
            np.copyto(d, s)

    def copy_out(self, call: int) -> None:
        for s, d in zip(self.slots(call), self.blocks.dst, strict=True):
            np.copyto(d, s)

    def threads_in(self, call: int) -> None:
        self.copier.copy([byte_view(d) for d in self.slots(call)], self.src_views)

    def threads_out(self, call: int) -> None:
        self.copier.copy(self.dst_views, [byte_view(s) for s in self.slots(call)])


def _run_size(
    report: Report,
    options: BenchOptions,
    ns: Namespace,
    block_bytes: int,
    shm_client: Client,
    tcp_client: Client,
    stream: StreamCeiling,
    redis_peer: RedisPeer | None,
    progress: Callable[[str], None],
) -> None:
    blocks = _Blocks(options, ns, block_bytes)
    with contextlib.ExitStack() as stack:
        writer = shm_client.writer(timeout=60)
        stack.callback(writer.close)
        target = stack.enter_context(shm_buffer(blocks.batch_bytes * blocks.num_calls))
        copier = Copier(shm_client.config.copy_threads)
        stack.callback(copier.close)
        memcpy = _MemcpyCeilings(blocks, target, copier)
        puts: dict[str, Callable[[int], None]] = {
            "memcpy": memcpy.copy_in,
            "memcpy_threads": memcpy.threads_in,
            "shm": blocks.put_with(shm_client, "shm"),
            "pipelined": blocks.pipelined_with(writer),
            "stream": lambda _: stream.send(blocks.src),
            "tcp": blocks.put_with(tcp_client, "tcp"),
        }
        gets: dict[str, Callable[[int], None]] = {
            "memcpy": memcpy.copy_out,
            "memcpy_threads": memcpy.threads_out,
            "shm": blocks.get_with(shm_client, "shm"),
            "stream": lambda _: stream.recv(blocks.dst),
            "tcp": blocks.get_with(tcp_client, "tcp"),
        }
        if redis_peer is not None:
            puts["redis"] = lambda call: redis_peer.put(blocks.keys_of("redis", call), blocks.src)
            gets["redis"] = lambda call: redis_peer.get(
                blocks.keys_of("redis", call % blocks.num_calls)
            )
        for op, fns in (("put", puts), ("get", gets)):
            progress(f"{format_size(block_bytes)} {op}: {', '.join(fns)}")
            _record(report, op, blocks, _interleaved(ROUNDS, blocks.calls, fns))
    for tag, client in (("shm", shm_client), ("pipelined", shm_client), ("tcp", tcp_client)):
        blocks.delete(client, tag)
    if redis_peer is not None:
        redis_peer.client.flushall()


def _record(report: Report, op: str, blocks: _Blocks, times: dict[str, list[list[float]]]) -> None:
    """The cases of one operation, each beside its ceiling (and Redis, where it ran)."""
    sizes = (blocks.block_bytes, blocks.batch_bytes)
    ours = [_shm_case(op, "shm", *sizes, times["shm"], times)]
    if "pipelined" in times:
        ours.append(_shm_case(op, "shm, pipelined", *sizes, times["pipelined"], times))
    ours.append(_case("kvpool", op, "tcp", *sizes, times["tcp"], times["stream"]))
    report.cases.extend(ours)
    if "redis" in times:
        redis_case = _case("redis", op, "tcp", *sizes, times["redis"], times["stream"])
        report.cases.append(redis_case)
        for case in ours:
            case.vs_redis = round(case.gbps / redis_case.gbps, 2)


def _lookup_case(client: Client, ns: Namespace) -> dict[str, Any]:
    keys = [ns.key(f"lookup-{i}".encode()) for i in range(LOOKUP_KEYS)]
    values = [b"x" * 64] * LOOKUP_KEYS
    client.put(keys, values)
    times = _timed(LOOKUP_ROUNDS, lambda _: client.lookup(keys))
    found = client.lookup(keys)
    client.delete(keys)
    return {
        "num_keys": LOOKUP_KEYS,
        "found": found,
        "path": "shm" if client.uses_shm else "unix",
        "p50_ms": round(_percentile(times, 0.5) * 1e3, 3),
        "p99_ms": round(_percentile(times, 0.99) * 1e3, 3),
        "mean_ms": round(statistics.fmean(times) * 1e3, 3),
    }


def render(report: Report, console: Console) -> None:
    table = Table(title="kvpool bench (ratio = our throughput / ceiling measured in this run)")
    for column in (
        "system",
        "op",
        "path",
        "block",
        "GB/s",
        "ceiling GB/s",
        "ratio",
        "threads ceiling (ratio)",
        "p50 ms",
        "p99 ms",
        "vs redis",
    ):
        table.add_column(column, justify="left" if column in ("system", "op", "path") else "right")
    for c in report.cases:
        table.add_row(
            c.system,
            c.op,
            c.path,
            format_size(c.block_bytes),
            f"{c.gbps:.2f}",
            f"{c.ceiling_gbps:.2f}",
            f"{c.ratio:.2f}",
            f"{c.threads_ceiling_gbps:.2f} ({c.threads_ratio:.2f})" if c.threads_ratio else "-",
            f"{c.p50_ms:.2f}",
            f"{c.p99_ms:.2f}",
            f"{c.vs_redis:.2f}x" if c.vs_redis else "-",
        )
    console.print(table)
    lk = report.lookup
    if lk:
        console.print(
            f"lookup of a {lk['num_keys']}-key prefix ({lk['path']}): p50 {lk['p50_ms']:.3f} ms, "
            f"p99 {lk['p99_ms']:.3f} ms"
        )
    for note in report.notes:
        console.print(f"[yellow]note:[/] {note}")


def run_bench(options: BenchOptions, json_output: bool) -> Report:
    console = Console(stderr=True)
    steps = len(options.block_sizes) * 2 + 1
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("starting", total=steps)

        def step(label: str) -> None:
            bar.update(task, advance=1, description=label)

        report = run_cases(options, step)
    if json_output:
        sys.stdout.write(json.dumps(asdict(report)) + "\n")
    else:
        render(report, Console(width=max(Console().width, 120)))
    return report
