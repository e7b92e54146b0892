"""The proxy's engine clients read a GPU replica's answers as TensorRT-LLM's Triton backend
sends them (issue 23, points 1 and 2): per-response ``num_output_tokens`` summed over a stream
in both stream shapes, and the executor's prompt refusal (INTERNAL, HTTP 500) taken for the
client's mistake by its message. Pure logic over tritonclient's types and raw HTTP bytes."""

from __future__ import annotations

import asyncio

import pytest
from tritonclient.grpc import InferResult
from tritonclient.utils import InferenceServerException

from backends.base import BackendFailed, BackendRejected, GenerationRequest
from backends.triton import TritonBackend, TritonTarget
from tests.test_transport_http import _HEAD, _chunked, collect, served_by
from tests.test_triton_responses import chunks, response

# What a GPU replica's request statistics look like on every response (``llmRequest.cpp``:
# the perf metrics are attached to every result, streamed or not).
PERF = {"kv_cache_reused_blocks": 4, "kv_cache_alloc_total_blocks": 6, "num_input_tokens": 70}
REFUSAL = (
    "Executor failed process requestId 7 due to the following error: Encountered an error in"
    " forwardAsync function: [TensorRT-LLM][ERROR] Assertion failed: Prompt length (70)"
    " exceeds maximum input length (64). Set log level to info and check TRTGptModel logs for"
    " how maximum input length is set"
)


def cxx_stream(tokens: str, extra_final: bool) -> list[InferResult]:
    """A streamed request as the C++ backend answers it: one response per token, each with the
    request's statistics and ``num_output_tokens`` 1; the last token carries the final flag,
    or (through an ensemble, ``ensemble_scheduler.cc``) an empty final response follows."""
    shaped = [response(False, t, **PERF, num_output_tokens=1) for t in tokens]
    if extra_final:
        return [*shaped, response(True)]
    last = response(True, tokens[-1], **PERF, num_output_tokens=1)
    return [*shaped[:-1], last]


@pytest.mark.parametrize("extra_final", [False, True], ids=["final-with-last", "empty-final"])
async def test_a_streams_completion_tokens_are_the_sum_over_its_responses(
    extra_final: bool,
) -> None:
    """Five tokens streamed by a GPU replica count five output tokens, not the last
    response's one; the request's statistics still come through (fails on main: 1)."""
    seen, _ = await chunks(cxx_stream("abcde", extra_final))
    stats = seen[-1].stats
    assert "".join(c.text for c in seen) == "abcde"
    assert stats is not None and stats.output_tokens == 5
    assert (stats.reused_blocks, stats.total_blocks, stats.input_tokens) == (4, 6, 70)


async def test_generate_stream_events_sum_their_output_tokens_over_http() -> None:
    """The same over HTTP's generate_stream (where a flags-only final response adds no event),
    events arriving in one read or apart."""
    stats = ',"kv_cache_reused_blocks":4,"num_input_tokens":70,"num_output_tokens":1'
    events = [f'data: {{"text_output":"{t}"{stats}}}\n\n'.encode() for t in "abcd"]
    body = _chunked([events[0], b"".join(events[1:])])  # Triton adds no event for an empty end

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_HEAD + body)
        await writer.drain()
        writer.close()

    async with served_by(answer) as backend:
        seen = await collect(backend, GenerationRequest("p", "x", max_tokens=4, stream=True))
    assert "".join(c.text for c in seen) == "abcd"
    assert seen[-1].stats is not None and seen[-1].stats.output_tokens == 4


@pytest.mark.parametrize(
    ("status", "error"),
    [(500, BackendRejected), (400, BackendRejected), (500, BackendFailed)],
    ids=["refusal-500", "refusal-400", "other-500"],
)
async def test_the_executors_prompt_refusal_is_the_clients_mistake_whatever_its_status(
    status: int, error: type[Exception]
) -> None:
    """A GPU replica refuses a prompt over its limit with HTTP 500 and the executor's message:
    that is a rejected request (the proxy's 400, no failover, no health penalty), while any
    other 500 stays a replica failure (fails on main: the refusal was BackendFailed)."""
    message = REFUSAL if error is BackendRejected else "Executor failed: out of memory"
    payload = ('{"error":"' + message + '"}').encode()
    reply = f"HTTP/1.1 {status} X\r\nContent-Length: {len(payload)}\r\n\r\n".encode() + payload

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    async with served_by(answer) as backend:
        with pytest.raises(error):
            await collect(backend, GenerationRequest("p", "x" * 70, max_tokens=2))


def test_the_refusal_over_grpc_is_rejected_too() -> None:
    """The same refusal as a gRPC INTERNAL error is BackendRejected; an INTERNAL error
    without it is BackendFailed."""
    backend = TritonBackend.__new__(TritonBackend)
    backend.replica_id = "g"
    refused = InferenceServerException(msg=REFUSAL, status="StatusCode.INTERNAL")
    failed = InferenceServerException(msg="internal: boom", status="StatusCode.INTERNAL")
    assert isinstance(backend._translate(refused, False), BackendRejected)
    assert isinstance(backend._translate(failed, False), BackendFailed)
    assert TritonTarget("g", "x:1", "http://x/metrics").model == "ensemble"
