"""Triton's generate extension: /v2/models/{model}/generate and /generate_stream, same shapes."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from router.errors import NotFound
from router.flight import Parsed
from router.http.context import (
    SETTINGS,
    authenticate,
    check_prompt,
    episode,
    new_request_id,
    read_json,
)
from router.http.parse import parse_generate
from router.http.respond import Reply, serve_json, serve_stream


class TritonReply(Reply):
    """``{"model_name", "model_version", "text_output"}`` plus ``"kvledger"`` on the last one."""

    def __init__(self, parsed: Parsed) -> None:
        self.parsed = parsed
        self.base = {"model_name": parsed.model, "model_version": "1"}

    def _event(self, payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({**self.base, **payload}) + b"\n\n"

    def body(self, text: str, record: dict[str, Any]) -> dict[str, Any]:
        if self.parsed.echo_prompt:
            text = self.parsed.request.prompt + text
        return {**self.base, "text_output": text, "kvledger": record}

    def prefix(self) -> bytes:
        # Streaming: TensorRT-LLM never echoes the prompt in streamed responses; neither do we.
        return b""

    def piece(self, text: str) -> bytes:
        return self._event({"text_output": text})

    def closing(self, record: dict[str, Any]) -> bytes:
        return self._event({"text_output": "", "kvledger": record})

    def error_event(self, error: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(error) + b"\n\n"


async def serve_generate(
    request: web.BaseRequest, app: web.Application, model: str, stream: bool
) -> web.StreamResponse:
    """``generate`` (``stream`` false) or ``generate_stream`` of ``model``."""
    principal = await authenticate(request, app)
    settings = app[SETTINGS]
    if model not in settings.models:
        raise NotFound(f"model '{model}' is not served here", param="model")
    body = await read_json(request)
    request_id = new_request_id()
    cap = settings.limits.max_tokens
    parsed = parse_generate(body, model, request_id, stream, cap, episode(request))
    check_prompt(app, parsed, "text_input")
    reply = TritonReply(parsed)
    if stream:
        return await serve_stream(request, app, parsed, principal, reply)
    return await serve_json(app, parsed, principal, reply)


async def generate(request: web.Request) -> web.StreamResponse:
    return await serve_generate(request, request.app, request.match_info["model"], False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await serve_generate(request, request.app, request.match_info["model"], True)


def routes() -> list[web.RouteDef]:
    return [
        web.post("/v2/models/{model}/generate", generate),
        web.post("/v2/models/{model}/generate_stream", generate_stream),
        web.post("/v2/models/{model}/versions/{version}/generate", generate),
        web.post("/v2/models/{model}/versions/{version}/generate_stream", generate_stream),
    ]
