"""OpenAI-compatible front: /v1/chat/completions, /v1/completions (streamed or not), /v1/models."""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from router.errors import NotFound
from router.flight import Parsed
from router.http.chat_reply import StreamedCalls, message
from router.http.chat_request import ChatOptions, parse_chat
from router.http.context import (
    SETTINGS,
    authenticate,
    check_prompt,
    episode,
    new_request_id,
    read_json,
)
from router.http.parse import parse_completion
from router.http.respond import Reply, serve_json, serve_stream


def _usage(record: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = int(record["prompt_tokens"]), int(record["completion_tokens"])
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(record["cached_tokens"])},
    }


_PLAIN = ChatOptions(None)


class OpenAIReply(Reply):
    """Bodies and stream events in OpenAI's shapes, chat or plain completion."""

    def __init__(self, parsed: Parsed, chat: bool, options: ChatOptions | None = None) -> None:
        self.parsed = parsed
        self.chat = chat
        rid = parsed.request.request_id
        self.options = options or _PLAIN
        parser = self.options.parser
        self.calls = StreamedCalls(parser, rid) if parser is not None else None
        self.id = ("chatcmpl-" if chat else "cmpl-") + rid
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def _finish_reason(self, record: dict[str, Any]) -> str:
        return "length" if self.ended_for_length(record, self.parsed.request.max_tokens) else "stop"

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.parsed.model}

    def body(
        self, text: str, record: dict[str, Any], outputs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        reason = self._finish_reason(record)
        choice: dict[str, Any] = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            rid = self.parsed.request.request_id
            choice["message"], called = message(text, self.options.parser, rid)
            if called:
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = text
        return {
            **self._base(self.object),
            "choices": [choice],
            "usage": _usage(record),
            "kvledger": record,
        }

    def _chunk(self, choice: dict[str, Any]) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return b"data: " + orjson.dumps({**self._base(obj), "choices": [choice]}) + b"\n\n"

    def piece(self, text: str) -> bytes:
        if self.calls is not None:
            return self._deltas(self.calls.feed(text))
        if self.chat:
            return self._chunk({"index": 0, "delta": {"content": text}, "finish_reason": None})
        return self._chunk({"index": 0, "text": text, "finish_reason": None, "logprobs": None})

    def _deltas(self, deltas: list[dict[str, Any]]) -> bytes:
        return b"".join(
            self._chunk({"index": 0, "delta": d, "finish_reason": None}) for d in deltas
        )

    def closing(self, record: dict[str, Any]) -> bytes:
        reason = self._finish_reason(record)
        rest = b""
        if self.calls is not None:
            rest = self._deltas(self.calls.finish())
            if self.calls.calls:
                reason = "tool_calls"
        end = rest + self._chunk(
            {"index": 0, "delta": {}, "finish_reason": reason}
            if self.chat
            else {"index": 0, "text": "", "finish_reason": reason, "logprobs": None}
        )
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        ledger = {**self._base(obj), "choices": [], "usage": _usage(record), "kvledger": record}
        if not self.options.include_usage:
            del ledger["usage"]
        return end + b"data: " + orjson.dumps(ledger) + b"\n\ndata: [DONE]\n\n"

    def error_event(self, error: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(error) + b"\n\ndata: [DONE]\n\n"


async def serve_completion(
    request: web.BaseRequest, app: web.Application, chat: bool
) -> web.StreamResponse:
    """``/v1/chat/completions`` (``chat``) or ``/v1/completions``."""
    principal = await authenticate(request, app)
    settings = app[SETTINGS]
    body = await read_json(request)
    label, cap = episode(request), settings.limits.max_tokens
    options = None
    if chat:
        parsed, options = parse_chat(body, new_request_id(), settings.chat, cap, label)
    else:
        parsed = parse_completion(body, new_request_id(), cap, label)
    check_prompt(app, parsed, "messages" if chat else "prompt")
    reply = OpenAIReply(parsed, chat, options)
    if parsed.request.stream:
        return await serve_stream(request, app, parsed, principal, reply)
    return await serve_json(app, parsed, principal, reply)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await serve_completion(request, request.app, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await serve_completion(request, request.app, chat=False)


async def models(request: web.Request) -> web.Response:
    await authenticate(request, request.app)
    data = [
        {"id": m, "object": "model", "created": 0, "owned_by": "kvledger"}
        for m in request.app[SETTINGS].models
    ]
    return web.json_response(
        {"object": "list", "data": data}, dumps=lambda o: orjson.dumps(o).decode()
    )


async def model(request: web.Request) -> web.Response:
    await authenticate(request, request.app)
    name = request.match_info["model"]
    if name not in request.app[SETTINGS].models:
        raise NotFound(f"model '{name}' is not served here", param="model")
    body = {"id": name, "object": "model", "created": 0, "owned_by": "kvledger"}
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
        web.get("/v1/models", models),
        web.get("/v1/models/{model}", model),
    ]
