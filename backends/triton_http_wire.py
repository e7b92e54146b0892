"""A minimal HTTP/1.1 keep-alive client for one replica: POST a body, read the answer as it comes.

Why not aiohttp's client: per request it builds a ClientRequest, a ClientResponse, header
multidicts, timers and trace hooks, which cost about as much CPU as the rest of the hop (the
benchmark in ``bench/overhead.py`` measured it). The replica hop needs one thing: write one
request on an idle connection, then read a status, a few headers, and a body in
``Content-Length`` or ``chunked`` framing. This module does that on asyncio's Protocol API and
nothing else (no redirects, cookies, proxies, TLS or compression).

Errors: :class:`WireError` (with ``answered``: whether any of the response arrived).
"""

from __future__ import annotations

import asyncio
from typing import cast
from urllib.parse import urlsplit


class WireError(Exception):
    """The connection failed or the answer is not HTTP/1.1 this client understands."""

    def __init__(self, message: str, *, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered  # some of the response arrived


class Connection(asyncio.Protocol):
    """One keep-alive connection: the bytes received and not yet read, and a waiter."""

    def __init__(self) -> None:
        self.transport: asyncio.WriteTransport | None = None
        self.buffer = bytearray()
        self.closed = False
        self._waiter: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.WriteTransport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def more(self) -> None:
        """Wait until more bytes arrived or the connection closed."""
        if self.closed:
            raise WireError("the replica closed the connection", answered=True)
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """One response: ``status``, then ``body()`` pieces as they arrive (chunked or sized)."""

    def __init__(self, connection: Connection, status: int, headers: dict[bytes, bytes]) -> None:
        self._c = connection
        self.status = status
        self.chunked = headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        self.length = int(headers.get(b"content-length", b"0") or 0)
        self.keep_alive = headers.get(b"connection", b"").lower() != b"close"
        self.complete = False

    async def read(self) -> bytes | None:
        """The body's next data: every chunk complete in the buffer, joined, so that a read
        that brought several (a decoupled model's responses) is handled once; None once the
        body has ended. ``complete`` is set with the data that ends the body."""
        if self.complete:
            return None
        buffer = self._c.buffer
        if not self.chunked:
            while len(buffer) < self.length:
                await self._c.more()
            piece = bytes(buffer[: self.length])
            del buffer[: self.length]
            self.complete = True
            return piece
        while True:
            pieces, ended = _take_chunks(buffer)
            if ended:
                self.complete = True
            if pieces or ended:
                return b"".join(pieces)
            await self._c.more()

    async def read_all(self) -> bytes:
        """The whole (rest of the) body."""
        if not self.chunked:  # one read gives all of a sized body
            return await self.read() or b""
        parts = []
        while (data := await self.read()) is not None:
            parts.append(data)
        return b"".join(parts)


def _take_chunks(buffer: bytearray) -> tuple[list[bytes], bool]:
    """The data of the complete chunks at the head of ``buffer`` (removed from it), and whether
    the last chunk (with its trailers) was among them."""
    pieces: list[bytes] = []
    while (end := buffer.find(b"\r\n")) >= 0:
        try:
            size = int(bytes(buffer[:end]).split(b";", 1)[0], 16)
        except ValueError as exc:
            line = bytes(buffer[:end])[:40]
            raise WireError(f"bad chunk size {line!r}", answered=True) from exc
        if size == 0:  # the last chunk: then optional trailers and an empty line
            stop = buffer.find(b"\r\n\r\n", end)
            if stop < 0:
                break
            del buffer[: stop + 4]
            return pieces, True
        if len(buffer) < end + 2 + size + 2:
            break
        pieces.append(bytes(buffer[end + 2 : end + 2 + size]))
        del buffer[: end + 2 + size + 2]
    return pieces, False


class Pool:
    """Idle keep-alive connections to one replica; at most one request per connection at once."""

    def __init__(self, url: str, connect_timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"an http:// URL is needed, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.hostport = parts.netloc
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[Connection] = []

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(Connection, self.host, self.port)
        except (OSError, TimeoutError) as exc:
            raise WireError(f"cannot connect to {self.hostport}: {exc}", answered=False) from exc
        return connection

    async def post(self, path: str, body: bytes) -> tuple[Response, Connection]:
        """Send the request and read the status and headers; a reused connection the server had
        closed meanwhile is replaced once (nothing ran on it)."""
        head = (
            f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.hostport}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        while True:
            reused = bool(self._idle)
            connection = self._idle.pop() if reused else await self._connect()
            if reused and connection.closed:
                continue
            if connection.transport is None:
                raise WireError("the connection has no transport", answered=False)
            connection.transport.write(head + body)
            try:
                return await _head(connection), connection
            except WireError as exc:
                connection.close()
                if exc.answered or not reused:
                    raise
            except BaseException:  # cancelled: a connection left mid-request is never reused
                connection.close()
                raise

    def release(self, response: Response, connection: Connection) -> None:
        """Back to the pool if the response was read to its end, else closed (which tells the
        replica that its client left)."""
        if response.complete and response.keep_alive and not connection.closed:
            if not connection.buffer:
                self._idle.append(connection)
                return
        connection.close()

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()


async def _head(connection: Connection) -> Response:
    buffer = connection.buffer
    end = buffer.find(b"\r\n\r\n")
    while end < 0:
        if connection.closed:
            raise WireError("the replica closed the connection", answered=bool(buffer))
        await connection.more()
        end = buffer.find(b"\r\n\r\n")
    lines = bytes(buffer[:end]).split(b"\r\n")
    del buffer[: end + 4]
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise WireError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}", answered=True)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return Response(connection, int(parts[1]), headers)
