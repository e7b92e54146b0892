"""Tool-call parsers on canned model outputs, whole and streamed (pure logic)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.chat.parsers import PARSERS, StreamSplitter, ToolCall

WEATHER = ToolCall("get_weather", json.dumps({"city": "Paris", "unit": "°C"}, ensure_ascii=False))
TIME = ToolCall("get_time", json.dumps({"zone": "CET"}))

# (parser, output, content, calls): what each family writes, as the engines' servers parse it.
CANNED: list[tuple[str, str, str, list[ToolCall]]] = [
    # hermes (Qwen 2.5 / Hermes): content, then <tool_call> blocks
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
        ' "unit": "°C"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments":'
        ' {"zone": "CET"}}\n</tool_call>',
        "Let me check.\n",
        [WEATHER, TIME],
    ),
    (
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>',
        "",
        [TIME],
    ),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}', "", [TIME]),
    ("hermes", "No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    (
        "hermes",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"arguments": {}}</tool_call>',
        [],
    ),
    # llama3_json (Llama 3.1-3.3): the whole output is the calls
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}',
        "",
        [WEATHER],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "°C"}}; '
        '{"name": "get_time", "parameters": {"zone": "CET"}}',
        "",
        [WEATHER, TIME],
    ),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    # mistral: [TOOL_CALLS] then a JSON array (older tokenizers) or name[ARGS]{...} (v11+)
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}},'
        ' {"name": "get_time", "arguments": {"zone": "CET"}}]',
        "",
        [WEATHER, TIME],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "°C"}'
        '[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
        "Sure. ",
        [WEATHER, TIME],
    ),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    ("mistral", "Plain answer.", "Plain answer.", []),
    # pythonic (Llama 3.2 / 4): a Python list of calls
    (
        "pythonic",
        '[get_weather(city="Paris", unit="°C"), get_time(zone="CET")]',
        "",
        [WEATHER, TIME],
    ),
    ("pythonic", '<|python_start|>[get_time(zone="CET")]<|python_end|>', "", [TIME]),
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", "[get_time(zone=__import__('os'))]", "[get_time(zone=__import__('os'))]", []),
    ("pythonic", "A list: [a, b]", "A list: [a, b]", []),
]


@pytest.mark.parametrize(("name", "output", "content", "calls"), CANNED)
def test_parser_splits_content_and_calls(
    name: str, output: str, content: str, calls: list[ToolCall]
) -> None:
    """Each format's calls come out with their arguments as a JSON object; text that does not
    parse stays content, whole."""
    assert PARSERS[name].parse(output) == (content, calls)


def stream(name: str, output: str, size: int) -> tuple[str, list[ToolCall], list[str]]:
    splitter = StreamSplitter(PARSERS[name])
    content, calls, sent = "", [], []
    pieces = [output[i : i + size] for i in range(0, len(output), size)]
    for piece in pieces:
        for delta in splitter.feed(piece):
            content += delta.content
            sent.append(delta.content)
    for delta in splitter.finish():
        if delta.call is not None:
            calls.append(delta.call)
        else:
            content += delta.content
    return content, calls, sent


@pytest.mark.parametrize(("name", "output", "content", "calls"), CANNED)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed_output_gives_what_the_whole_output_gives(
    name: str, output: str, content: str, calls: list[ToolCall], size: int
) -> None:
    """Streamed in pieces of any size: the same content and calls, and no piece of a tool
    call is ever sent as content before it is known not to be one."""
    got_content, got_calls, sent = stream(name, output, size)
    assert (got_content, got_calls) == (content, calls)
    if calls:
        assert "".join(sent) == content  # nothing of the calls leaked while streaming


def test_plain_text_streams_without_waiting() -> None:
    """Content that cannot start a call is sent as it comes; only a possible marker's
    beginning is held back (and sent once it turns out not to be one)."""
    splitter = StreamSplitter(PARSERS["hermes"])
    assert [d.content for d in splitter.feed("Hello <tool")] == ["Hello "]
    assert [d.content for d in splitter.feed("box> done")] == ["<toolbox> done"]
    splitter = StreamSplitter(PARSERS["llama3_json"])
    assert [d.content for d in splitter.feed("Sunny")] == ["Sunny"]
    assert [d.content for d in splitter.feed(' {"name": "x"}')] == [' {"name": "x"}']


@settings(deadline=None)  # a shared 2-core machine: no timing in tests
@given(text=st.text(max_size=60), size=st.integers(1, 8), name=st.sampled_from(sorted(PARSERS)))
def test_any_text_streams_to_what_parse_gives(text: str, size: int, name: str) -> None:
    """Whatever the model writes, streaming and parsing the whole agree, and text without
    calls comes out unchanged."""
    content, calls, _ = stream(name, text, size)
    assert (content, calls) == PARSERS[name].parse(text)
    if not calls:
        assert content == text
