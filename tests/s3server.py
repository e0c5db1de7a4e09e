"""A real S3 server for the tests: Ceph radosgw on a one-OSD memstore cluster.

``S3Server`` builds a throwaway cluster in a fresh temporary directory: one monitor, one
memstore OSD (object data lives in that daemon's RAM) and radosgw, all bound to 127.0.0.1 on
free ports, with cephx off and no mgr.  It then creates an S3 user with a random key and
secret.  Startup takes a few seconds, so the suite starts one per session (the ``s3_server``
fixture in conftest.py).

The daemons never outlive the test session: each runs in its own session, ``stop()`` kills
them, an ``atexit`` hook calls ``stop()``, and a small watchdog process kills them and removes
the directory if the Python process dies without running either (SIGKILL, a crash).

Needs the Debian packages ceph-mon, ceph-osd, radosgw and ceph-common (``make system-deps``).
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import IO

BINARIES = ("monmaptool", "ceph-mon", "ceph-osd", "ceph", "radosgw", "radosgw-admin")
READY_TIMEOUT = 60.0  # seconds for radosgw's HTTP port to answer
COMMAND_TIMEOUT = 60.0  # seconds for one ceph / radosgw-admin command

# Ceph's own $name and $id stay literal: each daemon expands them.
CONFIG = """\
[global]
fsid = {fsid}
mon_host = v2:127.0.0.1:{mon_port}
public_addr = 127.0.0.1
cluster_addr = 127.0.0.1
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
run_dir = {dir}/run
log_file = {dir}/log/$name.log
mon_cluster_log_file = {dir}/log/cluster.log
crash_dir = {dir}/crash
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_num = 8
mon_allow_pool_size_one = true
mon_warn_on_pool_no_redundancy = false
# The default of 1 s makes each pool radosgw creates cost a second or more.
paxos_propose_interval = 0.1
mon_data_avail_warn = 2
mon_warn_on_insecure_global_id_reclaim_allowed = false
mon_data = {dir}/mon/$id
osd_data = {dir}/osd/$id
osd_objectstore = memstore
# Object data lives in the OSD's RAM, allocated as written; the default cap is 1 GiB.
memstore_device_bytes = 4294967296

[client.rgw]
rgw_frontends = beast endpoint=127.0.0.1:{rgw_port}
rgw_data = {dir}/rgw
# radosgw defaults to "secure", which never connects to a monitor with auth none.
ms_mon_client_mode = crc
"""

# Reads PIDs (one a line) from stdin; at EOF (the test process is gone) kills each one's
# process group and removes the directory.  The line "exit" means a clean stop: do nothing.
WATCHDOG = """\
import os, shutil, signal, sys
pids = []
for line in sys.stdin:
    if line.strip() == "exit":
        sys.exit(0)
    pids.append(int(line))
for pid in pids:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""

BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"({path.name}: none)"
    return f"--- {path.name} (last {lines} lines) ---\n" + "\n".join(text.splitlines()[-lines:])


class S3Server:
    """A started radosgw: ``endpoint``, ``access_key``, ``secret_key``, ``region``."""

    region = "us-east-1"

    def __init__(self) -> None:
        self.directory: Path | None = None
        self.endpoint = ""
        self.access_key = ""
        self.secret_key = ""
        self.startup_seconds = 0.0
        self._mon_port = 0
        self._rgw_port = 0
        self._mon: subprocess.Popen[bytes] | None = None
        self._osd: subprocess.Popen[bytes] | None = None
        self._rgw: subprocess.Popen[bytes] | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._logs: list[IO[bytes]] = []

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> S3Server:
        missing = [b for b in BINARIES if shutil.which(b) is None]
        if missing:
            raise RuntimeError(
                f"the S3 test server needs {', '.join(missing)}: run `make system-deps`"
                " (Debian packages ceph-mon ceph-osd radosgw ceph-common)"
            )
        if self.directory is not None:
            raise RuntimeError("S3Server already started")
        began = time.monotonic()
        self.directory = Path(tempfile.mkdtemp(prefix="kvpool-s3-"))
        atexit.register(self.stop)
        try:
            self._start_watchdog()
            self._start_cluster()
            self._start_gateway()
            self._create_user()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Kill the three daemons, wait for them and remove the directory.  Idempotent."""
        atexit.unregister(self.stop)
        for proc in (self._rgw, self._osd, self._mon):
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    proc.kill()
        for proc in (self._rgw, self._osd, self._mon):
            if proc is not None:
                proc.wait()
        self._rgw = self._osd = self._mon = None
        for log in self._logs:
            log.close()
        self._logs.clear()
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None
        if self._watchdog is not None:
            assert self._watchdog.stdin is not None
            try:
                self._watchdog.stdin.write(b"exit\n")
                self._watchdog.stdin.close()
            except OSError:
                pass
            self._watchdog.wait()
            self._watchdog = None

    # -- the gateway, for fault-injection tests -------------------------------------------------

    def freeze(self) -> None:
        """SIGSTOP radosgw: connections are still accepted by the kernel, nothing answers."""
        os.kill(self._gateway().pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT radosgw after ``freeze()``."""
        os.kill(self._gateway().pid, signal.SIGCONT)

    def kill_gateway(self) -> None:
        """SIGKILL radosgw (the cluster behind it keeps running) and wait for it to exit."""
        proc = self._gateway()
        proc.kill()
        proc.wait()

    def restart_gateway(self) -> None:
        """Start radosgw again on the same port (killing it first if it still runs)."""
        proc = self._gateway()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self._start_gateway()

    # -- S3 ---------------------------------------------------------------------------------------

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (3-63 characters: lowercase letters, digits, '.', '-')."""
        if not BUCKET_NAME.fullmatch(name):
            raise ValueError(f"invalid S3 bucket name: {name!r}")
        status, body = self.request("PUT", f"/{name}")
        if status != 200:
            raise RuntimeError(f"creating bucket {name!r} failed: HTTP {status}: {body[:500]!r}")
        return name

    def request(
        self, method: str, path: str, body: bytes = b"", timeout: float = 30.0
    ) -> tuple[int, bytes]:
        """One SigV4-signed request (``path`` already URI-encoded, no query): status and body."""
        now = datetime.now(UTC)
        amz_date = now.strftime("%Y%m%dT%H%M%SZ")
        day = now.strftime("%Y%m%d")
        payload_hash = hashlib.sha256(body).hexdigest()
        headers = {
            "host": f"127.0.0.1:{self._rgw_port}",
            "x-amz-content-sha256": payload_hash,
            "x-amz-date": amz_date,
        }
        signed = ";".join(sorted(headers))
        canonical_headers = "".join(f"{k}:{headers[k]}\n" for k in sorted(headers))
        canonical = "\n".join([method, path, "", canonical_headers, signed, payload_hash])
        scope = f"{day}/{self.region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        key = ("AWS4" + self.secret_key).encode()
        for part in (day, self.region, "s3", "aws4_request"):
            key = hmac.new(key, part.encode(), hashlib.sha256).digest()
        signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.access_key}/{scope}, "
            f"SignedHeaders={signed}, Signature={signature}"
        )
        req = urllib.request.Request(
            self.endpoint + path, data=body or None, headers=headers, method=method
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    # -- internals --------------------------------------------------------------------------------

    @property
    def _conf(self) -> str:
        assert self.directory is not None
        return str(self.directory / "ceph.conf")

    def _gateway(self) -> subprocess.Popen[bytes]:
        if self._rgw is None:
            raise RuntimeError("S3Server is not running")
        return self._rgw

    def _start_watchdog(self) -> None:
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", WATCHDOG, str(self.directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def _spawn(self, log_name: str, *args: str) -> subprocess.Popen[bytes]:
        assert self.directory is not None
        log = (self.directory / "log" / f"{log_name}.out").open("ab")
        self._logs.append(log)
        proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.directory,
            start_new_session=True,
        )
        if self._watchdog is not None and self._watchdog.stdin is not None:
            self._watchdog.stdin.write(f"{proc.pid}\n".encode())
            self._watchdog.stdin.flush()
        return proc

    def _run(self, *args: str) -> str:
        """Run one command to completion: its stdout, or a RuntimeError with its output."""
        try:
            done = subprocess.run(
                args,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                cwd=self.directory,
                timeout=COMMAND_TIMEOUT,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(
                f"{' '.join(args)} timed out after {COMMAND_TIMEOUT:g} s\n{self._log_tails()}"
            ) from e
        if done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(args)} failed (exit {done.returncode}):\n"
                f"{done.stdout.decode(errors='replace')}{done.stderr.decode(errors='replace')}"
            )
        return done.stdout.decode()

    def _start_cluster(self) -> None:
        d = self.directory
        assert d is not None
        for sub in ("mon", "osd", "run", "log", "rgw", "crash"):
            (d / sub).mkdir()
        self._mon_port, self._rgw_port = free_ports(2)
        self.endpoint = f"http://127.0.0.1:{self._rgw_port}"
        fsid = str(uuid.uuid4())
        (d / "ceph.conf").write_text(
            CONFIG.format(fsid=fsid, dir=d, mon_port=self._mon_port, rgw_port=self._rgw_port)
        )
        c = ("-c", self._conf)
        monmap = str(d / "monmap")
        self._run(
            "monmaptool", "--create", "--fsid", fsid,
            "--addv", "a", f"[v2:127.0.0.1:{self._mon_port}]", monmap,
        )  # fmt: skip
        self._run("ceph-mon", *c, "-i", "a", "--mkfs", "--monmap", monmap)
        self._mon = self._spawn("ceph-mon", "ceph-mon", *c, "-i", "a", "-f")
        osd_uuid = str(uuid.uuid4())
        # Waits for the monitor.  Without a mgr some ceph commands hang: hence the timeouts.
        osd_id = self._run("ceph", *c, "--connect-timeout", "30", "osd", "new", osd_uuid).strip()
        if not osd_id.isdigit():
            raise RuntimeError(f"`ceph osd new` printed {osd_id!r}, not an OSD id")
        (d / "osd" / osd_id).mkdir()  # memstore's mkfs asserts if it is missing
        self._run("ceph-osd", *c, "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid)
        self._osd = self._spawn("ceph-osd", "ceph-osd", *c, "-i", osd_id, "-f")

    def _start_gateway(self) -> None:
        self._rgw = self._spawn("radosgw", "radosgw", "-c", self._conf, "-n", "client.rgw", "-f")
        self._wait_for_gateway()

    def _wait_for_gateway(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        proc = self._gateway()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"radosgw exited with status {proc.returncode} before answering\n"
                    + self._log_tails()
                )
            try:
                with urllib.request.urlopen(self.endpoint + "/", timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # any HTTP answer will do
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"radosgw did not answer on {self.endpoint} within {READY_TIMEOUT:g} s\n"
                    + self._log_tails()
                )
            time.sleep(0.05)

    def _create_user(self) -> None:
        self.access_key = "KV" + secrets.token_hex(9).upper()
        self.secret_key = secrets.token_urlsafe(30)
        self._run(
            "radosgw-admin", "-c", self._conf, "user", "create", "--uid=kvpool-tests",
            "--display-name=kvpool tests", f"--access-key={self.access_key}",
            f"--secret={self.secret_key}",
        )  # fmt: skip

    def _log_tails(self) -> str:
        if self.directory is None:
            return ""
        log = self.directory / "log"
        return "\n".join(
            _tail(log / name)
            for name in ("client.rgw.log", "radosgw.out", "mon.a.log", "ceph-mon.out")
        )
