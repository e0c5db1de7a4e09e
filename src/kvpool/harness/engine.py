"""A vLLM engine in a child process (:mod:`.runner`), driven plan by plan: the one way the
demo, the benchmarks and the tests run an offline engine.

    with EngineProcess(model, connector=config) as engine:
        first = engine.run([{"op": "generate", "prompts": [...], "max_tokens": 12}])
        again = engine.run([...])  # the same engine, as fresh: prefix cache and counters

vLLM keeps what it learns of a model (its architecture, inspected in a child process of its
own, 6 s on 2 cores) under ``VLLM_CACHE_ROOT`` (``~/.cache/vllm`` by default): engines that
share it start in half the time.  The tests give the session one of its own.

The child's stdout and stderr are one stream, read by a thread of this process into
:attr:`EngineProcess.log` while plans run, so that a caller can wait for a line the engine
logs (:meth:`EngineProcess.wait_for_log`) in the middle of a plan, at a pause.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import runner
from .runner import DONE_LINE, PAUSE_PREFIX, RESULT_PREFIX

# The runner is run as this release's file, whatever ``kvpool`` the engine's environment puts
# first (it imports nothing of kvpool's but for the steps that read vLLM's internals: see its
# docstring): an engine of an earlier release (its connector) runs under the same runner
# (tests/integrations/test_upgrade_vllm.py).
RUNNER = runner.__file__

START_TIMEOUT_S = 600.0
PLAN_TIMEOUT_S = 600.0
LOG_TAIL_LINES = 80


class EngineFailed(RuntimeError):
    """The engine process exited, or did not answer in time; the message ends with its log."""


class EngineProcess:
    """One runner process for ``model`` with these engine arguments, connector and
    environment.  :meth:`start` waits until the engine is built; each :meth:`run` is one plan.
    Every result carries ``log``: what the engine logged while it started and during that
    plan."""

    def __init__(
        self,
        model: str,
        *,
        engine: Mapping[str, Any] | None = None,
        connector: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        command_prefix: Sequence[str] = (),
        multiprocessing: bool = False,
    ):
        self.config = {
            "model": model,
            "engine": dict(engine or {}),
            "connector": dict(connector) if connector else None,
            "multiprocessing": multiprocessing,
        }
        self.env = dict(env or {})
        self.command_prefix = list(command_prefix)
        self.log: list[str] = []
        self.startup_log: list[str] = []
        self.ready: dict[str, Any] = {}
        self._events: queue.Queue[tuple[str, str]] = queue.Queue()
        self._log_changed = threading.Condition()
        self._proc: subprocess.Popen[str] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self, timeout: float = START_TIMEOUT_S) -> EngineProcess:
        """Start the engine and wait until it is built."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> EngineProcess:
        """Start the engine's process, without waiting for it (see :meth:`wait_ready`): engines
        that take long to become usable can start side by side."""
        self._tmp = tempfile.TemporaryDirectory(prefix="kvpool-engine-")
        config_file = Path(self._tmp.name) / "engine.json"
        config_file.write_text(json.dumps(self.config))
        self._proc = subprocess.Popen(
            [*self.command_prefix, sys.executable, "-P", RUNNER, str(config_file)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> EngineProcess:
        """Wait until the launched engine is built."""
        kind, payload = self._next_event(time.monotonic() + timeout, "to start")
        if kind != "result" or json.loads(payload).get("op") != "ready":
            self.kill()
            raise EngineFailed(f"the engine did not start ({kind}):\n{self.log_tail()}")
        self.ready = json.loads(payload)
        self.startup_log = list(self.log)
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(RESULT_PREFIX):
                self._events.put(("result", line[len(RESULT_PREFIX) :]))
            elif line.startswith(PAUSE_PREFIX):
                self._events.put(("pause", line[len(PAUSE_PREFIX) :].strip()))
            elif line.rstrip("\n") == DONE_LINE:
                self._events.put(("done", ""))
            else:
                with self._log_changed:
                    self.log.append(line)
                    self._log_changed.notify_all()
        self._events.put(("exit", ""))
        with self._log_changed:
            self._log_changed.notify_all()

    def _next_event(self, deadline: float, what: str) -> tuple[str, str]:
        try:
            return self._events.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            self.kill()
            raise EngineFailed(f"the engine took too long {what}:\n{self.log_tail()}") from None

    def run(
        self,
        steps: list[dict[str, Any]],
        on_pause: Callable[[str], None] | None = None,
        timeout: float = PLAN_TIMEOUT_S,
    ) -> list[dict[str, Any]]:
        """Run one plan; returns one result per step.  ``on_pause(tag)`` runs at each pause
        step, the engine waiting until it returns."""
        assert self._proc is not None and self._proc.stdin is not None, "not started"
        first_line = len(self.log)
        self._proc.stdin.write(json.dumps({"steps": steps}) + "\n")
        self._proc.stdin.flush()
        deadline = time.monotonic() + timeout
        results: list[dict[str, Any]] = []
        try:
            while True:
                kind, payload = self._next_event(deadline, "to run its plan")
                if kind == "result":
                    results.append(json.loads(payload))
                elif kind == "pause":
                    if on_pause is not None:
                        on_pause(payload)
                    self._proc.stdin.write("go\n")
                    self._proc.stdin.flush()
                elif kind == "done":
                    break
                else:
                    raise EngineFailed(f"the engine exited:\n{self.log_tail()}")
        except BaseException:
            self.kill()  # a plan left half-run: nobody may use this engine again
            raise
        plan_log = "".join(self.startup_log) + "".join(self.log[first_line:])
        for result in results:
            result["log"] = plan_log
        return results

    def log_mark(self) -> int:
        """Where the engine's log stands now: for :meth:`wait_for_log`'s ``since``."""
        return len(self.log)

    def wait_for_log(
        self, text: str, *, count: int = 1, since: int = 0, timeout: float = 60.0
    ) -> None:
        """Wait until ``text`` appears on ``count`` lines of the engine's log after line
        ``since`` (a :meth:`log_mark`), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._log_changed:
            while sum(text in line for line in self.log[since:]) < count:
                left = deadline - time.monotonic()
                if left <= 0 or not self.is_running:
                    raise EngineFailed(f"the engine never logged {text!r}:\n{self.log_tail()}")
                self._log_changed.wait(min(left, 1.0))

    def log_tail(self, num_lines: int = LOG_TAIL_LINES) -> str:
        return "".join(self.log[-num_lines:])

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self, grace_s: float = 10.0) -> None:
        """Stop the engine: its stdin closed (the runner exits once its plan is done), then
        its whole process group killed after ``grace_s`` (vLLM's own processes too)."""
        proc = self._proc
        if proc is None:
            return
        if proc.stdin is not None and not proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait()
        if self._reader is not None:
            self._reader.join(10)
        if proc.stdout is not None:
            proc.stdout.close()
        if self._tmp is not None:
            self._tmp.cleanup()
        self._proc = None

    def kill(self) -> None:
        self.close(grace_s=0)

    def __enter__(self) -> EngineProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
