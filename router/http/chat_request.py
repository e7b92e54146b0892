"""``/v1/chat/completions`` bodies → one rendered prompt and the engine request, or a 400.

Messages are taken as agent harnesses send them: ``system``, ``developer``, ``user`` (a string
or text parts), ``assistant`` (``content`` null with ``tool_calls``), ``tool`` (with
``tool_call_id``). They are rendered once, with the model's own chat template when it has one
(router.chat.templates), else with the format-string fallback of ``[chat_templates.MODEL]``.

A message that cannot be rendered is a 400 whose ``param`` is ``messages`` and whose message
names the message and its field (``'messages[2].tool_call_id' is required ...``).

Every field of the body is either honoured or refused with a 400 naming it: ``CHAT_FIELDS``
lists the accepted ones; a field accepted only at its default value (``n``, ``top_logprobs``,
``parallel_tool_calls``, the penalties, ...) is refused at any other value, since nothing
here could honour it (docs/chat.md says why, field by field).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from router.chat.parsers import ToolParser
from router.chat.templates import RenderError
from router.errors import BadRequest, Unavailable
from router.flight import Parsed
from router.http.parse import _common, _model
from router.settings import ModelChat

_MESSAGE_FIELDS: dict[str, frozenset[str]] = {
    "system": frozenset(("role", "content", "name")),
    "developer": frozenset(("role", "content", "name")),
    "user": frozenset(("role", "content", "name")),
    "assistant": frozenset(("role", "content", "name", "tool_calls")),
    "tool": frozenset(("role", "content", "tool_call_id", "name")),
}
# Accepted only at these values (absent and null mean the same): any other value is refused.
DEFAULT_ONLY: dict[str, object] = {
    "n": 1,
    "top_logprobs": 0,
    "parallel_tool_calls": True,
    "frequency_penalty": 0,
    "presence_penalty": 0,
}
_NO_TOP_LOG_PROBS = (
    "TensorRT-LLM returns the log probability of the sampled token only (output_log_probs),"
    " not the most likely alternatives (docs/chat.md)"
)
_WHY = {
    "n": "only n=1 is served (one choice per request)",
    "top_logprobs": _NO_TOP_LOG_PROBS,
    "parallel_tool_calls": "parallel_tool_calls false cannot be enforced on the model's output",
    "frequency_penalty": "penalties are not passed to the engine",
    "presence_penalty": "penalties are not passed to the engine",
}
CHAT_FIELDS = frozenset(
    (
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "response_format",
        "logprobs",
    )
) | frozenset(DEFAULT_ONLY)


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """What shapes the answer beyond the engine request."""

    parser: ToolParser | None  # parse the output for tool calls (tools sent, not "none")
    include_usage: bool = True  # stream_options.include_usage
    logprobs: bool = False  # answer with the engine's output_log_probs


def _logprobs(body: Mapping[str, Any], declared: Mapping[str, str], model: str) -> bool:
    """``logprobs: true`` asks TensorRT-LLM's ``return_log_probs`` input of the served model
    (its ``output_log_probs`` output answers): only where the model declares that input."""
    value = body.get("logprobs")
    if value is None or value is False:
        return False
    if value is not True:
        raise BadRequest("'logprobs' must be true or false", param="logprobs")
    if not declared:
        raise Unavailable(
            f"the inputs of model '{model}' are not known yet; retry", headers={"Retry-After": "1"}
        )
    if declared.get("return_log_probs") != "TYPE_BOOL":
        raise BadRequest(
            f"'logprobs': model '{model}' declares no return_log_probs input (TensorRT-LLM's"
            " ensemble does from its config.pbtxt; docs/chat.md), so no log probabilities"
            " could be returned",
            param="logprobs",
        )
    return True


def _fields(body: Mapping[str, Any]) -> None:
    for name, value in body.items():
        if name not in CHAT_FIELDS and value is not None:  # null: nothing sent, nothing lost
            raise BadRequest(
                f"'{name}' is not supported by this chat front (accepted fields:"
                f" {', '.join(sorted(CHAT_FIELDS))})",
                param=name,
            )
    for name, default in DEFAULT_ONLY.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(default, bool):
            same = value is default
        else:
            number = isinstance(value, int | float) and not isinstance(value, bool)
            same = number and value == default
        if not same:
            raise BadRequest(f"'{name}' = {value!r}: {_WHY[name]}", param=name)


def _text(content: Any, where: str, nullable: bool) -> str | None:
    """A message's content: a string, text parts (joined), or null where allowed."""
    if content is None and nullable:
        return None
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise BadRequest(
                    f"'{where}[{j}]' must be a text part ({{'type': 'text', 'text': ...}});"
                    " the replicas take text only",
                    param="messages",
                )
            text = part.get("text")
            if not isinstance(text, str) or set(part) - {"type", "text"}:
                raise BadRequest(f"'{where}[{j}].text' must be a string", param="messages")
            texts.append(text)
        return "".join(texts)
    allowed = "a string, an array of text parts" + (" or null" if nullable else "")
    raise BadRequest(f"'{where}' must be {allowed}", param="messages")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest(f"'{where}' must be a non-empty array", param="messages")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or set(call) - {"id", "type", "function"}:
            raise BadRequest(
                f"'{at}' must be an object with id, type and function", param="messages"
            )
        function = call.get("function")
        if call.get("type", "function") != "function" or not isinstance(function, dict):
            raise BadRequest(f"'{at}' must be a function call", param="messages")
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"'{at}.function.name' must be a string", param="messages")
        if not isinstance(call.get("id"), str):
            raise BadRequest(f"'{at}.id' must be a string", param="messages")
        try:
            parsed = orjson.loads(arguments) if isinstance(arguments, str) else None
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise BadRequest(
                f"'{at}.function.arguments' must be a JSON object in a string",
                param="messages",
            )
        # Templates read the arguments as a mapping (they `tojson` them), as vLLM and
        # transformers hand them over.
        calls.append(
            {"id": call["id"], "type": "function", "function": {"name": name, "arguments": parsed}}
        )
    return calls


def _message(message: Any, i: int) -> dict[str, Any]:
    """One message, checked, in the shape templates read; every check before any use."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise BadRequest(f"'{where}' must be an object with 'role' and 'content'", param="messages")
    role = message.get("role")
    if not isinstance(role, str) or role not in _MESSAGE_FIELDS:
        raise BadRequest(f"'{where}.role' must be one of {list(_MESSAGE_FIELDS)}", param="messages")
    for name, value in message.items():
        # null: as absent (the SDK's own message objects carry refusal: null and the like)
        if name not in _MESSAGE_FIELDS[role] and value is not None:
            raise BadRequest(
                f"'{where}.{name}' is not supported in a {role} message", param="messages"
            )
    out: dict[str, Any] = {"role": role}
    has_calls = bool(message.get("tool_calls"))  # null or [] : no calls
    content = _text(message.get("content"), f"{where}.content", role == "assistant" and has_calls)
    out["content"] = content
    if message.get("name") is not None:
        if not isinstance(message["name"], str):
            raise BadRequest(f"'{where}.name' must be a string", param="messages")
        out["name"] = message["name"]
    if has_calls or message.get("tool_calls") not in (None, []):
        out["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest(
                f"'{where}.tool_call_id' is required in a tool message and must be a string",
                param="messages",
            )
        out["tool_call_id"] = call_id
    return out


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be an array of function tools", param="tools")
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise BadRequest(
                f"'tools[{j}]' must be {{'type': 'function', 'function': {{'name': ...}}}}",
                param="tools",
            )
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequest(
                f"'tools[{j}].function.parameters' must be a JSON schema object",
                param="tools",
            )
    return tools or None


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> str:
    """'auto' or 'none'; 'required' and a named function cannot be forced on the output."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none"):
        return str(choice)
    if choice == "required" or isinstance(choice, dict):
        what = "'required'" if choice == "required" else "a named function"
        raise BadRequest(
            f"'tool_choice' {what}: forcing a tool call needs guided decoding, which the"
            " replicas do not declare; use 'auto' or 'none'",
            param="tool_choice",
        )
    raise BadRequest(
        "'tool_choice' must be 'auto', 'none', 'required' or an object", param="tool_choice"
    )


def _response_format(body: Mapping[str, Any]) -> None:
    value = body.get("response_format")
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return
    if kind in ("json_object", "json_schema"):
        raise BadRequest(
            f"'response_format' {kind}: needs guided decoding, which the replicas do not declare",
            param="response_format",
        )
    raise BadRequest("'response_format' must be {'type': 'text'}", param="response_format")


def _include_usage(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return True
    if not body.get("stream"):
        raise BadRequest("'stream_options' needs 'stream': true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest(
            "'stream_options' takes only {'include_usage': true|false}", param="stream_options"
        )
    include = options.get("include_usage", True)
    if not isinstance(include, bool):
        raise BadRequest(
            "'stream_options.include_usage' must be true or false",
            param="stream_options",
        )
    return include


def render_chat(
    messages: Any, chat: ModelChat, tools: list[dict[str, Any]] | None = None, model: str = ""
) -> str:
    """The prompt text for ``messages`` (and ``tools``): the model's template, else the
    fallback; a 400 naming the message and field for anything it cannot render."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    checked = [_message(m, i) for i, m in enumerate(messages)]
    if chat.jinja is not None:
        for m in checked:  # templates know system, user, assistant and tool
            if m["role"] == "developer":
                m["role"] = "system"
            if m["content"] is None:
                m["content"] = ""
        try:
            return chat.jinja.render(checked, tools)
        except RenderError as exc:
            raise BadRequest(f"model '{model}': {exc}", param="messages") from exc
    return _fallback(checked, chat, tools, model)


def _fallback(
    checked: list[dict[str, Any]], chat: ModelChat, tools: list[dict[str, Any]] | None, model: str
) -> str:
    why = (
        f"model '{model}' has no chat template, so it cannot be told about tools; give it one"
        " ([models.NAME] tokenizer or chat_template, docs/chat.md)"
    )
    if tools:
        raise BadRequest(f"'tools': {why}", param="tools")
    template = chat.fallback
    rendered = []
    for i, m in enumerate(checked):
        if "tool_calls" in m:
            raise BadRequest(f"'messages[{i}].tool_calls': {why}", param="messages")
        rendered.append(template.message.format(role=m["role"], content=m["content"]))
    return "".join(rendered) + template.generation_prompt


def parse_chat(
    body: dict[str, Any],
    request_id: str,
    chat_for: Any,
    cap: int,
    episode: str | None = None,
    declared: Mapping[str, str] | None = None,
) -> tuple[Parsed, ChatOptions]:
    """The engine request for a chat body, and how its answer is shaped."""
    _fields(body)
    model = _model(body)
    chat: ModelChat = chat_for(model)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    _response_format(body)
    include_usage = _include_usage(body)
    # tool_choice "none": the model is not told of the tools, and its output is not parsed.
    shown = tools if choice == "auto" else None
    parser = chat.parser if shown else None
    if shown and parser is None and chat.jinja is not None:
        raise BadRequest(
            f"'tools': model '{model}' has no tool_call_parser, so its tool calls could not be"
            " returned; set [models.NAME] tool_call_parser (docs/chat.md)",
            param="tools",
        )
    prompt = render_chat(body.get("messages"), chat, shown, model)
    logprobs = _logprobs(body, declared or {}, model)
    parsed = Parsed(model, _common(body, request_id, prompt, cap), episode=episode)
    if logprobs:
        parsed.request.extra = (("return_log_probs", "BOOL", True),)
        parsed.request.raw = True  # each engine response's outputs reach the reply
    return parsed, ChatOptions(parser, include_usage, logprobs)
