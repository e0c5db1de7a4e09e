"""The command line's reference page (docs/reference/cli.md), read from the commands' own
parsers: every ``kvpool`` command, its arguments and options, as ``--help`` describes them.
A test regenerates it and compares.  (Apart from :mod:`kvpool.cli.reference`, which the
commands import for their defaults: this module imports the commands.)

    python -m kvpool.cli.commands_page > docs/reference/cli.md
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from kvpool.cli.reference import shown, table


def cli_reference() -> str:
    """docs/reference/cli.md: each command as ``kvpool <command> --help`` describes it."""
    import typer.main

    from kvpool.cli.main import app

    root = typer.main.get_command(app)
    parts = [
        "# Command line: `kvpool`",
        "",
        "Generated from the commands' own parsers by `python -m kvpool.cli.commands_page` (a",
        "test regenerates this page and fails if it differs). `kvpool <command> --help` says",
        "the same. Every option of `kvpool serve` is also a `KVPOOL_*` variable, and every",
        "option of `kvpool router` a key of its config file: the",
        "[configuration reference](../configuration.md) lists them with their variables.",
        "",
    ]
    for path, command in _commands(root, ("kvpool",)):
        parts += _command_section(path, command)
    return "\n".join(parts)


def _commands(group: Any, path: tuple[str, ...]) -> Iterable[tuple[tuple[str, ...], Any]]:
    """Every leaf command under ``group``, in the order they are declared."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name), command


def _command_section(path: tuple[str, ...], command: Any) -> list[str]:
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    options = [p for p in command.params if p.param_type_name == "option"]
    usage = " ".join([*path, *(a.name.upper() for a in arguments), "[OPTIONS]"])
    lines = [f"## `{' '.join(path)}`", "", _paragraphs(command.help or ""), ""]
    lines += ["```text", usage, "```", ""]
    rows = [(f"`{a.name.upper()}`", _paragraphs(a.help or "")) for a in arguments]
    rows += [(_option_names(o), _option_help(o)) for o in options if not o.hidden]
    lines += [table(("argument or option", "meaning"), rows), ""]
    return lines


def _option_names(option: Any) -> str:
    names = " / ".join(f"`{name}`" for name in (*option.opts, *option.secondary_opts))
    if option.is_flag or option.count:
        return names
    return f"{names} {option.metavar or 'VALUE'}" + (" (repeatable)" if option.multiple else "")


def _option_help(option: Any) -> str:
    text = _paragraphs(option.help or "")
    shown_default = option.default not in (None, False, (), []) and "(default: " not in text
    if shown_default and not callable(option.default):
        text += f" (default: {shown(option.default)})"
    return text


def _paragraphs(text: str) -> str:
    """A help text on one line (a table cell), its paragraphs joined; a ``[`` stays text
    (never the start of a Markdown link)."""
    return " ".join(text.split()).replace("[", "\\[")


def main() -> None:
    sys.stdout.write(cli_reference())


if __name__ == "__main__":
    main()
