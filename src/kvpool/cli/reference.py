"""The configuration reference (docs/configuration.md), generated from the declarations:
the node's :class:`~kvpool.config.Setting` of every field, the SDK's and the engine
adapters' :class:`~kvpool.config.Option` of every field, the router's settings.  A test
regenerates it and compares (a table that drifts from the code fails the suite).  The
command line's page is :mod:`kvpool.cli.commands_page`'s.

    python -m kvpool.cli.reference > docs/configuration.md
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


def table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> str:
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
        table(("flag", "variable", "default", "meaning"), node),
        "",
        "## Clients: the SDK, and every engine adapter",
        "",
        "A keyword of `kvpool.Client(...)` / `AsyncClient(...)`, a key of an engine's extra",
        "config (vLLM's `kv_connector_extra_config`, SGLang's",
        "`--hicache-storage-backend-extra-config`), or its `KVPOOL_*` variable (a keyword or",
        "key wins over it).",
        "",
        table(options, option_rows(ClientConfig)),
        "",
        "## The vLLM connector: `kv_connector_extra_config`",
        "",
        "Beside the client's keys above; `health_*` are the pool's health policy, which every",
        "engine adapter takes.",
        "",
        table(options, own(ConnectorConfig)),
        "",
        "## The SGLang HiCache backend: its extra config",
        "",
        "Beside the client's keys above, and SGLang's own (`backend_name`, `module_path`,",
        "`class_name`, `interface_v1`, `allocator`, `tp_lcm_size`), which kvpool leaves to",
        "SGLang.",
        "",
        table(options, own(StorageConfig)),
        "",
        "## The router: `kvpool router`",
        "",
        "A flag, or the key of its config file (`--config router.toml`; a flag wins over it).",
        "",
        table(("flag", "router.toml key", "default", "meaning"), router),
        "",
    ]
    return "\n".join(parts)


def main() -> None:
    sys.stdout.write(reference())


if __name__ == "__main__":
    main()
