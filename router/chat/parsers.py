"""Tool calls in a model's output text, per model family: the formats the engines' servers parse.

A parser splits an output into content and tool calls; text that does not parse as tool calls
stays content (nothing is lost or invented). The formats, as the model families write them
(vLLM's ``entrypoints/openai/tool_parsers/`` and SGLang's ``function_call/`` parse the same):

- ``hermes`` (Hermes, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, after optional content;
- ``llama3_json`` (Llama 3.1-3.3): the output is ``<|python_tag|>``-optional JSON objects
  ``{"name": ..., "parameters": {...}}`` separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (older
  tokenizers) or ``name[ARGS]{...}`` / ``name{...}`` per call (v11 and later), after optional
  content;
- ``pythonic`` (Llama 3.2 / 4 in that mode): the output is a Python list of calls,
  ``[get_weather(city="Paris"), ...]``, with literal arguments.

:class:`StreamSplitter` does the same for a stream: content passes through as it comes, except
text that may begin a tool call, which is held back until it is known to be one (then parsed at
the end) or not (then sent as content).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's function.arguments is


class NotToolCalls(ValueError):
    """The text held as tool calls does not parse as them."""


def _call(obj: Any, arguments_key: tuple[str, ...] = ("arguments",)) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise NotToolCalls("a tool call needs a 'name'")
    args: Any = {}
    for key in arguments_key:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError as exc:
            raise NotToolCalls("arguments are not JSON") from exc
    if not isinstance(args, dict):
        raise NotToolCalls("arguments must be an object")
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str, separator: str = "") -> list[Any]:
    """Consecutive JSON values in ``text`` (whitespace, and ``separator``, between them)."""
    values: list[Any] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or (separator and text[at] == separator)):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError as exc:
            raise NotToolCalls(str(exc)) from exc
        values.append(value)


# Each parser: the text from a marker on -> its calls (NotToolCalls when it is not calls).

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _hermes(text: str) -> list[ToolCall]:
    blocks = _HERMES.findall(text)
    return [_call(v) for block in blocks for v in _json_values(block)]


def _llama3_json(text: str) -> list[ToolCall]:
    text = text.strip().removeprefix("<|python_tag|>")
    return [_call(v, ("parameters", "arguments")) for v in _json_values(text, ";")]


_MISTRAL_SEGMENT = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*(\{.*)", re.DOTALL)


def _mistral(text: str) -> list[ToolCall]:
    calls: list[ToolCall] = []
    for segment in text.split("[TOOL_CALLS]")[1:]:
        body = segment.strip()
        if body.startswith("["):  # a JSON array of {"name", "arguments"}
            for value in _json_values(body):
                items = value if isinstance(value, list) else [value]
                calls.extend(_call(item) for item in items)
            continue
        found = _MISTRAL_SEGMENT.fullmatch(body)
        if found is None:
            raise NotToolCalls("expected name[ARGS]{...} after [TOOL_CALLS]")
        args = _json_values(found.group(2))
        if len(args) != 1:
            raise NotToolCalls("expected one JSON object of arguments")
        calls.append(_call({"name": found.group(1), "arguments": args[0]}))
    if not calls:
        raise NotToolCalls("no call after [TOOL_CALLS]")
    return calls


def _pythonic(text: str) -> list[ToolCall]:
    text = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise NotToolCalls(str(exc)) from exc
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        raise NotToolCalls("expected a list of calls")
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            raise NotToolCalls("expected calls with keyword arguments only")
        name = _dotted(node.func)
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
        except ValueError as exc:
            raise NotToolCalls(f"arguments must be literals: {exc}") from exc
        if len(args) != len(node.keywords):
            raise NotToolCalls("**kwargs is not a tool call")
        calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return _dotted(node.value) + "." + node.attr
    raise NotToolCalls("a call's function must be a name")


@dataclass(frozen=True)
class ToolParser:
    """One format: where tool calls may begin (``markers``), and how the rest parses.

    ``anywhere``: a marker may follow content (hermes, mistral); else the whole output is
    calls or none is (llama3_json, pythonic: the output's first non-space text is a marker).
    """

    name: str
    markers: tuple[str, ...]
    anywhere: bool
    calls: Callable[[str], list[ToolCall]]

    def start(self, text: str) -> int | None:
        """Where the tool-call text begins in a complete output, or None."""
        if self.anywhere:
            found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
            return min(found) if found else None
        body = text.lstrip()
        if body.startswith(self.markers):
            return len(text) - len(body)
        return None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, calls)``: content is the text before the calls; all of it when it holds
        no calls, or when the calls do not parse."""
        at = self.start(text)
        if at is None:
            return text, []
        try:
            calls = self.calls(text[at:])
        except (NotToolCalls, RecursionError):
            return text, []
        return (text[:at], calls) if calls else (text, [])


PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", ("<tool_call>",), True, _hermes),
    "llama3_json": ToolParser("llama3_json", ("<|python_tag|>", "{"), False, _llama3_json),
    "mistral": ToolParser("mistral", ("[TOOL_CALLS]",), True, _mistral),
    "pythonic": ToolParser("pythonic", ("[", "<|python_start|>"), False, _pythonic),
}


@dataclass(frozen=True, slots=True)
class Delta:
    """A piece of a streamed answer: ``content`` text, or one complete tool ``call``."""

    content: str = ""
    call: ToolCall | None = None


class StreamSplitter:
    """Feed the output's pieces; get content as soon as it cannot be part of a tool call, and
    the tool calls (or the held text, as content, when it does not parse) at ``finish``."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.pending = ""  # not yet sent: possibly the beginning of a marker
        self.held = False  # a marker was seen: everything from it waits for finish()
        self.decided = parser.anywhere  # start-only formats: known whether output is calls
        self.content_sent = ""

    def feed(self, text: str) -> list[Delta]:
        self.pending += text
        if self.held:
            return []
        if not self.decided:
            return self._decide()
        at = self.parser.start(self.pending)
        if at is not None:
            self.held = True
            return self._send(self.pending[:at], self.pending[at:])
        cut = len(self.pending) - self._marker_prefix(self.pending)
        return self._send(self.pending[:cut], self.pending[cut:])

    def _decide(self) -> list[Delta]:
        body = self.pending.lstrip()
        if not body:
            return []
        if body.startswith(self.parser.markers):
            self.held = self.decided = True
            return []
        if any(m.startswith(body) for m in self.parser.markers):
            return []  # could still become a marker
        self.decided = True
        self.parser = _NEVER  # the output is content: no marker later counts
        return self._send(self.pending, "")

    def _marker_prefix(self, text: str) -> int:
        """Length of the longest end of ``text`` that begins some marker."""
        best = 0
        for marker in self.parser.markers:
            for n in range(min(len(marker) - 1, len(text)), best, -1):
                if text.endswith(marker[:n]):
                    best = n
                    break
        return best

    def _send(self, content: str, rest: str) -> list[Delta]:
        self.pending = rest
        self.content_sent += content
        return [Delta(content)] if content else []

    def finish(self) -> list[Delta]:
        """The rest: the tool calls, or the held text as content."""
        rest, self.pending = self.pending, ""
        if not rest:
            return []
        if self.held:
            content, calls = self.parser.parse(rest)
            if calls:
                out = [Delta(content)] if content else []
                return out + [Delta("", call) for call in calls]
        self.content_sent += rest
        return [Delta(rest)]


_NEVER = ToolParser("none", (), True, lambda text: [])
