"""Checking config tables against the dataclasses they fill: names, types, ranges, templates.

Each check raises :class:`SettingsError` with one line that says where (file and table), which
field, what was expected and what was found, e.g.
``kvledger.toml: [limits] backend_timeout_s: expected a number, got 'ten' (a string)``.
The expected types are read from the dataclass annotations, so a field added to a settings
class is checked without touching this module. Numbers may not be negative, and durations
(``*_s``) must be above zero: a zero timeout or interval is always a mistake.
"""

from __future__ import annotations

import inspect
import math
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from policies import DEFAULT_POLICY, POLICIES, make_policy
from router.chat.parsers import PARSERS
from router.chat.templates import JinjaChat, TemplateLoadError, load_chat


class SettingsError(ValueError):
    """The config file or environment is wrong; the message says where."""


_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _kind(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    names.update({list: "an array", dict: "a table"})
    return names.get(type(value), type(value).__name__)


def _is(value: Any, hint: Any) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, str)


def coerce(value: Any, hint: Any, where: str) -> Any:
    """``value`` as the annotated type ``hint`` wants it, or SettingsError."""
    origin = get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # TOML has no null: check the other member
        hint = next(a for a in get_args(hint) if a is not type(None))
        origin = get_origin(hint)
    if origin is Literal:
        choices = list(get_args(hint))
        if isinstance(value, str) and value in choices:
            return value
        raise SettingsError(f"{where}: expected one of {choices}, got {value!r}")
    target = str if hint is Path else hint
    if target not in _NAMES:
        return value  # nothing a TOML scalar could be checked against
    if not _is(value, target):
        what = "a path (a string)" if hint is Path else _NAMES[target]
        raise SettingsError(f"{where}: expected {what}, got {value!r} ({_kind(value)})")
    if target in (int, float):
        _range(value, where)
    return float(value) if target is float else value


def _range(value: float, where: str) -> None:
    if not math.isfinite(value):
        raise SettingsError(f"{where}: expected a finite number, got {value!r}")
    if value < 0:
        raise SettingsError(f"{where}: expected a number >= 0, got {value!r}")
    if where.endswith("_s") and value == 0:
        raise SettingsError(f"{where}: expected a duration above 0 seconds, got {value!r}")
    if where.endswith(" port") and value > 65535:
        raise SettingsError(f"{where}: expected a port from 0 to 65535, got {value!r}")


def check_table(
    table: Any, cls: type[Any], where: str, exclude: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """The values of ``table`` for the dataclass ``cls`` (but for its fields in ``exclude``):
    unknown keys and wrong types refused."""
    if not isinstance(table, Mapping):
        raise SettingsError(f"{where}: expected a table, got {table!r} ({_kind(table)})")
    hints = get_type_hints(cls)
    known = [name for name in cls.__dataclass_fields__ if name not in exclude]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise SettingsError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    return {name: coerce(value, hints[name], f"{where} {name}") for name, value in table.items()}


def check_template(message: str, where: str) -> None:
    """A chat template may name only ``{role}`` and ``{content}``."""
    try:
        message.format(role="user", content="hello")
    except (KeyError, IndexError, ValueError) as exc:
        raise SettingsError(
            f"{where}: expected a template using only {{role}} and {{content}}"
            f" (double braces for a literal one), got {message!r}: {exc!r}"
        ) from exc


def check_model_chat(
    tokenizer: str, chat_template: str, parser: str, base: Path, where: str
) -> JinjaChat | None:
    """``[models.NAME]``: the parser is known, and the template (if any) is found and compiles.
    Paths are relative to the config file's directory (``base``)."""
    if parser and parser not in PARSERS:
        raise SettingsError(
            f"{where} tool_call_parser: expected one of {sorted(PARSERS)}, got {parser!r}"
        )
    directory = base / tokenizer if tokenizer else None
    named = str(base / chat_template) if chat_template.endswith(".jinja") else chat_template
    try:
        return load_chat(directory, named)
    except TemplateLoadError as exc:
        raise SettingsError(f"{where}: {exc}") from exc


def routing_options(table: Any, where: str) -> tuple[str, dict[str, Any]]:
    """``[routing]``: the policy's name and its options, checked against its constructor."""
    if not isinstance(table, Mapping):
        raise SettingsError(f"{where}: expected a table, got {table!r} ({_kind(table)})")
    options = dict(table)
    policy = options.pop("policy", DEFAULT_POLICY)
    if not isinstance(policy, str) or policy not in POLICIES:
        raise SettingsError(f"{where} policy: expected one of {sorted(POLICIES)}, got {policy!r}")
    factory = POLICIES[policy]
    accepted = inspect.signature(factory).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise SettingsError(
            f"{where}: unknown key(s) {unknown} for policy {policy!r}; known:"
            f" {['policy', *sorted(accepted)]}"
        )
    init = getattr(factory, "__init__", factory)
    hints = get_type_hints(init)
    checked = {k: coerce(v, hints.get(k, Any), f"{where} {k}") for k, v in options.items()}
    try:
        make_policy(policy, **checked)
    except (TypeError, ValueError) as exc:
        raise SettingsError(f"{where}: {exc}") from exc
    return policy, checked
