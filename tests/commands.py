"""kvpool commands run in the foreground to their end: an operator's command (status,
drain), or a start that must fail (a daemon, a router or a setting refused) and what it
said as it refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_kvpool(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``kvpool ARGS`` to its end (``env`` adds to this process's environment)."""
    return subprocess.run(
        [sys.executable, "-m", "kvpool", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def serve(
    run_dir: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``kvpool serve`` in ``run_dir`` with an 8 MiB arena on any free ports (``args`` come
    last: they may set any of those again), for a start that must fail."""
    return run_kvpool(
        "serve",
        "--memory",
        "8MiB",
        "--port",
        "0",
        "--admin-port",
        "0",
        "--run-dir",
        str(run_dir),
        *args,
        env=env,
    )


def said(done: subprocess.CompletedProcess[str]) -> str:
    """All a refused command printed, its lines joined (the console wraps long ones)."""
    return " ".join((done.stdout + done.stderr).split())
