"""The package layout follows the data path, and dependencies point one way along it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import kvpool

ROOT = Path(kvpool.__file__).parent
# Each layer may import itself and the layers before it, never one after it.
LAYERS = [
    {
        "errors",
        "limits",
        "checksum",
        "buffers",
        "keys",
        "stats",
        "config",
        "tenants",
        "tls",
        "dirs",
        "mapping",
        "formats",
        "retention",
    },
    {"directory"},
    {"protocol"},
    {"store"},
    {"tiers"},
    {"cluster"},
    {"client"},
    {"node"},
    {"kvcache"},
    {"integrations", "ems"},
    {"router"},
    {"harness"},
    {"demo"},
    {"cli", "__main__", "__init__"},
]


REPO = ROOT.parents[1]
ARCHITECTURE = REPO / "docs" / "architecture.md"


def _layer(module: str) -> int:
    top = module.split(".", maxsplit=1)[0]
    for index, names in enumerate(LAYERS):
        if top in names:
            return index
    raise AssertionError(f"kvpool.{module} is in no layer of the layout")


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name below ``kvpool`` (a package by its own
    name, not ``….__init__``)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) - {m} for m, p in modules.items()}


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvpool modules ``module`` imports, anywhere in it (lazy imports included),
    relative imports resolved: ``from kvpool.a import b`` names ``a.b`` if that is a
    module, else ``a``."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                parts = [*base, *(node.module or "").split(".")]
                source = ".".join(p for p in parts if p)
            elif node.module and node.module.startswith("kvpool."):
                source = node.module[len("kvpool.") :]
            else:
                continue
            for alias in node.names:
                name = f"{source}.{alias.name}" if source else alias.name
                found.add(name if name in modules else source)
        elif isinstance(node, ast.Import):
            found.update(
                a.name[len("kvpool.") :] for a in node.names if a.name.startswith("kvpool.")
            )
    return {m for m in found if m}


def test_dependencies_point_one_way():
    wrong = []
    for module, imported_ids in _graph().items():
        for imported in imported_ids:
            if _layer(imported) > _layer(module):
                wrong.append(f"kvpool.{module} imports kvpool.{imported}")
    assert not wrong, wrong


def test_every_top_level_module_is_in_a_layer():
    top = {p.stem for p in ROOT.glob("*.py")} | {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert sorted(top - set().union(*LAYERS)) == []


def _drawn_layers() -> list[set[str]]:
    """docs/architecture.md's layer list (its first code block), layer by layer:
    ``a, b → c → d (what it holds), e``."""
    block = ARCHITECTURE.read_text().split("```", 2)[1]
    return [
        {name.strip() for name in re.sub(r"\([^)]*\)", "", layer).split(",")}
        for layer in block.split("→")
    ]


def test_the_architecture_lists_these_layers():
    assert _drawn_layers() == [names - {"__init__"} for names in LAYERS]


def test_every_module_the_architecture_names_exists():
    """Each ``path.py`` docs/architecture.md names (its table's modules, entry points and
    tests): below src/kvpool, or from the repository's root (``tests/...``)."""
    named = set(re.findall(r"`([\w/]+\.py)`", ARCHITECTURE.read_text()))
    assert len(named) > 40  # the table is still read
    missing = [n for n in sorted(named) if not (ROOT / n).exists() and not (REPO / n).exists()]
    assert missing == []


def test_no_import_circles():
    """No two modules import each other, directly or through others (imports inside
    functions and under TYPE_CHECKING count too: a circle is one concept split in two)."""
    graph = _graph()
    circles = [sorted(c) for c in _strongly_connected(graph) if len(c) > 1]
    assert circles == []


def _strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root, root_edges in graph.items():
        if root in index:
            continue
        work = [(root, iter(sorted(root_edges)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(component)
    return found


def test_the_engine_runner_imports_no_kvpool_by_name():
    """The runner runs under another release's kvpool in the upgrade tests: it names none
    of kvpool's modules, and reads vLLM's internals through the paged-cache file beside it
    (this release's, whatever is first on the path)."""
    from kvpool.harness import runner

    tree = ast.parse((ROOT / "harness" / "runner.py").read_text())
    named = [
        alias.name if isinstance(node, ast.Import) else node.module or ""
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    ]
    assert not [name for name in named if name.split(".")[0] == "kvpool"], named
    paged = runner._paged()
    assert Path(paged.__file__) == ROOT / "harness" / "paged.py"
    assert paged.__name__ != "kvpool.harness.paged"
