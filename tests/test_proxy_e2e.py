"""End to end: openai SDK and plain HTTP → kvledger (its own process) → stand-in Triton replicas."""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
import urllib3
from prometheus_client.parser import text_string_to_metric_families

from backends.sim.launcher import Replica
from policies import prefix_block_hashes, rendezvous_order
from tests.ledger_view import LedgerView
from tests.proxy_harness import Proxy
from tests.servers import RedisServer
from tests.triton_helpers import reset

HTTP = urllib3.PoolManager()
LONG_PREFIX = "You are a meticulous research agent with tools. " * 8


@pytest.fixture(scope="module")
def stack(replicas: dict[str, Replica]) -> Iterator[tuple[Proxy, str, LedgerView]]:
    """A proxy in front of r1 and r2 with its own Redis, and a production key."""
    redis = RedisServer()
    redis.start()
    proxy = Proxy([replicas["r1"], replicas["r2"]], redis.url)
    proxy.start()
    key = proxy.create_key("e2e")
    try:
        yield proxy, key, LedgerView(redis.url)
    finally:
        proxy.stop()
        redis.close()


def client(proxy: Proxy, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0)


def post(proxy: Proxy, path: str, body: Any, key: str | None, **headers: str) -> Any:
    all_headers = {"Content-Type": "application/json", **headers}
    if key is not None:
        all_headers["Authorization"] = f"Bearer {key}"
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    return HTTP.request("POST", proxy.url + path, body=data, headers=all_headers, retries=False)


def sse(data: bytes) -> list[Any]:
    return [
        orjson.loads(line[6:])
        for line in data.splitlines()
        if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]


def assert_annotated(
    headers: Any, record: dict[str, Any], stored: dict[str, Any] | None, *, stream: bool = False
) -> None:
    """Headers and body say what Redis stored. A stream's headers leave before its chain step,
    so they carry what the proxy knows then (replica, generation); its last event the rest."""
    assert stored == record
    assert headers["X-Request-Id"] == record["request_id"]
    assert headers["X-Kvl-Replica"] == record["replica"]
    assert int(headers["X-Kvl-Generation"]) == record["generation"]
    if stream:
        assert "X-Kvl-Seq" not in headers and "X-Kvl-State" not in headers
    else:
        assert int(headers["X-Kvl-Seq"]) == record["seq"]
        assert headers["X-Kvl-State"] == record["state_before"]
    assert record["state_after"] and record["status"] == "ok"
    assert record["state_known"] is not None and not record["stale"]


def test_openai_fronts_annotate_and_match_redis(stack: tuple[Proxy, str, LedgerView]) -> None:
    """Chat and completions, streamed or not: headers and body equal the stored record."""
    proxy, key, ledger = stack
    sdk = client(proxy, key)
    raw = sdk.chat.completions.with_raw_response.create(
        model="ensemble",
        max_tokens=8,
        messages=[{"role": "user", "content": "hi " + uuid.uuid4().hex}],
    )
    chat = raw.parse()
    record = chat.model_extra["kvledger"]
    assert_annotated(raw.headers, record, ledger.record(record["request_id"]))
    assert chat.usage.prompt_tokens_details.cached_tokens == record["cached_tokens"]

    raw_stream = sdk.chat.completions.with_raw_response.create(
        model="ensemble",
        max_tokens=8,
        stream=True,
        messages=[{"role": "user", "content": "stream " + uuid.uuid4().hex}],
    )
    chunks = list(raw_stream.parse())
    streamed = [c.model_extra["kvledger"] for c in chunks if c.model_extra.get("kvledger")]
    assert len(streamed) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The record's output digest is of exactly the text the client received.
    assert streamed[0]["output_digest"] == hashlib.sha256(text.encode()).hexdigest()
    stored = ledger.record(streamed[0]["request_id"])
    assert_annotated(raw_stream.headers, streamed[0], stored, stream=True)

    completion = post(
        proxy,
        "/v1/completions",
        {"model": "ensemble", "prompt": "c " + uuid.uuid4().hex, "max_tokens": 6},
        key,
    )
    body = orjson.loads(completion.data)
    assert_annotated(
        completion.headers, body["kvledger"], ledger.record(body["kvledger"]["request_id"])
    )


def test_triton_fronts_annotate_and_match_redis(stack: tuple[Proxy, str, LedgerView]) -> None:
    """Generate and generate_stream: headers and body (last event) equal the stored record."""
    proxy, key, ledger = stack
    generate = post(
        proxy,
        "/v2/models/ensemble/generate",
        {"text_input": "g " + uuid.uuid4().hex, "max_tokens": 6},
        key,
    )
    body = orjson.loads(generate.data)
    assert body["text_output"].startswith("g ")
    assert_annotated(
        generate.headers, body["kvledger"], ledger.record(body["kvledger"]["request_id"])
    )

    stream = post(
        proxy,
        "/v2/models/ensemble/generate_stream",
        {"text_input": "gs " + uuid.uuid4().hex, "max_tokens": 6},
        key,
    )
    events = sse(stream.data)
    assert "kvledger" in events[-1] and all("kvledger" not in e for e in events[:-1])
    record = events[-1]["kvledger"]
    assert_annotated(stream.headers, record, ledger.record(record["request_id"]), stream=True)


def test_identical_requests_chain_and_reuse(stack: tuple[Proxy, str, LedgerView]) -> None:
    """The same request twice: one replica, seq +1, chained states, reused blocks, cached tokens."""
    proxy, key, _ = stack
    sdk = client(proxy, key)
    messages = [
        {"role": "system", "content": LONG_PREFIX},
        {"role": "user", "content": "twice " + uuid.uuid4().hex},
    ]
    first = sdk.chat.completions.create(model="ensemble", max_tokens=4, messages=messages)
    second = sdk.chat.completions.create(model="ensemble", max_tokens=4, messages=messages)
    a, b = first.model_extra["kvledger"], second.model_extra["kvledger"]
    assert a["replica"] == b["replica"]
    assert b["seq"] == a["seq"] + 1
    assert b["state_before"] == a["state_after"]
    assert b["reused_blocks"] > 0
    assert second.usage.prompt_tokens_details.cached_tokens == b["reused_blocks"] * 16 > 0


def prompt_for(replica: str, ids: list[str]) -> str:
    """A prompt whose leading block prefix_affinity sends to ``replica``."""
    for _ in range(200):
        prompt = uuid.uuid4().hex * 2 + " " + LONG_PREFIX
        home = rendezvous_order(prefix_block_hashes(prompt, 16, 1)[0], ids)[0]
        if home == replica:
            return prompt
    raise AssertionError("no prompt maps to " + replica)


def test_reload_behind_the_proxy_raises_the_generation(
    stack: tuple[Proxy, str, LedgerView], replicas: dict[str, Replica]
) -> None:
    """Unload+load straight on Triton: generation +1, the reason logged, chain at genesis."""
    proxy, key, ledger = stack
    prompt = prompt_for("r2", ["r1", "r2"])
    body = {"model": "ensemble", "prompt": prompt, "max_tokens": 4}
    before = orjson.loads(post(proxy, "/v1/completions", body, key).data)["kvledger"]
    assert before["replica"] == "r2"
    reset(replicas["r2"])
    deadline = time.monotonic() + 15
    while ledger.head("r2")["generation"] == before["generation"] and time.monotonic() < deadline:
        time.sleep(0.2)
    head = ledger.head("r2")
    assert head["generation"] == before["generation"] + 1
    reasons = [g for g in ledger.generations() if g["replica"] == "r2"]
    assert reasons[-1]["generation"] == head["generation"]
    reason = reasons[-1]["reason"]
    assert any(why in reason for why in ("unavailable", "backwards", "restart or reload")), reason
    after = orjson.loads(post(proxy, "/v1/completions", body, key).data)["kvledger"]
    assert after["replica"] == "r2"
    assert after["generation"] == head["generation"]
    assert after["seq"] == 0
    assert after["state_before"] == ledger.genesis(after["engine_digest"])
    assert after["state_known"] is True
    assert after["reused_blocks"] == 0


@pytest.mark.parametrize(
    ("status", "path", "body", "key"),
    [
        (401, "/v1/chat/completions", {"model": "ensemble", "messages": []}, "kvl-wrong"),
        (401, "/v1/completions", {"model": "ensemble", "prompt": "x"}, None),
        (400, "/v1/chat/completions", b"{not json", "KEY"),
        (400, "/v1/chat/completions", {"model": "ensemble"}, "KEY"),
        (400, "/v1/chat/completions", {"model": "ensemble", "messages": "hi"}, "KEY"),
        (400, "/v1/completions", {"model": "ensemble", "prompt": "x", "max_tokens": "9"}, "KEY"),
        (400, "/v1/completions", {"model": "ensemble", "prompt": "x", "temperature": -1}, "KEY"),
        (400, "/v2/models/ensemble/generate", {"max_tokens": 3}, "KEY"),
        (400, "/v2/models/ensemble/generate", {"text_input": "x", "max_tokens": -3}, "KEY"),
        (404, "/v1/completions", {"model": "nope", "prompt": "x"}, "KEY"),
        (404, "/v2/models/nope/generate", {"text_input": "x"}, "KEY"),
        (413, "/v1/completions", {"model": "ensemble", "prompt": "x" * (2 << 20)}, "KEY"),
    ],
)
def test_bad_input_gets_a_clear_4xx(
    stack: tuple[Proxy, str, LedgerView], status: int, path: str, body: Any, key: str | None
) -> None:
    """Client mistakes get the right 4xx with an OpenAI-shaped error body, never a 500."""
    proxy, real_key, _ = stack
    response = post(proxy, path, body, real_key if key == "KEY" else key)
    assert response.status == status
    error = orjson.loads(response.data)["error"]
    assert error["message"] and error["type"] and error["code"]


@pytest.mark.parametrize(
    ("path", "headers"),
    [
        ("/v2/models/ensemble/generate", {}),  # the edge
        ("/v2/models/ensemble/generate?trace=1", {}),  # a query string: the application's router
        ("/v2/models/%65nsemble/generate", {}),  # a percent-escape: the router decodes it
        ("/v2/models/ensemble/versions/1/generate", {}),
        ("/v2/models/ensemble/generate", {"Expect": "100-continue"}),
        ("/v1/completions", {}),
        ("/v1/completions?trace=1", {}),
    ],
)
def test_every_spelling_of_a_generation_route_is_served_alike(
    stack: tuple[Proxy, str, LedgerView], path: str, headers: dict[str, str]
) -> None:
    """The generation routes answer the same whether the edge serves them or the application's
    router does (router/http/edge.py): a 200 with the record in headers, body and Redis."""
    proxy, key, ledger = stack
    text = "spelling " + uuid.uuid4().hex
    if path.startswith("/v1/"):
        body: dict[str, Any] = {"model": "ensemble", "prompt": text, "max_tokens": 3}
    else:
        body = {"text_input": text, "max_tokens": 3}
    response = post(proxy, path, body, key, **headers)
    assert response.status == 200, response.data
    record = orjson.loads(response.data)["kvledger"]
    assert_annotated(response.headers, record, ledger.record(record["request_id"]))


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("POST", "/v2/models/nope/generate", 404),  # the edge: a model not served here
        ("POST", "/v2/models/a{b/generate", 404),  # not a model name: the router's 404
        ("POST", "/v2/models/ensemble/generate/", 404),
        ("GET", "/v1/completions", 405),
        ("GET", "/v2/models/ensemble/generate", 405),
    ],
)
def test_refusals_around_the_generation_routes_are_openai_shaped(
    stack: tuple[Proxy, str, LedgerView], method: str, path: str, status: int
) -> None:
    proxy, key, _ = stack
    response = HTTP.request(
        method, proxy.url + path, body=b"{}", headers={"Authorization": f"Bearer {key}"}
    )
    assert response.status == status
    error = orjson.loads(response.data)["error"]
    assert error["message"] and error["type"] and error["code"]


def _scrape(proxy: Proxy) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    page = HTTP.request("GET", proxy.url + "/metrics").data.decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
    }


def test_metrics_count_every_request_by_replica_and_status(
    stack: tuple[Proxy, str, LedgerView],
) -> None:
    """/metrics: each answered request counts once on its replica, in ``kvl_requests_total``
    and in both histograms, whose buckets are cumulative up to ``+Inf`` (the count)."""
    proxy, key, _ = stack
    before = _scrape(proxy)
    served: dict[str, int] = {}
    for i in range(5):
        response = post(proxy, "/v2/models/ensemble/generate", {"text_input": f"m{i} " * 20}, key)
        assert response.status == 200
        replica = response.headers["X-Kvl-Replica"]
        served[replica] = served.get(replica, 0) + 1
    after = _scrape(proxy)
    for replica, count in served.items():
        ok = ("kvl_requests_total", (("replica", replica), ("status", "ok")))
        assert after[ok] - before.get(ok, 0.0) == count
        assert ("kvl_requests_created", ok[1]) in after
        for histogram in ("kvl_request_latency_seconds", "kvl_time_to_first_token_seconds"):
            labels = (("replica", replica),)
            total = after[(histogram + "_count", labels)]
            assert total - before.get((histogram + "_count", labels), 0.0) == count
            assert after[(histogram + "_sum", labels)] > 0
            buckets = sorted(
                (float(dict(names)["le"]), value)
                for (name, names), value in after.items()
                if name == histogram + "_bucket" and dict(names)["replica"] == replica
            )
            counts = [value for _, value in buckets]
            assert counts == sorted(counts) and counts[-1] == total
            assert buckets[-1][0] == float("inf") and len(buckets) == 14
