"""References that must not drift: a numbered rule cited in a comment or docstring under
src/ is a rule of that number, about what it was about, in the module it names; and
errors.py's class tree is its classes, each under its real parent."""

from __future__ import annotations

import ast
import functools
import inspect
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import kvpool
from kvpool import errors

ROOT = Path(kvpool.__file__).parent

# "rule 7", "(rules 1 and 3)", "rules 1-5", "step 5" (a module's numbered steps).  No
# document numbers decisions: a "decision 19" is a reference to nothing.
REFERENCE = re.compile(
    r"\b(?P<kind>rule|step|decision)s?\s+(?P<numbers>\d+(?:\s*(?:,|and|or|-|to)\s*\d+)*)",
    re.IGNORECASE,
)
# The module a reference names, after it ("rule 14 of :mod:`kvpool.store.block_store`",
# "rule 6 of the journal") or before it ("kvpool.directory rule 3", "the store's rule 11");
# a reference that names none cites the module it sits in.
NAMED_AFTER = re.compile(r"\s+of\s+(?::mod:`~?kvpool\.(?P<module>[\w.]+)|(?P<alias>the\s+\w+))")
NAMED_BEFORE = re.compile(
    r"(?:(?::mod:`~?)?kvpool\.(?P<module>[\w.]+)`?|(?P<alias>the\s+\w+)'s)\s+$"
)
ALIASES = {"the journal": "store.journal", "the store": "store.block_store"}

# What each numbered rule (or step) of every module cited is about: a phrase of its text,
# in order, from its first number.  A rule inserted, removed or moved no longer matches:
# renumber every reference to the module's rules (the test lists them), then this table.
SUBJECTS: dict[str, tuple[str, ...]] = {
    "store.block_store": (
        "``reserve`` allocates",
        "atomically",
        "return the memory",
        "until ``unpin``",
        "lease ledger",
        "least recently used",
        "overwritten",
        "for itself",
        "``spill``",
        "before it is acknowledged",
        "``quotas``",
        "shared directory",
        "``touch``",
        "``place``",
        "``expire``",
        "compaction",
        "``on_change``",
        "ReuseSampler",
        "leaving",
        "``retain``",
    ),
    "store.journal": (
        "acknowledged",
        "REMOVE",
        "never written",
        "torn",
        "commit order",
        "compacted",
        "names the arena",
        "format version",
    ),
    "store.leases": (
        "LeaseLedger.grant",
        "LeaseLedger.expire",
        "LeaseLedger.release",
        "one counter",
    ),
    "store.accounts": ("tenant's tag", "Accounts.charge", "credits it back", "reload"),
    "store.retention": ("reverts to the default", "RETAINED_BYTES", "``forget``"),
    "formats": ("kvpool status", "Format.oldest", "refused at start", "shared object", "CHANGELOG"),
    "directory": ("committed, sealed", "withdrawn", "retires", "does not list"),
    "node.handoff": (
        "accounted for",
        "rendezvous",
        "rate_bytes",
        "Best effort",
        "``seal``",
        "operators",
    ),
    "node.sink": ("``put`` never blocks", "in order", "``flush``"),
    "kvcache.guard": ("pool error", "a bug", "returns"),
    "kvcache.loads": ("end the prefix", "ran out", "Copies.settle", "a miss", "``stop``"),
    "node.build": (
        "TLS files",
        "directory's lock",
        "KV event publisher",
        "open_lower_tiers",
        "data port",
        "replayed",
        "migrated",
        "lease ledger",
        "cluster agent",
    ),
}


@dataclass(frozen=True)
class Reference:
    where: str  # path:line
    kind: str  # "rule" or "step" (or "decision", which nothing numbers)
    numbers: tuple[int, ...]
    module: str | None  # the module cited, below kvpool (None: an alias this test lacks)
    text: str

    def __str__(self) -> str:
        return f"{self.where}: {self.text!r} (cites {self.module})"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _path_of(module: str) -> Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _prose(path: Path) -> list[tuple[int, str]]:
    """Every docstring and comment of ``path``, by its first line: a run of whole-line
    comments is one text (a line each), so that a reference may wrap."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.append((first.lineno, first.value.value))
    run: list[str] = []
    start = last = -1
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        whole_line = token.line.lstrip().startswith("#")
        if run and not (whole_line and line == last + 1):
            found.append((start, "\n".join(run)))
            run = []
        if not run:
            start = line
        run.append(token.string.lstrip("#").strip())
        last = line if whole_line else -2
    if run:
        found.append((start, "\n".join(run)))
    return found


def _numbers(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in re.split(r"\s*(?:,|and|or)\s*", text):
        bounds = [int(n) for n in re.split(r"\s*(?:-|to)\s*", part) if n]
        out.extend(range(bounds[0], bounds[-1] + 1))
    return tuple(out)


def _cited(flat: str, match: re.Match[str], own: str) -> str | None:
    named = NAMED_AFTER.match(flat, match.end()) or NAMED_BEFORE.search(flat[: match.start()])
    if named is None:
        return own
    if named["module"]:
        return named["module"]
    return ALIASES.get(" ".join(named["alias"].split()))


@functools.cache
def references() -> tuple[Reference, ...]:
    """Every numbered reference in a docstring or comment under src/kvpool."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        own = _module_name(path)
        for line, text in _prose(path):
            for match in REFERENCE.finditer(text):
                context = text[max(match.start() - 40, 0) : match.end() + 40]
                at = line + text.count("\n", 0, match.start())
                found.append(
                    Reference(
                        where=f"{path.relative_to(ROOT.parent)}:{at}",
                        kind=match["kind"].lower(),
                        numbers=_numbers(match["numbers"]),
                        module=_cited(text, match, own),
                        text=" ".join(context.split()),
                    )
                )
    return tuple(found)


def numbered(module: str, kind: str = "rule") -> dict[int, str]:
    """The numbered items of ``module``'s docstring, by number: its rules (the list after a
    line that starts ``Rules``; without one, every numbered item), or its steps (every
    numbered item)."""
    doc = ast.get_docstring(ast.parse(_path_of(module).read_text())) or ""
    lines = doc.splitlines()
    heading = next((i for i, line in enumerate(lines) if line.startswith("Rules")), None)
    in_section = kind == "rule" and heading is not None
    items: dict[int, str] = {}
    current = None
    for line in lines[heading + 1 :] if in_section and heading is not None else lines:
        item = re.match(r"(\d+)\.\s+(.*)", line)
        if item:
            current = int(item[1])
            assert current not in items, f"kvpool.{module} numbers two items {current}"
            items[current] = item[2]
        elif current is not None and line.startswith(" "):
            items[current] += " " + line.strip()
        elif line.strip():
            current = None
            if in_section and items:
                break
    return items


def test_every_numbered_reference_names_an_item_of_that_number():
    refs = references()
    assert len(refs) > 40  # the scan still finds them
    wrong = []
    for ref in refs:
        if ref.kind == "decision":
            wrong.append(f"{ref}: no document numbers decisions; say what it means")
        elif ref.module is None:
            wrong.append(f"{ref}: name the module (or add its alias to ALIASES)")
        elif not _path_of(ref.module).exists():
            wrong.append(f"{ref}: kvpool.{ref.module} does not exist")
        elif ref.module not in SUBJECTS:
            wrong.append(f"{ref}: pin what kvpool.{ref.module}'s {ref.kind}s say in SUBJECTS")
        else:
            have = numbered(ref.module, ref.kind)
            wrong += [f"{ref}: no {ref.kind} {n}" for n in ref.numbers if n not in have]
    assert not wrong, "\n".join(wrong)


def test_the_cited_rules_say_what_they_said():
    """A module whose rules are cited keeps them in order: one inserted, removed or moved
    fails here, with the references to renumber."""
    refs = references()
    wrong = []
    for module, subjects in SUBJECTS.items():
        kind = "step" if any(r.kind == "step" and r.module == module for r in refs) else "rule"
        have = numbered(module, kind)
        first = min(have, default=1)
        pinned = dict(enumerate(subjects, start=first))
        moved = [
            f"{kind} {n}: {pinned.get(n, '(not pinned)')!r} not in {have.get(n, '(none)')!r}"
            for n in sorted(have.keys() | pinned.keys())
            if n not in have or n not in pinned or pinned[n].lower() not in have[n].lower()
        ]
        if moved:
            citing = [str(r) for r in refs if r.module == module]
            wrong.append("\n  ".join([f"kvpool.{module}'s {kind}s moved:", *moved, *citing]))
    assert not wrong, "\n".join(wrong)


def _drawn_tree() -> dict[str, str | None]:
    """errors.py's docstring tree: each class drawn, by the class it is drawn under."""
    doc = errors.__doc__ or ""
    block = doc.split("::", 1)[1].split("\n\n")[1:3]
    parents: dict[str, str | None] = {}
    stack: list[tuple[int, str]] = []
    for line in "\n".join(block).splitlines():
        drawn = re.match(r"(?P<indent>[ │├└─]*)(?P<name>[A-Z]\w*)", line)
        if drawn is None:
            continue
        depth = len(drawn["indent"])
        while stack and stack[-1][0] >= depth:
            stack.pop()
        parents[drawn["name"]] = stack[-1][1] if stack else None
        stack.append((depth, drawn["name"]))
    return parents


def test_the_errors_tree_draws_every_class_under_its_parent():
    classes = {
        name: cls
        for name, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__ == errors.__name__
    }
    real = {
        name: next((b.__name__ for b in cls.__bases__ if b.__name__ in classes), None)
        for name, cls in classes.items()
    }
    assert _drawn_tree() == real
