"""A model's own chat template: found through its tokenizer files, rendered in a Jinja sandbox.

The engines' OpenAI servers (vLLM, SGLang, trtllm-serve, Triton's OpenAI frontend) render the
Hugging Face chat template that ships with the model's tokenizer; kvledger sits in front of
Triton's ``ensemble``, which takes finished text, so the proxy renders it. Where the template
comes from, in order (``[models.NAME]`` in the config):

- ``chat_template = "FILE.jinja"``: that file (relative to the config file);
- else the tokenizer directory (``tokenizer = DIR``): ``DIR/chat_template.jinja`` if present
  (how recent ``transformers`` saves it), else ``chat_template`` in ``DIR/tokenizer_config.json``,
  a string or a list of ``{"name", "template"}``; from a list, ``chat_template = "NAME"`` picks
  one, else ``tool_use`` when the request has tools and the list has it, else ``default``
  (the choice ``transformers``' ``apply_chat_template`` makes).

Rendering follows the conventions those templates rely on (``transformers``'
``utils/chat_template_utils.py``): jinja2's ``ImmutableSandboxedEnvironment`` with
``trim_blocks`` and ``lstrip_blocks`` and the ``loopcontrols`` extension; the variables
``messages``, ``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``; the functions
``raise_exception(message)`` and ``strftime_now(format)``; ``tojson`` that keeps non-ASCII text
and takes ``indent``. Each distinct template source is compiled once (cached); a request renders
once. Anything the template raises becomes :class:`RenderError` (the front answers 400).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class TemplateLoadError(ValueError):
    """The model's template cannot be found, read or compiled; the message says which."""


class RenderError(ValueError):
    """The template refused the request's messages (``raise_exception``) or failed on them."""


class _Raised(Exception):
    """What ``raise_exception`` throws inside a template."""


def _raise_exception(message: str) -> None:
    raise _Raised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


_ENCODER = json.JSONEncoder(ensure_ascii=False)  # the usual case, made once


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Not jinja2's own tojson: that one escapes HTML characters, which no model was trained on.
    if not ensure_ascii and indent is None and separators is None and not sort_keys:
        return _ENCODER.encode(value)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


_DICT_ATTRIBUTES = frozenset(dir(dict))


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with ``message.role`` on a plain dict looked up as the item
    directly. Jinja first tries the attribute (a dict has none by that name: AttributeError),
    then the item; skipping the failed attempt gives the same value (names of dict's own
    attributes, such as ``items``, still take the usual path) at about half the cost of a
    typical render (bench/chat_render.py)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and attribute not in _DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                pass
        return super().getattr(obj, attribute)


@functools.lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template for ``source``, cached: a model's template compiles once."""
    try:
        return _environment().from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateLoadError(f"line {exc.lineno}: {exc.message}") from exc


@dataclass(frozen=True)
class JinjaChat:
    """A model's chat template(s) and the special tokens its tokenizer names."""

    origin: str  # where it was read from, for messages
    default: str | None  # the template without a name (or named "default")
    tool_use: str | None = None  # the one named "tool_use", preferred when tools are sent
    bos_token: str = ""
    eos_token: str = ""

    def source(self, has_tools: bool) -> str:
        if has_tools and self.tool_use is not None:
            return self.tool_use
        if self.default is None:
            raise RenderError(f"the chat template list in {self.origin} has no 'default' entry")
        return self.default

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text; RenderError naming what the template said when it fails."""
        template = compile_template(self.source(bool(tools)))
        try:
            return template.render(
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **(extra or {}),
            )
        except _Raised as exc:
            raise RenderError(f"the model's chat template refused the messages: {exc}") from exc
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, RecursionError) as exc:
            raise RenderError(
                f"the model's chat template failed on these messages: {type(exc).__name__}: {exc}"
            ) from exc


def _token(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TemplateLoadError(f"cannot read {path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise TemplateLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TemplateLoadError(f"{path} is not a JSON object")
    return data


def _named(value: Any, origin: str) -> dict[str, str]:
    """``chat_template`` from tokenizer_config.json as ``{name: source}`` (a string: default)."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        named = {}
        for entry in value:
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise TemplateLoadError(
                    f"{origin}: chat_template list entries must be {{'name', 'template'}} objects"
                )
            named[entry["name"]] = entry["template"]
        return named
    raise TemplateLoadError(f"{origin}: chat_template must be a string or a list")


def load_chat(tokenizer: Path | None, chat_template: str = "") -> JinjaChat | None:
    """The model's template as the module docstring says, or None when it has none (the
    format-string fallback then renders its chats). TemplateLoadError when what is named is
    missing or does not compile."""
    config: dict[str, Any] = {}
    if tokenizer is not None:
        if not tokenizer.is_dir():
            raise TemplateLoadError(f"tokenizer directory {tokenizer} does not exist")
        if (tokenizer / TOKENIZER_CONFIG).exists():
            config = _read_json(tokenizer / TOKENIZER_CONFIG)
    bos, eos = _token(config.get("bos_token")), _token(config.get("eos_token"))
    if chat_template.endswith(".jinja"):
        path = Path(chat_template)
        try:
            source = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise TemplateLoadError(f"cannot read chat template {path}: {exc.strerror}") from exc
        chat = JinjaChat(str(path), source, None, bos, eos)
    elif tokenizer is not None and (tokenizer / TEMPLATE_FILE).exists() and not chat_template:
        path = tokenizer / TEMPLATE_FILE
        chat = JinjaChat(str(path), path.read_text(encoding="utf-8"), None, bos, eos)
    elif "chat_template" in config:
        origin = str(tokenizer / TOKENIZER_CONFIG) if tokenizer else TOKENIZER_CONFIG
        named = _named(config["chat_template"], origin)
        if chat_template:
            if chat_template not in named:
                raise TemplateLoadError(
                    f"{origin} has no chat template named {chat_template!r}; it has {sorted(named)}"
                )
            chat = JinjaChat(origin, named[chat_template], None, bos, eos)
        else:
            chat = JinjaChat(origin, named.get("default"), named.get("tool_use"), bos, eos)
    elif chat_template:
        raise TemplateLoadError(
            f"chat_template {chat_template!r} names no .jinja file, and the tokenizer"
            f" ({tokenizer or 'not configured'}) has no named templates"
        )
    else:
        return None
    for found in (chat.default, chat.tool_use):
        if found is not None:
            try:
                compile_template(found)
            except TemplateLoadError as exc:
                raise TemplateLoadError(f"chat template in {chat.origin}: {exc}") from exc
    return chat
