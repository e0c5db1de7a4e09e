"""The reference pages, generated from the declarations; a test regenerates each and
compares (a table that drifts from the code fails the suite):

- the configuration reference (docs/configuration.md): the node's
  :class:`~kvpool.config.Setting` of every field, the SDK's and the engine adapters'
  :class:`~kvpool.config.Option` of every field, the router's settings;
- the command line (docs/reference/cli.md): every ``kvpool`` command, its arguments and
  options, read from the command's own parser.

    python -m kvpool.cli.reference > docs/configuration.md
    python -m kvpool.cli.reference cli > docs/reference/cli.md
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable
from typing import Any

from kvpool.config import (
    ClientConfig,
    NodeConfig,
    Setting,
    format_size,
    node_sections,
    node_settings,
    options_of,
    parse_size,
    sections_of,
)

# Defaults that depend on the machine: how the docs and --help say them.
MACHINE_DEFAULTS: dict[tuple[type, str], str] = {
    (NodeConfig, "host_id"): "the hostname",
    (ClientConfig, "host_id"): "the hostname",
    (ClientConfig, "copy_threads"): "CPUs, at most 4",
}


def shown(value: object, parse: Callable[[str], object] | None = None) -> str:
    """A default as an operator would write it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if value in ("", None, ()):
        return "none"
    if isinstance(value, tuple | list):
        return ",".join(map(str, value))
    if parse is parse_size and isinstance(value, int):
        return format_size(value).replace(".0 ", "").replace(" ", "")
    return str(value)


def node_defaults() -> dict[str, str]:
    """Each node setting's default, by its key (what ``kvpool serve --help`` shows)."""
    sections = node_sections()
    out = {}
    for section, name, setting in node_settings():
        owner = NodeConfig if not section else sections[section]
        machine = MACHINE_DEFAULTS.get((owner, name))
        if machine is not None:
            out[setting.key] = machine
            continue
        default = _field_default(owner, name)
        out[setting.key] = shown(default, setting.parse)
    return out


def settings_defaults(settings: Iterable[Setting], config_type: type) -> dict[str, str]:
    """The defaults of command settings whose keys are fields of ``config_type`` (the
    router's)."""
    return {s.key: shown(_field_default(config_type, s.key), s.parse) for s in settings}


def _field_default(owner: type, name: str) -> Any:
    found = {f.name: f for f in dataclasses.fields(owner)}[name]
    if found.default_factory is not dataclasses.MISSING:
        return found.default_factory()
    return found.default


def option_rows(cls: type) -> list[tuple[str, str, str, str]]:
    """``(key, variable, default, meaning)`` of every option of ``cls`` and its sections."""
    rows = []
    for declared in options_of(cls):
        default = MACHINE_DEFAULTS.get((cls, declared.field)) or shown(declared.default)
        rows.append((f"`{declared.key}`", f"`{declared.env}`", default, declared.help))
    for section in sections_of(cls).values():
        rows.extend(option_rows(section))
    return rows


def _table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def reference() -> str:
    """docs/configuration.md."""
    from kvpool.integrations.sglang.config import StorageConfig
    from kvpool.integrations.vllm.config import ConnectorConfig
    from kvpool.router.config import ROUTER_SETTINGS, RouterSettings

    defaults = node_defaults()
    node = [
        (f"`{s.flag}`", f"`{s.env_var}`", defaults[s.key], s.help) for _, _, s in node_settings()
    ]
    router_defaults = settings_defaults(ROUTER_SETTINGS, RouterSettings)
    router = [
        (f"`{s.flag}`", f"`{s.key}`", router_defaults[s.key], s.help) for s in ROUTER_SETTINGS
    ]
    client_keys = {row[0] for row in option_rows(ClientConfig)}

    def own(cls: type) -> list[tuple[str, str, str, str]]:
        return [row for row in option_rows(cls) if row[0] not in client_keys]

    options = ("key", "variable", "default", "meaning")
    parts = [
        "# Configuration reference",
        "",
        "Generated from the code's declarations by `python -m kvpool.cli.reference` (a test",
        "regenerates this page and fails if it differs): every option is declared once, beside",
        "the field it sets, with its name, variable, default and help.",
        "",
        "## The node: `kvpool serve`",
        "",
        "A flag, or its `KVPOOL_*` variable (a flag wins over it).",
        "",
        _table(("flag", "variable", "default", "meaning"), node),
        "",
        "## Clients: the SDK, and every engine adapter",
        "",
        "A keyword of `kvpool.Client(...)` / `AsyncClient(...)`, a key of an engine's extra",
        "config (vLLM's `kv_connector_extra_config`, SGLang's",
        "`--hicache-storage-backend-extra-config`), or its `KVPOOL_*` variable (a keyword or",
        "key wins over it).",
        "",
        _table(options, option_rows(ClientConfig)),
        "",
        "## The vLLM connector: `kv_connector_extra_config`",
        "",
        "Beside the client's keys above; `health_*` are the pool's health policy, which every",
        "engine adapter takes.",
        "",
        _table(options, own(ConnectorConfig)),
        "",
        "## The SGLang HiCache backend: its extra config",
        "",
        "Beside the client's keys above, and SGLang's own (`backend_name`, `module_path`,",
        "`class_name`, `interface_v1`, `allocator`, `tp_lcm_size`), which kvpool leaves to",
        "SGLang.",
        "",
        _table(options, own(StorageConfig)),
        "",
        "## The router: `kvpool router`",
        "",
        "A flag, or the key of its config file (`--config router.toml`; a flag wins over it).",
        "",
        _table(("flag", "router.toml key", "default", "meaning"), router),
        "",
    ]
    return "\n".join(parts)


def cli_reference() -> str:
    """docs/reference/cli.md: each command as ``kvpool <command> --help`` describes it."""
    import typer.main

    from kvpool.cli.main import app

    root = typer.main.get_command(app)
    parts = [
        "# Command line: `kvpool`",
        "",
        "Generated from the commands' own parsers by `python -m kvpool.cli.reference cli` (a",
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
    lines += [_table(("argument or option", "meaning"), rows), ""]
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
    pages = {"configuration": reference, "cli": cli_reference}
    page = sys.argv[1] if len(sys.argv) > 1 else "configuration"
    if page not in pages:
        raise SystemExit(f"usage: python -m kvpool.cli.reference [{'|'.join(pages)}]")
    sys.stdout.write(pages[page]())


if __name__ == "__main__":
    main()
