"""The previous release for the upgrade tests: its sources built once per session from git
(:mod:`kvpool.harness.releases`), its nodes started as this release's are, and its client
run in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.errors import ConfigError
from kvpool.harness.releases import PREVIOUS, build_release, release_env

# Blocks of the upgrade tests: a block's bytes are its key, repeated (cheap to make and to
# check by the hundred thousand, in either release).
BLOCK_SCRIPT = """
def block(key, size):
    return (key * (size // len(key) + 1))[:size]
"""


def block(key: bytes, size: int) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def previous_src(cache: Path) -> Path:
    """The previous release's ``src``, built under ``cache``; skipped (failed under CI)
    where this checkout lacks its commit."""
    try:
        return build_release(PREVIOUS, cache)
    except ConfigError as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(str(exc))
        pytest.skip(str(exc))


def run_previous_client(src: Path, address: str, script: str, **params: object) -> dict:
    """Run ``script`` with the previous release's client (``client``: connected to
    ``address``; ``params``: its globals; ``block``: the blocks' bytes) and return the
    JSON object it prints last (``emit(obj)``)."""
    program = "\n".join(
        [
            "import json, sys",
            "import kvpool",
            BLOCK_SCRIPT,
            "params = json.loads(sys.stdin.read())",
            "globals().update(params)",
            "def emit(obj): print(json.dumps(obj), flush=True)",
            "with kvpool.Client(address, timeout=10) as client:",
            *("    " + line for line in script.strip().splitlines()),
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", program],
        input=json.dumps({"address": address, **params}),
        capture_output=True,
        text=True,
        timeout=120,
        env=release_env(src),
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def previous_version(src: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", "import kvpool; print(kvpool.__version__, kvpool.__file__)"],
        capture_output=True,
        text=True,
        env=release_env(src),
        check=True,
    )
    version, path = result.stdout.split()
    assert Path(path).is_relative_to(src), path  # the previous release's, not this one
    return version
