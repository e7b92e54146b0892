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
    FLEET,
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


def log_probs_of(outputs: dict[str, Any] | None) -> list[float]:
    """``output_log_probs`` ([1, beam, n], beam 0) of one engine response, flat."""
    value: Any = (outputs or {}).get("output_log_probs")
    while isinstance(value, list) and value and isinstance(value[0], list):
        value = value[0]
    return [float(v) for v in value] if isinstance(value, list) else []


def _entries(log_probs: list[float]) -> list[dict[str, Any]]:
    # The ensemble answers detokenized text only, not its tokens: the token's text is unknown
    # here, so ``token`` is empty and ``bytes`` null (docs/chat.md).
    return [{"token": "", "bytes": None, "logprob": v, "top_logprobs": []} for v in log_probs]


class LogProbs:
    """A stream's log probabilities, whichever way the engine sends them: each response with
    the log probabilities of every token so far (``LlmRequest::createResult``), or of its own
    tokens only. A response whose list extends the ones already taken replaces them."""

    def __init__(self) -> None:
        self.taken: list[float] = []
        self.pending: list[float] = []

    def add(self, values: list[float]) -> None:
        taken = self.taken
        if len(values) > len(taken) and values[: len(taken)] == taken:  # every token so far
            new, self.taken = values[len(taken) :], values
        else:  # this response's tokens only
            new, self.taken = values, taken + values
        self.pending += new

    def take(self) -> dict[str, Any] | None:
        pending, self.pending = self.pending, []
        return {"content": _entries(pending)} if pending else None


class OpenAIReply(Reply):
    """Bodies and stream events in OpenAI's shapes, chat or plain completion."""

    def __init__(self, parsed: Parsed, chat: bool, options: ChatOptions | None = None) -> None:
        self.parsed = parsed
        self.chat = chat
        rid = parsed.request.request_id
        self.options = options or _PLAIN
        parser = self.options.parser
        self.calls = StreamedCalls(parser, rid) if parser is not None else None
        self.log_probs = LogProbs() if self.options.logprobs else None
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
        if self.log_probs is not None:
            choice["logprobs"] = {"content": _entries(log_probs_of(outputs))}
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

    def passed(self, outputs: dict[str, Any]) -> bytes:
        """One engine response of a ``logprobs`` chat: its text, and the log probabilities of
        its new tokens on the next chunk sent."""
        if self.log_probs is not None:
            self.log_probs.add(log_probs_of(outputs))
        return super().passed(outputs)

    def piece(self, text: str) -> bytes:
        if self.calls is not None:
            return self._deltas(self.calls.feed(text))
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
            if self.log_probs is not None:
                choice["logprobs"] = self.log_probs.take()
            return self._chunk(choice)
        return self._chunk({"index": 0, "text": text, "finish_reason": None, "logprobs": None})

    def _deltas(self, deltas: list[dict[str, Any]]) -> bytes:
        chunks = []
        for delta in deltas:
            choice = {"index": 0, "delta": delta, "finish_reason": None}
            if self.log_probs is not None:
                choice["logprobs"] = self.log_probs.take()
            chunks.append(self._chunk(choice))
        return b"".join(chunks)

    def closing(self, record: dict[str, Any]) -> bytes:
        reason = self._finish_reason(record)
        rest = b""
        if self.calls is not None:
            rest = self._deltas(self.calls.finish())
            if self.calls.calls:
                reason = "tool_calls"
        last: dict[str, Any] = (
            {"index": 0, "delta": {}, "finish_reason": reason}
            if self.chat
            else {"index": 0, "text": "", "finish_reason": reason, "logprobs": None}
        )
        if self.log_probs is not None:  # what no text chunk carried (tokens held back, or none)
            last["logprobs"] = self.log_probs.take()
        end = rest + self._chunk(last)
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
        declared: dict[str, str] = {}
        if body.get("logprobs") and isinstance(model := body.get("model"), str):
            serving = app[FLEET].serving(model)
            declared = next((r.model_inputs for r in serving if r.model_inputs), {})
        rid = new_request_id()
        parsed, options = parse_chat(body, rid, settings.chat, cap, label, declared)
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
