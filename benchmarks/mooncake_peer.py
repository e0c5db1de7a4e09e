"""Mooncake Store as a peer: its put/get bandwidth on this machine, for comparison with kvpool.

Blocks are 2 MiB of random bytes; a batch is a list of keys put or got in one call, 8 MiB (4
blocks) or 32 MiB (16 blocks).  Two paths, each with ``put`` and ``get``:

- ``same_node``: one client process that contributes its own global segment and keeps the
  data there (``ReplicateConfig.preferred_segment`` set to itself), so Mooncake moves the bytes
  with a local memcpy (``MC_STORE_MEMCPY``, on by default in a TCP-only setup);
- ``tcp``: a holder process contributes the only segment it uses, and a client process that
  contributes none (global segment size 0) puts into it and gets from it over Mooncake's TCP
  transport, so every byte crosses a loopback TCP connection.

The data path is Mooncake's fastest for a caller whose data sits in registered memory:
``register_buffer`` once, then ``batch_put_from`` / ``batch_get_into`` (zero copy on the
client side).  ``--api bytes`` measures ``put_batch`` / ``get_batch`` instead, the API for
callers holding Python bytes; it is also the fallback on a Mooncake without the zero-copy calls.

Placement is checked, not assumed: before measuring, each process stores a probe object in its
own segment and learns that segment's transport endpoint; every object the benchmark puts is
then looked up with ``get_replica_desc`` and must sit on the expected endpoint (the client's
own for ``same_node``, the holder's for ``tcp``).  The bytes that crossed loopback during each
case are read from ``/proc/net/dev`` and reported as ``loopback_ratio`` (loopback bytes over
payload bytes): about 0 for ``same_node``, at least 1 for ``tcp``.

Per case: ``--warmup`` calls (default 2), then ``--total-mib`` of payload (default 256) in
timed calls, one at a time.  ``gbps`` is payload bytes over the summed call times (GB = 1e9
bytes), the median of ``--rounds`` rounds (default 3); ``p50_ms`` is the median call time over
all rounds.  A put writes fresh keys, which are removed after each call, outside the timing; a
get reads one batch put beforehand, into a zeroed buffer, and its bytes are compared with the
source after each call, outside the timing.

Mooncake's transfer engine listens on every address, so everything runs in a new network
namespace that has only loopback: the script re-executes itself under ``unshare --net`` (root
or user namespaces needed), brings ``lo`` up, starts ``mooncake_master`` (metadata by
P2PHANDSHAKE, so no metadata server), the holder and the clients, and stops them all, process
group by process group, whatever happens.  Run it with the Python of a virtual environment
that has Mooncake installed (``pip install mooncake-transfer-engine-non-cuda numpy``; on
Debian also ``apt-get install libibverbs1``)::

    /path/to/mooncake-venv/bin/python benchmarks/mooncake_peer.py --json

It prints one JSON line: ``{"version": ..., "api": ..., "cases": [{"path": "same_node",
"op": "put", "batch_bytes": 8388608, "block_bytes": 2097152, "gbps": ..., "p50_ms": ...},
...]}``.  ``mooncake_master`` is taken from beside ``sys.executable``, else from PATH, else
from ``--master``.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

BLOCK_BYTES = 2 << 20
BATCH_BLOCKS = (4, 16)
LOCALHOST = "127.0.0.1"
PROBE_KEY = "mooncake-peer-probe-{role}"
READY = "READY "
PR_SET_PDEATHSIG = 1


# --------------------------------------------------------------------------- orchestration


def _die_with_parent() -> None:
    """In a child, before exec: its own process group, and SIGKILL when the parent dies."""
    os.setsid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill_group(proc: subprocess.Popen[Any], grace_s: float = 3.0) -> None:
    """Stop a child started in its own process group: SIGTERM, then SIGKILL."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        except ProcessLookupError:
            return
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so that ``finally`` blocks run."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def _only_loopback() -> bool:
    """Whether this process's network namespace has no interface but ``lo``."""
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    return [line.split(":", 1)[0].strip() for line in lines] == ["lo"]


def _find_master(explicit: str | None) -> str:
    if explicit:
        return explicit
    beside = Path(sys.executable).parent / "mooncake_master"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise SystemExit("mooncake_master not found beside sys.executable nor on PATH; use --master")


def _mooncake_version() -> str:
    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _wait_port(port: int, proc: subprocess.Popen[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {proc.returncode}")
        try:
            with socket.create_connection((LOCALHOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"mooncake_master did not listen on port {port} in {timeout_s} s")


def _reexec_in_netns(argv: list[str]) -> int:
    """Run this script again with ``--inside`` under ``unshare --net``; return its exit code."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SystemExit("unshare (util-linux) is needed to isolate Mooncake's listeners")
    cmd = [unshare, "--net", "--", sys.executable, str(Path(__file__).resolve()), "--inside"]
    proc = subprocess.Popen([*cmd, *argv], preexec_fn=_die_with_parent)  # noqa: PLW1509 (no threads yet)
    try:
        return proc.wait()
    finally:
        _kill_group(proc, grace_s=10.0)


class Orchestra:
    """The processes of one run, started in order and stopped in reverse, whatever happens."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: list[tuple[str, subprocess.Popen[Any]]] = []

    def start(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        log = (self.logdir / f"{name}.log").open("w")
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            env=env,
            text=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 (no threads yet)
        )
        log.close()
        self.procs.append((name, proc))
        return proc

    def stop_all(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.stdin is not None and not proc.stdin.closed:
                with suppress(BrokenPipeError):
                    proc.stdin.close()
            _kill_group(proc)
        self.procs.clear()

    def dump_logs(self, lines: int = 20) -> None:
        for log in sorted(self.logdir.glob("*.log")):
            tail = log.read_text(errors="replace").splitlines()[-lines:]
            print(f"--- {log.name} (last {len(tail)} lines)", file=sys.stderr)
            for line in tail:
                print(line, file=sys.stderr)


def _read_line(proc: subprocess.Popen[str], name: str, timeout_s: float) -> str:
    """The next stdout line of a child, or an error if it exits or takes too long."""
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), True)
    deadline = time.monotonic() + timeout_s
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=0.2):
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"{name} exited with {proc.wait()} before answering")
                return line
    raise RuntimeError(f"{name} gave no answer in {timeout_s} s")


def run_inside(args: argparse.Namespace) -> dict[str, Any]:
    """Start master, holder and clients in this (fresh) network namespace; return the report."""
    if not _only_loopback():
        raise SystemExit("--inside needs a network namespace with only lo (see unshare --net)")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    master_bin = _find_master(args.master)
    env = dict(os.environ)
    env.setdefault("MC_STORE_MEMCPY", "1")
    env.setdefault("GLOG_minloglevel", "1")
    master_addr = f"{LOCALHOST}:{args.rpc_port}"
    script = str(Path(__file__).resolve())
    common = [
        "--master-addr", master_addr,
        "--rounds", str(args.rounds),
        "--total-mib", str(args.total_mib),
        "--warmup", str(args.warmup),
        "--api", args.api,
    ]  # fmt: skip

    with tempfile.TemporaryDirectory(prefix="mooncake-peer-") as tmp:
        orch = Orchestra(Path(tmp))
        try:
            master = orch.start(
                "master",
                [
                    master_bin,
                    f"--rpc_port={args.rpc_port}",
                    f"--rpc_address={LOCALHOST}",
                    f"--metrics_port={args.rpc_port + 1}",
                    "--enable_http_metadata_server=false",
                ],
                env,
            )
            _wait_port(args.rpc_port, master, timeout_s=30)

            seg = args.segment_mib << 20
            holder = orch.start(
                "holder",
                [sys.executable, script, "--role", "holder", "--segment-bytes", str(seg), *common],
                env,
            )
            ready = json.loads(_read_line(holder, "holder", 60).removeprefix(READY))

            results: list[dict[str, Any]] = []
            plans = [
                ("same_node", seg, ""),
                ("tcp", 0, ready["hostname"]),
            ]
            api = ""
            for path, client_seg, target in plans:
                cmd = [
                    sys.executable, script, "--role", "client", "--path", path,
                    "--segment-bytes", str(client_seg), "--holder-endpoint", ready["endpoint"],
                    "--target", target, *common,
                ]  # fmt: skip
                client = orch.start(f"client-{path}", cmd, env)
                assert client.stdin is not None
                client.stdin.close()
                out = json.loads(_read_line(client, f"client-{path}", args.timeout_s))
                if client.wait(timeout=30) != 0:
                    raise RuntimeError(f"client-{path} exited with {client.returncode}")
                results.extend(out["cases"])
                api = out["api"]
        except BaseException:
            orch.stop_all()
            orch.dump_logs()
            raise
        finally:
            orch.stop_all()

    return {
        "version": _mooncake_version(),
        "api": api,
        "transport": "tcp",
        "metadata": "P2PHANDSHAKE",
        "rounds": args.rounds,
        "total_mib": args.total_mib,
        "warmup": args.warmup,
        "cases": results,
    }


# --------------------------------------------------------------------------- Mooncake side


def _setup_store(master_addr: str, segment_bytes: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    local_buffer = 64 << 20
    rc = store.setup(LOCALHOST, "P2PHANDSHAKE", segment_bytes, local_buffer, "tcp", "", master_addr)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def _config(preferred_segment: str) -> Any:
    from mooncake.store import ReplicateConfig

    config = ReplicateConfig()
    config.replica_num = 1
    config.preferred_segment = preferred_segment
    return config


def _endpoint(store: Any, key: str) -> str:
    """The transport endpoint of the segment holding the (single) replica of ``key``."""
    replicas = store.get_replica_desc(key)
    if len(replicas) != 1 or not replicas[0].is_memory_replica():
        raise RuntimeError(f"{key}: expected one memory replica, got {replicas}")
    return str(replicas[0].get_memory_descriptor().buffer_descriptor.transport_endpoint)


def _own_endpoint(store: Any, role: str) -> str:
    """Put a probe into this process's own segment and return that segment's endpoint."""
    key = PROBE_KEY.format(role=role)
    probe = b"\0" * 4096
    if store.put(key, probe, _config(store.get_hostname())) != 0:
        raise RuntimeError("probe put failed")
    endpoint = _endpoint(store, key)
    store.remove(key, True)
    return endpoint


def _check(codes: list[int] | int, what: str, expect: int | None = None) -> None:
    values = codes if isinstance(codes, list) else [codes]
    bad = [c for c in values if (c != expect if expect is not None else c != 0)]
    if bad:
        raise RuntimeError(f"{what} failed: {values}")


def _loopback_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines()[2:]:
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # transmitted bytes
    return 0


class Case:
    """One (op, batch size) case run on an open store."""

    def __init__(self, store: Any, api: str, config: Any, expect_endpoint: str) -> None:
        import numpy as np

        self.np = np
        self.store = store
        self.api = api
        self.config = config
        self.expect_endpoint = expect_endpoint
        size = max(BATCH_BLOCKS) * BLOCK_BYTES
        self.src = np.random.default_rng().integers(0, 256, size, dtype=np.uint8)
        self.dst = np.zeros(size, dtype=np.uint8)
        if api == "zero_copy":
            for arr in (self.src, self.dst):
                _check(store.register_buffer(arr.ctypes.data, arr.nbytes), "register_buffer")
        self.seq = 0

    def close(self) -> None:
        if self.api == "zero_copy":
            for arr in (self.src, self.dst):
                self.store.unregister_buffer(arr.ctypes.data)

    def _keys(self, blocks: int) -> list[str]:
        self.seq += 1
        return [f"mooncake-peer/{os.getpid()}/{self.seq}/{i}" for i in range(blocks)]

    def _put(self, keys: list[str]) -> None:
        n = len(keys)
        if self.api == "zero_copy":
            ptrs = [self.src.ctypes.data + i * BLOCK_BYTES for i in range(n)]
            _check(self.store.batch_put_from(keys, ptrs, [BLOCK_BYTES] * n, self.config), "put")
        else:
            views = [
                memoryview(self.src)[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES] for i in range(n)
            ]
            _check(self.store.put_batch(keys, views, self.config), "put_batch")

    def _get(self, keys: list[str]) -> None:
        n = len(keys)
        if self.api == "zero_copy":
            ptrs = [self.dst.ctypes.data + i * BLOCK_BYTES for i in range(n)]
            got = self.store.batch_get_into(keys, ptrs, [BLOCK_BYTES] * n)
            _check(got, "batch_get_into", expect=BLOCK_BYTES)
        else:
            values = self.store.get_batch(keys)
            for i, value in enumerate(values):
                if len(value) != BLOCK_BYTES:
                    raise RuntimeError(f"get_batch: {len(value)} bytes for {keys[i]}")
                self.dst[i * BLOCK_BYTES : (i + 1) * BLOCK_BYTES] = self.np.frombuffer(
                    value, dtype=self.np.uint8
                )

    def _check_placement(self, keys: list[str]) -> None:
        for key in keys:
            endpoint = _endpoint(self.store, key)
            if endpoint != self.expect_endpoint:
                raise RuntimeError(f"{key} is on {endpoint}, expected {self.expect_endpoint}")

    def _remove(self, keys: list[str]) -> None:
        _check(self.store.batch_remove(keys, True), "batch_remove")

    def run(self, op: str, blocks: int, calls: int, warmup: int) -> tuple[list[float], int]:
        """Time ``calls`` calls after ``warmup``; return call times and loopback bytes."""
        perf = time.perf_counter
        times: list[float] = []
        lo_before = 0
        if op == "get":
            keys = self._keys(blocks)
            self._put(keys)
            self._check_placement(keys)
        for i in range(warmup + calls):
            if i == warmup:
                lo_before = _loopback_bytes()
            if op == "put":
                keys = self._keys(blocks)
                t0 = perf()
                self._put(keys)
                dt = perf() - t0
                if i == 0:
                    self._check_placement(keys)
                self._remove(keys)
            else:
                self.dst[: blocks * BLOCK_BYTES] = 0
                t0 = perf()
                self._get(keys)
                dt = perf() - t0
                n = blocks * BLOCK_BYTES
                if not self.np.array_equal(self.dst[:n], self.src[:n]):
                    raise RuntimeError("get returned bytes that differ from those put")
            if i >= warmup:
                times.append(dt)
        lo_bytes = _loopback_bytes() - lo_before
        if op == "get":
            self._remove(keys)
        return times, lo_bytes


def run_holder(args: argparse.Namespace) -> None:
    store = _setup_store(args.master_addr, args.segment_bytes)
    try:
        ready = {"hostname": store.get_hostname(), "endpoint": _own_endpoint(store, "holder")}
        print(READY + json.dumps(ready), flush=True)
        sys.stdin.read()  # serve until the orchestrator closes our stdin
    finally:
        store.close()


def run_client(args: argparse.Namespace) -> None:
    store = _setup_store(args.master_addr, args.segment_bytes)
    api = args.api
    if api == "zero_copy" and not hasattr(store, "batch_put_from"):
        api = "bytes"
    api_name = {
        "zero_copy": "register_buffer+batch_put_from/batch_get_into",
        "bytes": "put_batch/get_batch",
    }[api]
    try:
        if args.path == "same_node":
            expect = _own_endpoint(store, "client")
            if expect == args.holder_endpoint:
                raise RuntimeError("client's own segment reported on the holder's endpoint")
            preferred = store.get_hostname()
        else:
            expect = args.holder_endpoint
            preferred = args.target
        case = Case(store, api, _config(preferred), expect)
        samples: dict[tuple[str, int], list[tuple[list[float], int]]] = {}
        try:
            for _ in range(args.rounds):
                for blocks in BATCH_BLOCKS:
                    calls = max(1, (args.total_mib << 20) // (blocks * BLOCK_BYTES))
                    for op in ("put", "get"):
                        result = case.run(op, blocks, calls, args.warmup)
                        samples.setdefault((op, blocks), []).append(result)
        finally:
            case.close()
        cases = []
        for (op, blocks), rounds in samples.items():
            batch = blocks * BLOCK_BYTES
            gbps = [len(t) * batch / sum(t) / 1e9 for t, _ in rounds]
            all_times = [x for t, _ in rounds for x in t]
            ratio = [lo / (len(t) * batch) for t, lo in rounds]
            cases.append(
                {
                    "path": args.path,
                    "op": op,
                    "batch_bytes": batch,
                    "block_bytes": BLOCK_BYTES,
                    "calls": len(rounds[0][0]),
                    "gbps": round(statistics.median(gbps), 3),
                    "gbps_rounds": [round(g, 3) for g in gbps],
                    "p50_ms": round(statistics.median(all_times) * 1e3, 3),
                    "loopback_ratio": round(statistics.median(ratio), 3),
                }
            )
        print(json.dumps({"api": api_name, "cases": cases}), flush=True)
    finally:
        store.close()


# --------------------------------------------------------------------------- entry point


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--json", action="store_true", help="print one JSON line (default: a table)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per case; gbps is the median")
    p.add_argument("--total-mib", type=int, default=256, help="timed payload per case and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before each case")
    p.add_argument("--api", choices=("zero_copy", "bytes"), default="zero_copy")
    p.add_argument("--segment-mib", type=int, default=512, help="global segment of the holders")
    p.add_argument("--rpc-port", type=int, default=50051, help="master port (in the netns)")
    p.add_argument("--master", help="mooncake_master binary (default: beside python, or PATH)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="limit for each client")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--role", choices=("holder", "client"), help=argparse.SUPPRESS)
    p.add_argument("--path", choices=("same_node", "tcp"), help=argparse.SUPPRESS)
    p.add_argument("--master-addr", help=argparse.SUPPRESS)
    p.add_argument("--segment-bytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--holder-endpoint", default="", help=argparse.SUPPRESS)
    p.add_argument("--target", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 1 or args.total_mib < 1 or args.warmup < 0:
        p.error("--rounds and --total-mib must be positive, --warmup not negative")
    return args


def _print_table(report: dict[str, Any]) -> None:
    print(f"Mooncake {report['version']}, {report['api']}, {report['rounds']} rounds")
    print(f"{'path':<10} {'op':<4} {'batch MiB':>9} {'GB/s':>8} {'p50 ms':>8} {'lo ratio':>8}")
    for c in report["cases"]:
        mib = c["batch_bytes"] >> 20
        print(
            f"{c['path']:<10} {c['op']:<4} {mib:>9} {c['gbps']:>8.3f} {c['p50_ms']:>8.2f} "
            f"{c['loopback_ratio']:>8.2f}"
        )


@contextmanager
def _sigterm_as_exit() -> Iterator[None]:
    _exit_on_sigterm()
    yield


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = _parse(raw)
    with _sigterm_as_exit():
        if args.role == "holder":
            run_holder(args)
            return 0
        if args.role == "client":
            run_client(args)
            return 0
        if not args.inside:
            return _reexec_in_netns(raw)
        report = run_inside(args)
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        _print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
