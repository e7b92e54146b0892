"""Triton over HTTP keep-alive: generations from ``POST /v2/models/{model}/generate_stream``.

One pool of keep-alive connections per replica (``backends.triton_http_wire``: a minimal
HTTP/1.1 client, as aiohttp's client costs about as much CPU as the rest of the hop), so no
request pays a connection set-up, and a request costs one HTTP/1.1 exchange instead of a gRPC
bidirectional stream (``bench/overhead.py`` measures the difference). Model control,
statistics and metrics stay on :class:`backends.triton.TritonBackend`, which this class extends.

Every generation, streamed or not, goes through the streaming endpoint with the model's
``stream`` input on: Triton's HTTP server notices a client that left only when it next writes to
the connection (triton-inference-server/server issue 7077), and a streamed response writes at
every token, so closing the connection stops the request inside Triton within a token or two.
The events that arrive in one read become one chunk: a non-streamed answer, or a stream whose
client reads slower than the engine writes, pays the proxy's per-chunk work once per read, not
once per token.

How Triton maps the body (``src/http_server.cc``, ``HandleGenerate``): each top-level key that
names a model input becomes that input (a scalar or a 1-D array, reshaped to the input's
dims), any other key a request parameter, ``id`` the request id. Each response becomes one
server-sent event ``data: {JSON}``: every output by name (one-element tensors as scalars),
``model_name`` and ``model_version``; an error is ``data: {"error": "..."}`` (with the HTTP
status of its code when it is the first response). The final response ends the chunked body; a
final response without outputs (a decoupled model's flags-only end) adds no event. Statistics
are therefore taken from whichever events carry them (``backends.triton.parse_stats``, shared
with the gRPC transport), not only from the last event.

Errors, into the tree of ``backends.base``: nothing streamed and the replica unreachable (refused,
reset, 503, model not found) is :class:`BackendUnavailable`, so production fails over; the
replica refusing the input (400) :class:`BackendRejected`; anything after acceptance
:class:`BackendFailed`.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import AsyncGenerator
from itertools import repeat
from typing import Any

import aiohttp
import orjson

from backends.base import (
    BackendError,
    BackendFailed,
    BackendRejected,
    BackendUnavailable,
    Chunk,
    EngineStats,
    GenerationRequest,
)
from backends.triton import TritonBackend, TritonTarget, parse_stats
from backends.triton_http_wire import Pool, WireError


def request_body(target: TritonTarget, request: GenerationRequest) -> bytes:
    """The generate body: the ensemble's inputs by name, streaming on, statistics asked for."""
    body: dict[str, Any] = {
        "id": request.request_id,
        "text_input": request.prompt,
        "max_tokens": request.max_tokens,
        "stream": True,
        "exclude_input_in_output": True,
        target.perf_input: True,
    }
    if target.token_counts:
        body["return_num_input_tokens"] = body["return_num_output_tokens"] = True
    for name, value in (
        ("temperature", request.temperature),
        ("top_k", request.top_k),
        ("top_p", request.top_p),
        (target.seed_input, request.seed),
    ):
        if value is not None:
            body[name] = value
    if request.stop:
        body["stop_words"] = list(request.stop)
    if request.bad_words:
        body["bad_words"] = list(request.bad_words)
    return orjson.dumps(body)


_has_error = operator.methodcaller("__contains__", "error")


def _merged(events: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for outputs in events:
        merged.update(outputs)
    return merged


def _error_message(raw: bytes) -> str:
    text = raw.strip()
    if text.startswith(b"data:"):
        text = text[5:].strip()
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        return text[:500].decode(errors="replace") or "no body"
    if isinstance(body, dict) and "error" in body:
        return str(body["error"])
    return text[:500].decode(errors="replace")


class TritonHttpBackend(TritonBackend):
    """The engine client for one Triton replica, generating over HTTP keep-alive."""

    def __init__(self, target: TritonTarget, http_url: str, http: aiohttp.ClientSession) -> None:
        super().__init__(target, http)
        self._pool = Pool(http_url, target.timeout_s)
        self._path = f"/v2/models/{target.model}/generate_stream"

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        body = request_body(self.target, request)
        try:
            response, connection = await self._pool.post(self._path, body)
        except WireError as exc:
            raise BackendUnavailable(self.replica_id, str(exc)) from exc
        except asyncio.CancelledError:
            # Left before the first response (Triton sends the headers with it, so a long
            # prefill is spent here): the connection is closed; the engine is asked to stop.
            await self._stop(request.request_id)
            raise
        produced = released = failed = False
        stats: EngineStats | None = None
        # A non-streamed request needs only the whole answer: woken once it may be complete,
        # or every quarter of the no-progress deadline while it is not (the progress it sees).
        gather_s = None if request.stream else self.target.timeout_s / 4
        try:
            if response.status != 200:
                failed = True
                raise self._refused(response.status, await response.read_all())
            buffer = b""
            pieces: list[str] = []
            while (data := await response.read(gather_s)) is not None:
                data = buffer + data
                end = data.rfind(b"\n\n")  # the events that arrived whole; the rest waits
                if end < 0:
                    buffer = data
                    continue
                buffer = data[end + 2 :]
                events = self._events(data[:end], produced)
                # Per output, the last event that has it counts (as parse_stats over a stream).
                stats = parse_stats(events[0] if len(events) == 1 else _merged(events), stats)
                texts = [str(text) for outputs in events if (text := outputs.get("text_output"))]
                if texts:
                    produced = True
                    pieces += texts
                if pieces and not response.complete:
                    yield Chunk("".join(pieces))  # the tokens that arrived together, as one
                    pieces = []
            if buffer.strip():
                raise BackendFailed(self.replica_id, "the stream ended inside an event")
            # Back to the pool before the last chunk: the caller may never close this generator.
            self._pool.release(response, connection)
            released = True
            yield Chunk("".join(pieces), True, stats)  # the last: text, final, stats
        except WireError as exc:
            failed = True
            kind = BackendFailed if produced else BackendUnavailable
            raise kind(self.replica_id, str(exc)) from exc
        except BackendError:
            failed = True
            raise
        finally:
            # A stream left before its end closes its connection: Triton's next write to it
            # fails and Triton cancels the request, but an ensemble only between its steps, so
            # the engine model is also asked to stop (``TritonBackend._stop``).
            if not released:
                self._pool.release(response, connection)
                if not failed:
                    await self._stop(request.request_id)

    def _events(self, events: bytes, produced: bool) -> list[dict[str, Any]]:
        """The outputs of whole ``data: {...}`` events (separated by blank lines): parsed in one
        call when they are what Triton sends, else one by one, so that an error event raises
        what it raises alone and a garbled one is named (:meth:`_event`)."""
        if events.startswith(b"data:"):
            try:
                parsed = orjson.loads(b"[" + events[5:].replace(b"\n\ndata:", b",") + b"]")
            except orjson.JSONDecodeError:
                parsed = None
            # Every event an object without an error (no generator: map and C functions).
            if type(parsed) is list and all(map(isinstance, parsed, repeat(dict))):
                every: list[dict[str, Any]] = parsed
                if not any(map(_has_error, every)):
                    return every
        found = []
        for event in events.split(b"\n\n"):
            outputs = self._event(event, produced)
            produced = produced or bool(outputs.get("text_output"))  # an error after it failed
            found.append(outputs)
        return found

    def _event(self, event: bytes, produced: bool) -> dict[str, Any]:
        """One ``data: {...}`` event's outputs; an error event raises."""
        payload = event.strip()
        if payload.startswith(b"data:"):
            payload = payload[5:]
        try:
            outputs = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise BackendFailed(self.replica_id, f"not a JSON event: {event[:200]!r}") from exc
        if not isinstance(outputs, dict):
            raise BackendFailed(self.replica_id, f"not a JSON object: {event[:200]!r}")
        if "error" in outputs:
            message = str(outputs["error"])
            if produced:
                raise BackendFailed(self.replica_id, message)
            raise self._classify(message, 200)
        return outputs

    def _refused(self, status: int, raw: bytes) -> BackendError:
        return self._classify(_error_message(raw), status)

    def _classify(self, message: str, status: int) -> BackendError:
        """Nothing was streamed: which error this is, by status and message as gRPC's are."""
        lowered = message.lower()
        if status in (404, 502, 503, 504) or "unavailable" in lowered or "not found" in lowered:
            return BackendUnavailable(self.replica_id, message)
        if status >= 500 or "internal" in lowered:
            return BackendFailed(self.replica_id, message)
        return BackendRejected(self.replica_id, message)

    async def close(self) -> None:
        self._pool.close()
        await super().close()
