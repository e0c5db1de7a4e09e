"""A node at scale: many small blocks held, and many clients at once (issue 29).

1. ``fill``: a real ``kvpool serve`` filled with ``--blocks`` 4 KiB blocks through the SDK
   over shared memory, 256 keys per put, each key a namespace and a 32-byte block id (as an
   engine's: vLLM's block hashes are SHA-256 digests).  Reports the daemon's heap per block
   held (growth of RssAnon in /proc/PID/status over the blocks held), the put rate per
   ``--step`` blocks, the worst put while filling, ``--evicting`` puts once the arena is full (every
   one evicts: p50, p99, max and each call over 300 ms with when it came), the restart
   after SIGKILL until the node answers with the share of a sample of held keys found
   after it, and a 1,000-key lookup's latency on the empty and on the full node.
2. ``clients``: 1..32 client processes (``--clients``), each looping over a lookup of 64
   keys, a put and a get of 4 x 64 KiB, for ``--seconds`` per step against one node:
   calls/s, lookup and put p50/p99, errors and wrong bytes; and where the CPU went: the
   daemon's CPU time per call (/proc/PID/stat) and its share of a core, how long it waited
   for a CPU while it had work (/proc/PID/task/PID/schedstat), the clients' CPU
   per call, the daemon's context switches per call, the run queue, and the cores that
   other work on the machine took meanwhile.  Every client process connects first; the
   clock starts when all are ready.  ``--profile DIR`` records the daemon with py-spy
   (when it is on the PATH) during each step; ``--daemon-nice N`` runs the daemon at that
   nice value (an experiment: what the daemon's share of the CPU is worth).
3. ``floor``: the same counts of processes, each timing a put's own CPU work on the
   client (copy 4 x 64 KiB and checksum each) with no node at all: the latency that
   waiting for a core adds at that count, under any daemon.

    .venv/bin/python -m benchmarks.scale [fill|clients|floor|all] [--blocks 200000] [--json]
        [--eviction lru|learned]
        [--clients 1,4,16,32] [--seconds 8] [--profile DIR] [--daemon-nice N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

from kvpool import Client, Namespace, Status
from kvpool.checksum import checksum
from kvpool.harness.process import NodeProcess

BLOCK = 4096
BATCH = 256
SLOW_S = 0.300
LOOKUP_KEYS = 1000
LOOKUP_ROUNDS = 200
SAMPLE = 10_000
STORED = (Status.OK, Status.EXISTS)

LOOP_KEYS = 64
LOOP_BLOCKS = 4
LOOP_BLOCK = 64 << 10
FLOOR_REPEATS = 5


def rss_anon(pid: int) -> int:
    """The process's anonymous resident memory (its heap, not the shared arena), bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/PID/status")


def block_id(i: int, kind: bytes = b"") -> bytes:
    """A 32-byte block id, as an engine's are (vLLM's block hashes are SHA-256 digests)."""
    return hashlib.sha256(kind + i.to_bytes(8, "big")).digest()


def pct(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)) * 1000, 2) if values else 0.0


def _lookup_ms(client: Client, keys: list[bytes]) -> dict[str, float]:
    took = []
    for _ in range(LOOKUP_ROUNDS):
        started = time.perf_counter()
        client.lookup(keys)
        took.append(time.perf_counter() - started)
    return {"p50_ms": pct(took, 50), "p99_ms": pct(took, 99)}


def fill(blocks: int, evicting: int, step: int, eviction: str = "lru") -> dict[str, Any]:
    """Fill, evict, kill -9 and restart one node; see the module's docstring."""
    run_dir = tempfile.mkdtemp(prefix="kvpool-scale-", dir="/dev/shm")
    ns = Namespace(model="scale")
    # The arena holds about ``blocks`` blocks; the puts past it all evict.
    memory = blocks * BLOCK
    payload = np.random.default_rng(0).integers(0, 256, BLOCK, dtype=np.uint8)
    values = [payload] * BATCH
    try:
        extra = ["--eviction", eviction]
        node = NodeProcess.private("scale", memory, run_dir=run_dir, extra=extra).start()
        with Client(node.unix_address, timeout=60) as client:
            absent = ns.keys(block_id(i, b"absent") for i in range(LOOKUP_KEYS))
            lookup_empty = _lookup_ms(client, absent)
            heap_empty = rss_anon(node.pid)

            def put(index: int) -> tuple[list[bytes], float]:
                keys = ns.keys(block_id(index + i) for i in range(BATCH))
                started = time.perf_counter()
                result = client.put(keys, values)
                took = time.perf_counter() - started
                ok = [k for k, s in zip(keys, result.statuses, strict=True) if s in STORED]
                return ok, took

            began = time.perf_counter()
            rates: list[dict[str, Any]] = []
            worst_fill = 0.0
            step_began, step_done = began, 0
            written = 0
            while written < blocks:
                _, took = put(written)
                worst_fill = max(worst_fill, took)
                written += BATCH
                if written - step_done >= step:
                    now = time.perf_counter()
                    rates.append(
                        {
                            "upto": written,
                            "blocks_per_s": round((written - step_done) / (now - step_began)),
                        }
                    )
                    step_began, step_done = now, written
            stats = client.stats()
            held_full = stats.num_blocks
            heap_full = rss_anon(node.pid)

            evict_took: list[float] = []
            slow: list[dict[str, float]] = []
            evictions_before = stats.evictions
            recent: list[bytes] = []
            for _ in range(evicting):
                ok, took = put(written)
                written += BATCH
                evict_took.append(took)
                recent += ok
                if took > SLOW_S:
                    slow.append(
                        {"at_s": round(time.perf_counter() - began, 2), "ms": round(took * 1000)}
                    )
            stats = client.stats()
            held = stats.num_blocks
            heap_held = rss_anon(node.pid)
            # The newest blocks are those still held: the lookup and the restart's sample.
            present = recent[-min(len(recent), held) :]
            lookup_full = _lookup_ms(client, present[-LOOKUP_KEYS:])
            rng = np.random.default_rng(1)
            sample = [
                present[i]
                for i in rng.choice(len(present), min(SAMPLE, len(present)), replace=False)
            ]
            before = client.exists(sample).count(True)
        node.kill()
        launched = time.perf_counter()
        again = NodeProcess.private("scale", memory, run_dir=run_dir, extra=extra).start()
        ready_s = time.perf_counter() - launched
        with Client(again.unix_address, timeout=60) as client:
            client.health()
            answers_s = time.perf_counter() - launched
            after = client.exists(sample).count(True)
        again.stop()
        return {
            "blocks_requested": blocks,
            "blocks_held_full": held_full,
            "heap_per_block_bytes": round((heap_full - heap_empty) / max(held_full, 1)),
            "heap_per_block_after_eviction_bytes": round((heap_held - heap_empty) / max(held, 1)),
            "fill_rate": rates,
            "fill_worst_put_ms": round(worst_fill * 1000, 1),
            "evicting_puts": len(evict_took),
            "evicted_blocks": stats.evictions - evictions_before,
            "evicting_put_ms": {
                "p50": pct(evict_took, 50),
                "p99": pct(evict_took, 99),
                "max": round(max(evict_took, default=0.0) * 1000, 1),
            },
            "calls_over_300ms": slow,
            "restart_ready_s": round(ready_s, 3),
            "restart_answers_s": round(answers_s, 3),
            "restart_found_share": round(after / max(before, 1), 4),
            "lookup_1000_empty_ms": lookup_empty,
            "lookup_1000_full_ms": lookup_full,
        }
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system), from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _switches(pid: int) -> tuple[int, int]:
    """A process's main thread (the daemon's event loop): its voluntary and involuntary
    (preempted) context switches so far."""
    counts = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name.endswith("voluntary_ctxt_switches"):
                counts[name] = int(value)
    return counts["voluntary_ctxt_switches"], counts["nonvoluntary_ctxt_switches"]


def _runnable_wait_s(pid: int) -> float:
    """How long a process's main thread (the daemon's event loop) has been runnable but
    waiting for a CPU so far (/proc/PID/task/PID/schedstat), seconds."""
    with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def _busy_s() -> float:
    """The machine's CPU time spent busy so far, all cores (/proc/stat), seconds."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _run_queue(stop: threading.Event, into: list[int]) -> None:
    """Sample the machine's runnable threads (/proc/stat procs_running) every 10 ms."""
    while not stop.wait(0.01):
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running"):
                    into.append(int(line.split()[1]))
                    break


def _client_loop(address: str, worker: int, seconds: float, ready: Any, go: Any, out: Any) -> None:
    """One client process: lookup 64 keys, put 4 x 64 KiB, get them back and compare.  It
    says when it is connected and ready, and starts at the common time ``go`` brings, so
    that no process is still starting while others are measured."""
    ns = Namespace(model="scale-clients")
    rng = np.random.default_rng(worker)
    lookups: list[float] = []
    puts: list[float] = []
    calls = errors = wrong = 0
    with Client(address, timeout=30) as client:
        blocks = [rng.integers(0, 256, LOOP_BLOCK, dtype=np.uint8) for _ in range(LOOP_BLOCKS)]
        into = [np.empty(LOOP_BLOCK, np.uint8) for _ in range(LOOP_BLOCKS)]
        client.lookup(ns.keys([b"warm-up"]))
        ready.put(worker)
        start_at = go.get()
        while time.time() < start_at:
            time.sleep(0.001)
        cpu_before = time.process_time()
        n = 0
        while time.time() < start_at + seconds:
            base = b"w%d-%d" % (worker, n)
            keys = ns.keys(base + b"-%d" % i for i in range(LOOP_BLOCKS))
            probe = ns.keys(base + b"-p%d" % i for i in range(LOOP_KEYS))
            try:
                t0 = time.perf_counter()
                client.lookup(probe)
                t1 = time.perf_counter()
                client.put(keys, blocks)
                t2 = time.perf_counter()
                got = client.get(keys, into)
                lookups.append(t1 - t0)
                puts.append(t2 - t1)
                calls += 3
                for i, found in enumerate(got.found):
                    if found and not np.array_equal(into[i], blocks[i]):
                        wrong += 1
            except Exception:
                errors += 1
            n += 1
        cpu_s = time.process_time() - cpu_before
    out.put(
        {
            "calls": calls,
            "lookups": lookups,
            "puts": puts,
            "errors": errors,
            "wrong": wrong,
            "cpu_s": cpu_s,
        }
    )


def _profiler(pid: int, seconds: float, profile_dir: str | None, count: int) -> Any:
    """py-spy recording the daemon for one step (``--profile DIR``), or None."""
    if profile_dir is None:
        return None
    out = os.path.join(profile_dir, f"daemon-{count}-clients.txt")
    command = ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds))]
    return subprocess.Popen(
        [*command, "--format", "raw", "--output", out, "--nonblocking"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _start_together(
    ctx: Any, count: int, target: Any, args_of: Any
) -> tuple[list[Any], Any, float]:
    """``count`` processes of ``target(*args_of(worker), ready, go, out)``, each ready (its
    imports done, connected) before any starts to measure: the processes, the queue they
    report on, and the time they all start at."""
    ready, go, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(w), ready, go, out)) for w in range(count)]
    for p in procs:
        p.start()
    for _ in procs:
        ready.get(timeout=120)
    start_at = time.time() + 0.5
    for _ in procs:
        go.put(start_at)
    return procs, out, start_at


def clients(
    counts: list[int], seconds: float, profile_dir: str | None = None, daemon_nice: int = 0
) -> list[dict[str, Any]]:
    """The concurrency table: one fresh node, each client count in turn.  Beside the
    latencies: the daemon's CPU time per call and its share of one core, the clients' CPU
    per call, the daemon's context switches per call (involuntary: preempted), and the
    machine's run queue (runnable threads, sampled every 10 ms) while the step runs."""
    run_dir = tempfile.mkdtemp(prefix="kvpool-scale-c-", dir="/dev/shm")
    rows = []
    ctx = mp.get_context("spawn")
    try:
        with NodeProcess.private("scale-c", 1 << 30, run_dir=run_dir) as node:
            if daemon_nice:  # an experiment (needs the privilege to raise a priority)
                for tid in os.listdir(f"/proc/{node.pid}/task"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), daemon_nice)
            for count in counts:
                procs, out, start_at = _start_together(
                    ctx, count, _client_loop, lambda w: (node.unix_address, w, seconds)
                )
                time.sleep(max(start_at - time.time(), 0))
                cpu_before, switches_before = _cpu_s(node.pid), _switches(node.pid)
                busy_before, wait_before = _busy_s(), _runnable_wait_s(node.pid)
                queue: list[int] = []
                stop = threading.Event()
                sampler = threading.Thread(target=_run_queue, args=(stop, queue), daemon=True)
                sampler.start()
                profiler = _profiler(node.pid, seconds, profile_dir, count)
                time.sleep(seconds)
                daemon_cpu_s = _cpu_s(node.pid) - cpu_before
                busy_s = _busy_s() - busy_before
                daemon_wait_s = _runnable_wait_s(node.pid) - wait_before
                switches = [
                    a - b for a, b in zip(_switches(node.pid), switches_before, strict=True)
                ]
                stop.set()
                results = [out.get(timeout=seconds + 120) for _ in procs]
                for p in procs:
                    p.join()
                if profiler is not None:
                    profiler.wait(timeout=60)
                lookups = [x for r in results for x in r["lookups"]]
                puts = [x for r in results for x in r["puts"]]
                num_calls = max(sum(r["calls"] for r in results), 1)
                clients_cpu_s = sum(r["cpu_s"] for r in results)
                rows.append(
                    {
                        "clients": count,
                        "calls_per_s": round(num_calls / seconds),
                        "lookup_p50_ms": pct(lookups, 50),
                        "lookup_p99_ms": pct(lookups, 99),
                        "put_p50_ms": pct(puts, 50),
                        "put_p99_ms": pct(puts, 99),
                        "errors": sum(r["errors"] for r in results),
                        "wrong_bytes": sum(r["wrong"] for r in results),
                        "daemon_cpu_us_per_call": round(daemon_cpu_s / num_calls * 1e6, 1),
                        "daemon_core_share": round(daemon_cpu_s / seconds, 2),
                        # Runnable with work to do, but another process had the CPU.
                        "daemon_cpu_wait_us_per_call": round(daemon_wait_s / num_calls * 1e6, 1),
                        "daemon_cpu_wait_share": round(daemon_wait_s / seconds, 2),
                        "clients_cpu_us_per_call": round(clients_cpu_s / num_calls * 1e6, 1),
                        # What else ran on the machine meanwhile (other work, the kernel's
                        # own threads), in cores: the share the step did not have.
                        "others_cores": round(
                            max(busy_s - daemon_cpu_s - clients_cpu_s, 0) / seconds, 2
                        ),
                        "daemon_switches_per_call": round(switches[0] / num_calls, 2),
                        "daemon_preempted_per_call": round(switches[1] / num_calls, 3),
                        "run_queue_mean": round(float(np.mean(queue)), 1) if queue else 0.0,
                    }
                )
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows


def _floor_loop(worker: int, seconds: float, ready: Any, go: Any, out: Any) -> None:
    """One process of the floor step: time a call's worth of CPU work with no node (a put's
    data work on the client, copy 4 x 64 KiB and checksum each, FLOOR_REPEATS times: about
    the CPU a client spends per call, 0.1 ms), over and over."""
    rng = np.random.default_rng(worker)
    blocks = [rng.integers(0, 256, LOOP_BLOCK, dtype=np.uint8) for _ in range(LOOP_BLOCKS)]
    into = [np.empty(LOOP_BLOCK, np.uint8) for _ in range(LOOP_BLOCKS)]
    took: list[float] = []
    ready.put(worker)
    start_at = go.get()
    while time.time() < start_at:
        time.sleep(0.001)
    while time.time() < start_at + seconds:
        started = time.perf_counter()
        for _ in range(FLOOR_REPEATS):
            for block, dst in zip(blocks, into, strict=True):
                np.copyto(dst, block)
                checksum(dst)
        took.append(time.perf_counter() - started)
    out.put(took)


def floor(counts: list[int], seconds: float) -> list[dict[str, Any]]:
    """What the machine alone does to a call's latency: P processes each timing a put's own
    CPU work (no node, no socket).  With more processes than cores, a process waits for a
    core in turn, and a call that needs 0.1 ms of CPU takes what its wait for a core adds:
    the latency floor under any daemon at that count."""
    rows = []
    ctx = mp.get_context("spawn")
    for count in counts:
        procs, out, _ = _start_together(ctx, count, _floor_loop, lambda w: (w, seconds))
        took = [x for _ in procs for x in out.get(timeout=seconds + 120)]
        for p in procs:
            p.join()
        rows.append(
            {
                "processes": count,
                "work_p50_ms": pct(took, 50),
                "work_p99_ms": pct(took, 99),
                "work_max_ms": round(max(took) * 1000, 2) if took else 0.0,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "what", nargs="?", default="all", choices=["fill", "clients", "floor", "all"]
    )
    parser.add_argument("--blocks", type=int, default=200_000, help="blocks the arena holds")
    parser.add_argument("--evicting", type=int, default=2000, help="puts once full")
    parser.add_argument("--step", type=int, default=250_000, help="blocks per fill-rate row")
    parser.add_argument("--clients", default="1,4,16,32")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--eviction", default="lru", help="the node's policy (fill)")
    parser.add_argument("--profile", metavar="DIR", help="py-spy the daemon each clients step")
    parser.add_argument(
        "--daemon-nice", type=int, default=0, help="run the daemon at this nice value (experiment)"
    )
    args = parser.parse_args()
    report: dict[str, Any] = {"cpus": os.cpu_count()}
    if args.what in ("fill", "all"):
        step = min(args.step, args.blocks)
        report["fill"] = fill(args.blocks, args.evicting, step, args.eviction)
    if args.what in ("clients", "all"):
        report["clients"] = clients(
            [int(c) for c in args.clients.split(",")], args.seconds, args.profile, args.daemon_nice
        )
    if args.what == "floor":
        report["floor"] = floor([int(c) for c in args.clients.split(",")], args.seconds)
    sys.stdout.write(json.dumps(report, indent=None if args.json else 2) + "\n")


if __name__ == "__main__":
    main()
