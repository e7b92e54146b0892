"""Chat answers with tool calls: ``message.tool_calls`` and ``finish_reason: "tool_calls"``, or,
streamed, tool-call deltas in OpenAI's shape (``index``, ``id``, ``type``, ``function.name``,
``function.arguments``), each call in one delta once it is complete."""

from __future__ import annotations

from typing import Any

from router.chat.parsers import Delta, StreamSplitter, ToolCall, ToolParser


def call_id(request_id: str, index: int) -> str:
    """A tool call's id: unique per request and call, and the same on a rerun of the request."""
    return f"call_{request_id}_{index}"


def tool_call(request_id: str, index: int, call: ToolCall) -> dict[str, Any]:
    return {
        "id": call_id(request_id, index),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def message(text: str, parser: ToolParser | None, request_id: str) -> tuple[dict[str, Any], bool]:
    """The assistant message for the output ``text``; True when it holds tool calls."""
    if parser is None:
        return {"role": "assistant", "content": text}, False
    content, calls = parser.parse(text)
    if not calls:
        return {"role": "assistant", "content": text}, False
    return {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [tool_call(request_id, i, c) for i, c in enumerate(calls)],
    }, True


class StreamedCalls:
    """The chat stream's deltas: content as it comes, tool calls when they are known."""

    def __init__(self, parser: ToolParser, request_id: str) -> None:
        self.splitter = StreamSplitter(parser)
        self.request_id = request_id
        self.calls = 0

    def _delta(self, delta: Delta) -> dict[str, Any]:
        if delta.call is None:
            return {"content": delta.content}
        index, self.calls = self.calls, self.calls + 1
        call = tool_call(self.request_id, index, delta.call)
        return {"tool_calls": [{"index": index, **call}]}

    def feed(self, text: str) -> list[dict[str, Any]]:
        return [self._delta(d) for d in self.splitter.feed(text)]

    def finish(self) -> list[dict[str, Any]]:
        return [self._delta(d) for d in self.splitter.finish()]
