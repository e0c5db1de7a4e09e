"""``kvpool ems install DIR``: make ``import ems`` (and, on hosts without Ascend, the guide
connector's own imports) work, without shadowing a real package.

It writes, into DIR (which the user adds to ``PYTHONPATH``):

- ``ems/``: a thin package re-exporting :mod:`kvpool.ems` (``ems``, ``ems.cc_v1``,
  ``ems.cc_v1.cc_config``);
- with ``connector_files``: ``vllm_ascend/distributed/ems_store/``, holding the user's copy
  of the guide's connector files, and a ``torch_npu`` stand-in whose
  ``npu.synchronize()`` is a no-op (``torch.cuda.synchronize()`` on a CUDA host).  The
  stand-in sets no ``torch.npu``, so libraries that probe for an NPU find none.

Nothing is ever written over a real ``ems``, ``vllm_ascend`` or ``torch_npu``: if one is
importable from elsewhere, or DIR holds files this command did not write, it refuses.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

from kvpool.errors import ConfigError

MARKER = "# Written by `kvpool ems install`: a thin layer over kvpool. Safe to delete.\n"
CONNECTOR_FILES = ("__init__.py", "ems_adapter.py", "ems_env.py", "ems_store_connector.py")

EMS_INIT = (
    MARKER
    + '''"""The EMS SDK, served by kvpool (kvpool.ems)."""

from kvpool.ems import *  # noqa: F403
from kvpool.ems import __all__  # noqa: F401
'''
)
CC_V1_INIT = MARKER + "from kvpool.ems.cc_v1 import *  # noqa: F403\n"
CC_CONFIG = MARKER + "from kvpool.ems.cc_v1.cc_config import *  # noqa: F403\n"
TORCH_NPU = (
    MARKER
    + '''"""A stand-in for torch_npu on hosts without Ascend NPUs: only what the EMS connector
calls.  It does not add torch.npu, so nothing mistakes this host for an NPU host."""


class _Npu:
    @staticmethod
    def synchronize() -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


npu = _Npu()
'''
)


def _write(path: Path, text: str) -> None:
    if path.exists() and MARKER not in path.read_text(errors="replace"):
        raise ConfigError(f"{path} exists and was not written by kvpool: refusing to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _refuse_real(name: str, target: Path) -> None:
    """Refuse if ``name`` is importable from somewhere other than ``target``."""
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != target.resolve()]
        spec = importlib.util.find_spec(name)
    finally:
        sys.path[:] = saved
    if spec is not None:
        where = spec.origin or (list(spec.submodule_search_locations or []) or ["?"])[0]
        raise ConfigError(f"a real {name!r} is installed ({where}): refusing to shadow it")


def install(target: str | Path, connector_files: str | Path | None = None) -> list[Path]:
    """Write the packages; returns the files written."""
    root = Path(target)
    names = ["ems"] + (["vllm_ascend", "torch_npu"] if connector_files else [])
    for name in names:
        _refuse_real(name, root)
    written = []
    for relative, text in (
        ("ems/__init__.py", EMS_INIT),
        ("ems/cc_v1/__init__.py", CC_V1_INIT),
        ("ems/cc_v1/cc_config.py", CC_CONFIG),
    ):
        _write(root / relative, text)
        written.append(root / relative)
    if connector_files:
        source = Path(connector_files)
        missing = [f for f in CONNECTOR_FILES if not (source / f).is_file()]
        if missing:
            raise ConfigError(f"{source} lacks the connector's {', '.join(missing)}")
        for relative in ("vllm_ascend/__init__.py", "vllm_ascend/distributed/__init__.py"):
            _write(root / relative, MARKER)
            written.append(root / relative)
        store = root / "vllm_ascend" / "distributed" / "ems_store"
        store.mkdir(parents=True, exist_ok=True)
        for name in CONNECTOR_FILES:
            shutil.copyfile(source / name, store / name)  # the user's copy, byte for byte
            written.append(store / name)
        _write(root / "torch_npu" / "__init__.py", TORCH_NPU)
        written.append(root / "torch_npu" / "__init__.py")
    return written
