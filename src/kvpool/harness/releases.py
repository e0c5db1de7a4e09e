"""The previous release, built from git, to run beside this one: the upgrade tests start its
nodes and clients, then this release's on the same files (``tests/node/test_upgrade.py``,
``tests/integrations/test_upgrade_vllm.py``, ``benchmarks/upgrade.py``).

The previous release is named by its commit, with its tag as an alias: a checkout may not
have fetched tags, but a clone of main has the commit.  Its sources are taken with ``git
archive`` (no work tree is touched) and run with this checkout's Python and third-party
libraries, with ``PYTHONPATH`` naming them first: the dependencies of one release to the
next are the same (pyproject.toml's ranges).  Each new release moves these two names on
(the CHANGELOG says which commit each tag is).
"""

from __future__ import annotations

import os
import subprocess
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpool.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Release:
    tag: str
    commit: str


PREVIOUS = Release("v0.1.0", "0e5709d9e43ce194412440c9a47b9d1a0a6fa3b7")


def repository_root() -> Path:
    """The git checkout this package is running from."""
    return Path(__file__).resolve().parents[3]


def build_release(release: Release, dest: Path, repo: Path | None = None) -> Path:
    """The sources of ``release`` extracted under ``dest`` (once: kept for later calls);
    their ``src`` directory, to put first on ``PYTHONPATH``.  Raises
    :class:`~kvpool.errors.ConfigError` where the checkout lacks the commit."""
    src = dest / release.commit[:12] / "src"
    if (src / "kvpool" / "__init__.py").exists():
        return src
    repo = repo or repository_root()
    archive = dest / f"{release.commit[:12]}.tar"
    dest.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", "-o", str(archive), release.commit],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise ConfigError(
            f"cannot build kvpool {release.tag} (commit {release.commit[:12]}) from {repo}: "
            f"{result.stderr.strip()}. A clone of main with its history has it."
        )
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith("src/")]
        tar.extractall(src.parent, members=members, filter="data")
    archive.unlink()
    return src


def release_env(src: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment that runs the release whose sources are ``src`` (its ``kvpool``
    package first on the path, this checkout's libraries after it)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = str(src)
    return env
