"""Long prompts, as agents send them (issue 51): sessions whose every request repeats the
last one's prefix and adds a few hundred blocks, up to ~2,000 engine blocks a prompt (128k
tokens at 64 tokens a block), replayed against a real ``kvpool serve`` over the Unix socket
(shared memory) and over TCP.

Each request does what a connector does with it: a lookup of all its blocks (the longest
stored prefix), a get of the prefix found into the engine's buffers, and a put of the
blocks after it.  Reported per path: put, lookup and get latency (p50, p99, max), the hit
rate (blocks found over blocks looked up), and the **node's CPU per block** on each kind of
call: the run time of the daemon's event loop (its main thread, which serves every request:
``/proc/PID/task/PID/schedstat``, nanoseconds) across the calls, over the blocks they moved;
and of all its threads (the scrubber's re-hashing and the arena's pre-faulting run beside,
at their own pace); and the client's: the CPU time of the calling thread across the calls,
over their blocks (the copier's second thread aside).  A cold phase first puts whole long
prompts
(``--cold`` puts of ``--prompt-blocks`` fresh blocks: a prompt never seen, or a prefill
instance's handover), the row "a 2,000-block put" of docs/benchmarks-log.md, after one put that
is not counted (a connection's first takes its write area, and faults its pages in).  Each
latency's p99 is also given less the pauses of this process's own garbage collector within
the calls (``gc.callbacks``): the client's Python, not the pool.

Ceilings of the same run: a memcpy of the same blocks (one thread, into a shared-memory
mapping), and for TCP a plain socket stream of the same bytes between two processes
(kvpool.cli.bench_peers.StreamCeiling).

    .venv/bin/python -m benchmarks.long_prompts [--sessions 4] [--turns 6]
        [--prompt-blocks 2000] [--block-bytes 4096] [--cold 30] [--paths shm,tcp] [--json]
        [--profile DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvpool import Client, Namespace
from kvpool.cli.bench_peers import StreamCeiling, shm_buffer
from kvpool.harness.process import NodeProcess


@dataclass(frozen=True)
class Request:
    session: int
    blocks: int  # the prompt's length in blocks; its first blocks are the last request's


def agent_trace(
    sessions: int, turns: int, first: tuple[int, int], grow: tuple[int, int], seed: int
) -> list[Request]:
    """Sessions interleaved round robin: each one's first prompt ``first`` blocks (a range),
    each next one the last one's plus ``grow`` blocks (a range)."""
    rng = np.random.default_rng(seed)
    lengths = [int(rng.integers(*first)) for _ in range(sessions)]
    trace = []
    for _ in range(turns):
        for session in range(sessions):
            trace.append(Request(session, lengths[session]))
            lengths[session] += int(rng.integers(*grow))
    return trace


def block_ids(session: int, count: int) -> list[bytes]:
    """A session's chain of block hashes (SHA-256 digests, as vLLM's are)."""
    return [hashlib.sha256(b"s%d/%d" % (session, i)).digest() for i in range(count)]


def node_cpu_ns(pid: int) -> tuple[int, int]:
    """The daemon's run time so far, nanoseconds: its event loop's, and every thread's."""
    total = loop = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):  # a thread that ended
            run_ns = int((task / "schedstat").read_text().split()[0])
            total += run_ns
            if task.name == str(pid):
                loop = run_ns
    return loop, total


class GcPauses:
    """The time this process spends in its garbage collector (``gc.callbacks``): a
    client's pauses, within the latencies measured, that are not the pool's work."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._started = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.total_s += time.perf_counter() - self._started


GC = GcPauses()


class Phase:
    """One kind of call: latencies, blocks moved, the node's CPU across them."""

    def __init__(self, pid: int):
        self.pid = pid
        self.took: list[float] = []
        self.gc_s: list[float] = []  # the client's GC pauses within each call
        self.blocks = 0
        self.loop_ns = 0
        self.all_ns = 0
        self.client_s = 0.0  # the calling thread's CPU (the copier's helper aside)

    def time(self, call: Any, blocks: int) -> Any:
        loop, total = node_cpu_ns(self.pid)
        gc_before = GC.total_s
        started, cpu = time.perf_counter(), time.thread_time()
        result = call()
        self.client_s += time.thread_time() - cpu
        self.took.append(time.perf_counter() - started)
        self.gc_s.append(GC.total_s - gc_before)
        loop_after, total_after = node_cpu_ns(self.pid)
        self.loop_ns += loop_after - loop
        self.all_ns += total_after - total
        self.blocks += blocks
        return result

    def report(self) -> dict[str, Any]:
        ms = np.array(self.took) * 1000 if self.took else np.zeros(1)
        less_gc = (np.array(self.took) - np.array(self.gc_s)) * 1000 if self.took else ms
        return {
            "calls": len(self.took),
            "blocks": self.blocks,
            "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "max_ms": round(float(ms.max()), 2),
            # The same calls less the client's garbage collector pauses within them.
            "p99_ms_less_client_gc": round(float(np.percentile(less_gc, 99)), 2),
            "client_gc_ms": round(sum(self.gc_s) * 1000, 1),
            "node_us_per_block": round(self.loop_ns / 1000 / max(self.blocks, 1), 2),
            "node_all_threads_us_per_block": round(self.all_ns / 1000 / max(self.blocks, 1), 2),
            "client_thread_us_per_block": round(self.client_s * 1e6 / max(self.blocks, 1), 2),
        }


def memcpy_ceiling_s(block_bytes: int, blocks: int) -> float:
    """One thread copying ``blocks`` blocks into a shared-memory mapping: the best of 5."""
    source = np.random.default_rng(2).integers(0, 256, block_bytes, dtype=np.uint8)
    with shm_buffer(block_bytes * blocks) as target:
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for i in range(blocks):
                target[i * block_bytes : (i + 1) * block_bytes] = source
            best = min(best, time.perf_counter() - started)
        return best


def socket_ceiling_s(block_bytes: int, blocks: int) -> float:
    """A plain socket stream of the same blocks to another process: the best of 5."""
    source = np.random.default_rng(2).integers(0, 256, block_bytes, dtype=np.uint8)
    stream = StreamCeiling()
    try:
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            stream.send([source] * blocks)
            best = min(best, time.perf_counter() - started)
        return best
    finally:
        stream.close()


def replay(address: str, pid: int, trace: list[Request], args: argparse.Namespace) -> dict:
    ns = Namespace(model="long-prompts", extra=address.split(":", maxsplit=1)[0])
    rng = np.random.default_rng(3)
    payload = rng.integers(0, 256, args.block_bytes, dtype=np.uint8)
    buffers = [np.empty(args.block_bytes, np.uint8) for _ in range(max(r.blocks for r in trace))]
    cold, puts, lookups, gets = Phase(pid), Phase(pid), Phase(pid), Phase(pid)
    looked = found = 0
    with Client(address, timeout=60) as client:
        warm = ns.keys(block_ids(-1, args.prompt_blocks))  # the connection's first area
        client.put(warm, [payload] * len(warm))
        for i in range(args.cold):
            ids = (
                hashlib.sha256(b"cold%d/%d" % (i, b)).digest() for b in range(args.prompt_blocks)
            )
            keys = ns.keys(ids)
            cold.time(lambda k=keys: client.put(k, [payload] * len(k)), len(keys))
        for request in trace:
            keys = ns.keys(block_ids(request.session, request.blocks))
            hit = lookups.time(lambda k=keys: client.lookup(k), len(keys))
            looked += len(keys)
            found += hit
            if hit:
                result = gets.time(
                    lambda k=keys[:hit]: client.get(k, buffers[: len(k)], prefix=True), hit
                )
                assert all(result.found), "a block the lookup found was not delivered"
            rest = keys[hit:]
            if rest:
                puts.time(lambda k=rest: client.put(k, [payload] * len(k)), len(rest))
    return {
        "cold_put": cold.report(),
        "put": puts.report(),
        "lookup": lookups.report(),
        "get": gets.report(),
        "hit_rate": round(found / max(looked, 1), 4),
    }


def _profile(pid: int, directory: str) -> subprocess.Popen[bytes]:
    """py-spy recording the daemon into ``directory``/node.txt (collapsed stacks)."""
    os.makedirs(directory, exist_ok=True)
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    out = os.path.join(directory, "node.txt")
    command = [spy, "record", "-p", str(pid), "-o", out, "-f", "raw", "-r", "250"]
    profiler = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    return profiler


def run(args: argparse.Namespace) -> dict[str, Any]:
    trace = agent_trace(args.sessions, args.turns, (300, 600), (200, 400), seed=0)
    held = args.cold * args.prompt_blocks + sum(
        max(r.blocks for r in trace if r.session == s) for s in range(args.sessions)
    )
    memory = 2 * held * args.block_bytes + (64 << 20)  # both paths' blocks, no eviction
    run_dir = tempfile.mkdtemp(prefix="kvpool-long-", dir="/dev/shm")
    try:
        with NodeProcess.private("long", memory, run_dir=run_dir, ephemeral=True) as node:
            profiler = _profile(node.pid, args.profile) if args.profile else None
            results: dict[str, Any] = {}
            for path in args.paths.split(","):
                address = node.unix_address if path == "shm" else node.tcp_address
                results[path] = replay(address, node.pid, trace, args)
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)
                profiler.wait(timeout=60)
        memcpy_s = memcpy_ceiling_s(args.block_bytes, args.prompt_blocks)
        socket_s = socket_ceiling_s(args.block_bytes, args.prompt_blocks)
        return {
            "trace": {
                "sessions": args.sessions,
                "requests": len(trace),
                "longest_blocks": max(r.blocks for r in trace),
                "block_bytes": args.block_bytes,
            },
            "ceilings": {
                "memcpy_ms_per_prompt": round(memcpy_s * 1000, 2),
                "memcpy_us_per_block": round(memcpy_s * 1e6 / args.prompt_blocks, 3),
                "socket_ms_per_prompt": round(socket_s * 1000, 2),
            },
            "paths": results,
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--prompt-blocks", type=int, default=2000)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--cold", type=int, default=30)
    parser.add_argument("--paths", default="shm,tcp")
    parser.add_argument("--profile", default=None, help="record the daemon with py-spy here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(args)
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
