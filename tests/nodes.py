"""A node daemon for a fixture wider than one test (a module's tests sharing a node, where
none of them needs a fresh one): in a run directory of its own under /dev/shm, stopped and
its directory removed at the end.  A test's own nodes come from ``start_node``
(tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvpool.harness.process import NodeProcess


@contextmanager
def own_node(
    name: str,
    memory: str = "64MiB",
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[NodeProcess]:
    """``kvpool serve`` on any free ports (``env`` adds to this process's environment)."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"kvpool-test-{name}-", dir="/dev/shm"))
    node = NodeProcess.private(
        name, memory, run_dir=str(run_dir), extra=extra, env={**os.environ, **(env or {})}
    )
    try:
        yield node.start()
    finally:
        node.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
