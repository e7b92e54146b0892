"""The replica hop over HTTP keep-alive (backends/triton_http.py) against real tritonserver
stand-ins: same output and statistics as gRPC, errors in the backend tree, and a client gone
mid-generation stops the replica, streamed or not; and against raw servers: framing, errors."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace

import aiohttp
import orjson
import pytest
import urllib3

from backends.base import (
    BackendFailed,
    BackendRejected,
    BackendUnavailable,
    Chunk,
    EngineStats,
    GenerationRequest,
)
from backends.sim.launcher import Replica, config_snippet, free_ports
from backends.triton import TritonBackend, TritonTarget, parse_stats
from backends.triton_http import TritonHttpBackend
from router.cli.local import ProxyProcess, create_key
from tests.ledger_view import LedgerView
from tests.servers import RedisServer
from tests.triton_helpers import metric, metrics

HTTP = urllib3.PoolManager()
ITERATIONS = ("nv_trt_llm_general_metrics", {"general_type": "iteration_counter"})


def target(replica: Replica, model: str = "ensemble") -> TritonTarget:
    return TritonTarget(replica.id, replica.grpc_url, replica.metrics_url, model=model)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def collect(backend: TritonBackend, request: GenerationRequest) -> list[Chunk]:
    chunks = []
    async for chunk in backend.stream(request):
        chunks.append(chunk)
        if chunk.final:
            break
    return chunks


def counts(stats: EngineStats | None) -> EngineStats | None:
    """The statistics without their timestamps (two runs never share those)."""
    if stats is None:
        return None
    return replace(stats, arrival_ns=0, first_token_ns=0, last_token_ns=0)


@pytest.mark.parametrize("stream", [False, True])
async def test_http_and_grpc_give_the_same_text_and_statistics(
    replicas: dict[str, Replica], session: aiohttp.ClientSession, stream: bool
) -> None:
    """A generation over HTTP has the text and statistics the same request has over gRPC."""
    r3 = replicas["r3"]  # reuse off: the statistics do not depend on what ran before
    grpc_backend = TritonBackend(target(r3), session)
    http_backend = TritonHttpBackend(target(r3), r3.http_url, session)
    try:
        prompt = "transport parity"  # reuse off, greedy: the same tokens every time
        request = GenerationRequest(uuid.uuid4().hex, prompt, max_tokens=12, stream=stream)
        over_grpc = await collect(grpc_backend, request)
        over_http = await collect(http_backend, request)
    finally:
        await grpc_backend.close()
        await http_backend.close()
    assert "".join(c.text for c in over_http) == "".join(c.text for c in over_grpc)
    assert over_http[-1].final and over_grpc[-1].final
    assert counts(over_http[-1].stats) == counts(over_grpc[-1].stats)
    assert over_http[-1].stats is not None and over_http[-1].stats.output_tokens > 0


async def test_replica_refusing_the_input_is_rejected(
    replicas: dict[str, Replica], session: aiohttp.ClientSession
) -> None:
    """Input the replica refuses is BackendRejected (the proxy answers 400), not a failover."""
    backend = TritonHttpBackend(target(replicas["r1"]), replicas["r1"].http_url, session)
    try:
        with pytest.raises(BackendRejected, match="max_tokens|request_output_len"):
            await collect(backend, GenerationRequest("bad", "hello", max_tokens=-1))
    finally:
        await backend.close()


async def test_unreachable_replica_or_model_is_unavailable(
    replicas: dict[str, Replica], session: aiohttp.ClientSession
) -> None:
    """Nothing listening, or no such model: BackendUnavailable, so production fails over."""
    gone = TritonTarget("gone", "127.0.0.1:1", "http://127.0.0.1:1/metrics")
    port, r1 = free_ports(1)[0], replicas["r1"]
    for backend in (
        TritonHttpBackend(gone, f"http://127.0.0.1:{port}", session),
        TritonHttpBackend(target(r1, "no_such_model"), r1.http_url, session),
    ):
        try:
            with pytest.raises(BackendUnavailable):
                await collect(backend, GenerationRequest("x", "hello", max_tokens=2))
        finally:
            await backend.close()


def test_statistics_are_read_from_outputs_by_name() -> None:
    """An event without statistics gives None; one-element arrays and scalars both count."""
    assert parse_stats({"text_output": "x", "model_name": "ensemble"}) is None
    stats = parse_stats({"kv_cache_reused_blocks": [3], "num_output_tokens": 7})
    assert stats is not None and (stats.reused_blocks, stats.output_tokens) == (3, 7)


@pytest.fixture
def http_proxy(replicas: dict[str, Replica]) -> Iterator[tuple[ProxyProcess, str, LedgerView]]:
    """A proxy in front of r3 alone (in the production pool), over HTTP, with its own Redis."""
    redis = RedisServer()
    redis.start()
    snippet = config_snippet([replicas["r3"]])
    snippet = snippet.replace("[[replicas]]\n", '[[replicas]]\ntransport = "http"\n')
    # r3 reuses no block (the same prompt generates the same tokens again): production here.
    snippet = snippet.replace("production = false", "production = true")
    proxy = ProxyProcess(snippet, redis.url, monitor_interval_s=0.5)
    proxy.start()
    try:
        yield proxy, create_key(redis.url, "transport"), LedgerView(redis.url)
    finally:
        proxy.stop()
        redis.close()


def _send(proxy: ProxyProcess, key: str, path: str, body: dict[str, object]) -> socket.socket:
    data = orjson.dumps(body)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=60)
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def _iterations(replica: Replica) -> float:
    family, labels = ITERATIONS
    return metric(metrics(replica), family, **labels)


def _wait_idle(replica: Replica) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if metric(metrics(replica), "nv_trt_llm_request_metrics", request_type="active") == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"replica {replica.id} still busy after 30 s")


def _last_status(ledger: LedgerView, attempts: int) -> str:
    """The status of the newest record once there is one per attempt."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        records = ledger.tail(50, key="transport")
        if len(records) >= attempts:
            return str(records[-1]["status"])
        time.sleep(0.1)
    raise AssertionError(f"{attempts} requests but {len(records)} records")


def test_client_gone_from_a_stream_stops_the_replica_within_a_few_tokens(
    http_proxy: tuple[ProxyProcess, str, LedgerView], replicas: dict[str, Replica]
) -> None:
    """A streamed client leaving after 20 tokens: the replica generated only a few more."""
    proxy, key, ledger = http_proxy
    r3 = replicas["r3"]
    for attempt in range(1, 11):  # the stand-in's random weights end some generations early
        _wait_idle(r3)
        before = _iterations(r3)
        body = {"text_input": "stream " + uuid.uuid4().hex, "max_tokens": 3000}
        with _send(proxy, key, "/v2/models/ensemble/generate_stream", body) as sock:
            received = b""
            while received.count(b"data: ") < 20 and b"kvledger" not in received:
                received += sock.recv(65536)
        _wait_idle(r3)
        if _last_status(ledger, attempt) == "cancelled":
            break
    else:
        raise AssertionError("no prompt streamed 20 tokens in 10 attempts")
    extra = _iterations(r3) - before - received.count(b"data: ")
    assert extra <= 16, f"the replica ran {extra} iterations after the client's last token"


LONG = 64  # tokens a prompt is known to generate; a stopped request runs well under half


def _long_prompt(proxy: ProxyProcess, key: str) -> str:
    """A prompt whose (deterministic, greedy) generation runs LONG tokens without an end token
    (the stand-in's random weights end most generations within about 20)."""
    for _ in range(200):
        prompt = "wait " + uuid.uuid4().hex
        body = {"model": "ensemble", "prompt": prompt, "max_tokens": LONG}
        response = HTTP.request(
            "POST",
            proxy.url + "/v1/completions",
            body=orjson.dumps(body),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        if orjson.loads(response.data)["usage"]["completion_tokens"] == LONG:
            return prompt
    raise AssertionError(f"every prompt met an end token before {LONG} tokens")


def test_client_gone_from_a_non_streamed_request_stops_the_replica(
    http_proxy: tuple[ProxyProcess, str, LedgerView], replicas: dict[str, Replica]
) -> None:
    """A non-streamed client leaving as its request reaches the replica: the replica stops
    within half of the prompt's known length."""
    # Triton's HTTP server notices a client that left only when it writes, which for generate's
    # one answer is at its end: the proxy asks the engine to stop the request (TensorRT-LLM's
    # stop input). Closing the connection alone would let this prompt, known to run LONG, end.
    proxy, key, _ = http_proxy
    r3 = replicas["r3"]  # reuse off: the same prompt generates the same tokens again
    prompt = _long_prompt(proxy, key)
    _wait_idle(r3)
    before = _iterations(r3)
    body = {"model": "ensemble", "prompt": prompt, "max_tokens": 3000}
    with _send(proxy, key, "/v1/completions", body):
        deadline = time.monotonic() + 30
        while metric(metrics(r3), "nv_trt_llm_request_metrics", request_type="active") == 0:
            assert time.monotonic() < deadline, "the request never reached the replica"
            time.sleep(0.005)
    _wait_idle(r3)
    # The engine's iterations are about as fast as this loop's reading of its metrics: what it
    # ran counts from the request's arrival, not from the client's leaving.
    ran = _iterations(r3) - before
    assert ran < LONG // 2, f"the replica ran {ran} of the prompt's {LONG} iterations"


@contextlib.asynccontextmanager
async def served_by(
    answer: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    timeout_s: float = 10.0,
) -> AsyncIterator[TritonHttpBackend]:
    """An HTTP backend whose replica is ``answer``: raw bytes from a server on a free port."""
    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    target = TritonTarget("raw", "127.0.0.1:1", "http://127.0.0.1:1/metrics", timeout_s=timeout_s)
    async with aiohttp.ClientSession() as session, server:
        backend = TritonHttpBackend(target, f"http://127.0.0.1:{port}", session)
        try:
            yield backend
        finally:
            await backend.close()


async def test_a_connection_the_replica_closed_while_idle_is_replaced() -> None:
    """A replica that closed an idle keep-alive connection: the request goes out on a new one."""
    # Also: a non-streamed request asks generate (not generate_stream) for one answer, and its
    # one chunk carries the text and the statistics.
    answer = b'{"text_output":"hi","num_output_tokens":1,"model_name":"ensemble"}'
    reply = _HEAD + _chunked([answer])
    connections, paths = 0, []

    async def one_answer_then_close(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        nonlocal connections
        connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        paths.append(head.split(b" ")[1])
        writer.write(reply)
        await writer.drain()
        writer.close()

    async with served_by(one_answer_then_close) as backend:
        for i in range(3):
            chunks = await collect(backend, GenerationRequest(str(i), "x", max_tokens=1))
            assert [(c.text, c.final) for c in chunks] == [("hi", True)]
            assert chunks[-1].stats is not None and chunks[-1].stats.output_tokens == 1
    assert connections == 3
    assert paths == [b"/v2/models/ensemble/generate"] * 3


def _chunked(pieces: list[bytes], trailer: bytes = b"") -> bytes:
    body = b"".join(f"{len(e):x}\r\n".encode() + e + b"\r\n" for e in pieces)
    return body + b"0\r\n" + trailer + b"\r\n"


_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize("stream", [True, False])
async def test_an_answer_split_across_reads_or_packed_in_one_arrives_whole_and_in_order(
    stream: bool,
) -> None:
    """Chunked framing cut anywhere (a size line, a chunk, its CRLF) or several chunks in one
    write: the text arrives whole and in order, and the statistics from their event. A stream
    hands on what each read brought; a non-streamed answer (generate's one JSON object, which
    Triton may write in pieces) is one chunk."""
    text = "".join(f"t{i} " for i in range(6))
    if stream:
        pieces = [f'data: {{"text_output":"t{i} "}}\n\n'.encode() for i in range(6)]
        pieces.append(b'data: {"text_output":"","num_output_tokens":6}\n\n')
    else:
        whole = f'{{"text_output":"{text}","num_output_tokens":6}}'.encode()
        pieces = [whole[:9], whole[9:30], whole[30:]]
    body = _chunked(pieces, b"X-Trailer: 1\r\n")
    cuts = [3, 4, 5, 40, 41, 42, len(body) - 30, len(body) - 3]  # mid size, data, CRLF, ...
    expected = b"/v2/models/ensemble/generate" + (b"_stream" if stream else b"")

    async def answer_in_pieces(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.split(b" ")[1] == expected
        writer.write(_HEAD)
        start = 0
        for cut in [*cuts, len(body)]:
            writer.write(body[start:cut])
            await writer.drain()
            await asyncio.sleep(0.01)  # separate reads
            start = cut
        writer.close()

    async with served_by(answer_in_pieces) as backend:
        request = GenerationRequest("p", "x", max_tokens=6, stream=stream)
        chunks = await collect(backend, request)
    assert "".join(c.text for c in chunks) == text
    with_text = [c for c in chunks if c.text]
    if stream:
        assert 1 < len(with_text) < 6  # the events of one read became one chunk
    else:
        assert len(chunks) == 1
    assert chunks[-1].final and chunks[-1].stats is not None
    assert chunks[-1].stats.output_tokens == 6


_INPUT_TOO_LONG = b'{"error":"Prompt length (9) exceeds maximum input length (8)."}'
_SEVERAL = b'{"error":"generate expects model to produce exactly 1 response"}'


@pytest.mark.parametrize(
    ("status", "body", "error", "message"),
    [
        # The engine refused the input (Triton maps its error code to the status).
        (400, _INPUT_TOO_LONG, BackendRejected, "exceeds maximum input length"),
        # Triton's frontend refused with 200 (generate on a model that sent several responses).
        (200, _SEVERAL, BackendRejected, "exactly 1 response"),
        # The engine failed inside.
        (500, b'{"error":"Executor failed"}', BackendFailed, "Executor failed"),
        # Not an answer this client understands.
        (200, b"[1, 2]", BackendFailed, "not a JSON object"),
        (200, b"{not json", BackendFailed, "not a JSON object"),
    ],
)
async def test_a_non_streamed_answer_that_is_an_error_raises_what_it_says(
    status: int, body: bytes, error: type[Exception], message: str
) -> None:
    """generate's error answers, whatever status Triton gave them, are told apart: the
    replica refusing the input, failing, or answering what is not an answer."""
    reply = f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    async with served_by(answer) as backend:
        with pytest.raises(error, match=message):
            await collect(backend, GenerationRequest("p", "x", max_tokens=2))


@pytest.mark.parametrize(
    ("events", "error", "message"),
    [
        # Tokens, then the engine failed, all in one read: it failed after producing (no
        # failover: the replica's cache was touched), and its message is kept.
        (
            [b'data: {"text_output":"a"}\n\n', b'data: {"error":"engine fell over"}\n\n'],
            BackendFailed,
            "engine fell over",
        ),
        # A refusal before any token: the replica said no (a client's 4xx).
        ([b'data: {"error":"bad stop words"}\n\n'], BackendRejected, "bad stop words"),
        # A garbled event among good ones is named.
        (
            [b'data: {"text_output":"a"}\n\n', b"data: {not json\n\n"],
            BackendFailed,
            "not a JSON event",
        ),
    ],
)
async def test_an_error_or_garbled_event_among_others_in_one_read_is_told_apart(
    events: list[bytes], error: type[Exception], message: str
) -> None:
    """The events of one read of a stream are parsed together; an error or a garbled event
    among them still raises what it would have raised alone, in order."""
    body = _chunked(events)

    async def at_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(_HEAD + body)
        await writer.drain()
        writer.close()

    async with served_by(at_once) as backend:
        with pytest.raises(error, match=message):
            await collect(backend, GenerationRequest("p", "x", max_tokens=2, stream=True))
