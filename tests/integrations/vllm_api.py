"""vLLM's connector API as a release's sources state it, read without importing them (a
CUDA build's modules need CUDA): from a wheel, or from an installed package's directory.

kvpool's connector must implement every abstract hook of the release's
``KVConnectorBase_V1`` with the same parameters, override no hook with other parameters,
and every name kvpool imports from ``vllm`` must exist in that release.
"""

from __future__ import annotations

import ast
import zipfile
from dataclasses import dataclass
from pathlib import Path

BASE_MODULE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
BASE_CLASS = "KVConnectorBase_V1"
SRC = Path(__file__).resolve().parents[2] / "src" / "kvpool"
CONNECTOR = SRC / "integrations" / "vllm" / "connector.py"


class Sources:
    """A release's ``vllm`` package: its files by path (``vllm/...``)."""

    def __init__(self, where: Path) -> None:
        self.where = where
        if where.suffix == ".whl":
            self._zip: zipfile.ZipFile | None = zipfile.ZipFile(where)
            self.names = {n for n in self._zip.namelist() if n.startswith("vllm/")}
        else:  # an installed package: the directory that holds vllm/
            self._zip = None
            root = where
            self.names = {str(p.relative_to(root)) for p in (root / "vllm").rglob("*.py")}

    def read(self, name: str) -> str:
        if self._zip is not None:
            return self._zip.read(name).decode()
        return (self.where / name).read_text()

    def module_file(self, module: str) -> str | None:
        """The file of ``module`` (dotted), if the release has it."""
        path = module.replace(".", "/")
        for name in (f"{path}.py", f"{path}/__init__.py"):
            if name in self.names:
                return name
        return None

    def has_name(self, module: str, name: str) -> bool:
        """Whether ``from module import name`` finds something in this release: a name its
        module defines or imports at top level, a submodule, or a lazy attribute (a
        module ``__getattr__`` whose module names it in a string)."""
        if self.module_file(f"{module}.{name}") is not None:
            return True
        file = self.module_file(module)
        if file is None:
            return False
        tree = ast.parse(self.read(file))
        defined = _top_level_names(tree.body)
        if name in defined:
            return True
        if "__getattr__" in defined:
            strings = {
                node.value
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant) and isinstance(node.value, str)
            }
            return any(s == name or s.endswith(f":{name}") for s in strings)
        return False


def _top_level_names(body: list[ast.stmt]) -> set[str]:
    """Names a module binds at top level (inside ``if``/``try`` too)."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(t.id for t in ast.walk(target) if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try):
            for part in (node.body, node.orelse, getattr(node, "finalbody", [])):
                names |= _top_level_names(part)
            for handler in getattr(node, "handlers", []):
                names |= _top_level_names(handler.body)
    return names


@dataclass(frozen=True)
class Parameters:
    """A method's parameters as its signature reads: names by kind, and which have
    defaults (``self`` left out)."""

    positional: tuple[str, ...]
    keyword_only: tuple[str, ...]
    defaults: int  # how many of the trailing positional ones have defaults
    var_positional: bool
    var_keyword: bool

    def accepts_calls_to(self, base: Parameters) -> bool:
        """Whether a method with these parameters takes every call vLLM makes to ``base``'s:
        the same names in the same order, a default wherever the base has one (it may have
        more), and ``*args``/``**kwargs`` where the base takes them."""
        return (
            self.positional == base.positional
            and self.keyword_only == base.keyword_only
            and self.defaults >= base.defaults
            and self.var_positional >= base.var_positional
            and self.var_keyword >= base.var_keyword
        )

    @classmethod
    def of(cls, function: ast.FunctionDef | ast.AsyncFunctionDef) -> Parameters:
        args = function.args
        positional = tuple(a.arg for a in [*args.posonlyargs, *args.args])[1:]
        return cls(
            positional,
            tuple(a.arg for a in args.kwonlyargs),
            len(args.defaults),
            args.vararg is not None,
            args.kwarg is not None,
        )


def methods(source: str, class_name: str) -> dict[str, tuple[Parameters, bool]]:
    """The methods a class defines: each one's parameters, and whether it is abstract."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            found = {}
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    abstract = any(
                        (isinstance(d, ast.Name) and d.id == "abstractmethod")
                        or (isinstance(d, ast.Attribute) and d.attr == "abstractmethod")
                        for d in item.decorator_list
                    )
                    found[item.name] = (Parameters.of(item), abstract)
            return found
    raise LookupError(f"no class {class_name}")


def connector_problems(release: Sources, connector_source: str | None = None) -> list[str]:
    """What kvpool's connector gets wrong against ``release``'s base class (none: right):
    an abstract hook it does not implement, or a hook it overrides with other
    parameters."""
    base = methods(release.read(BASE_MODULE), BASE_CLASS)
    ours = methods(connector_source or CONNECTOR.read_text(), "KVPoolConnector")
    problems = []
    for name, (parameters, abstract) in sorted(base.items()):
        if name.startswith("__") and name != "__init__":
            continue
        if name not in ours:
            if abstract:
                problems.append(f"{name}: abstract in {BASE_CLASS}, not implemented")
            continue
        mine = ours[name][0]
        if not mine.accepts_calls_to(parameters):
            problems.append(f"{name}: vLLM's takes {parameters}, kvpool's {mine}")
    return problems


def imported_names(root: Path = SRC) -> set[tuple[str, str | None]]:
    """Every ``(module, name)`` kvpool imports from vLLM, anywhere in its code (``name``
    None: ``import module``)."""
    found: set[tuple[str, str | None]] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "vllm" or node.module.startswith("vllm."):
                    found.update((node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(
                    (alias.name, None)
                    for alias in node.names
                    if alias.name == "vllm" or alias.name.startswith("vllm.")
                )
    return found


def missing_names(release: Sources) -> list[str]:
    """The names kvpool imports that ``release`` lacks (none: all there)."""
    missing = []
    for module, name in sorted(imported_names(), key=lambda mn: (mn[0], mn[1] or "")):
        if name is None:
            if release.module_file(module) is None:
                missing.append(f"import {module}")
        elif not release.has_name(module, name):
            missing.append(f"from {module} import {name}")
    return missing
