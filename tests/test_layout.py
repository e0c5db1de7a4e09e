"""The package layout follows the data path, and dependencies point one way along it."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpool

ROOT = Path(kvpool.__file__).parent
# Each layer may import itself and the layers before it, never one after it.
LAYERS = [
    {"errors", "timing", "checksum", "keys", "stats", "config", "tenants", "tls", "directory"},
    {"protocol"},
    {"store"},
    {"tiers"},
    {"cluster"},
    {"client"},
    {"node"},
    {"kvcache"},
    {"integrations", "ems"},
    {"router"},
    {"demo"},
    {"cli", "__main__", "__init__"},
]


def _layer(module: str) -> int:
    top = module.split(".", maxsplit=1)[0]
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"kvpool.{module} is in no layer of the layout")


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT).with_suffix("")
        out[".".join(relative.parts)] = path
    return out


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("kvpool."):
                found.add(node.module[len("kvpool.") :])
        elif isinstance(node, ast.Import):
            found.update(
                a.name[len("kvpool.") :] for a in node.names if a.name.startswith("kvpool.")
            )
    return found


def test_dependencies_point_one_way():
    wrong = []
    for module, path in _modules().items():
        for imported in _imports(path):
            if _layer(imported) > _layer(module):
                wrong.append(f"kvpool.{module} imports kvpool.{imported}")
    assert not wrong, wrong
