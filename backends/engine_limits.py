"""The prompt limit a TensorRT-LLM executor enforces, computed as the runtime computes it.

The limit is not always the engine's ``build_config.max_input_len``. TensorRT-LLM's
``cpp/tensorrt_llm/batch_manager/trtGptModel.h`` (``TrtGptModel``'s constructor) sets it:

- chunked context enabled (the ``tensorrt_llm`` model's ``enable_chunked_context``):
  ``max_seq_len - 1``;
- else, context FMHA with packed input (``plugin_config.context_fmha`` and
  ``plugin_config.remove_input_padding``, both on by default): ``min(max_seq_len - 1,
  max_num_tokens)``, with the engine's ``max_num_tokens`` (the Triton backend's
  ``model_instance_state.cc`` passes no runtime ``maxNumTokens`` to the ``ExecutorConfig``);
- else the built ``max_input_len``.

A prompt over the limit is refused by the executor (``LlmRequest::validate`` in
``cpp/tensorrt_llm/batch_manager/llmRequest.cpp``); a prompt + output over ``max_seq_len`` is
not refused: its output is clamped to ``max_seq_len - prompt``.

Pure functions of the engine's ``config.json`` (as a dict) and the model's parameters (plain
strings, or Triton's model-config form ``{"string_value": ...}``); the proxy and the stand-in
both use them.

``tokens_per_block`` is the engine's ``plugin_config.tokens_per_block``: the metrics page's
``tokens_per`` gauge reads 0 after every load until the first request, so it is no source.
The executor's refusal is recognised by its message (:func:`is_prompt_refusal`), whatever
status Triton gives it (INTERNAL, HTTP 500, on a GPU).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "on")
REFUSAL_MARK = "exceeds maximum input length"


@dataclass(frozen=True)
class EngineLimits:
    """The executor's limits: the longest prompt it takes, the longest sequence it holds."""

    max_input_len: int
    max_seq_len: int
    rule: str  # which branch of trtGptModel.h chose max_input_len, for messages and docs


def _int(section: Mapping[str, Any], key: str) -> int | None:
    value = section.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def plain_params(parameters: Mapping[str, Any] | None) -> dict[str, str]:
    """Triton's model-config ``parameters`` (``{name: {"string_value": v}}``) as plain strings;
    the template's unfilled ``${...}`` placeholders left out."""
    plain: dict[str, str] = {}
    for name, entry in (parameters or {}).items():
        value = entry.get("string_value") if isinstance(entry, Mapping) else entry
        text = "" if value is None else str(value).strip()
        if text and not text.startswith("${"):
            plain[str(name)] = text
    return plain


def tokens_per_block(config: Mapping[str, Any]) -> int | None:
    """``build_config.plugin_config.tokens_per_block``: the engine's KV-cache block size."""
    build: Mapping[str, Any] = config.get("build_config") or config.get("builder_config") or {}
    plugins: Mapping[str, Any] = build.get("plugin_config") or {}
    return _int(plugins, "tokens_per_block") or _int(build, "tokens_per_block")


def is_prompt_refusal(message: str) -> bool:
    """Whether an engine error is the executor refusing a prompt over its limit (a client's
    mistake, whatever status it came with)."""
    return REFUSAL_MARK in message


def _switch(value: Any, default: bool) -> bool:
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in _TRUE


def engine_limits(config: Mapping[str, Any], parameters: Mapping[str, Any]) -> EngineLimits | None:
    """The limits of an engine (``config.json``) run with these ``tensorrt_llm`` parameters;
    None when the config names no ``max_seq_len`` or ``max_input_len`` to work from."""
    params = plain_params(parameters)
    build: Mapping[str, Any] = config.get("build_config") or config.get("builder_config") or {}
    plugins: Mapping[str, Any] = build.get("plugin_config") or {}
    built_input = _int(build, "max_input_len")
    max_seq = _int(build, "max_seq_len")
    if max_seq is None:
        return None
    max_tokens = _int(build, "max_num_tokens")
    if _switch(params.get("enable_chunked_context"), False):
        return EngineLimits(max_seq - 1, max_seq, "max_seq_len - 1 (chunked context)")
    context_fmha = _switch(plugins.get("context_fmha"), True)
    packed = _switch(plugins.get("remove_input_padding"), True)
    if context_fmha and packed and max_tokens is not None:
        return EngineLimits(
            min(max_seq - 1, max_tokens),
            max_seq,
            "min(max_seq_len - 1, max_num_tokens) (context FMHA, packed input)",
        )
    if built_input is None:
        return None
    return EngineLimits(built_input, max_seq, "max_input_len (as built)")


def clamped_output_len(prompt_len: int, output_len: int, limits: EngineLimits) -> int:
    """The output tokens the executor will produce at most: ``LlmRequest::validate`` lowers
    ``request_output_len`` so that prompt + output fits ``max_seq_len`` (with a warning)."""
    return max(0, min(output_len, limits.max_seq_len - prompt_len))


def prompt_too_long(prompt_len: int, limits: EngineLimits) -> str | None:
    """The executor's refusal of a prompt over the limit (``LlmRequest::validate``), or None
    when it fits. The Triton backend sends it as an INTERNAL error prefixed with "Executor failed
    process requestId N due to the following error: " (``model_instance_state.cc``)."""
    if prompt_len <= limits.max_input_len:
        return None
    return (
        f"Prompt length ({prompt_len}) exceeds maximum input length ({limits.max_input_len})."
        " Set log level to info and check TRTGptModel logs for how maximum input length is set"
    )
