"""The configuration reference and ``--help`` come from the code's declarations: the page
in docs/ is what the generator writes now (a table that drifts fails here), a changed
declaration changes it, and every default shows in ``--help``."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from kvpool.cli.reference import node_defaults, option_rows, reference
from kvpool.config import ClientConfig, node_settings
from kvpool.router.config import ROUTER_SETTINGS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_configuration_page_is_the_declarations():
    assert PAGE.read_text() == reference(), (
        "docs/configuration.md drifted from the code: "
        "python -m kvpool.cli.reference > docs/configuration.md"
    )


def test_a_changed_declaration_changes_the_page(monkeypatch):
    """The comparison above compares: a field's help, declared once, is what the page says."""
    import kvpool.config as config

    fields = {f.name: f for f in dataclasses.fields(ClientConfig)}
    declared = fields["tls_server_name"].metadata[config.OPTION]
    changed = dataclasses.replace(declared, help="Something else entirely.")
    metadata = {**fields["tls_server_name"].metadata, config.OPTION: changed}
    monkeypatch.setattr(fields["tls_server_name"], "metadata", metadata)
    rows = {row[0]: row for row in option_rows(ClientConfig)}
    assert rows["`tls_server_name`"][3] == "Something else entirely."
    assert reference() != PAGE.read_text()


def test_every_default_shows_in_help():
    """``kvpool serve --help``: each setting's default beside its variable (which names the
    setting); ``kvpool router --help``: a default for each of its settings."""
    from kvpool.cli.reference import settings_defaults
    from kvpool.router.config import RouterSettings

    env = {**os.environ, "COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"}

    def help_of(command: str) -> str:
        shown = subprocess.run(
            [sys.executable, "-m", "kvpool", command, "--help"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        ).stdout
        return " ".join(shown.replace("│", " ").split())

    serve = help_of("serve")
    defaults = node_defaults()
    for _, _, setting in node_settings():
        assert f"(default: {defaults[setting.key]}; {setting.env_var})" in serve, setting.flag
    router = help_of("router")
    router_defaults = settings_defaults(ROUTER_SETTINGS, RouterSettings)
    assert router.count("(default: ") == len(ROUTER_SETTINGS)
    for setting in ROUTER_SETTINGS:
        assert f"(default: {router_defaults[setting.key]})" in router, setting.flag


CLI_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md"


def test_the_command_line_page_is_the_parsers():
    from kvpool.cli.commands_page import cli_reference

    assert CLI_PAGE.read_text() == cli_reference(), (
        "docs/reference/cli.md drifted from the commands: "
        "python -m kvpool.cli.commands_page > docs/reference/cli.md"
    )


def test_the_command_line_page_has_every_command_and_option():
    """Read from the parsers themselves: each command a heading, each option a row."""
    import typer.main

    from kvpool.cli.main import app

    page = CLI_PAGE.read_text()
    root = typer.main.get_command(app)
    for name, command in root.commands.items():
        leaves = command.commands.items() if hasattr(command, "commands") else [("", command)]
        for leaf, found in leaves:
            heading = " ".join(part for part in ("kvpool", name, leaf) if part)
            assert f"## `{heading}`" in page
            for param in found.params:
                if param.param_type_name == "option" and not param.hidden:
                    assert f"`{param.opts[0]}`" in page, (heading, param.opts)
