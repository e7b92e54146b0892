"""Answering a proxied request: one JSON body, or a stream whose last event carries the record.

Both paths end the flight exactly once (``ok``, ``error`` or ``cancelled``), so every admitted
request advances its replica's chain and leaves a lineage record, also when the client is gone.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any

import orjson
import structlog
from aiohttp import web

from router.errors import GatewayTimeout, KvlError
from router.flight import Flight, Parsed
from router.http.context import SETTINGS, open_flight
from router.http.errors import error_body
from router.ledger.records import Principal, record_headers

_log = structlog.get_logger("kvledger.respond")


class Reply(ABC):
    """A front's response shapes."""

    # The serving replica's engine max_seq_len (0: not known): an answer whose prompt + output
    # reached it was clamped by the executor (``LlmRequest::validate``), so it ended for length.
    max_seq_len = 0

    def ended_for_length(self, record: dict[str, Any], max_tokens: int) -> bool:
        """The output stopped at ``max_tokens`` or at the engine's sequence limit."""
        completion = int(record["completion_tokens"])
        if completion >= max_tokens:
            return True
        limit = self.max_seq_len
        return limit > 0 and int(record["prompt_tokens"]) + completion >= limit

    @abstractmethod
    def body(
        self, text: str, record: dict[str, Any], outputs: dict[str, Any] | None = None
    ) -> dict[str, Any]: ...

    @abstractmethod
    def piece(self, text: str) -> bytes: ...

    @abstractmethod
    def closing(self, record: dict[str, Any]) -> bytes: ...

    @abstractmethod
    def error_event(self, error: dict[str, Any]) -> bytes: ...

    def passed(self, outputs: dict[str, Any]) -> bytes:
        """One engine response's outputs, for a request that passes Triton's protocol through
        (the Triton fronts); a front that merges responses sends their text."""
        text = outputs.get("text_output")
        return self.piece(str(text)) if text else b""

    def prefix(self) -> bytes:
        """Bytes sent before the first piece (the Triton front's echoed prompt)."""
        return b""


def _too_long(app: web.Application) -> GatewayTimeout:
    limit = app[SETTINGS].limits.request_timeout_s
    return GatewayTimeout(f"the request took longer than request_timeout_s ({limit:g} s)")


async def _end(flight: Flight, status: str) -> dict[str, Any]:
    # A cancelled handler must still release the replica and write the record: shielded,
    # unless nothing can be lost (a production flight that ended well: its stream has ended, so
    # closing it waits on nothing, and the ledger keeps a step it was cancelled in), which
    # spares a task per request.
    if status == "ok" and flight.dispatcher.cancel_safe:
        return await flight.finish(status)
    return await asyncio.shield(flight.finish(status))


async def _drain(flight: Flight, timeout_s: float) -> None:
    if flight.first.final:  # the whole answer came at once: nothing to wait for, or time
        await flight.collect()
        return
    async with asyncio.timeout(timeout_s):
        await flight.collect()


async def serve_json(
    app: web.Application, parsed: Parsed, principal: Principal, reply: Reply
) -> web.Response:
    settings = app[SETTINGS]
    flight = await open_flight(app, parsed, principal)
    reply.max_seq_len = flight.replica.engine_max_seq_len
    try:
        await _drain(flight, settings.limits.request_timeout_s)
    except (asyncio.CancelledError, ConnectionResetError):
        await _end(flight, "cancelled")
        raise
    except (KvlError, TimeoutError) as exc:
        await _end(flight, "error")
        if isinstance(exc, TimeoutError):
            raise _too_long(app) from exc
        raise
    except Exception:
        await _end(flight, "error")  # whatever escaped, the flight ends and leaves its record
        raise
    record = await _end(flight, "ok")
    return web.Response(
        body=orjson.dumps(reply.body(flight.text, record, flight.outputs)),
        content_type="application/json",
        headers=record_headers(record),
    )


async def serve_stream(
    request: web.BaseRequest,
    app: web.Application,
    parsed: Parsed,
    principal: Principal,
    reply: Reply,
) -> web.StreamResponse:
    settings = app[SETTINGS]
    flight = await open_flight(app, parsed, principal)
    reply.max_seq_len = flight.replica.engine_max_seq_len
    response = web.StreamResponse()
    try:
        response.headers.update(flight.admission.headers(parsed.request.request_id))
        response.content_type = "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
        await response.prepare(request)
        await response.write(reply.prefix())
        async with asyncio.timeout(settings.limits.request_timeout_s):
            async for chunk in flight.chunks():
                if chunk.outputs is not None:
                    await response.write(reply.passed(chunk.outputs))
                elif chunk.text:
                    await response.write(reply.piece(chunk.text))
    except (asyncio.CancelledError, ConnectionResetError) as exc:
        record = await _end(flight, "cancelled")
        _log.info("client_gone", request_id=record["request_id"], replica=flight.replica.id)
        if isinstance(exc, asyncio.CancelledError):
            raise
        return response
    except (KvlError, TimeoutError) as exc:
        await _end(flight, "error")
        error = exc if isinstance(exc, KvlError) else _too_long(app)
        # The status line went out with the first byte: the error is the last event, then the
        # stream ends (a client must never wait on a stream that will send nothing more).
        await response.write(reply.error_event(error_body(error.message, error.type, error.code)))
        await response.write_eof()
        return response
    except Exception:
        # A bug or a garbled replica: the flight still ends, and the client's stream ends with
        # an error event instead of hanging on a response that never completes.
        _log.exception("stream_failed", request_id=parsed.request.request_id)
        await _end(flight, "error")
        if response.prepared:
            body = error_body("internal error; see the proxy's log", "server_error", "internal")
            await response.write(reply.error_event(body))
            await response.write_eof()
            return response
        raise
    record = await _end(flight, "ok")
    await response.write(reply.closing(record))
    await response.write_eof()
    return response
