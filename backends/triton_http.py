"""Triton over HTTP keep-alive: Triton's generate extension, ``POST /v2/models/{model}/generate``
for one answer and ``generate_stream`` for a stream of tokens.

One pool of keep-alive connections per replica (``backends.triton_http_wire``: a minimal
HTTP/1.1 client, as aiohttp's client costs about as much CPU as the rest of the hop), so no
request pays a connection set-up, and a request costs one HTTP/1.1 exchange instead of a gRPC
bidirectional stream (``bench/overhead.py`` measures the difference). Model control,
statistics and metrics stay on :class:`backends.triton.TritonBackend`, which this class extends.

A request asks the replica the way its client asked the proxy. A streamed one goes to
``generate_stream`` with the model's ``stream`` input on, and the events that arrive in one read
become one chunk (a client that reads slower than the engine writes pays the proxy's per-chunk
work once per read, not once per token). A non-streamed one goes to ``generate`` with ``stream``
off: the engine sends one response and Triton one JSON body, as to the floor of the stack (a
bare pass-through). Asking for its tokens instead would cost the replica a response per token
(through a TensorRT-LLM ensemble, a ``postprocessing`` step per token) and the proxy an event
per token, for an answer nobody reads before its end: with the benchmark's trivial model, that
alone cost more latency than the whole budget of the proxy (``bench/overhead.py``).

A client gone: closing the connection is not enough. Triton's HTTP server notices a client
that left only when it next writes to the connection (triton-inference-server/server issue
7077), which for one answer is at its end, and an ensemble is cancelled only between its steps.
So an abandoned request, streamed or not, closes its connection *and* asks the engine model to
stop its request id (``TritonBackend._stop``: TensorRT-LLM's ``stop`` input, which cancels the
request inside the executor); the engine stops within an iteration or two.

How Triton maps the body (``src/http_server.cc``, ``HandleGenerate``): each top-level key that
names a model input becomes that input (a scalar or a 1-D array, reshaped to the input's
dims), any other key a request parameter, ``id`` the request id. Each response becomes a JSON
object of every output by name (one-element tensors as scalars), ``model_name`` and
``model_version``: ``generate``'s body, or one server-sent event ``data: {JSON}`` of
``generate_stream``; an error is ``{"error": "..."}`` (with the HTTP status of its code when it is
the first response, but 200 when the frontend itself refused: ``generate`` on a model that sent
more than one response). The final response ends the body; a final response without outputs (a
decoupled model's flags-only end) adds no event. Statistics are therefore taken from whichever
events carry them (``backends.triton.parse_stats``, shared with the gRPC transport), not only
from the last event.

Errors, into the tree of ``backends.base``: nothing streamed and the replica unreachable (refused,
reset, 503, model not found) is :class:`BackendUnavailable`, so production fails over; the
replica refusing the input (400) :class:`BackendRejected`; anything after acceptance
:class:`BackendFailed`. A connection that failed after the request was written (the replica
may have run it: it read the request, then closed, or the answer broke off) says so with
``written`` (never sent twice: ``backends.triton_http_wire``), so that the dispatcher records
the replica's cache state as unknown before it fails over.
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
from backends.engine_limits import is_prompt_refusal
from backends.triton import TritonBackend, TritonTarget, parse_stats
from backends.triton_http_wire import Connection, Pool, Response, WireError


def request_body(target: TritonTarget, request: GenerationRequest) -> bytes:
    """The generate body: the ensemble's inputs by name, statistics asked for."""
    body: dict[str, Any] = {
        "id": request.request_id,
        "text_input": request.prompt,
        "max_tokens": request.max_tokens,
        "stream": request.stream,
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
    for name, _, value in request.extra:  # passed through, types checked by the front
        body[name] = value
    return orjson.dumps(body)


_has_error = operator.methodcaller("__contains__", "error")


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
        self._generate = f"/v2/models/{target.model}/generate"
        self._generate_stream = f"/v2/models/{target.model}/generate_stream"

    def stream(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        if request.stream:
            return self._tokens(request)
        return self._answer(request)

    async def _post(self, path: str, request: GenerationRequest) -> tuple[Response, Connection]:
        try:
            return await self._pool.post(path, request_body(self.target, request))
        except WireError as exc:
            raise BackendUnavailable(self.replica_id, str(exc), written=exc.written) from exc
        except asyncio.CancelledError:
            # Left before the first response (Triton sends the headers with it, so a long
            # prefill is spent here): the connection is closed; the engine is asked to stop.
            await self._stop(request.request_id)
            raise

    async def _answer(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        """A non-streamed request: ``generate``'s one JSON answer, as one final chunk."""
        response, connection = await self._post(self._generate, request)
        released = failed = False
        try:
            raw = await response.read_all()
            outputs = self._outputs(response.status, raw)
            # Back to the pool before the chunk: the caller may never close this generator.
            self._pool.release(response, connection)
            released = True
            text = outputs.get("text_output")
            passed = outputs if request.raw else None
            yield Chunk(str(text) if text else "", True, parse_stats(outputs), passed)
        except WireError as exc:  # the answer had begun: the request reached the engine
            failed = True
            raise BackendFailed(self.replica_id, str(exc), written=True) from exc
        except BackendError:
            failed = True
            raise
        finally:
            if not released:
                self._pool.release(response, connection)  # closes it: the answer is unread
                if not failed:
                    await self._stop(request.request_id)

    def _outputs(self, status: int, raw: bytes) -> dict[str, Any]:
        """The outputs of ``generate``'s answer; an error answer raises."""
        try:
            outputs = orjson.loads(raw)
        except orjson.JSONDecodeError:
            outputs = None
        if type(outputs) is dict and status == 200 and "error" not in outputs:
            return outputs
        if status == 200 and type(outputs) is dict:
            raise self._classify(str(outputs["error"]), status)
        if status == 200:
            raise BackendFailed(self.replica_id, f"not a JSON object: {raw[:200]!r}")
        raise self._refused(status, raw)

    async def _tokens(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        """A streamed request: ``generate_stream``'s events, those of one read as one chunk."""
        response, connection = await self._post(self._generate_stream, request)
        produced = released = failed = False
        stats: EngineStats | None = None
        try:
            if response.status != 200:
                failed = True
                raise self._refused(response.status, await response.read_all())
            buffer = b""
            while (data := await response.read()) is not None:
                data = buffer + data
                end = data.rfind(b"\n\n")  # the events that arrived whole; the rest waits
                buffer = data[end + 2 :] if end >= 0 else data
                text = ""
                if end >= 0:
                    events = self._events(data[:end], produced)
                    for event in events:  # each event's num_output_tokens adds (parse_stats)
                        stats = parse_stats(event, stats)
                    text = "".join(str(t) for e in events if (t := e.get("text_output")))
                    produced = produced or bool(text)
                    if request.raw:  # one chunk per engine response, its outputs as they came
                        for event in events:
                            yield Chunk(str(event.get("text_output") or ""), False, None, event)
                        text = ""
                if response.complete:  # read() gave the data that ends the body
                    if buffer.strip():
                        raise BackendFailed(self.replica_id, "the stream ended inside an event")
                    # Back to the pool before the last chunk: the caller may never close us.
                    self._pool.release(response, connection)
                    released = True
                    yield Chunk(text, True, stats)  # the last: text, final, stats
                    return
                if text:
                    yield Chunk(text)  # the tokens that arrived together, as one
        except WireError as exc:
            failed = True
            kind = BackendFailed if produced else BackendUnavailable
            raise kind(self.replica_id, str(exc), written=True) from exc
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
        """Nothing was streamed: which error this is, by status and message as gRPC's are.
        The executor's refusal of a prompt over its limit comes as INTERNAL (HTTP 500) from a
        GPU replica; it is the client's mistake, recognised by its message."""
        if is_prompt_refusal(message):
            return BackendRejected(self.replica_id, message)
        lowered = message.lower()
        if status in (404, 502, 503, 504) or "unavailable" in lowered or "not found" in lowered:
            return BackendUnavailable(self.replica_id, message)
        if status >= 500 or "internal" in lowered:
            return BackendFailed(self.replica_id, message)
        return BackendRejected(self.replica_id, message)

    async def close(self) -> None:
        self._pool.close()
        await super().close()
