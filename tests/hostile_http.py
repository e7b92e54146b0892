"""A raw HTTP/1.1 client for hostile requests: any bytes in the request line, headers and body.

Ordinary clients refuse to send what these tests must send (a byte that is not UTF-8 in a header,
the same header twice, a body that does not match its Content-Encoding), so requests are written
to a socket as bytes, with ``Connection: close``, and the answer is read to the end.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

Header = tuple[str | bytes, str | bytes]


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names; a repeated header keeps its last value
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)

    def events(self) -> list[bytes]:
        """The ``data:`` payloads of an event stream, in order."""
        return [line[6:] for line in self.body.split(b"\n") if line.startswith(b"data: ")]

    def error(self) -> dict[str, Any]:
        """The OpenAI-shaped error of a 4xx/5xx; fails the test if it is not one."""
        error = self.json()["error"]
        assert isinstance(error["message"], str) and error["message"], error
        assert {"message", "type", "code", "param"} <= set(error), error
        return dict(error)


def _dechunk(body: bytes) -> bytes:
    out, rest = b"", body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2 :]
    return out


def parse_answer(raw: bytes) -> Answer:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(body)
    return Answer(status, headers, body)


def request_bytes(
    method: str, path: str | bytes, headers: Iterable[Header], body: bytes = b""
) -> bytes:
    lines = [_bytes(method) + b" " + _bytes(path) + b" HTTP/1.1", b"Host: 127.0.0.1"]
    lines += [_bytes(name) + b": " + _bytes(value) for name, value in headers]
    names = {_bytes(name).lower() for name, _ in headers}
    if b"content-length" not in names and b"transfer-encoding" not in names:
        lines.append(b"Content-Length: " + str(len(body)).encode())
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def send(
    port: int,
    method: str,
    path: str | bytes,
    headers: Iterable[Header] = (),
    body: bytes = b"",
    timeout_s: float = 120.0,
) -> Answer:
    """One request on a fresh connection; the whole answer, once the server closes it."""
    data = request_bytes(method, path, list(headers), body)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(data)  # a server refusing a large body may answer before reading it all
        chunks = []
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                chunks.append(chunk)
    if not chunks:
        raise ConnectionError("the server closed the connection without an answer")
    return parse_answer(b"".join(chunks))


def bearer(key: str) -> Header:
    return ("Authorization", f"Bearer {key}")


def post_json(port: int, path: str, body: Any, *headers: Header) -> Answer:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    return send(port, "POST", path, [("Content-Type", "application/json"), *headers], data)
