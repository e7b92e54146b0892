"""The replica wire (backends/triton_http_wire.py) against raw servers that misbehave in one way
each: a request is never sent twice, an interim answer never desynchronises the pool, every
framing is read as RFC 9112 says or refused cleanly (never an empty success), memory stays
bounded for a slow reader, and (hypothesis) an answer split anywhere reads the same."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.base import BackendError, BackendUnavailable, Chunk, GenerationRequest
from backends.triton import TritonTarget
from backends.triton_http import TritonHttpBackend
from backends.triton_http_wire import HIGH_WATER, Connection, Pool, Response

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Raw:
    """A raw server on a free port: counts connections and the request ids it received."""

    def __init__(
        self,
        handle: Callable[[Raw, asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]],
    ) -> None:
        self.handle = handle
        self.connections = 0
        self.ids: list[str] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Raw:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            await self.handle(self, reader, writer, number)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def request(self, reader: asyncio.StreamReader) -> dict[str, Any]:
        """Read one request (head and sized body); note its id."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body: dict[str, Any] = orjson.loads(await reader.readexactly(length))
        self.ids.append(str(body["id"]))
        return body


@contextlib.asynccontextmanager
async def backend_for(raw: Raw) -> AsyncIterator[TritonHttpBackend]:
    target = TritonTarget("raw", "127.0.0.1:1", "http://127.0.0.1:1/metrics", timeout_s=5)
    async with aiohttp.ClientSession() as session:
        backend = TritonHttpBackend(target, f"http://127.0.0.1:{raw.port}", session)
        try:
            yield backend
        finally:
            await backend.close()


async def collect(backend: TritonHttpBackend, request: GenerationRequest) -> list[Chunk]:
    chunks = []
    async for chunk in backend.stream(request):
        chunks.append(chunk)
        if chunk.final:
            break
    return chunks


def answer(text: str) -> bytes:
    body = orjson.dumps({"text_output": text, "num_output_tokens": 1})
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


# A request is written once ---------------------------------------------------------------


@pytest.mark.parametrize("idle", [0, 1, 3])
async def test_a_request_read_then_dropped_reaches_the_replica_once_whatever_is_idle(
    idle: int,
) -> None:
    """A replica that reads a request and closes the connection may have run it: the client
    never writes it again (not on another idle connection, not on a new one), and says the
    request was written, so the dispatcher records the replica's state as unknown."""
    drop = asyncio.Event()
    arrived: list[asyncio.Event] = []
    all_in = asyncio.Event()

    async def handle(raw: Raw, reader: asyncio.StreamReader, writer: Any, _: int) -> None:
        while True:
            body = await raw.request(reader)
            if drop.is_set():
                return  # read, then the connection closes: no answer
            arrived.append(asyncio.Event())
            if len(arrived) >= idle:
                all_in.set()
            await all_in.wait()  # the warm-up's requests overlap: one connection each
            writer.write(answer(str(body["id"])))
            await writer.drain()

    async with Raw(handle) as raw, backend_for(raw) as backend:
        warm = [GenerationRequest(f"warm{i}", "x", max_tokens=1) for i in range(idle)]
        got = await asyncio.gather(*(collect(backend, r) for r in warm))
        assert [c[-1].text for c in got] == [r.request_id for r in warm]
        assert backend._pool.idle == idle
        drop.set()
        with pytest.raises(BackendUnavailable) as caught:
            await collect(backend, GenerationRequest("once", "x", max_tokens=1))
        assert caught.value.written
        await asyncio.sleep(0.05)  # a second copy would have been written by now
    assert raw.ids.count("once") == 1


async def test_a_connection_closed_while_idle_is_swapped_before_the_write() -> None:
    """Known dead before the write (the close already arrived): the request goes out on a new
    connection, once, and succeeds."""

    async def handle(raw: Raw, reader: asyncio.StreamReader, writer: Any, _: int) -> None:
        body = await raw.request(reader)
        writer.write(answer(str(body["id"])))
        await writer.drain()  # then closes: the client's idle connection is dead

    async with Raw(handle) as raw, backend_for(raw) as backend:
        for i in range(3):
            chunks = await collect(backend, GenerationRequest(f"r{i}", "x", max_tokens=1))
            assert chunks[-1].text == f"r{i}"
            await asyncio.sleep(0.01)  # the close arrives
    assert raw.ids == ["r0", "r1", "r2"] and raw.connections == 3


# Interim answers and framing -----------------------------------------------------------------


@pytest.mark.parametrize(
    "interim",
    [
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n",
    ],
)
async def test_interim_answers_are_skipped_and_each_caller_gets_its_own(interim: bytes) -> None:
    """1xx then 200 (RFC 9110, 15.2): the caller gets the 200, and the next caller on the same
    connection gets its own answer, not the previous one's."""

    async def handle(raw: Raw, reader: asyncio.StreamReader, writer: Any, _: int) -> None:
        while True:
            body = await raw.request(reader)
            writer.write(interim)
            await writer.drain()
            await asyncio.sleep(0.005)  # a separate read
            writer.write(answer(str(body["id"])))
            await writer.drain()

    async with Raw(handle) as raw, backend_for(raw) as backend:
        for i in range(4):
            chunks = await collect(backend, GenerationRequest(f"c{i}", "x", max_tokens=1))
            assert chunks[-1].text == f"c{i}"
    assert raw.connections == 1


_JSON = b'{"text_output":"whole","num_output_tokens":1}'
_EVENTS = b'data: {"text_output":"a"}\n\ndata: {"text_output":"b","num_output_tokens":2}\n\n'


@pytest.mark.parametrize(
    ("head", "stream"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", True),
        (b"HTTP/1.0 200 OK\r\n\r\n", False),
        (b"HTTP/1.1 200 OK\r\n\r\n", True),  # no length, no chunks: the close ends it
    ],
)
async def test_a_body_ended_by_the_close_is_read_whole(head: bytes, stream: bool) -> None:
    """A body delimited by the connection closing (RFC 9112, 6.3) is the whole body, not an
    empty one, and that connection is never reused."""
    body = _EVENTS if stream else _JSON

    async def handle(raw: Raw, reader: asyncio.StreamReader, writer: Any, _: int) -> None:
        await raw.request(reader)
        writer.write(head + body[:10])
        await writer.drain()
        await asyncio.sleep(0.005)
        writer.write(body[10:])
        await writer.drain()

    async with Raw(handle) as raw, backend_for(raw) as backend:
        for i in range(2):
            request = GenerationRequest(f"b{i}", "x", max_tokens=2, stream=stream)
            chunks = await collect(backend, request)
            assert "".join(c.text for c in chunks) == ("ab" if stream else "whole")
            assert chunks[-1].final and chunks[-1].stats is not None
    assert raw.connections == 2


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: close, te\r\nContent-Length: %d\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nConnection: TE, Close\r\nContent-Length: %d\r\n\r\n",
    ],
)
async def test_a_connection_the_replica_closes_is_not_reused(head: bytes) -> None:
    async def handle(raw: Raw, reader: asyncio.StreamReader, writer: Any, _: int) -> None:
        while True:
            await raw.request(reader)
            writer.write(head % len(_JSON) + _JSON)
            await writer.drain()

    async with Raw(handle) as raw, backend_for(raw) as backend:
        for i in range(2):
            chunks = await collect(backend, GenerationRequest(f"k{i}", "x", max_tokens=1))
            assert chunks[-1].text == "whole"
    assert raw.connections == 2


def _chunked_head(extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n" + extra + b"\r\n"


_MALFORMED = {
    "length with junk": b"HTTP/1.1 200 OK\r\nContent-Length: 12abc\r\n\r\n" + _JSON,
    "two lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 46\r\nContent-Length: 47\r\n\r\n" + _JSON,
    "short body": b"HTTP/1.1 200 OK\r\nContent-Length: 90\r\n\r\n" + _JSON,
    "identity, chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: identity, chunked\r\n\r\n"
    + b"2e\r\n"
    + _JSON
    + b"\r\n0\r\n\r\n",
    "gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n" + _JSON,
    "chunk size +5": _chunked_head() + b"+5\r\nhello\r\n0\r\n\r\n",
    "chunk size 5_0": _chunked_head() + b"5_0\r\nhello\r\n0\r\n\r\n",
    "chunk size -1": _chunked_head() + b"-1\r\nhello\r\n0\r\n\r\n",
    "no CRLF after chunk": _chunked_head() + b"2e\r\n" + _JSON + b"0\r\n\r\n",
    "chunks cut off": _chunked_head() + b"2e\r\n" + _JSON + b"\r\n",
    "folded header": b"HTTP/1.1 200 OK\r\nX-A: 1\r\n  folded\r\nContent-Length: 46\r\n\r\n" + _JSON,
    "not HTTP": b"SMTP 220 hello\r\n\r\n",
    "101": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n" + _JSON,
    "huge head": b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reply", list(_MALFORMED.values()), ids=list(_MALFORMED))
async def test_a_malformed_answer_is_a_clean_backend_error(reply: bytes, stream: bool) -> None:
    """Bad lengths, bad chunk sizes, a missing CRLF, folded headers, an unsupported transfer
    coding, a head too long: a BackendError, never an ok answer with short or empty output."""

    async def handle(raw: Raw, reader: asyncio.StreamReader, writer: Any, _: int) -> None:
        await raw.request(reader)
        writer.write(reply)
        await writer.drain()

    async with Raw(handle) as raw, backend_for(raw) as backend:
        request = GenerationRequest("m", "x", max_tokens=1, stream=stream)
        with pytest.raises(BackendError) as caught:
            await collect(backend, request)
        assert caught.value.written  # it reached the replica: its state is now unknown
        assert raw.ids == ["m"]


async def test_bytes_after_the_answer_close_the_connection() -> None:
    """A replica that sends more than the answer (a second response nobody asked for): the
    caller gets its answer, the connection is not reused, the next caller its own answer."""

    async def handle(raw: Raw, reader: asyncio.StreamReader, writer: Any, _: int) -> None:
        body = await raw.request(reader)
        writer.write(answer(str(body["id"])) + answer("stray"))
        await writer.drain()
        await reader.read()  # hold the connection open until the client closes it

    async with Raw(handle) as raw, backend_for(raw) as backend:
        for i in range(2):
            chunks = await collect(backend, GenerationRequest(f"s{i}", "x", max_tokens=1))
            assert chunks[-1].text == f"s{i}"
    assert raw.connections == 2


# Backpressure and bounds ---------------------------------------------------------------


async def test_a_slow_reader_keeps_memory_bounded() -> None:
    """A replica that writes faster than its caller reads: the connection stops reading above
    its high-water mark (the replica's writes block), and resumes as the caller reads."""
    piece = b"x" * 65536
    pieces = 1024  # 64 MiB in all
    sent = 0

    async def handle(raw: Raw, reader: asyncio.StreamReader, writer: Any, _: int) -> None:
        nonlocal sent
        await raw.request(reader)
        writer.write(_chunked_head())
        for _ in range(pieces):
            writer.write(b"10000\r\n" + piece + b"\r\n")
            await writer.drain()
            sent += 1
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async with Raw(handle) as raw:
        pool = Pool(f"http://127.0.0.1:{raw.port}", 5)
        response, connection = await pool.post("/x", b'{"id":"slow"}')
        first = await response.read()
        assert first
        for _ in range(500):  # until the connection paused (the replica then blocks)
            if connection._paused:
                break
            await asyncio.sleep(0.01)
        assert connection._paused
        await asyncio.sleep(0.1)
        assert len(connection.body) <= HIGH_WATER + 256 * 1024
        assert sent < pieces  # the replica is held back, not buffered here
        total = len(first)
        while (data := await response.read()) is not None:
            total += len(data)
        assert total == len(piece) * pieces
        pool.release(response, connection)
        pool.close()


async def test_the_pool_is_bounded_and_idle_connections_expire() -> None:
    """At most ``max_open`` connections (a caller beyond waits for one); an idle connection
    older than the expiry is closed, not reused."""
    release = asyncio.Event()

    async def handle(raw: Raw, reader: asyncio.StreamReader, writer: Any, _: int) -> None:
        while True:
            body = await raw.request(reader)
            await release.wait()
            writer.write(answer(str(body["id"])))
            await writer.drain()

    async with Raw(handle) as raw:
        pool = Pool(f"http://127.0.0.1:{raw.port}", 5, max_open=2, idle_expiry_s=3600)

        async def one(i: int) -> bytes:
            response, connection = await pool.post("/x", b'{"id":"%d"}' % i)
            data = await response.read_all()
            pool.release(response, connection)
            return data

        calls = [asyncio.ensure_future(one(i)) for i in range(3)]
        for _ in range(500):
            if len(raw.ids) == 2:
                break
            await asyncio.sleep(0.01)
        assert raw.connections == 2 and pool.open == 2  # the third waits for a place
        release.set()
        await asyncio.gather(*calls)
        assert raw.connections == 2 and sorted(raw.ids) == ["0", "1", "2"]
        pool.idle_expiry_s = 0.0
        await asyncio.sleep(0.01)
        await one(3)
        assert raw.connections == 3  # the idle ones had expired
        pool.close()
        assert pool.open == 0


# Split anywhere (hypothesis) -------------------------------------------------------------


class _Transport:
    """A transport for the protocol alone (pure parsing: no socket)."""

    def __init__(self) -> None:
        self.paused = False
        self.closed = False

    def get_extra_info(self, name: str, default: object = None) -> object:
        return default

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True

    def write(self, data: bytes) -> None:
        pass


@st.composite
def responses(draw: st.DrawFn) -> tuple[bytes, bytes, bool]:
    """A response as bytes, its body, and whether its framing allows reuse."""
    body = draw(st.binary(max_size=300))
    interim = draw(st.sampled_from([b"", b"HTTP/1.1 103 Early Hints\r\nLink: <x>\r\n\r\n"]))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    if framing == "length":
        wire = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        return interim + wire, body, True
    if framing == "close":
        return interim + b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + body, body, False
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
    parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    out = b""
    for part in parts:
        if not part:
            continue
        ext = draw(st.sampled_from([b"", b";a=b", b';name="q v"', b";x"]))
        out += b"%x" % len(part) + ext + b"\r\n" + part + b"\r\n"
    trailer = draw(st.sampled_from([b"", b"X-Trailer: 1\r\n", b"A: b\r\nC: d\r\n"]))
    out += b"0\r\n" + trailer + b"\r\n"
    return interim + _chunked_head() + out, body, True


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(responses(), st.lists(st.integers(min_value=0, max_value=2000), max_size=8))
def test_a_response_split_anywhere_reads_the_same(
    response: tuple[bytes, bytes, bool], splits: list[int]
) -> None:
    raw, body, reusable = response
    points = sorted({min(s, len(raw)) for s in splits})
    pieces = [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]

    async def go() -> None:
        c = Connection()
        c.connection_made(_Transport())  # type: ignore[arg-type]
        c.begin()
        got = b""
        for piece in pieces:
            if piece:
                c.data_received(piece)
            assert c.error is None, c.error
            if c.head_done:
                got += c.take()
        if not reusable:
            c.eof_received()
        assert c.error is None, c.error
        assert c.head_done and c.status == 200 and c.done
        got += c.take()
        assert got == body
        assert c.reusable() == reusable

    asyncio.run(go())


async def test_response_read_reports_the_end_with_its_last_data() -> None:
    """``read`` gives the data that ends the body with ``complete`` set, then None."""
    c = Connection()
    c.connection_made(_Transport())  # type: ignore[arg-type]
    c.begin()
    c.data_received(_chunked_head() + b"3\r\nabc\r\n")
    response = Response(c)
    assert await response.read() == b"abc" and not response.complete
    c.data_received(b"2\r\nde\r\n0\r\n\r\n")
    assert await response.read() == b"de" and response.complete
    assert await response.read() is None
    assert c.reusable()
    c.data_received(b"HTTP/1.1 200 OK\r\n\r\n")  # nobody asked: out of step
    assert not c.reusable() and c.dead()
