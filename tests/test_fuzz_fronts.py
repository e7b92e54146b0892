"""Fuzzing every front (chat, completions, generate, generate_stream, admin, ops) with generated
and hand-written malformed requests, sent as raw bytes: never a 5xx, every 4xx in OpenAI's
error shape, every stream ended, and the proxy still serves afterwards.

Over 400 requests: 200 + 120 generated (hypothesis) and about 100 written by hand. The proxy
caps max_tokens at 4, so whatever happens to be valid generates little; it keeps two
production replicas (min_production_replicas = 2), so nothing generated can lease one for an
eval run, and replica ids that exist are never generated, so nothing drains or resets one.
"""

from __future__ import annotations

import gzip
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.sim.launcher import Replica
from router.cli.local import ProxyProcess, create_key
from tests.hostile_http import Answer, Header, bearer, send
from tests.hostile_stack import ADMIN, hostile_proxy
from tests.servers import RedisServer

KEY_NAME = "fuzz-" + uuid.uuid4().hex
CONFIG = "\n[limits]\nmax_tokens = 4\n\n[eval]\nmin_production_replicas = 2\n"
FRONTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v2/models/ensemble/generate",
    "/v2/models/ensemble/generate_stream",
)


@pytest.fixture(scope="module")
def fuzzed(replicas: dict[str, Replica]) -> Iterator[tuple[ProxyProcess, str]]:
    """A proxy in front of r1 and r2 with its own Redis and a production key."""
    redis = RedisServer()
    redis.start()
    proxy = hostile_proxy([replicas["r1"], replicas["r2"]], redis.url, extra=CONFIG)
    proxy.start()
    try:
        yield proxy, create_key(redis.url, KEY_NAME)
    finally:
        proxy.stop()
        redis.close()


def check_answer(answer: Answer) -> None:
    """The property: no 5xx; a 4xx says what is wrong in OpenAI's shape; a stream ends."""
    assert answer.status < 500, (answer.status, answer.body[:800])
    content_type = answer.headers.get("content-type", "")
    if answer.status >= 400 and not content_type.startswith("text/plain"):
        answer.error()
    elif answer.status >= 400:
        # Only aiohttp's HTTP parser answers in plain text: a request line or header that is
        # not HTTP at all never reaches the application.
        assert answer.status == 400, answer.body
    if content_type.startswith("text/event-stream"):
        last = answer.events()[-1]
        assert last == b"[DONE]" or b'"kvledger"' in last or b'"error"' in last, answer.body


def check_still_serves(proxy: ProxyProcess, key: str) -> None:
    body = {"model": "ensemble", "prompt": uuid.uuid4().hex, "max_tokens": 2}
    headers = [bearer(key), ("Content-Type", "application/json")]
    answer = send(proxy.port, "POST", "/v1/completions", headers, orjson.dumps(body))
    assert answer.status == 200, answer.body


# --- generated -------------------------------------------------------------------------------

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=24)
    | st.sampled_from(["ensemble", "user", "system", "", "\x00", "é" * 3, "1e999"])
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
_message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["user", "system", "assistant", "tool", "bot", ""]) | _values,
        "content": st.text(max_size=40) | _values,
        "name": _values,
    },
)
_FIELDS = (
    "model messages prompt max_tokens max_completion_tokens temperature top_p top_k seed stream"
    " stop n text_input bad_words stop_words random_seed exclude_input_in_output stream_options"
).split()
_valid = {
    "model": "ensemble",
    "messages": [{"role": "user", "content": "hi"}],
    "prompt": "hello",
    "text_input": "hello",
    "max_tokens": 2,
}
_bodies = st.one_of(
    st.binary(max_size=64),
    st.dictionaries(st.sampled_from(_FIELDS), _values, max_size=6).map(orjson.dumps),
    # A valid request with one field broken or dropped.
    st.tuples(st.sampled_from(_FIELDS), _values, st.booleans()).map(
        lambda t: orjson.dumps(
            {k: v for k, v in {**_valid, t[0]: t[1]}.items() if not (t[2] and k == t[0])}
        )
    ),
    st.lists(_message, max_size=4).map(
        lambda m: orjson.dumps({"model": "ensemble", "messages": m, "max_tokens": 2})
    ),
    _values.map(orjson.dumps),
)
_header_bytes = st.binary(max_size=40).filter(lambda b: b"\r" not in b and b"\n" not in b)


def _auth(key: str) -> st.SearchStrategy[list[Header]]:
    return st.sampled_from(
        [
            [bearer(key)],
            [],
            [bearer("kvl-made-up")],
            [("Authorization", b"Bearer kvl-\xc3\xa9\xff")],
            [bearer(key), bearer(key)],
            [("Authorization", "Basic dXNlcjpwYXNz")],
            [("Authorization", "Bearer ")],
            [("X-Api-Key", key)],
            [("X-Api-Key", key), ("X-Api-Key", "other")],
            [bearer(ADMIN)],
        ]
    )


def _extras() -> st.SearchStrategy[list[Header]]:
    optional: list[st.SearchStrategy[list[Header]]] = [
        _header_bytes.map(lambda b: [("X-Kvl-Episode", b)]),
        st.sampled_from(["gzip", "deflate", "br", "zstd", "identity", "x-made-up"]).map(
            lambda e: [("Content-Encoding", e)]
        ),
        st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=x"]).map(
            lambda t: [("Content-Type", t)]
        ),
    ]
    return st.lists(st.one_of(*optional), max_size=3).map(lambda parts: sum(parts, []))


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_generated_requests_to_the_fronts(
    data: st.DataObject, fuzzed: tuple[ProxyProcess, str]
) -> None:
    """Generated bodies and headers on the four generation fronts: never a 5xx."""
    proxy, key = fuzzed
    path = data.draw(st.sampled_from(FRONTS + ("/v2/models/other/generate", "/v1/models")))
    method = data.draw(st.sampled_from(["POST"] * 6 + ["GET", "PUT"]))
    headers = data.draw(_auth(key)) + data.draw(_extras())
    check_answer(send(proxy.port, method, path, headers, data.draw(_bodies)))


_segment = st.text(min_size=1, max_size=20).filter(lambda s: s not in ("r1", "r2", KEY_NAME))
_ADMIN_FIELDS = "name mode cache replica idle_timeout_s arm model from_run upto requests".split()
_admin_values = st.one_of(
    _values,
    st.sampled_from(["production", "prod", "reset", "replay:x", "shared", "off", "r9", "a.1"]),
)
_admin_bodies = st.one_of(
    st.dictionaries(st.sampled_from(_ADMIN_FIELDS), _admin_values, max_size=5).map(orjson.dumps),
    st.binary(max_size=32),
)
_query = st.lists(
    st.tuples(
        st.sampled_from(["count", "replica", "key", "run", "arm", "x"]),
        st.text(max_size=8) | st.sampled_from(["0", "-1", "10001", "²", "1e3", "50"]),
    ),
    max_size=3,
).map(lambda pairs: "&".join(f"{quote(k)}={quote(v, safe='')}" for k, v in pairs))


def _admin_path(segment: str, query: str) -> st.SearchStrategy[tuple[str, str]]:
    s = quote(segment, safe="")
    routes = [
        ("GET", "/admin/keys"),
        ("POST", "/admin/keys"),
        ("DELETE", f"/admin/keys/{s}"),
        ("GET", "/admin/replicas"),
        ("POST", f"/admin/replicas/{s}/drain"),
        ("POST", f"/admin/replicas/{s}/undrain"),
        ("POST", f"/admin/replicas/{s}/reset"),
        ("GET", f"/admin/lineage?{query}"),
        ("GET", f"/admin/lineage/{s}"),
        ("GET", f"/admin/generations?{query}"),
        ("GET", f"/admin/runs?{query}"),
        ("POST", "/admin/runs"),
        ("GET", f"/admin/runs/{s}"),
        ("POST", f"/admin/runs/{s}/end"),
        ("GET", "/admin/snapshots"),
        ("POST", "/admin/snapshots"),
        ("GET", f"/admin/snapshots/{s}"),
        ("DELETE", f"/admin/snapshots/{s}"),
        ("GET", f"/v1/models/{s}"),
        ("POST", f"/v2/models/{s}/generate"),
        ("GET", "/readyz"),
        ("GET", "/metrics"),
    ]
    return st.sampled_from(routes)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_generated_requests_to_the_admin_api(
    data: st.DataObject, fuzzed: tuple[ProxyProcess, str]
) -> None:
    """Generated paths, queries, tokens and bodies on the admin API: never a 5xx."""
    proxy, key = fuzzed
    method, path = data.draw(_admin_path(data.draw(_segment), data.draw(_query)))
    token = data.draw(
        st.sampled_from(
            [[bearer(ADMIN)]] * 4
            + [[], [bearer(key)], [("Authorization", b"Bearer \xff")], [bearer(ADMIN)] * 2]
        )
    )
    check_answer(send(proxy.port, method, path, token, data.draw(_admin_bodies)))


# --- written by hand -------------------------------------------------------------------------

K = "{key}"  # replaced by the production key
DEEP = b"[" * 5000 + b"]" * 5000
_HAND: list[tuple[str, str | bytes, list[Header], bytes]] = [
    # bodies that are not a JSON object
    ("POST", "/v1/completions", [bearer(K)], b""),
    ("POST", "/v1/completions", [bearer(K)], b"null"),
    ("POST", "/v1/completions", [bearer(K)], b"[]"),
    ("POST", "/v1/completions", [bearer(K)], b'"prompt"'),
    ("POST", "/v1/completions", [bearer(K)], b"{"),
    ("POST", "/v1/completions", [bearer(K)], b'{"model": "ensemble",}'),
    ("POST", "/v1/completions", [bearer(K)], b"\xef\xbb\xbf{}"),
    ("POST", "/v1/completions", [bearer(K)], '{"prompt": "hé"}'.encode("utf-16")),
    ("POST", "/v1/completions", [bearer(K)], b'{"model": "ens\xffemble"}'),
    ("POST", "/v1/completions", [bearer(K)], b'{"prompt": "\\ud800"}'),
    ("POST", "/v1/completions", [bearer(K)], DEEP),
    ("POST", "/v1/chat/completions", [bearer(K)], b'{"messages": ' + DEEP + b"}"),
    ("POST", "/v1/completions", [bearer(K)], b'{"max_tokens": 1e400}'),
    ("POST", "/v1/completions", [bearer(K)], b'{"max_tokens": 184467440737095516160000}'),
    ("POST", "/v1/completions", [bearer(K)], b'{"max_tokens": NaN}'),
    ("POST", "/v1/completions", [bearer(K)], b"{" + b'"a":1,' * 20000 + b'"b":2}'),
    ("POST", "/v1/completions", [bearer(K)], b"x" * (4 << 20) + b"x"),
]
_FIELDS_BAD: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {"messages": ["hi"]}),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [1]}),
    ("/v1/chat/completions", {"messages": [None]}),
    ("/v1/chat/completions", {"messages": [[]]}),
    ("/v1/chat/completions", {"messages": [[[[["x"]]]]]}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": {"role": "user", "content": "hi"}}),
    ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [1]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": {"text": "x"}}]}),
    ("/v1/chat/completions", {"messages": [{"role": "{content}", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "{role}{0}{x.y}"}]}),
    ("/v1/completions", {"prompt": None}),
    ("/v1/completions", {"prompt": 42}),
    ("/v1/completions", {"prompt": [1, 2, 3]}),
    ("/v1/completions", {"prompt": ["a", "b"]}),
    ("/v1/completions", {"prompt": [["a"]]}),
    ("/v1/completions", {"model": None}),
    ("/v1/completions", {"model": ""}),
    ("/v1/completions", {"model": ["ensemble"]}),
    ("/v1/completions", {"model": "not-served"}),
    ("/v1/completions", {"max_tokens": -1}),
    ("/v1/completions", {"max_tokens": 5}),
    ("/v1/completions", {"max_tokens": 2**64 - 1}),
    ("/v1/completions", {"max_tokens": True}),
    ("/v1/completions", {"max_tokens": 1.5}),
    ("/v1/completions", {"max_tokens": "2"}),
    ("/v1/completions", {"max_completion_tokens": "many"}),
    ("/v1/completions", {"temperature": -0.1}),
    ("/v1/completions", {"temperature": "hot"}),
    ("/v1/completions", {"temperature": 1e308}),
    ("/v1/completions", {"top_p": 2}),
    ("/v1/completions", {"top_k": -1}),
    ("/v1/completions", {"top_k": 2**40}),
    ("/v1/completions", {"seed": -5}),
    ("/v1/completions", {"seed": 2**63}),
    ("/v1/completions", {"stop": ""}),
    ("/v1/completions", {"stop": [""]}),
    ("/v1/completions", {"stop": ["x"] * 17}),
    ("/v1/completions", {"stop": {"a": 1}}),
    ("/v1/completions", {"n": 2}),
    ("/v1/completions", {"n": 0}),
    ("/v1/completions", {"stream": "yes"}),
    ("/v1/completions", {"stream": 1}),
    ("/v1/completions", {"prompt": "x" * 5000}),
    ("/v1/completions", {"prompt": "\u0000\u0001\u001f"}),
    ("/v2/models/ensemble/generate", {"text_input": None}),
    ("/v2/models/ensemble/generate", {"text_input": ["a"]}),
    ("/v2/models/ensemble/generate", {"bad_words": "x", "text_input": "a"}),
    ("/v2/models/ensemble/generate", {"bad_words": [""], "text_input": "a"}),
    ("/v2/models/ensemble/generate", {"stop_words": [1], "text_input": "a"}),
    ("/v2/models/ensemble/generate", {"random_seed": -1, "text_input": "a"}),
    ("/v2/models/ensemble/generate", {"exclude_input_in_output": "no", "text_input": "a"}),
    ("/v2/models/ensemble/generate_stream", {"stream": "x", "text_input": "a"}),
    ("/v2/models/ensemble/generate_stream", {"text_input": "é" * 2000}),
    ("/v2/models/nope/generate", {"text_input": "a"}),
]
for _path, _fields in _FIELDS_BAD:
    _HAND.append(("POST", _path, [bearer(K)], orjson.dumps({**_valid, **_fields})))
_HAND += [
    # headers
    ("POST", "/v1/completions", [bearer(K), ("X-Kvl-Episode", b"\xff\xfe")], orjson.dumps(_valid)),
    ("POST", "/v1/completions", [bearer(K), ("X-Kvl-Episode", "e" * 129)], orjson.dumps(_valid)),
    ("POST", "/v1/completions", [bearer(K), ("X-Kvl-Episode", b"a\x00b")], orjson.dumps(_valid)),
    ("POST", "/v1/completions", [bearer(K), ("X-Kvl-Episode", "1"), ("X-Kvl-Episode", "2")], b"{}"),
    ("POST", "/v1/completions", [("Authorization", b"Bearer \xc3\xa9")], orjson.dumps(_valid)),
    ("POST", "/v1/completions", [("Authorization", b"Bearer \xff")], orjson.dumps(_valid)),
    ("POST", "/v1/completions", [bearer(K), bearer(K)], orjson.dumps(_valid)),
    ("POST", "/v1/completions", [("Authorization", "Bearer")], orjson.dumps(_valid)),
    ("POST", "/v1/completions", [("Authorization", "Bearer " + "k" * 6000)], b"{}"),
    ("POST", "/v1/completions", [("X-Api-Key", b"\xe2\x82\xac")], orjson.dumps(_valid)),
    ("POST", "/v1/completions", [("X-Api-Key", K), ("X-Api-Key", K)], orjson.dumps(_valid)),
    ("POST", "/v1/completions", [bearer(K), ("Content-Encoding", "br")], b"\x8b\x00garbage"),
    ("POST", "/v1/completions", [bearer(K), ("Content-Encoding", "deflate")], b"\x78\x9cbroken"),
    ("POST", "/v1/completions", [bearer(K), ("Content-Encoding", "gzip")], b"\x1f\x8bbroken"),
    ("POST", "/v1/completions", [bearer(K), ("Content-Encoding", "gzip, br")], b"{}"),
    ("POST", "/v1/completions", [bearer(K), ("Content-Encoding", "zstd")], b"(\xb5/\xfd bad"),
    (
        "POST",
        "/v1/completions",
        [bearer(K), ("Content-Encoding", "gzip")],
        gzip.compress(b"[" * 100_000),  # small on the wire, deep once decoded
    ),
    (
        "POST",
        "/v1/completions",
        [bearer(K), ("Content-Encoding", "gzip")],
        gzip.compress(b" " * (8 << 20)),  # a decompression bomb past max_body_bytes
    ),
    (
        "POST",
        "/v1/completions",
        [bearer(K), ("Transfer-Encoding", "chunked")],
        b"zz\r\nx\r\n0\r\n\r\n",
    ),
    ("POST", "/v1/completions", [bearer(K), ("Content-Length", "-1")], b"{}"),
    ("POST", "/v1/completions", [bearer(K), ("Content-Length", "abc")], b"{}"),
    ("POST", "/v1/completions", [bearer(K), ("X-Bad\x00Name", "v")], orjson.dumps(_valid)),
    # paths and methods
    ("GET", "/v1/completions", [bearer(K)], b""),
    ("DELETE", "/v1/chat/completions", [bearer(K)], b""),
    ("POST", "/v2/models/%ff/generate", [bearer(K)], orjson.dumps(_valid)),
    ("POST", "/v2/models/ensemble/versions/%00/generate", [bearer(K)], orjson.dumps(_valid)),
    ("GET", "/v1/models/%ff%fe", [bearer(K)], b""),
    ("GET", "/v1/models/" + "m" * 4000, [bearer(K)], b""),
    ("GET", b"/nowhere/\xff\xfe", [], b""),
    # admin
    ("GET", "/admin/keys", [], b""),
    ("GET", "/admin/keys", [bearer("wrong")], b""),
    ("GET", "/admin/keys", [("Authorization", b"Bearer admin-secr\xc3\xa9t")], b""),
    ("GET", "/admin/keys", [bearer(ADMIN), bearer(ADMIN)], b""),
    ("GET", "/admin/lineage?count=%C2%B2", [bearer(ADMIN)], b""),
    ("GET", "/admin/lineage?count=1&count=2", [bearer(ADMIN)], b""),
    ("GET", "/admin/lineage?count=99999999999999999999", [bearer(ADMIN)], b""),
    ("GET", "/admin/lineage?replica=%ff&key=%00", [bearer(ADMIN)], b""),
    ("GET", "/admin/lineage/%ff", [bearer(ADMIN)], b""),
    ("GET", "/admin/generations?replica=r1&count=0", [bearer(ADMIN)], b""),
    ("POST", "/admin/keys", [bearer(ADMIN)], b'{"name": "a b", "mode": "production"}'),
    ("POST", "/admin/keys", [bearer(ADMIN)], b'{"name": "x", "mode": "production", "cache": 1}'),
    ("POST", "/admin/keys", [bearer(ADMIN)], b'{"name": "x", "mode": "eval", "cache": "nope"}'),
    ("POST", "/admin/keys", [bearer(ADMIN)], b'{"name": "x", "mode": "eval", "cache": "replay:"}'),
    (
        "POST",
        "/admin/keys",
        [bearer(ADMIN)],
        b'{"name": "x", "mode": "eval", "cache": "reset", "idle_timeout_s": true}',
    ),
    (
        "POST",
        "/admin/keys",
        [bearer(ADMIN)],
        b'{"name": "x", "mode": "eval", "cache": "reset", "replica": "r9"}',
    ),
    ("POST", "/admin/keys", [bearer(ADMIN)], b'{"name": ["x"]}'),
    ("POST", "/admin/keys", [bearer(ADMIN)], b"[]"),
    ("DELETE", "/admin/keys/%ff", [bearer(ADMIN)], b""),
    ("POST", "/admin/replicas/%ff/drain", [bearer(ADMIN)], b""),
    ("POST", "/admin/replicas/r9/reset", [bearer(ADMIN)], b""),
    ("POST", "/admin/runs", [bearer(ADMIN)], b'{"arm": 1}'),
    ("POST", "/admin/runs", [bearer(ADMIN)], b'{"arm": "nobody"}'),
    ("POST", "/admin/runs", [bearer(ADMIN)], orjson.dumps({"arm": KEY_NAME})),
    ("POST", "/admin/runs", [bearer(ADMIN)], orjson.dumps({"arm": KEY_NAME, "model": [1]})),
    ("GET", "/admin/runs?arm=%ff&count=x", [bearer(ADMIN)], b""),
    ("GET", "/admin/runs/%ff", [bearer(ADMIN)], b""),
    ("POST", "/admin/runs/nobody.1/end", [bearer(ADMIN)], b""),
    ("POST", "/admin/snapshots", [bearer(ADMIN)], b'{"name": "bad name"}'),
    ("POST", "/admin/snapshots", [bearer(ADMIN)], b'{"name": "s", "from_run": 5}'),
    ("POST", "/admin/snapshots", [bearer(ADMIN)], b'{"name": "s", "from_run": "nobody.1"}'),
    ("POST", "/admin/snapshots", [bearer(ADMIN)], b'{"name": "s", "from_run": "x", "upto": "1"}'),
    ("POST", "/admin/snapshots", [bearer(ADMIN)], b'{"name": "s", "requests": "x"}'),
    ("POST", "/admin/snapshots", [bearer(ADMIN)], b'{"name": "s", "requests": [1]}'),
    ("POST", "/admin/snapshots", [bearer(ADMIN)], b'{"name": "s", "requests": [{"prompt": 1}]}'),
    ("POST", "/admin/snapshots", [bearer(ADMIN)], b'{"name": "s", "model": 3, "requests": []}'),
    ("GET", "/admin/snapshots/%ff", [bearer(ADMIN)], b""),
    ("DELETE", "/admin/snapshots/nothing", [bearer(ADMIN)], b""),
]


def _ids(case: tuple[str, str | bytes, list[Header], bytes]) -> str:
    method, path, headers, body = case
    return f"{method} {path[:40]} {[h[0] for h in headers]} {body[:30]!r}"


@pytest.mark.parametrize("case", _HAND, ids=[_ids(c) for c in _HAND])
def test_hand_written_malformed_requests(
    fuzzed: tuple[ProxyProcess, str], case: tuple[str, str | bytes, list[Header], bytes]
) -> None:
    """Each known way of getting a request wrong is a 4xx (or served): never a 5xx."""
    proxy, key = fuzzed
    method, path, headers, body = case
    real = [(name, key if value == K else _key_in(value, key)) for name, value in headers]
    check_answer(send(proxy.port, method, path, real, body))


def _key_in(value: str | bytes, key: str) -> str | bytes:
    if isinstance(value, str) and K in value:
        return value.replace(K, key)
    return value


def test_the_proxy_still_serves_after_the_fuzzing(fuzzed: tuple[ProxyProcess, str]) -> None:
    """After everything above (this test runs last in the module), a real request is served."""
    proxy, key = fuzzed
    check_still_serves(proxy, key)
