"""A minimal HTTP/1.1 keep-alive client for one replica: POST a body, read the answer as it comes.

Why not aiohttp's client: per request it builds a ClientRequest, a ClientResponse, header
multidicts, timers and trace hooks, which cost about as much CPU as the rest of the hop (the
benchmark in ``bench/overhead.py`` measured it). The replica hop needs one thing: write one
request on an idle connection, then read a status, a few headers and a body. This module does
that on asyncio's Protocol API (no redirects, cookies, proxies, TLS or compression); the bytes
are parsed by llhttp (through ``httptools``, the parser uvicorn uses), not by hand.

Framing (RFC 9112 section 6): a body is delimited by ``Content-Length``, by chunks (the only
transfer coding accepted is ``chunked`` alone), or by the connection closing; interim (1xx)
responses are skipped (RFC 9110 section 15.2) and ``101`` is refused (no upgrade was asked
for). Anything llhttp refuses (a malformed length or chunk size, a missing CRLF, folded header
lines, two lengths) is a :class:`WireError`, never a short or empty body. Headers are limited to
``MAX_HEAD`` bytes, a chunk to ``MAX_CHUNK``, a body read whole to ``MAX_BODY``.

Keep-alive: a connection goes back to the pool only when its response was read to its end, the
server did not ask to close (``Connection: close``, HTTP/1.0 without keep-alive, a body ended by
the close) and no byte beyond the response arrived; idle connections expire after
``IDLE_EXPIRY_S`` (below Triton's keep-alive timeout) and the pool holds at most ``MAX_IDLE``
idle and ``MAX_OPEN`` open connections a replica (a caller beyond that waits for one).
Backpressure: above ``HIGH_WATER`` unread body bytes the connection stops reading from the
socket until the reader takes them.

Never twice (the rule that protects the ledger): a request whose bytes were written is never
written again, to this replica or through this pool. A server that read the request and then
closed may have run it; the failure is a :class:`WireError` with ``written`` set, and the caller
(``backends.triton_http``) says so to the dispatcher, which records the replica's cache state as
unknown. Only a connection known dead *before* the write (its close already read, or seen by a
non-blocking peek at the socket) is swapped for another one.

Errors: :class:`WireError` (``written``: the request's bytes went out; ``answered``: some of
the response arrived).
"""

from __future__ import annotations

import asyncio
import collections
import os
import socket
import time
from typing import cast
from urllib.parse import urlsplit

import httptools

MAX_HEAD = 64 * 1024  # status line and headers of one response
MAX_CHUNK = 16 * 1024 * 1024  # one chunk of a chunked body
MAX_BODY = 64 * 1024 * 1024  # a body read whole (``read_all``)
HIGH_WATER = 256 * 1024  # unread body bytes above which reading from the socket pauses
MAX_OPEN = 256  # connections a pool holds open (idle or busy)
MAX_IDLE = 64  # idle connections a pool keeps
IDLE_EXPIRY_S = 30.0  # an idle connection older than this is closed (Triton keeps them longer)

_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT


class WireError(Exception):
    """The connection failed or the answer is not HTTP/1.1 this client understands."""

    def __init__(self, message: str, *, answered: bool, written: bool = True) -> None:
        super().__init__(message)
        self.answered = answered  # some of the response arrived
        self.written = written  # the request's bytes were written: the replica may have run it


class _Stray(Exception):
    """Raised inside the parser's callback to stop at a response nobody asked for."""


class Connection(asyncio.Protocol):
    """One keep-alive connection: llhttp's parser, the body bytes not yet read, and a waiter.

    The parser's callbacks fill in the current response; ``error`` is set when the bytes or
    the connection went wrong (the connection is then closed and never reused).
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.error: WireError | None = None
        self._loop = asyncio.get_running_loop()
        self._waiter: asyncio.Future[None] | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._peek: socket.socket | None = None  # a duplicate of the socket, to peek at it
        self.idle_since = 0.0
        self._reset()
        self.busy = False  # a request is on its way or its response is being read
        self.counted = True  # holds one of its pool's places (see Pool._drop)
        self.stray = False  # bytes beyond the answer arrived: never reused

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.head_done = False  # a final (non-1xx) response's headers are in
        self.done = False  # that response's end has been parsed
        self.keep_alive = True
        self.by_close = False  # its body ends when the connection closes
        self.body = bytearray()
        self._head_bytes = 0  # bytes received while the head is incomplete
        self._head_size = 0  # the head's header lines, as parsed
        self._chunk = 0
        self._interim = False
        self._paused = False
        self.received = False  # any byte of a response arrived

    # asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                self._peek = socket.socket(fileno=os.dup(sock.fileno()))
            except OSError:
                self._peek = None

    def data_received(self, data: bytes) -> None:
        if self.error is not None or self.stray:
            return
        if not self.busy or self.done:  # nobody asked: the stream is out of step
            self._stray()
            return
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Stray):
                cause = exc.__context__ if isinstance(exc.__context__, WireError) else None
                self._fail(str(cause) if cause is not None else f"malformed HTTP answer: {exc}")
                return
            self._stray()
        except httptools.HttpParserUpgrade:
            self._fail("the replica switched protocols (101), which nobody asked for")
            return
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc.__context__, WireError) else None
            self._fail(str(cause) if cause is not None else f"malformed HTTP answer: {exc}")
            return
        if not self.head_done:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD:
                self._fail(f"the answer's head is longer than {MAX_HEAD} bytes")
                return
        if len(self.body) > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._ended("the replica closed the connection")
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(f"the connection was lost: {exc}" if exc else "the replica closed it")

    def _ended(self, message: str) -> None:
        if self.closed:
            return
        self.closed = True
        self._close_peek()
        if self.busy and self.head_done and self.by_close and not self.done:
            self.done = True  # a body delimited by the close (RFC 9112, 6.3 item 8)
            self.keep_alive = False
        elif self.busy and not self.done and self.error is None:
            self.error = WireError(message, answered=self.received)
        self._wake()

    # llhttp's callbacks ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.done:  # a second response after the one asked for: out of step
            raise _Stray()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD:
            raise WireError(f"the answer's head is longer than {MAX_HEAD} bytes", answered=True)
        if not self._interim:
            self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # interim: its headers are dropped, the final one follows
            self._interim = True
            self.headers = {}
            return
        self.status = status
        self.head_done = True
        headers = self.headers
        coding = headers.get(b"transfer-encoding")
        if coding is not None and coding.strip().lower() != b"chunked":
            raise WireError(f"transfer coding {coding[:60]!r} is not supported", answered=True)
        self.keep_alive = self._parser.should_keep_alive()
        no_body = status in (204, 304)
        self.by_close = coding is None and b"content-length" not in headers and not no_body
        if self.by_close:
            self.keep_alive = False

    def on_chunk_header(self) -> None:
        self._chunk = 0

    def on_body(self, body: bytes) -> None:
        self._chunk += len(body)
        if self._chunk > MAX_CHUNK:
            raise WireError(f"a chunk is longer than {MAX_CHUNK} bytes", answered=True)
        self.body += body

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            self._head_bytes = self._head_size = 0
            return
        self.done = True

    # The reader's side ----------------------------------------------------------------------

    def begin(self) -> None:
        """A request goes out on this connection: a fresh response to parse."""
        self._reset()
        self.busy = True

    def _stray(self) -> None:
        """Bytes beyond the answer asked for (a response nobody asked for): the answer, if
        complete, stands, but the connection is out of step and is closed, never reused."""
        self.stray = True
        if self.transport is not None:
            self.transport.close()
        if self.busy and not self.done and self.error is None:
            self.error = WireError("the replica sent bytes nobody asked for", answered=True)
        self._wake()

    def _fail(self, message: str, *, answered: bool = True) -> None:
        if self.error is None:
            self.error = WireError(message, answered=answered)
        self.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def more(self) -> None:
        """Wait until more was parsed, or the connection failed or closed."""
        if self.error is not None:
            raise self.error
        if self.closed:
            raise WireError("the replica closed the connection", answered=self.received)
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def take(self) -> bytes:
        """The body bytes parsed so far (removed); reading resumes below the high-water mark."""
        data = bytes(self.body)
        self.body.clear()
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def dead(self) -> bool:
        """Known unusable before a write: closed, failed, or a peek at the socket finds the
        close (or bytes nobody asked for) waiting to be read."""
        if self.closed or self.error is not None or self.stray:
            return True
        if self._peek is None:
            return False
        try:
            return self._peek.recv(1, _PEEK) is not None  # b"": closed; a byte: out of step
        except BlockingIOError:
            return False
        except OSError:
            return True

    def reusable(self) -> bool:
        """The response was read to its end, the server keeps the connection, nothing unread."""
        return (
            self.done
            and self.keep_alive
            and not self.stray
            and not self.closed
            and self.error is None
            and not self.body
        )

    def _close_peek(self) -> None:
        if self._peek is not None:
            self._peek.close()
            self._peek = None

    def close(self) -> None:
        self.closed = True
        self._close_peek()
        if self.transport is not None:
            self.transport.close()


class Response:
    """One response: ``status``, then ``read()`` pieces of the body as they arrive."""

    def __init__(self, connection: Connection) -> None:
        self._c = connection
        self.status = connection.status
        self.headers = connection.headers
        self.complete = False

    async def read(self) -> bytes | None:
        """The body's next data: everything parsed since the last read (for a chunked body,
        every chunk that arrived, joined, so that a read that brought several, a decoupled
        model's responses, is handled once); None once the body has ended. ``complete`` is set
        with the data that ends the body."""
        if self.complete:
            return None
        c = self._c
        while not c.body and not c.done:
            await c.more()
        data = c.take()
        if c.done:
            self.complete = True
        return data

    async def read_all(self) -> bytes:
        """The whole (rest of the) body, at most ``MAX_BODY`` bytes."""
        parts = []
        size = 0
        while (data := await self.read()) is not None:
            size += len(data)
            if size > MAX_BODY:
                self._c.close()
                raise WireError(f"the answer is longer than {MAX_BODY} bytes", answered=True)
            parts.append(data)
        return b"".join(parts)


class Pool:
    """Keep-alive connections to one replica; at most one request per connection at once."""

    def __init__(
        self,
        url: str,
        connect_timeout_s: float,
        *,
        max_open: int = MAX_OPEN,
        max_idle: int = MAX_IDLE,
        idle_expiry_s: float = IDLE_EXPIRY_S,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"an http:// URL is needed, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.hostport = parts.netloc
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.max_open, self.max_idle, self.idle_expiry_s = max_open, max_idle, idle_expiry_s
        self._idle: collections.deque[Connection] = collections.deque()  # oldest first
        self._open = 0  # connections made and not yet given up (idle or busy)
        self._slots: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def open(self) -> int:
        return self._open

    async def _connection(self) -> Connection:
        """An idle connection, or a new one; at ``max_open``, the first of either that frees
        up (within the connect timeout)."""
        connection = self._take_idle()
        while connection is None:
            if self._open < self.max_open:
                return await self._connect()
            slot = asyncio.get_running_loop().create_future()
            self._slots.append(slot)
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    await slot
            except TimeoutError as exc:
                raise WireError(
                    f"all {self.max_open} connections to {self.hostport} are busy",
                    answered=False,
                    written=False,
                ) from exc
            finally:
                if not slot.done():
                    slot.cancel()
            connection = self._take_idle()
        return connection

    async def _connect(self) -> Connection:
        self._open += 1
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(Connection, self.host, self.port)
        except (OSError, TimeoutError) as exc:
            self._given_up()
            raise WireError(
                f"cannot connect to {self.hostport}: {exc}", answered=False, written=False
            ) from exc
        except BaseException:
            self._given_up()
            raise
        return connection

    def _given_up(self) -> None:
        self._open -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        """A caller waiting for a connection may go on (one freed up or went idle)."""
        while self._slots:
            slot = self._slots.popleft()
            if not slot.done():
                slot.set_result(None)
                return

    def _drop(self, connection: Connection) -> None:
        connection.close()
        if connection.counted:  # each connection frees its place once
            connection.counted = False
            self._given_up()

    def _take_idle(self) -> Connection | None:
        """The most recently used idle connection that is not known dead or expired."""
        expired_before = time.monotonic() - self.idle_expiry_s  # no get_running_loop: a getpid
        while self._idle:
            connection = self._idle.pop()
            if connection.idle_since < expired_before or connection.dead():
                self._drop(connection)
                continue
            assert not connection.busy and not connection.body  # nothing unread in the pool
            return connection
        return None

    async def post(self, path: str, body: bytes) -> tuple[Response, Connection]:
        """Send the request and read the status and headers of its final response.

        The request is written once: a failure after the write raises :class:`WireError`
        with ``written`` set (the replica may have run it), never a second copy."""
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.hostport}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        connection = await self._connection()
        if connection.transport is None:
            self._drop(connection)
            raise WireError("the connection has no transport", answered=False, written=False)
        connection.begin()
        connection.transport.write(head + body)
        try:
            while not connection.head_done:
                await connection.more()
        except WireError as exc:
            self._drop(connection)
            raise WireError(str(exc), answered=exc.answered, written=True) from exc
        except BaseException:  # cancelled: a connection left mid-request is never reused
            self._drop(connection)
            raise
        return Response(connection), connection

    def release(self, response: Response, connection: Connection) -> None:
        """Back to the pool if the response was read to its end and nothing else arrived, else
        closed (which tells the replica that its client left)."""
        if response.complete and connection.reusable() and len(self._idle) < self.max_idle:
            connection.busy = False
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
            self._wake_one()
            return
        connection.busy = False
        self._drop(connection)

    def close(self) -> None:
        while self._idle:
            self._drop(self._idle.popleft())
