"""Third-party files the suite reads but the project never copies: the EMS connector seed
(``ems-seed/``) and Kthena's pinned ModelServing CRD (``kthena/``).

They are found under one directory, ``KVPOOL_THIRD_PARTY_DIR`` (by default ``../shared``
beside the project).  Where a file is absent, the test that needs it is skipped with a
message that says how to provide it; under CI (``CI=true``) it fails instead, so that a
missing directory never turns into a green run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = "KVPOOL_THIRD_PARTY_DIR"


def third_party_dir() -> Path:
    """Where the third-party files are looked for."""
    return Path(os.environ.get(ENV) or ROOT.parent / "shared")


def third_party(relative: str) -> Path:
    """The path of a third-party file or directory; skip (fail under CI) if it is absent."""
    path = third_party_dir() / relative
    if path.exists():
        return path
    message = (
        f"third-party file {relative} not found under {third_party_dir()}: put the project's "
        f"shared directory (ems-seed/, kthena/) beside the checkout as ../shared, or set {ENV} "
        "to where it is"
    )
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)
