"""Triton's generate extension: /v2/models/{model}/generate and /generate_stream, same shapes.

These fronts pass Triton's protocol through: ``generate_stream`` answers one event per engine
response with every output the ensemble returned (``output_log_probs``, ``cum_log_probs``,
``sequence_index``, ...), and ``generate`` one body with all of them; the ledger's additions
(``kvledger``, the statistics kvledger asks for) stay added. A body key that names an input the
served model declares and kvledger does not interpret (``return_log_probs``, ``beam_width``,
...) is passed on after its type is checked against the model's config; a key that is neither
is a 400, as it would be for the model itself.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from router.errors import BadRequest, NotFound, Unavailable
from router.flight import Parsed
from router.http.context import (
    FLEET,
    SETTINGS,
    authenticate,
    check_prompt,
    episode,
    new_request_id,
    read_json,
)
from router.http.parse import parse_generate
from router.http.respond import Reply, serve_json, serve_stream

# Keys kvledger reads itself (router.http.parse.parse_generate), or always sets (the statistics).
INTERPRETED = frozenset(
    (
        *("text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "seed"),
        *("random_seed", "stop_words", "bad_words", "exclude_input_in_output", "id"),
        *("return_perf_metrics", "return_kv_cache_reuse_stats"),
        *("return_num_input_tokens", "return_num_output_tokens"),
    )
)
_INT_RANGES = {
    "TYPE_INT8": (-(1 << 7), (1 << 7) - 1),
    "TYPE_INT16": (-(1 << 15), (1 << 15) - 1),
    "TYPE_INT32": (-(1 << 31), (1 << 31) - 1),
    "TYPE_INT64": (-(1 << 63), (1 << 63) - 1),
    "TYPE_UINT8": (0, (1 << 8) - 1),
    "TYPE_UINT16": (0, (1 << 16) - 1),
    "TYPE_UINT32": (0, (1 << 32) - 1),
    "TYPE_UINT64": (0, (1 << 64) - 1),
}


def _fits(kind: str, item: Any) -> bool:
    if kind == "TYPE_BOOL":
        return isinstance(item, bool)
    if kind == "TYPE_STRING":
        return isinstance(item, str)
    if isinstance(item, bool) or not isinstance(item, int | float):
        return False
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        return isinstance(item, int) and low <= item <= high
    return kind in ("TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_BF16")


def passed_inputs(
    body: dict[str, Any], declared: dict[str, str], model: str
) -> tuple[tuple[str, str, Any], ...]:
    """The body's inputs kvledger passes on untouched: each declared by the model, of its type
    (a scalar or a flat array of it). Anything else is a 400 naming the key."""
    rest = [key for key in body if key not in INTERPRETED]
    if not rest:
        return ()
    if not declared:
        raise Unavailable(
            f"the inputs of model '{model}' are not known yet; retry", headers={"Retry-After": "1"}
        )
    found = []
    for key in rest:
        kind = declared.get(key)
        if kind is None:
            raise BadRequest(f"'{key}' is not an input of model '{model}'", param=key)
        value = body[key]
        items = value if isinstance(value, list) else [value]
        if not items or not all(_fits(kind, item) for item in items):
            wanted = kind.removeprefix("TYPE_").lower()
            raise BadRequest(
                f"'{key}' must be a {wanted} or an array of them ({kind} in the model's config)",
                param=key,
            )
        triton = "BYTES" if kind == "TYPE_STRING" else kind.removeprefix("TYPE_")
        found.append((key, triton, value))
    return tuple(found)


class TritonReply(Reply):
    """Triton's answers as the model gave them, plus ``"kvledger"`` (the body; a last event)."""

    def __init__(self, parsed: Parsed) -> None:
        self.parsed = parsed
        self.base = {"model_name": parsed.model, "model_version": "1"}

    def _event(self, payload: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps({**self.base, **payload}) + b"\n\n"

    def body(
        self, text: str, record: dict[str, Any], outputs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        if self.parsed.echo_prompt:
            text = self.parsed.request.prompt + text
        return {**self.base, **(outputs or {}), "text_output": text, "kvledger": record}

    def passed(self, outputs: dict[str, Any]) -> bytes:
        return self._event(outputs)

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
    declared = next((r.model_inputs for r in app[FLEET].serving(model) if r.model_inputs), {})
    parsed.request.extra = passed_inputs(body, declared, model)
    parsed.request.raw = True
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
