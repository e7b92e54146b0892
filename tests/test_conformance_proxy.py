"""What the proxy answers and records in front of a replica that behaves as a GPU replica does
(issue 23, points 1, 2, 3 and 5), over the openai SDK and raw HTTP, against a stand-in replica
with a small engine: built ``max_input_len`` 48, ``max_seq_len`` 96, 8 tokens per block, so the
runtime's prompt limit (95: ``max_seq_len - 1``, trtGptModel.h) differs from the built one and
the block size from the proxy's config (16)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import orjson
import pytest
import urllib3

from backends.sim.launcher import ReplicaSpec, config_snippet, launch
from backends.sim.repository import ModelSettings
from router.cli.local import ProxyProcess, create_key
from tests.servers import RedisServer

pytestmark = pytest.mark.triton
HTTP = urllib3.PoolManager()
SMALL = ModelSettings(tokens_per_block=8, max_input_len=48, max_seq_len=96)
LIMIT = 95


class Stack:
    """One small-engine replica, and two proxies over HTTP in front of it: one that knows the
    tokenizer's bytes per token (refuses before the replica), one that does not (the engine
    refuses), both configured with the wrong block size."""

    def __init__(self, checked: ProxyProcess, blind: ProxyProcess, key: str) -> None:
        self.checked, self.blind, self.key = checked, blind, key

    def post(self, proxy: ProxyProcess, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        response = HTTP.request(
            "POST",
            proxy.url + path,
            body=orjson.dumps(body),
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
            retries=False,
        )
        data = response.data
        if body.get("stream") or path.endswith("_stream"):
            events = [
                orjson.loads(line[5:])
                for line in data.splitlines()
                if line.startswith(b"data:") and line.strip() != b"data: [DONE]"
            ]
            return response.status, events
        return response.status, orjson.loads(data)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    redis = RedisServer()
    redis.start()
    with launch([ReplicaSpec("small", SMALL)]) as (replica,):
        snippet = config_snippet([replica]).replace(
            "[[replicas]]\n", '[[replicas]]\ntransport = "http"\n'
        )
        snippet = snippet.replace("tokens_per_block = 8", "tokens_per_block = 16")
        checked = ProxyProcess(snippet, redis.url, monitor_interval_s=0.3)
        blind = ProxyProcess(
            snippet.replace("max_token_bytes = 1\n", ""), redis.url, monitor_interval_s=0.3
        )
        checked.start()
        try:
            blind.start()
            try:
                yield Stack(checked, blind, create_key(redis.url, "conformance"))
            finally:
                blind.stop()
        finally:
            checked.stop()
            redis.close()


def test_the_prompt_limit_is_the_runtimes_and_a_longer_prompt_is_refused_first(
    stack: Stack,
) -> None:
    """A prompt over the built max_input_len but within the runtime's limit is served; one token
    over the runtime's limit is a 400 naming that limit, before any replica (fails on main:
    the built 48 was taken for the limit)."""
    status, body = stack.post(
        stack.checked, "/v1/completions", {"model": "ensemble", "prompt": "a" * 60, "max_tokens": 2}
    )
    assert status == 200, body
    status, body = stack.post(
        stack.checked,
        "/v1/completions",
        {"model": "ensemble", "prompt": "b" * (LIMIT + 1), "max_tokens": 2},
    )
    assert status == 400, body
    assert str(LIMIT) in body["error"]["message"] and body["error"]["param"] == "prompt"


def test_the_engines_own_refusal_is_a_400_and_the_replica_stays_in_service(
    stack: Stack,
) -> None:
    """A proxy that cannot tell the prompt's tokens passes it on; the engine refuses it as a GPU
    replica does (INTERNAL, HTTP 500, "Prompt length (N) exceeds maximum input length (M)"),
    and the client gets a 400 with that message, while the replica keeps serving (fails on
    main: a 502 upstream failure)."""
    body = {"model": "ensemble", "prompt": "c" * (LIMIT + 5), "max_tokens": 2}
    status, answer = stack.post(stack.blind, "/v1/completions", body)
    assert status == 400, answer
    assert "exceeds maximum input length" in answer["error"]["message"]
    status, answer = stack.post(
        stack.blind, "/v1/completions", {"model": "ensemble", "prompt": "after", "max_tokens": 2}
    )
    assert status == 200, answer


def test_an_answer_clamped_at_max_seq_len_ends_for_length(stack: Stack) -> None:
    """Prompt + max_tokens past max_seq_len is served, its output cut at max_seq_len - prompt,
    and the answer says finish_reason "length" with the true token count."""
    sdk = openai.OpenAI(base_url=stack.checked.url + "/v1", api_key=stack.key, max_retries=0)
    for attempt in range(12):  # a prompt whose greedy output does not end on its own first
        prompt = f"clamp {attempt} " + "x" * 70
        answer = sdk.completions.create(
            model="ensemble", prompt=prompt, max_tokens=60, temperature=0.0
        )
        assert answer.usage is not None
        room = 96 - answer.usage.prompt_tokens
        assert answer.usage.completion_tokens <= room
        if answer.usage.completion_tokens == room:
            assert answer.choices[0].finish_reason == "length"
            return
    pytest.skip("every prompt met an end token before the clamp")


def test_streamed_and_not_report_the_same_tokens_and_cache(stack: Stack) -> None:
    """The same prompt and seed, streamed and not, on the same warm cache: the same
    completion_tokens, cached_tokens and reused blocks (fails on main when each streamed
    response carries its own num_output_tokens: the stream reported about 1)."""
    prompt = "the same prompt, streamed or not: s"  # within the built limit: main serves it
    body = {"model": "ensemble", "prompt": prompt, "max_tokens": 12, "seed": 7}
    status, warm = stack.post(stack.checked, "/v1/completions", body)
    assert status == 200, warm
    status, whole = stack.post(stack.checked, "/v1/completions", body)
    assert status == 200, whole
    status, events = stack.post(stack.checked, "/v1/completions", {**body, "stream": True})
    assert status == 200, events
    last = events[-1]
    streamed_text = "".join(c["text"] for e in events for c in e.get("choices", []))
    assert streamed_text == whole["choices"][0]["text"]
    assert last["usage"] == whole["usage"]
    assert last["usage"]["completion_tokens"] == whole["kvledger"]["completion_tokens"] > 1
    assert last["kvledger"]["reused_blocks"] == whole["kvledger"]["reused_blocks"] > 0


def test_cached_tokens_use_the_engines_block_size_and_never_reach_the_prompt(
    stack: Stack,
) -> None:
    """cached_tokens is reused blocks x the engine's block size (config.json's 8, not the
    proxy config's 16), an estimate never above prompt_tokens - 1 (fails on main: 16 a block,
    and a fully reused prompt reported as wholly cached)."""
    prompt = "p" * 40  # five whole blocks of 8, within the built limit
    body = {"model": "ensemble", "prompt": prompt, "max_tokens": 2}
    for _ in range(2):
        status, answer = stack.post(stack.checked, "/v1/completions", body)
        assert status == 200, answer
    record, usage = answer["kvledger"], answer["usage"]
    assert record["reused_blocks"] > 0
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == min(record["reused_blocks"] * 8, usage["prompt_tokens"] - 1)
    assert cached <= usage["prompt_tokens"] - 1


def test_generate_stream_passes_each_engine_response_through(stack: Stack) -> None:
    """generate_stream answers one event per engine response, each with every output the
    ensemble returned (log probs when asked: return_log_probs is passed on), then the ledger's
    event; generate answers them in one body (fails on main: merged text events only, and
    return_log_probs refused or dropped)."""
    body = {"text_input": "pass it through", "max_tokens": 6, "return_log_probs": True}
    status, events = stack.post(stack.checked, "/v2/models/ensemble/generate_stream", body)
    assert status == 200, events
    *engine, ledger = events
    assert "kvledger" in ledger
    completion = ledger["kvledger"]["completion_tokens"]
    assert len(engine) == completion  # one event per token: one per engine response
    assert all("output_log_probs" in e and "num_output_tokens" in e for e in engine), engine
    assert sum(e["num_output_tokens"] for e in engine) == completion
    status, whole = stack.post(stack.checked, "/v2/models/ensemble/generate", body)
    assert status == 200, whole
    assert "cum_log_probs" in whole and "output_log_probs" in whole and "kvledger" in whole


@pytest.mark.parametrize(
    ("extra", "complaint"),
    [
        ({"no_such_input": 1}, "is not an input of model"),
        ({"return_log_probs": "yes"}, "must be a bool"),
        ({"beam_width": 1.5}, "must be a int32"),
    ],
)
def test_generate_refuses_unknown_inputs_and_wrong_types(
    stack: Stack, extra: dict[str, Any], complaint: str
) -> None:
    """An input the model does not declare, or one of the wrong type for its config, is a 400
    naming it, before any replica."""
    body = {"text_input": "typed", "max_tokens": 2, **extra}
    status, answer = stack.post(stack.checked, "/v2/models/ensemble/generate", body)
    assert status == 400, answer
    assert complaint in answer["error"]["message"]
    assert answer["error"]["param"] == next(iter(extra))
