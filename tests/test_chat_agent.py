"""The chat front as an agent harness drives it: the openai SDK's tool loop through the proxy,
against stand-in replicas whose tokenizer ships a chat template (ChatML-like, Hermes tools).

The stand-in's model is tiny and random: it never writes a tool call by itself. The harness
therefore plays the model's side of the loop as agent evals replay it: after every answer it
appends an assistant message with ``tool_calls`` (content null) and the tool's result, built
from the model's real output, so every turn's history depends on the previous answers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from backends.sim.launcher import Replica
from router.cli.up import chat_model_toml
from tests.eval_helpers import admin, begin, chained, client, end
from tests.ledger_view import LedgerView
from tests.proxy_harness import Proxy
from tests.servers import RedisServer

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "lookup_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TURNS = 5


@pytest.fixture(scope="module")
def stack(replicas: dict[str, Replica]) -> Iterator[tuple[Proxy, LedgerView]]:
    """A proxy whose model renders with the stand-in tokenizer's template, parser hermes."""
    redis = RedisServer()
    redis.start()
    running = list(replicas.values())
    proxy = Proxy(running, redis.url, extra=chat_model_toml(running))
    proxy.start()
    try:
        yield proxy, LedgerView(redis.url)
    finally:
        proxy.stop()
        redis.close()


def agent_loop(sdk: openai.OpenAI, turns: int = TURNS) -> tuple[list[str], list[dict[str, Any]]]:
    """``turns`` chat turns with tools; after each, a tool call and its result join the history.
    The answers' texts and kvledger records."""
    messages: list[Any] = [
        {"role": "system", "content": "You are a weather agent."},
        {"role": "user", "content": "What is the weather in Paris, then in Oslo?"},
    ]
    outputs, records = [], []
    for turn in range(turns):
        raw = sdk.chat.completions.with_raw_response.create(
            model="ensemble", messages=messages, tools=TOOLS, max_tokens=8, temperature=0
        )
        assert raw.http_response.status_code == 200
        answer = raw.parse()
        records.append(answer.model_extra["kvledger"])  # type: ignore[index]
        text = answer.choices[0].message.content or ""
        outputs.append(text)
        call_id = f"call_{turn}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": "lookup_weather",
                            "arguments": json.dumps({"city": text.strip()[:12] or "Paris"}),
                        },
                    }
                ],
            }
        )
        messages.append(
            {"role": "tool", "tool_call_id": call_id, "content": f"result {turn}: {text!r}"}
        )
    return outputs, records


def stored_prompts(proxy: Proxy, run: str) -> list[str]:
    """The run's stored inputs (what a snapshot of it holds): the rendered prompts."""
    status, body = admin(proxy, "POST", "/admin/snapshots", {"name": f"s-{run}", "from_run": run})
    assert status == 201, body
    status, body = admin(proxy, "GET", f"/admin/snapshots/s-{run}")
    assert status == 200, body
    return [entry["prompt"] for entry in body["requests"]]


def test_agent_tool_loop_on_a_reset_arm_is_verified_and_reruns_identically(
    stack: tuple[Proxy, LedgerView],
) -> None:
    """5 turns with tool-call messages and tool results, every turn 200; the run's records
    verified and chained; the rerun gives the same outputs and the same state chain; the
    stored inputs are the rendered template, holding the tools and the tool results."""
    proxy, ledger = stack
    sdk = client(proxy, proxy.create_key("agent-reset", mode="eval", cache="reset"))
    runs = []
    for _ in range(2):
        run = begin(proxy, "agent-reset")
        outputs, records = agent_loop(sdk)
        end(proxy, run["id"])
        runs.append((run, outputs, records))
    (run_a, out_a, rec_a), (run_b, out_b, rec_b) = runs
    assert out_a == out_b
    assert run_a["replica"] == run_b["replica"]
    stored_a, stored_b = ledger.tail(run=run_a["id"]), ledger.tail(run=run_b["id"])
    assert len(stored_a) == TURNS
    assert all(r["verified"] and r["exact"] for r in stored_a + stored_b)
    assert chained(stored_a) and chained(stored_b)
    sig = [(r["state_before"], r["state_after"], r["output_digest"]) for r in stored_a]
    assert sig == [(r["state_before"], r["state_after"], r["output_digest"]) for r in stored_b]
    assert [r["prompt_digest"] for r in rec_a] == [r["prompt_digest"] for r in rec_b]
    prompts = stored_prompts(proxy, run_a["id"])
    assert len(prompts) == TURNS
    last = prompts[-1]
    assert last.startswith("<|im_start|>system\nYou are a weather agent.\n\n# Tools")
    assert '"name": "lookup_weather"' in last  # the tools section
    assert '<tool_call>\n{"name": "lookup_weather", "arguments": {"city": ' in last
    assert f"<tool_response>\nresult {TURNS - 2}: {out_a[TURNS - 2]!r}\n</tool_response>" in last
    assert last.endswith("<|im_start|>assistant\n")
    assert all(p in q for p, q in zip(prompts[:1], prompts[1:], strict=False))
    # A replay arm from that run: the stored rendered prompts (never re-rendered) replay to
    # the run's final fingerprint, and the agent's next turn starts there.
    snapshot = admin(proxy, "GET", f"/admin/snapshots/s-{run_a['id']}")[1]
    assert snapshot["fingerprint"] == stored_a[-1]["state_after"]
    replay = client(
        proxy, proxy.create_key("agent-replay", mode="eval", cache=f"replay:s-{run_a['id']}")
    )
    run_c = begin(proxy, "agent-replay")
    _, records_c = agent_loop(replay, turns=1)
    end(proxy, run_c["id"])
    assert records_c[0]["state_before"] == snapshot["fingerprint"]
    replayed = ledger.tail(run=run_c["id"])
    assert [r["policy"] for r in replayed] == ["replay"] * TURNS + ["eval"]


def chat(proxy: Proxy, key: str, **body: Any) -> openai.types.chat.ChatCompletion:
    sdk = client(proxy, key)
    messages = body.pop("messages", [{"role": "user", "content": "Weather in Paris?"}])
    body.setdefault("max_tokens", 4)
    return sdk.chat.completions.create(model="ensemble", messages=messages, **body)


def test_tools_change_the_prompt_digest(stack: tuple[Proxy, LedgerView]) -> None:
    """Two requests that differ only in ``tools`` (or in tool_choice "none", which hides them)
    are different requests in the ledger."""
    proxy, _ = stack
    key = proxy.create_key("prod-tools")
    plain = chat(proxy, key).model_extra["kvledger"]  # type: ignore[index]
    tooled = chat(proxy, key, tools=TOOLS).model_extra["kvledger"]  # type: ignore[index]
    hidden = chat(proxy, key, tools=TOOLS, tool_choice="none").model_extra["kvledger"]  # type: ignore[index]
    assert plain["prompt_digest"] != tooled["prompt_digest"]
    assert hidden["prompt_digest"] == plain["prompt_digest"]


def test_the_sdks_own_messages_go_back_into_the_history(stack: tuple[Proxy, LedgerView]) -> None:
    """The README's loop: the SDK's assistant message, dumped as it comes back, then a tool
    result, is a valid next turn."""
    proxy, _ = stack
    sdk = client(proxy, proxy.create_key("readme-loop"))
    messages: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
    for _ in range(2):
        answer = sdk.chat.completions.create(
            model="ensemble", messages=messages, tools=TOOLS, max_tokens=4
        )
        messages.append(answer.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": "And in Oslo?"})
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]


def test_streamed_chat_with_tools_ends_with_the_record(stack: tuple[Proxy, LedgerView]) -> None:
    """A streamed answer with tools: content deltas (the model wrote no tool call), a finish
    reason, and the record in the last chunk, through the SDK's stream reader."""
    proxy, _ = stack
    sdk = client(proxy, proxy.create_key("stream-tools"))
    stream = sdk.chat.completions.create(
        model="ensemble",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] in ("length", "stop") and chunks[-1].usage is not None
    assert chunks[-1].model_extra["kvledger"]["completion_tokens"] == len(text)  # type: ignore[index]


def test_refusals_name_the_field(stack: tuple[Proxy, LedgerView]) -> None:
    """What the front cannot honour is a 400 naming it: logprobs (the stand-in's ensemble
    declares no return_log_probs), a template that raises, an unknown field, a malformed
    tool-call message."""
    proxy, _ = stack
    key = proxy.create_key("refused")
    cases: list[tuple[dict[str, Any], str, str]] = []
    cases += [
        ({"logprobs": True, "top_logprobs": 2}, "top_logprobs", "sampled token only"),
        ({"extra_body": {"best_of": 2}}, "best_of", "not supported"),
        ({"tool_choice": "required", "tools": TOOLS}, "tool_choice", "guided decoding"),
        ({"response_format": {"type": "json_object"}}, "response_format", "guided decoding"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "system", "content": "late"},
                ]
            },
            "messages",
            "a system message must come first",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None},
                ]
            },
            "messages",
            "'messages[1].content' must be a string",
        ),
        (
            {"messages": [{"role": "tool", "content": "42"}]},
            "messages",
            "'messages[0].tool_call_id' is required",
        ),
    ]
    for body, param, words in cases:
        extra = body.pop("extra_body", None)
        with pytest.raises(openai.BadRequestError) as caught:
            chat(proxy, key, extra_body=extra, **body)
        error = caught.value.body
        assert isinstance(error, dict), error
        assert error.get("param") == param and words in error["message"], (body, error)


def test_logprobs_come_back_whole_and_streamed(stack: tuple[Proxy, LedgerView]) -> None:
    """logprobs: true passes TensorRT-LLM's return_log_probs to the ensemble (the stand-in's
    declares it) and answers its output_log_probs: one per generated token, whole or spread
    over a stream's chunks; without it, none. (Whole and streamed answers are not compared:
    the second request may reuse the first's blocks, which is what kvledger records.)"""
    proxy, _ = stack
    key = proxy.create_key("logprobs")
    answer = chat(proxy, key, logprobs=True, max_tokens=6)
    assert answer.choices[0].logprobs is not None
    whole = [t.logprob for t in answer.choices[0].logprobs.content or []]
    assert len(whole) == answer.usage.completion_tokens > 0  # type: ignore[union-attr]
    assert all(v <= 0 for v in whole)
    assert chat(proxy, key, max_tokens=6).choices[0].logprobs is None
    streamed: list[float] = []
    usage = None
    events = client(proxy, key).chat.completions.create(
        model="ensemble",
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        max_tokens=6,
        logprobs=True,
        stream=True,
    )
    for event in events:
        usage = event.usage or usage
        for choice in event.choices:
            if choice.logprobs is not None:
                streamed += [t.logprob for t in choice.logprobs.content or []]
    assert usage is not None
    assert len(streamed) == usage.completion_tokens > 0
    assert all(v <= 0 for v in streamed)
