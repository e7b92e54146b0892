"""The proxy in front of TensorRT-LLM's topology: what it records is what tensorrt_llm reported,
continuity watches the engine model, the engine digest sees engine files, reuse and precision,
and an abandoned request stops inside the engine."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import urllib3

from backends.sim.engine_files import EngineBuild, build_engine
from backends.sim.launcher import Replica, ReplicaSpec, launch
from backends.sim.repository import ModelSettings, engine_dir
from backends.triton import TritonBackend, TritonTarget
from tests.eval_helpers import begin, client, complete, end
from tests.ledger_view import LedgerView
from tests.proxy_harness import Proxy
from tests.servers import RedisServer
from tests.triton_helpers import engine_generate, metric, metrics, request_count, reset, wait_for

HTTP = urllib3.PoolManager()
PREFIX = "You are a meticulous research agent with tools. " * 8
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack(replicas: dict[str, Replica]) -> Iterator[tuple[Proxy, str, LedgerView]]:
    """A proxy in front of r1 and r2 with its own Redis, and a production key."""
    redis = RedisServer()
    redis.start()
    proxy = Proxy([replicas["r1"], replicas["r2"]], redis.url)
    proxy.start()
    try:
        yield proxy, proxy.create_key("topology"), LedgerView(redis.url)
    finally:
        proxy.stop()
        redis.close()


@pytest.fixture(scope="module")
def alone(replicas: dict[str, Replica]) -> Iterator[tuple[Proxy, str]]:
    """A proxy in front of r1 alone, so that no request can land elsewhere, and a key."""
    redis = RedisServer()
    redis.start()
    proxy = Proxy([replicas["r1"]], redis.url)
    proxy.start()
    try:
        yield proxy, proxy.create_key("topology-r1")
    finally:
        proxy.stop()
        redis.close()


def completion(proxy: Proxy, key: str, prompt: str, stream: bool) -> dict[str, Any]:
    """One /v1/completions through the proxy: its text, finish reason, usage and record.

    A 503 (the proxy has not yet seen a just-reloaded replica ready again) reached no replica,
    so it is asked again."""
    body = {"model": "ensemble", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream}
    deadline = time.monotonic() + 30
    while True:
        response = HTTP.request(
            "POST",
            proxy.url + "/v1/completions",
            body=orjson.dumps(body),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            retries=False,
        )
        if response.status != 503 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert response.status == 200, response.data
    if not stream:
        parsed = orjson.loads(response.data)
        choice = parsed["choices"][0]
        return {"text": choice["text"], "finish": choice["finish_reason"], **parsed}
    events = [
        orjson.loads(line[6:])
        for line in response.data.splitlines()
        if line.startswith(b"data: ") and line != b"data: [DONE]"
    ]
    choices = [e["choices"][0] for e in events if e.get("choices")]
    record = next(e["kvledger"] for e in events if "kvledger" in e)
    finish = next(c["finish_reason"] for c in choices if c["finish_reason"])
    return {"text": "".join(c["text"] for c in choices), "finish": finish, "kvledger": record}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_record_equals_what_the_engine_reported(
    alone: tuple[Proxy, str], replicas: dict[str, Replica], stream: bool
) -> None:
    """Through the ensemble (final response with or without outputs), the record's reused
    blocks, cached tokens, usage and finish reason are what tensorrt_llm reports for the same
    requests from the same cache state."""
    proxy, key = alone
    r1 = replicas["r1"]
    prefix = uuid.uuid4().hex + PREFIX
    first, second = prefix + "Task: one.", prefix + "Task: two."
    reset(r1)
    completion(proxy, key, first, stream)
    served = completion(proxy, key, second, stream)
    record = served["kvledger"]
    assert record["replica"] == "r1"
    reset(r1)
    engine_generate(r1, first, MAX_TOKENS, stream)
    direct = engine_generate(r1, second, MAX_TOKENS, stream)
    stats = direct.stats
    assert stats["kv_cache_reused_blocks"] > 0
    assert served["text"] == bytes(direct.ids).decode()
    assert record["reused_blocks"] == stats["kv_cache_reused_blocks"]
    assert record["new_blocks"] == stats["kv_cache_alloc_new_blocks"]
    assert record["total_blocks"] == stats["kv_cache_alloc_total_blocks"]
    # An estimate from blocks, never the whole prompt (the engine computes its last token).
    cached = min(stats["kv_cache_reused_blocks"] * 16, stats["num_input_tokens"] - 1)
    assert record["cached_tokens"] == cached
    assert record["prompt_tokens"] == stats["num_input_tokens"]
    # num_output_tokens counts each response's tokens: the request's are every token it sent.
    assert record["completion_tokens"] == len(direct.ids)
    engine_finish = "length" if len(direct.ids) == MAX_TOKENS else "stop"
    assert served["finish"] == engine_finish
    if not stream:
        usage = served["usage"]
        assert usage["prompt_tokens"] == stats["num_input_tokens"]
        assert usage["completion_tokens"] == len(direct.ids)
        assert usage["prompt_tokens_details"]["cached_tokens"] == record["cached_tokens"]


def test_prompt_over_max_input_len_is_a_client_error(
    stack: tuple[Proxy, str, LedgerView], replicas: dict[str, Replica]
) -> None:
    """A prompt longer than the runtime's limit (from the engine's own config and the
    tensorrt_llm parameters: chunked context, so max_seq_len - 1 = 36863): 400 naming the
    limit, answered by the proxy before any replica computes anything."""
    proxy, key, _ = stack
    counts = [request_count(replicas[r]) for r in ("r1", "r2")]
    body = {"model": "ensemble", "prompt": "z" * 36864, "max_tokens": 2}
    response = HTTP.request(
        "POST",
        proxy.url + "/v1/completions",
        body=orjson.dumps(body),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        retries=False,
    )
    assert response.status == 400, response.data
    error = orjson.loads(response.data)["error"]
    assert error["code"] == "context_length_exceeded" and "36863 input tokens" in error["message"]
    assert [request_count(replicas[r]) for r in ("r1", "r2")] == counts


def test_direct_engine_request_breaks_continuity(
    stack: tuple[Proxy, str, LedgerView], replicas: dict[str, Replica]
) -> None:
    """A request sent straight to tensorrt_llm of a leased replica during an eval run changes
    its cache without going through the ensemble: the run's next record says verified false."""
    proxy, _, _ = stack
    sdk = client(proxy, proxy.create_key("topology-arm", mode="eval", cache="reset"))
    run = begin(proxy, "topology-arm")
    try:
        _, _, before = complete(sdk, PREFIX + "Task: first.")
        assert before["verified"] is True
        engine_generate(replicas[run["replica"]], PREFIX + "A side door.", 2)
        _, headers, after = complete(sdk, PREFIX + "Task: second.")
        assert after["verified"] is False
        assert "1 request(s) outside run" in after["warning"]
        assert headers["x-kvl-warning"] == after["warning"]
    finally:
        end(proxy, run["id"])


def target(replica: Replica, **fields: Any) -> TritonTarget:
    return TritonTarget(replica.id, replica.grpc_url, replica.metrics_url, **fields)


async def digest_and_limit(replica: Replica, **fields: Any) -> tuple[str, int | None]:
    async with aiohttp.ClientSession() as http:
        backend = TritonBackend(target(replica, **fields), http)
        try:
            return await backend.engine_digest(), await backend.max_input_len()
        finally:
            await backend.close()


async def test_engine_digest_sees_reuse_and_precision(
    replicas: dict[str, Replica], tmp_path: Path
) -> None:
    """Identical replicas share an engine digest; one with reuse off, or with int4 weights
    instead of bf16, does not. The engine's max_input_len comes from its config.json."""
    with launch([ReplicaSpec("q4", ModelSettings(precision="int4"))], workdir=tmp_path) as (q4,):
        int4, _ = await digest_and_limit(q4)
    r1, limit = await digest_and_limit(replicas["r1"])
    r2, _ = await digest_and_limit(replicas["r2"])
    off, _ = await digest_and_limit(replicas["r3"])
    assert r1 == r2
    assert len({r1, off, int4}) == 3
    assert limit == 36863  # chunked context: max_seq_len (32768 + 4096) - 1 (trtGptModel.h)
    # An engine directory the proxy cannot read: no limit, and a digest all the same.
    unread, none = await digest_and_limit(replicas["r1"], engine_dir=str(tmp_path / "absent"))
    assert none is None and unread != r1


def test_replaced_engine_and_reload_raise_generation(tmp_path: Path) -> None:
    """New engine files take effect when the model is reloaded: the generation rises with
    reason "engine changed" and records carry the new digest; until then, the old one."""
    redis = RedisServer()
    redis.start()
    with launch([ReplicaSpec("e1")], workdir=tmp_path) as (replica,):
        proxy = Proxy([replica], redis.url)
        proxy.start()
        try:
            key, ledger = proxy.create_key("engines"), LedgerView(redis.url)
            old = completion(proxy, key, PREFIX + "Before.", False)["kvledger"]
            build_engine(engine_dir(replica.workdir), EngineBuild(precision="int4"))
            assert (
                completion(proxy, key, PREFIX + "Swapped.", False)["kvledger"]["engine_digest"]
                == old["engine_digest"]
            )
            reset(replica)
            wait_for(lambda: ledger.head("e1")["generation"] > old["generation"])
            reasons = [g["reason"] for g in ledger.generations("e1")]
            assert "engine changed" in reasons
            new = completion(proxy, key, PREFIX + "After.", False)["kvledger"]
            assert new["engine_digest"] != old["engine_digest"]
            assert new["generation"] > old["generation"] and new["reused_blocks"] == 0
        finally:
            proxy.stop()
            redis.close()


def test_abandoned_long_prompt_stops_in_the_engine(replicas: dict[str, Replica]) -> None:
    """A client that leaves while its 30,000-character prompt is in prefill: the proxy stops
    the request inside tensorrt_llm (the ensemble alone cannot), so the engine goes idle long
    before such a prefill would end."""
    redis = RedisServer()
    redis.start()
    r3 = replicas["r3"]  # reuse off: the prefill is computed, never found cached
    proxy = Proxy([r3], redis.url)
    # r3 serves cache=off eval arms by default; here it takes production traffic.
    proxy.config.write_text(
        proxy.config.read_text().replace("production = false", "production = true")
    )
    proxy.start()
    try:
        key = proxy.create_key("leaver")
        body = orjson.dumps({"text_input": "w" * 30000, "max_tokens": 4})
        request = (
            "POST /v2/models/ensemble/generate_stream HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        active = "nv_trt_llm_request_metrics"
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=60) as sock:
            sock.sendall(request)
            wait_for(lambda: metric(metrics(r3), active, request_type="active") == 1)
        # Without the stop the engine would compute this prefill for minutes on this machine.
        wait_for(lambda: metric(metrics(r3), active, request_type="active") == 0, 30)
    finally:
        proxy.stop()
        redis.close()
