"""Request bodies of the fronts → engine requests, with a clear 400 for every client mistake.

One JSON parse per request (orjson) and hand-written checks: the error says which field is wrong
and why, in OpenAI's error shape, and nothing a client sends can become a 500.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from backends.base import GenerationRequest
from router.errors import BadRequest, PromptTooLong
from router.flight import Parsed


def load_json(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a number", param=name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low} and {high}, got {value}", param=name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer", param=name)
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low} and {high}, got {value}", param=name)
    return value


def _strings(body: Mapping[str, Any], name: str) -> tuple[str, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise BadRequest(f"'{name}' must be a string or an array of non-empty strings", param=name)
    if len(value) > 16:
        raise BadRequest(f"'{name}' takes at most 16 sequences", param=name)
    return tuple(value)


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a string", param="model")
    return model


def _flag(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:  # absent or null: the default, as for every other field
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be true or false", param=name)
    return value


def _sampling(
    body: Mapping[str, Any], max_tokens_cap: int, names: Mapping[str, str]
) -> dict[str, Any]:
    max_tokens = _integer(body, names["max_tokens"], 0, max_tokens_cap)
    return {
        "max_tokens": 16 if max_tokens is None else max_tokens,
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_k": _integer(body, "top_k", 0, 1 << 16),
        "top_p": _number(body, "top_p", 0.0, 1.0),
        "seed": _integer(body, "seed", 0, (1 << 63) - 1),
        "stop": _strings(body, names["stop"]),
    }


def _request(
    request_id: str,
    prompt: str,
    stream: bool,
    sampling: dict[str, Any],
    bad_words: tuple[str, ...],
) -> GenerationRequest:
    # Positional (see backends.base on per-request values), in GenerationRequest's order.
    return GenerationRequest(
        request_id,
        prompt,
        sampling["max_tokens"],
        stream,
        sampling["temperature"],
        sampling["top_k"],
        sampling["top_p"],
        sampling["seed"],
        sampling["stop"],
        bad_words,
    )


_OPENAI = {"max_tokens": "max_tokens", "stop": "stop"}
_TRITON = {"max_tokens": "max_tokens", "stop": "stop_words"}


def check_prompt_length(
    model: str, prompt: str, limits: Sequence[tuple[int, int]], param: str
) -> None:
    """PromptTooLong when ``prompt`` certainly has more tokens than any replica of ``model`` takes.

    ``limits``: each replica's ``(max_input_len, max_token_bytes)``.

    The proxy cannot tokenize for the engine, so it refuses only what it is sure of: a replica
    whose tokenizer maps at most ``max_token_bytes`` UTF-8 bytes to one token turns B bytes into
    at least B / max_token_bytes tokens, so B > max_input_len * max_token_bytes is too long
    whatever the text (the stand-in's tokenizer is byte-level: one token per byte). A replica
    with either figure unknown (0) decides for itself, at admission.
    """
    if not limits or any(tokens * width == 0 for tokens, width in limits):
        return
    max_input_len, max_token_bytes = max(limits, key=lambda pair: pair[0] * pair[1])
    limit = max_input_len * max_token_bytes
    # Length in characters bounds the UTF-8 size from both sides: skip the encode when it can.
    if len(prompt) * 4 <= limit:
        return
    size = len(prompt) if prompt.isascii() else len(prompt.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise PromptTooLong(
            f"'{param}' is too long for model '{model}': {size} UTF-8 bytes are certainly more"
            f" than its {max_input_len} input tokens (at most {max_token_bytes}"
            " bytes per token); shorten it",
            param=param,
        )


def _openai_max_tokens(body: dict[str, Any]) -> None:
    # Newer SDKs send max_completion_tokens; treat it as max_tokens.
    if "max_completion_tokens" in body and body.get("max_tokens") is None:
        body["max_tokens"] = body["max_completion_tokens"]


def _common(body: dict[str, Any], request_id: str, prompt: str, cap: int) -> GenerationRequest:
    _openai_max_tokens(body)
    n = _integer(body, "n", 1, 1)
    del n  # only n=1 is served; larger values are refused by the range check above
    return _request(request_id, prompt, _flag(body, "stream"), _sampling(body, cap, _OPENAI), ())


# /v1/completions: every field either honoured or refused (docs/chat.md, "The fields").
COMPLETION_FIELDS = frozenset(
    (
        *("model", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p"),
        *("top_k", "seed", "stop", "stream", "n"),
    )
)


def parse_completion(
    body: dict[str, Any], request_id: str, cap: int, episode: str | None = None
) -> Parsed:
    for name, value in body.items():
        if name not in COMPLETION_FIELDS and value is not None:  # null: nothing sent
            raise BadRequest(
                f"'{name}' is not supported by /v1/completions (accepted fields:"
                f" {', '.join(sorted(COMPLETION_FIELDS))})",
                param=name,
            )
    model = _model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' is required and must be a string", param="prompt")
    return Parsed(model, _common(body, request_id, prompt, cap), episode=episode)


def parse_generate(
    body: dict[str, Any],
    model: str,
    request_id: str,
    stream: bool,
    cap: int,
    episode: str | None = None,
) -> Parsed:
    """Triton's generate extension with TensorRT-LLM's ensemble input names."""
    prompt = body.get("text_input")
    if not isinstance(prompt, str):
        raise BadRequest("'text_input' is required and must be a string", param="text_input")
    sampling = _sampling(body, cap, _TRITON)
    seed = _integer(body, "random_seed", 0, (1 << 63) - 1)
    if sampling["seed"] is None and seed is not None:
        sampling["seed"] = seed
    stream = stream or _flag(body, "stream")
    request = _request(request_id, prompt, stream, sampling, _strings(body, "bad_words"))
    echo = not _flag(body, "exclude_input_in_output", False)
    return Parsed(model, request, echo, episode)  # model, request, echo_prompt, episode
