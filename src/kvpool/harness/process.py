"""Start a node daemon as a child process and wait until it is ready (used by ``kvpool
bench``, ``kvpool demo`` and the tests)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from kvpool.errors import ConfigError
from kvpool.node.daemon import READY_PREFIX

READY_TIMEOUT_S = 30.0


class NodeProcess:
    """A running ``kvpool serve`` child.  ``info`` is its ready line: name, unix, tcp,
    admin, arena."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_file: IO[str] | None = None,
        ready_timeout: float = READY_TIMEOUT_S,
        command_prefix: Sequence[str] = (),
        ephemeral: bool = False,
    ):
        self.args = list(args)
        self.command_prefix = list(command_prefix)  # e.g. ["ip", "netns", "exec", "ns1"]
        self.env = dict(os.environ if env is None else env)
        self.log_file = log_file
        self.ready_timeout = ready_timeout
        self.proc: subprocess.Popen[str] | None = None
        self.info: dict[str, Any] = {}
        self.output: list[str] = []
        # A node for one run of a tool (a demo, a benchmark): its arena and journal go with
        # it, where a real node keeps them for its next start.
        self.ephemeral = ephemeral

    @classmethod
    def private(
        cls,
        name: str,
        memory: str | int,
        *,
        run_dir: str | None = None,
        log_level: str = "warning",
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        ephemeral: bool = False,
    ) -> NodeProcess:
        """A node on any free ports (loopback), for tools and tests: not yet started."""
        args = [
            "--name",
            name,
            "--memory",
            str(memory),
            "--port",
            "0",
            "--admin-port",
            "0",
            "--log-level",
            log_level,
        ]
        if run_dir is not None:
            args += ["--run-dir", run_dir]
        return cls([*args, *extra], env=env, ephemeral=ephemeral)

    def start(self) -> NodeProcess:
        command = [*self.command_prefix, sys.executable, "-m", "kvpool", "serve", *self.args]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            start_new_session=True,
        )
        ready = threading.Event()
        self._pump_thread = threading.Thread(target=self._pump, args=(ready,), daemon=True)
        self._pump_thread.start()
        if not ready.wait(self.ready_timeout) or not self.info:
            self.stop()
            raise ConfigError("kvpool serve did not become ready:\n" + "".join(self.output[-30:]))
        return self

    def _pump(self, ready: threading.Event) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(READY_PREFIX) and not self.info:
                self.info = json.loads(line[len(READY_PREFIX) :])
                ready.set()
                continue
            self.output.append(line)
            del self.output[:-200]
            if self.log_file is not None:
                self.log_file.write(line)
                self.log_file.flush()
        ready.set()

    @property
    def unix_address(self) -> str:
        return f"unix:{self.info['unix']}"

    @property
    def tcp_address(self) -> str:
        return str(self.info["tcp"])

    @property
    def admin_url(self) -> str:
        return str(self.info["admin"])

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL: a crash, leaving the arena behind."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self._close_output()

    def _close_output(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self._pump_thread.join(5)
            if not self._pump_thread.is_alive():
                self.proc.stdout.close()

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not stop in time."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_output()
        if self.ephemeral and self.info:
            self.remove_files()
        return self.proc.returncode

    def remove_files(self) -> None:
        """Remove what the node keeps for its next start (its arena and journal)."""
        arena = Path(self.info["arena"])
        for path in (arena, arena.parent / "index"):
            path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            arena.parent.rmdir()

    def __enter__(self) -> NodeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
