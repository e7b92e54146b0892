"""Where a model's chat template comes from, how it renders, and what the config refuses
(pure logic over files in a temporary directory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from backends.sim.tokenizer import CHAT_TEMPLATE
from router.chat.templates import JinjaChat, RenderError, load_chat
from router.errors import BadRequest
from router.http.chat_request import render_chat
from router.settings import (
    DEFAULT_GENERATION_PROMPT,
    ChatTemplate,
    ModelChat,
    SettingsError,
    build_settings,
)

REPLICA = {"id": "r1", "grpc": "localhost:1", "metrics": "http://x/metrics", "transport": "grpc"}
USER = [{"role": "user", "content": "Hi"}]


def tokenizer(tmp: Path, **config: Any) -> Path:
    directory = tmp / "tok"
    directory.mkdir(exist_ok=True)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def settings(tmp: Path, models: dict[str, Any] | None = None) -> Any:
    raw: dict[str, Any] = {"replicas": [REPLICA]}
    if models is not None:
        raw["models"] = models
    return build_settings(raw, {}, tmp, source="kvledger.toml", hostname="h")


def test_template_string_with_special_tokens(tmp_path: Path) -> None:
    """A string chat_template renders with the tokenizer's bos/eos tokens (AddedToken dicts
    too), HF's tojson (non-ASCII kept) and trim_blocks."""
    source = (
        "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content | tojson }}\n"
        "{% endfor %}{% if add_generation_prompt %}bot:{% endif %}"
    )
    directory = tokenizer(
        tmp_path, chat_template=source, bos_token={"content": "<s>"}, eos_token="</s>"
    )
    chat = load_chat(directory)
    assert chat is not None and chat.eos_token == "</s>"
    assert chat.render([{"role": "user", "content": "café"}], None) == '<s>user: "café"\nbot:'


def test_named_templates_and_jinja_files(tmp_path: Path) -> None:
    """A list of named templates: ``tool_use`` when tools are sent, else ``default``; a name
    picks one; a .jinja file beats the tokenizer's own; chat_template.jinja in the directory
    is read as transformers saves it."""
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    directory = tokenizer(tmp_path, chat_template=named)
    chat = load_chat(directory)
    assert chat is not None
    assert chat.render(USER, None) == "D" and chat.render(USER, [{"type": "function"}]) == "T"
    picked = load_chat(directory, "tool_use")
    assert picked is not None and picked.render(USER, None) == "T"
    (tmp_path / "mine.jinja").write_text("M")
    mine = load_chat(directory, str(tmp_path / "mine.jinja"))
    assert mine is not None and mine.render(USER, None) == "M"
    (directory / "chat_template.jinja").write_text("F")
    saved = load_chat(directory)
    assert saved is not None and saved.render(USER, None) == "F"


def test_a_tokenizer_without_a_template_falls_back(tmp_path: Path) -> None:
    """No template anywhere: the format-string fallback renders the chat, and it takes no
    tools (400 naming 'tools')."""
    directory = tokenizer(tmp_path, eos_token_id=2)
    assert load_chat(directory) is None
    chat = settings(tmp_path, {"m": {"tokenizer": "tok"}}).chat("m")
    assert chat.jinja is None
    assert render_chat(USER, chat, None, "m") == "<|user|>\nHi\n" + DEFAULT_GENERATION_PROMPT
    with pytest.raises(BadRequest) as caught:
        render_chat(USER, chat, [{"type": "function", "function": {"name": "f"}}], "m")
    assert caught.value.param == "tools"
    unconfigured = settings(tmp_path).chat("ensemble")
    assert unconfigured.jinja is None and unconfigured.parser is None


def test_a_raising_template_is_a_400(tmp_path: Path) -> None:
    """raise_exception in the template, or a failure inside it, is the client's 400 (on
    'messages', with the template's words), never a 500."""
    chat = JinjaChat("t", CHAT_TEMPLATE)
    with pytest.raises(RenderError, match="a system message must come first"):
        chat.render([*USER, {"role": "system", "content": "late"}], None)
    broken = JinjaChat("t", "{{ messages[5].content.upper() }}")
    with pytest.raises(RenderError):
        broken.render(USER, None)
    model = ModelChat(chat, ChatTemplate(), None)
    with pytest.raises(BadRequest) as caught:
        render_chat([*USER, {"role": "system", "content": "late"}], model, None, "m")
    assert caught.value.param == "messages" and "must come first" in caught.value.message


def test_the_sandbox_keeps_templates_from_the_process() -> None:
    """Templates are data from a model's files: no attribute walks to Python internals, and
    the passed messages cannot be changed by the template (immutable sandbox)."""
    escape = JinjaChat("t", "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(RenderError):
        escape.render(USER, None)
    mutate = JinjaChat("t", "{{ messages.append(1) }}")
    with pytest.raises(RenderError):
        mutate.render(USER, None)


@pytest.mark.parametrize(
    ("models", "words"),
    [
        ({"m": {"tool_call_parser": "xml"}}, "tool_call_parser: expected one of"),
        ({"m": {"tokenizer": "missing"}}, "does not exist"),
        ({"m": {"chat_template": "gone.jinja"}}, "cannot read chat template"),
        ({"m": {"chat_template": "tool_use"}}, "names no .jinja file"),
        ({"m": {"tokenize": "tok"}}, "unknown key(s) ['tokenize']"),
        ({"m": {"tokenizer": "bad"}}, "line 1"),
    ],
)
def test_config_errors_name_the_model_and_field(
    tmp_path: Path, models: dict[str, Any], words: str
) -> None:
    """[models.NAME] mistakes fail at start, in one line naming the table."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for %}"}))
    with pytest.raises(SettingsError) as caught:
        settings(tmp_path, models)
    assert "[models.m]" in str(caught.value) and words in str(caught.value)


def test_stand_in_template_renders_the_tool_loop() -> None:
    """The stand-in tokenizer's template: tools in the system turn, an assistant's tool calls
    and the tool's result in Hermes' tags, the generation prompt last."""
    chat = JinjaChat("t", CHAT_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    call = {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        *USER,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "18 C", "tool_call_id": "c"},
    ]
    text = chat.render(messages, tools)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '{"type": "function", "function": {"name": "get_weather", "parameters": {}}}' in text
    assert text.endswith(
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {}}\n</tool_call>\n<|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert chat.render(USER, None) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
