"""Hostile clients: each mistake that once gave a 500 now gets a 4xx naming its field, and a
prompt too long for the model is refused before any replica sees it."""

from __future__ import annotations

import gzip
import uuid
import zlib
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from backends.sim.launcher import Replica
from router.cli.local import ProxyProcess, create_key
from tests.hostile_http import Answer, bearer, post_json, send
from tests.hostile_stack import ADMIN, MAX_INPUT_LEN, hostile_proxy
from tests.ledger_view import LedgerView
from tests.servers import RedisServer

LIMITS = "\n[limits]\nmax_body_bytes = 4194304\n"


@pytest.fixture(scope="module")
def hostile(replicas: dict[str, Replica]) -> Iterator[tuple[ProxyProcess, str, LedgerView]]:
    """A proxy in front of r1 and r2 (1024-token inputs), its own Redis, a production key."""
    redis = RedisServer()
    redis.start()
    proxy = hostile_proxy([replicas["r1"], replicas["r2"]], redis.url, extra=LIMITS)
    proxy.start()
    try:
        yield proxy, create_key(redis.url, "hostile"), LedgerView(redis.url)
    finally:
        proxy.stop()
        redis.close()


def completion(prompt: str = "a short prompt", **fields: Any) -> dict[str, Any]:
    return {"model": "ensemble", "prompt": prompt, "max_tokens": 2, **fields}


def served(proxy: ProxyProcess, key: str) -> Answer:
    """A well-formed request: the proxy must still answer it with 200."""
    answer = post_json(proxy.port, "/v1/completions", completion(uuid.uuid4().hex), bearer(key))
    assert answer.status == 200, answer.body
    return answer


@pytest.mark.parametrize(
    "messages",
    [
        ["hi"],
        [{"content": "hi"}],
        [1],
        [None],
        [[]],
        [[[[[["deep"]]]]]],
        [{"role": ["user"], "content": "hi"}],
        [{"role": {"user": 1}, "content": "hi"}],
        [{"role": "user", "content": "hi"}, "and a string"],
    ],
    ids=repr,
)
def test_chat_messages_that_are_not_role_objects_get_400(
    hostile: tuple[ProxyProcess, str, LedgerView], messages: list[Any]
) -> None:
    """A chat message that is not an object with a role is a 400 on 'messages', not a 500."""
    proxy, key, _ = hostile
    body = {"model": "ensemble", "messages": messages, "max_tokens": 2}
    answer = post_json(proxy.port, "/v1/chat/completions", body, bearer(key))
    assert answer.status == 400, answer.body
    assert answer.error()["param"] == "messages"


def test_episode_header_that_is_not_utf8_gets_400_before_the_replica(
    hostile: tuple[ProxyProcess, str, LedgerView],
) -> None:
    """A non-UTF-8 byte in X-Kvl-Episode is a 400 naming it, and nothing reaches a replica."""
    proxy, key, ledger = hostile
    before = len(ledger.tail(10_000, key="hostile"))
    for value in (b"\xff\xfe", b"ep\x80isode", "\u00e9pisode\u200b".encode()):
        body = orjson.dumps(completion())
        answer = send(
            proxy.port, "POST", "/v1/completions", [bearer(key), ("X-Kvl-Episode", value)], body
        )
        assert answer.status == 400, answer.body
        assert answer.error()["param"] == "X-Kvl-Episode"
    assert len(ledger.tail(10_000, key="hostile")) == before  # no record: no replica was used
    label = ("X-Kvl-Episode", "épisode 7".encode())
    body = orjson.dumps(completion(uuid.uuid4().hex))
    assert send(proxy.port, "POST", "/v1/completions", [bearer(key), label], body).status == 200


@pytest.mark.parametrize(
    "header",
    [
        ("Authorization", b"Bearer kvl-\xc3\xa9t\xc3\xa9"),
        ("Authorization", b"Bearer \xff\xfe"),
        ("X-Api-Key", b"kvl-\xe2\x82\xac"),
    ],
    ids=["utf8-accent", "not-utf8", "x-api-key"],
)
def test_key_with_a_non_ascii_byte_gets_401(
    hostile: tuple[ProxyProcess, str, LedgerView], header: tuple[str, bytes]
) -> None:
    """A key with a byte outside printable ASCII is an invalid key (401 naming the header)."""
    proxy, _, _ = hostile
    answer = send(proxy.port, "POST", "/v1/completions", [header], orjson.dumps(completion()))
    assert answer.status == 401, answer.body
    assert answer.error()["param"] == header[0]


def test_two_authorization_headers_get_400(hostile: tuple[ProxyProcess, str, LedgerView]) -> None:
    """Two Authorization headers are refused (400), even when one of them holds a valid key."""
    proxy, key, _ = hostile
    for second in (f"Bearer {key}", "Bearer someone-else"):
        headers = [bearer(key), ("Authorization", second)]
        answer = send(proxy.port, "POST", "/v1/completions", headers, orjson.dumps(completion()))
        assert answer.status == 400, answer.body
        assert answer.error()["param"] == "Authorization"


@pytest.mark.parametrize(
    ("encoding", "body", "param"),
    [
        ("br", b'{"model": "ensemble"}', "Content-Encoding"),
        ("deflate", b"\x78\x9c not deflate at all", "Content-Encoding"),
        ("gzip", b"plainly not gzip", "Content-Encoding"),
        # A truncated stream is data that is not complete gzip (router/http/decode.py).
        ("gzip", gzip.compress(b'{"model": "ensemble"}')[:12], "Content-Encoding"),
    ],
    ids=["br-garbage", "deflate-broken", "gzip-garbage", "gzip-truncated"],
)
def test_body_that_cannot_be_decoded_gets_400(
    hostile: tuple[ProxyProcess, str, LedgerView], encoding: str, body: bytes, param: str | None
) -> None:
    """A body its Content-Encoding cannot decode is a 400 naming the header."""
    proxy, key, _ = hostile
    headers = [bearer(key), ("Content-Encoding", encoding), ("Content-Type", "application/json")]
    answer = send(proxy.port, "POST", "/v1/completions", headers, body)
    assert answer.status == 400, answer.body
    assert answer.error()["param"] == param


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_body_in_a_decodable_encoding_is_served(
    hostile: tuple[ProxyProcess, str, LedgerView], encoding: str
) -> None:
    """A correctly compressed body is decoded and served as usual."""
    proxy, key, _ = hostile
    raw = orjson.dumps(completion(uuid.uuid4().hex))
    body = gzip.compress(raw) if encoding == "gzip" else zlib.compress(raw)
    headers = [bearer(key), ("Content-Encoding", encoding)]
    answer = send(proxy.port, "POST", "/v1/completions", headers, body)
    assert answer.status == 200, answer.body


def dispatched(proxy: ProxyProcess) -> dict[str, tuple[int, int]]:
    """Per replica, the requests this proxy sent it: finished and in flight (admin API)."""
    answer = send(proxy.port, "GET", "/admin/replicas", [bearer(ADMIN)])
    return {r["id"]: (r["served"], r["in_flight"]) for r in answer.json()["replicas"]}


def test_one_mebibyte_prompt_is_refused_before_any_replica(
    hostile: tuple[ProxyProcess, str, LedgerView],
) -> None:
    """A 1 MiB prompt gets 400 context_length_exceeded without being sent to any replica, and
    the replicas go on serving others."""
    proxy, key, _ = hostile
    before = dispatched(proxy)
    for path, body in (
        ("/v1/completions", completion("x" * (1 << 20))),
        ("/v2/models/ensemble/generate", {"text_input": "é" * (1 << 19), "max_tokens": 2}),
        (
            "/v1/chat/completions",
            {"model": "ensemble", "messages": [{"role": "user", "content": "y" * (1 << 20)}]},
        ),
    ):
        answer = post_json(proxy.port, path, body, bearer(key))
        assert answer.status == 400, answer.body[:500]
        error = answer.error()
        assert error["code"] == "context_length_exceeded"
        assert error["param"] in ("prompt", "text_input", "messages")
    assert dispatched(proxy) == before
    served(proxy, key)


def test_prompt_limit_refuses_only_what_is_certainly_too_long(
    hostile: tuple[ProxyProcess, str, LedgerView],
) -> None:
    """One byte over max_input_len * max_token_bytes is refused; a prompt at the limit is not."""
    proxy, key, _ = hostile
    over = post_json(
        proxy.port, "/v1/completions", completion("z" * (MAX_INPUT_LEN + 1)), bearer(key)
    )
    assert over.status == 400 and over.error()["param"] == "prompt"
    fits = completion(uuid.uuid4().hex + "z" * (MAX_INPUT_LEN - 32 - 64), max_tokens=1)
    assert post_json(proxy.port, "/v1/completions", fits, bearer(key)).status == 200


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ([("Authorization", b"Bearer admin-secr\xc3\xa9t")], 401),
        ([("Authorization", b"Bearer \xff")], 401),
        ([("Authorization", f"Bearer {ADMIN}"), ("Authorization", f"Bearer {ADMIN}")], 400),
    ],
    ids=["non-ascii", "not-utf8", "twice"],
)
def test_admin_token_mistakes_get_4xx(
    hostile: tuple[ProxyProcess, str, LedgerView], headers: list[Any], status: int
) -> None:
    """The admin API checks its token header like the fronts check keys."""
    proxy, _, _ = hostile
    answer = send(proxy.port, "GET", "/admin/keys", headers)
    assert answer.status == status, answer.body
    assert answer.error()["param"] in (None, "Authorization")


@pytest.mark.parametrize("query", ["count=%C2%B2", "count=-1", "count=1&count=2", "count=10001"])
def test_admin_query_mistakes_get_400(
    hostile: tuple[ProxyProcess, str, LedgerView], query: str
) -> None:
    """A count that is not a plain number in range, or given twice, is a 400 naming 'count'."""
    proxy, _, _ = hostile
    answer = send(proxy.port, "GET", f"/admin/lineage?{query}", [bearer(ADMIN)])
    assert answer.status == 400, answer.body
    assert answer.error()["param"] == "count"
