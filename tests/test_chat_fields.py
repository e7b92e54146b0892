"""Every field the chat front accepts is honoured (it changes the engine request or the
answer's shape) or refused with a 400 naming it; tool calls come back in OpenAI's shapes, whole
and streamed, as the openai SDK reads them (pure logic: the parser and the reply, no server)."""

from __future__ import annotations

from dataclasses import astuple
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from backends.sim.tokenizer import CHAT_TEMPLATE
from router.chat.parsers import PARSERS
from router.chat.templates import JinjaChat
from router.errors import BadRequest, Unavailable
from router.http.chat_request import CHAT_FIELDS, ChatOptions, parse_chat
from router.http.openai import OpenAIReply
from router.http.parse import parse_completion
from router.settings import ChatTemplate, ModelChat

CHAT = ModelChat(JinjaChat("stand-in", CHAT_TEMPLATE), ChatTemplate(), PARSERS["hermes"])
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
BASE: dict[str, Any] = {"model": "ensemble", "messages": [{"role": "user", "content": "Hi"}]}
RECORD = {"prompt_tokens": 10, "completion_tokens": 30, "cached_tokens": 0}

# field -> (value, what the baseline also sends), or a refusal: (value, base, None)
WALK: dict[str, tuple[Any, dict[str, Any], bool]] = {
    "model": ("other", {}, True),
    "messages": ([{"role": "user", "content": "Bye"}], {}, True),
    "max_tokens": (5, {}, True),
    "max_completion_tokens": (5, {}, True),
    "temperature": (0.5, {}, True),
    "top_p": (0.5, {}, True),
    "top_k": (3, {}, True),
    "seed": (7, {}, True),
    "stop": (["\n"], {}, True),
    "stream": (True, {}, True),
    "stream_options": ({"include_usage": False}, {"stream": True}, True),
    "tools": (TOOLS, {}, True),
    "tool_choice": ("none", {"tools": TOOLS}, True),
    "response_format": ({"type": "json_schema", "json_schema": {}}, {}, False),
    "n": (2, {}, False),
    "logprobs": (True, {}, True),
    "top_logprobs": (3, {}, False),
    "parallel_tool_calls": (False, {"tools": TOOLS}, False),
    "frequency_penalty": (0.5, {}, False),
    "presence_penalty": (0.5, {}, False),
}


# The inputs TensorRT-LLM's ensemble declares for log probabilities (its config.pbtxt).
DECLARED = {"return_log_probs": "TYPE_BOOL", "stream": "TYPE_BOOL"}


def parse(body: dict[str, Any], declared: dict[str, str] = DECLARED) -> tuple[Any, ...]:
    parsed, options = parse_chat(dict(body), "rid", lambda model: CHAT, 4096, None, declared)
    return parsed.model, astuple(parsed.request), options


def test_logprobs_only_where_the_model_declares_return_log_probs() -> None:
    """logprobs: true asks the ensemble's return_log_probs input; a model without it is a 400
    naming the field, a model whose inputs are not read yet a 503 to retry."""
    _, request, options = parse({**BASE, "logprobs": True})
    assert options.logprobs and ("return_log_probs", "BOOL", True) in request[10]
    with pytest.raises(BadRequest) as caught:
        parse({**BASE, "logprobs": True}, {"stream": "TYPE_BOOL"})
    assert caught.value.param == "logprobs" and "return_log_probs" in caught.value.message
    with pytest.raises(Unavailable):
        parse({**BASE, "logprobs": True}, {})


def test_the_walk_covers_every_accepted_field() -> None:
    assert set(WALK) == set(CHAT_FIELDS)


@pytest.mark.parametrize("field", sorted(WALK))
def test_each_accepted_field_is_honoured_or_refused(field: str) -> None:
    """Set to a value other than its default, a field changes what is sent to the engine
    (model, prompt, sampling, stream) or how the answer is shaped (parser, usage), or the
    request is a 400 naming it; at its default (or null) it changes nothing."""
    value, base_extra, honoured = WALK[field]
    base = {**BASE, **base_extra}
    before = parse(base)
    if honoured:
        assert parse({**base, field: value}) != before
    else:
        with pytest.raises(BadRequest) as caught:
            parse({**base, field: value})
        assert caught.value.param == field
    if field not in ("model", "messages"):  # required: null is refused, checked elsewhere
        assert parse({**base, field: None}) == before


def test_unknown_fields_are_refused_by_name() -> None:
    for field in ("user", "best_of", "functions", "logit_bias", "metadata"):
        with pytest.raises(BadRequest) as caught:
            parse({**BASE, field: "x"})
        assert caught.value.param == field and "not supported" in caught.value.message


def test_the_sdks_null_fields_count_as_absent() -> None:
    """An assistant message dumped whole by the SDK (refusal, audio, function_call null;
    tool_calls null or []) is the message without them."""
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    dumped = [
        plain[0],
        {**plain[1], "refusal": None, "audio": None, "function_call": None, "tool_calls": None},
    ]
    assert parse({**BASE, "messages": dumped}) == parse({**BASE, "messages": plain})
    dumped[1]["tool_calls"] = []
    assert parse({**BASE, "messages": dumped}) == parse({**BASE, "messages": plain})
    assert parse({**BASE, "user": None}) == parse(BASE)


def test_agent_messages_render_and_bad_ones_name_the_field() -> None:
    """The openai SDK's tool loop messages render; a tool-call message with arguments that
    are not JSON, or a tool message without tool_call_id, is a 400 saying which."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Rules."}]},
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
    ]
    _, request, _ = parse({**BASE, "messages": messages, "tools": TOOLS})
    prompt = request[1]
    assert prompt.startswith("<|im_start|>system\nRules.\n\n# Tools")
    assert "<tool_response>\n12:00\n</tool_response>" in prompt
    broken = dict(call, function={"name": "get_time", "arguments": "{not json"})
    cases = [
        (
            [messages[1], {"role": "assistant", "content": None, "tool_calls": [broken]}],
            "'messages[1].tool_calls[0].function.arguments' must be a JSON object",
        ),
        ([{"role": "tool", "content": "x"}], "'messages[0].tool_call_id' is required"),
        (
            [{"role": "user", "content": "x", "tool_call_id": "c"}],
            "'messages[0].tool_call_id' is not supported in a user message",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "'messages[0].content[0]' must be a text part",
        ),
    ]
    for bad, words in cases:
        with pytest.raises(BadRequest) as caught:
            parse({**BASE, "messages": bad, "tools": TOOLS})
        assert caught.value.param == "messages" and words in caught.value.message


def reply(stream: bool = False) -> OpenAIReply:
    parsed, options = parse_chat(
        {**BASE, "tools": TOOLS, "stream": stream, "max_tokens": 100}, "rid", lambda m: CHAT, 4096
    )
    assert isinstance(options, ChatOptions) and options.parser is not None
    return OpenAIReply(parsed, True, options)


OUTPUT = 'Checking.<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'


def test_a_tool_call_answer_in_openai_shape() -> None:
    body = ChatCompletion.model_validate(reply().body(OUTPUT, RECORD))
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    calls = choice.message.tool_calls or []
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        ("call_rid_0", "get_time", '{"zone": "CET"}')
    ]
    plain = ChatCompletion.model_validate(reply().body("No call.", RECORD)).choices[0]
    assert plain.finish_reason == "stop" and plain.message.tool_calls is None


def test_a_streamed_tool_call_in_openai_deltas() -> None:
    """Streamed one character at a time: the content before the call as deltas, then the call
    as one tool-call delta (index, id, type, name, arguments), finish_reason tool_calls."""
    answer = reply(stream=True)
    raw = b"".join(answer.piece(c) for c in OUTPUT) + answer.closing(RECORD)
    events = [line[6:] for line in raw.split(b"\n\n") if line.startswith(b"data: {")]
    chunks = [ChatCompletionChunk.model_validate(orjson.loads(e)) for e in events]
    deltas = [c.choices[0] for c in chunks if c.choices]
    content = "".join(d.delta.content or "" for d in deltas)
    calls = [t for d in deltas for t in d.delta.tool_calls or []]
    assert content == "Checking."
    assert [(t.index, t.id, t.type, t.function.name, t.function.arguments) for t in calls] == [  # type: ignore[union-attr]
        (0, "call_rid_0", "function", "get_time", '{"zone": "CET"}')
    ]
    assert deltas[-1].finish_reason == "tool_calls"
    assert raw.endswith(b"data: [DONE]\n\n")


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
_call = st.fixed_dictionaries(
    {"id": st.text(max_size=3), "type": st.just("function")},
    optional={
        "function": st.fixed_dictionaries(
            {"name": st.text(max_size=4), "arguments": _json | st.just('{"a": [1]}')}
        )
    },
)
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "bot"])},
    optional={
        "content": _json | st.text(max_size=8),
        "tool_calls": st.lists(_call, max_size=2) | _json,
        "tool_call_id": _json | st.text(max_size=3),
        "name": _json,
    },
)
_body = st.fixed_dictionaries(
    {"model": st.just("ensemble"), "messages": st.lists(_message, min_size=1, max_size=4)},
    optional={
        name: _json | st.just(TOOLS) | st.sampled_from(["auto", "none", "required"])
        for name in ("tools", "tool_choice", "response_format", "stream_options", "n", "logprobs")
    },
)


@settings(deadline=None)  # a shared 2-core machine: no timing in tests
@given(body=_body)
def test_any_chat_body_parses_or_is_a_400(body: dict[str, Any]) -> None:
    """Whatever a client sends, the chat front answers with a request or a 400, never a
    crash (the template and the checks included)."""
    try:
        parse(body)
    except BadRequest as error:
        assert error.param


def test_completions_refuse_what_they_would_ignore() -> None:
    """/v1/completions names a field it does not honour (echo, logprobs, best_of, suffix, ...)
    instead of answering without it; null still means absent."""
    body = {"model": "ensemble", "prompt": "Hi"}
    for field, value in (("echo", True), ("logprobs", 2), ("best_of", 2), ("suffix", "x")):
        with pytest.raises(BadRequest) as caught:
            parse_completion({**body, field: value}, "rid", 64)
        assert caught.value.param == field and "not supported" in caught.value.message
    assert parse_completion({**body, "echo": None}, "rid", 64).request.prompt == "Hi"
