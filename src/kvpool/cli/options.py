"""Command-line options built from :class:`~kvpool.config.Setting` declarations, so that a
setting's flag, help and parser are written once (beside the field it sets) and a command
lists them all.

:func:`with_settings` gives a command function that takes ``**values`` one typer option per
setting (typer reads a function's parameters from its signature); :func:`given` turns what
the operator gave into overrides by :attr:`Setting.key`, parsed as the setting's environment
variable would be.  An option left out is absent from the overrides, so the environment
and the defaults apply to it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, TypeVar

import typer

from kvpool.config import Setting, parse_size

Command = TypeVar("Command", bound=Callable[..., Any])

_METAVARS: dict[object, str] = {parse_size: "SIZE", int: "INTEGER", float: "NUMBER"}


def with_settings(
    settings: Iterable[Setting],
    defaults: Mapping[str, str] | None = None,
    *,
    env: bool = True,
) -> Callable[[Command], Command]:
    """A decorator: ``command`` also takes one option per setting, as keyword arguments
    named by :attr:`Setting.key`, listed before its own (which it takes by keyword); its
    help says the setting's default (``defaults``, by key: what applies when neither the
    option nor its variable is given) and, with ``env``, its ``KVPOOL_*`` variable."""

    def decorate(command: Command) -> Command:
        signature = inspect.signature(command, eval_str=True)
        own = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in signature.parameters.values()
            if p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        added = [
            _parameter(setting, (defaults or {}).get(setting.key), env) for setting in settings
        ]
        command.__signature__ = signature.replace(parameters=[*added, *own])  # type: ignore[attr-defined]
        return command

    return decorate


def _parameter(
    setting: Setting, default_text: str | None = None, env: bool = True
) -> inspect.Parameter:
    help_text = setting.help
    if default_text is not None:
        # Parentheses: typer's help is rich markup, where [default: ...] would be a tag.
        help_text += f" (default: {default_text}" + (f"; {setting.env_var})" if env else ")")
    if setting.is_switch:
        option = typer.Option(setting.flag, help=help_text)
        annotation: Any = Annotated[bool, option]
        default: object = False
    else:
        metavar = _METAVARS.get(setting.parse, "TEXT")
        option = typer.Option(setting.flag, help=help_text, metavar=metavar)
        annotation = Annotated[str | None, option]
        default = None
    return inspect.Parameter(
        setting.key, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
    )


def given(settings: Iterable[Setting], values: Mapping[str, object]) -> dict[str, object]:
    """The options the operator gave, by key and parsed (a switch left off is not given)."""
    overrides: dict[str, object] = {}
    for setting in settings:
        value = values.get(setting.key)
        if value is None or value is False:
            continue
        overrides[setting.key] = (
            setting.parse_text(value, setting.flag) if isinstance(value, str) else value
        )
    return overrides
