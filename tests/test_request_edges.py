"""Request parsing edges over real HTTP: every Content-Encoding is decoded or refused by name, and
a request line without a version gets no HTTP/0.9 answer."""

from __future__ import annotations

import gzip
import socket
import uuid
import zlib
from collections.abc import Iterator

import brotli
import orjson
import pytest

from backends.sim.launcher import Replica
from router.cli.local import ProxyProcess, create_key
from tests.hostile_http import Answer, bearer, send
from tests.hostile_stack import hostile_proxy
from tests.servers import RedisServer

BODY_LIMIT = 1 << 20
LIMITS = f"\n[limits]\nmax_body_bytes = {BODY_LIMIT}\n"


@pytest.fixture(scope="module")
def edges(replicas: dict[str, Replica]) -> Iterator[tuple[ProxyProcess, str]]:
    """A proxy in front of r1 with a 1 MiB body limit, its own Redis, a production key."""
    redis = RedisServer()
    redis.start()
    proxy = hostile_proxy([replicas["r1"]], redis.url, extra=LIMITS)
    proxy.start()
    try:
        yield proxy, create_key(redis.url, "edges")
    finally:
        proxy.stop()
        redis.close()


def completion_body() -> bytes:
    return orjson.dumps({"model": "ensemble", "prompt": uuid.uuid4().hex, "max_tokens": 2})


def post_encoded(proxy: ProxyProcess, key: str, encoding: str, body: bytes) -> Answer:
    headers = [bearer(key), ("Content-Type", "application/json"), ("Content-Encoding", encoding)]
    return send(proxy.port, "POST", "/v1/completions", headers, body)


@pytest.mark.parametrize("encoding", ["x-bogus", "zstd", "gzip, x-bogus"])
def test_unknown_encoding_gets_415_naming_the_supported_ones(
    edges: tuple[ProxyProcess, str], encoding: str
) -> None:
    """A coding the proxy cannot decode is a JSON 415 that names it and lists the supported
    ones, not a body read as plain text or a text/plain 400."""
    proxy, key = edges
    answer = post_encoded(proxy, key, encoding, completion_body())
    assert answer.status == 415, answer.body
    assert answer.headers["content-type"].startswith("application/json")
    error = answer.error()
    assert error["param"] == "Content-Encoding"
    unknown = encoding.split(",")[-1].strip()
    assert repr(unknown) in error["message"]
    for supported in ("identity", "gzip", "deflate", "br"):
        assert supported in error["message"]


@pytest.mark.parametrize(
    ("encoding", "encode"),
    [
        ("gzip, gzip", lambda b: gzip.compress(gzip.compress(b))),
        ("deflate, gzip", lambda b: gzip.compress(zlib.compress(b))),
        ("br", brotli.compress),
        ("gzip, br", lambda b: brotli.compress(gzip.compress(b))),
        ("identity", lambda b: b),
    ],
    ids=["gzip-gzip", "deflate-gzip", "br", "gzip-br", "identity"],
)
def test_encoded_bodies_are_decoded_and_served(
    edges: tuple[ProxyProcess, str], encoding: str, encode: object
) -> None:
    """A body in stacked or brotli codings is decoded in the order they were applied and served."""
    proxy, key = edges
    assert callable(encode)
    answer = post_encoded(proxy, key, encoding, encode(completion_body()))
    assert answer.status == 200, answer.body
    assert answer.json()["kvledger"]["status"] == "ok"


@pytest.mark.parametrize(
    ("encoding", "body", "named"),
    [
        ("gzip, gzip", gzip.compress(b"plainly not gzip"), "gzip"),
        ("gzip, br", b"not brotli", "br"),
        ("br", brotli.compress(completion_body())[:-3], "br"),
    ],
    ids=["inner-gzip-corrupt", "br-corrupt", "br-truncated"],
)
def test_corrupt_data_gets_400_naming_the_encoding(
    edges: tuple[ProxyProcess, str], encoding: str, body: bytes, named: str
) -> None:
    """Data that is not in the coding it claims is a 400 naming that coding."""
    proxy, key = edges
    answer = post_encoded(proxy, key, encoding, body)
    assert answer.status == 400, answer.body
    error = answer.error()
    assert error["param"] == "Content-Encoding"
    assert repr(named) in error["message"]


def test_stacked_bomb_past_the_body_limit_gets_413(edges: tuple[ProxyProcess, str]) -> None:
    """A small body whose stacked codings inflate past max_body_bytes is a 413, as a large body
    is, and the proxy goes on serving."""
    proxy, key = edges
    bomb = gzip.compress(gzip.compress(b" " * (4 * BODY_LIMIT)))
    assert len(bomb) < 64 << 10
    answer = post_encoded(proxy, key, "gzip, gzip", bomb)
    assert answer.status == 413, answer.body
    assert answer.error()["code"] == "request_too_large"
    assert post_encoded(proxy, key, "gzip", gzip.compress(completion_body())).status == 200


def test_http09_request_line_gets_400_not_an_http09_answer(
    edges: tuple[ProxyProcess, str],
) -> None:
    """A request line without a version is answered 400 on an HTTP/1.0 status line and the
    connection closes; the proxy goes on serving."""
    proxy, key = edges
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as sock:
        sock.sendall(b"GET /healthz\r\n\r\n")
        chunks = []
        while chunk := sock.recv(1 << 16):  # ends when the proxy closes the connection
            chunks.append(chunk)
    raw = b"".join(chunks)
    assert not raw.startswith(b"HTTP/0.9"), raw
    assert raw.startswith(b"HTTP/1.0 400 "), raw
    body = orjson.loads(raw.partition(b"\r\n\r\n")[2])
    assert "HTTP/0.9" in body["error"]["message"]
    assert send(proxy.port, "GET", "/healthz").status == 200
