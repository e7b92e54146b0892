"""What the stand-in's Python-backend models share: reading inputs, making tensors, errors.

These modules run inside Triton's Python-backend stub (``triton_python_backend_utils`` exists
only there); the repository's ``<model>/1/model.py`` files import their model class from here.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = 1  # pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class InputError(ValueError):
    """A request the model refuses; its message goes back to the client as a Triton error."""


def parameters(args: dict[str, str]) -> dict[str, str]:
    """The model config's ``parameters`` as plain strings; unfilled ``${...}`` templates are ''."""
    config = json.loads(args["model_config"])
    values = {}
    for key, value in config.get("parameters", {}).items():
        text = str(value.get("string_value", ""))
        values[key] = "" if text.startswith("${") else text
    return values


def flag(params: dict[str, str], name: str, default: bool) -> bool:
    value = params.get(name, "")
    return default if not value else value.lower() in ("1", "true", "yes", "on")


def array(request: Any, name: str) -> np.ndarray[Any, Any] | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()


def scalar(request: Any, name: str, default: Any) -> Any:
    """One value of an input that holds one value per request (batch dimension included)."""
    values = array(request, name)
    if values is None:
        return default
    if values.size != 1:
        raise InputError(f"input '{name}' must hold exactly one value, got shape {values.shape}")
    value = values.reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value


def word_list(words: list[list[int]]) -> np.ndarray[Any, Any]:
    """TensorRT-LLM's word-list tensor [1, 2, N]: the words' ids concatenated, then the
    offsets where each word ends, padded with 0 and -1 (an empty list is [[0], [-1]])."""
    flat = [token for word in words for token in word]
    ends, total = [], 0
    for word in words:
        total += len(word)
        ends.append(total)
    width = max(len(flat), len(ends), 1)
    ids = flat + [0] * (width - len(flat))
    offsets = ends + [-1] * (width - len(ends))
    return np.array([[ids, offsets]], dtype=np.int32)


def words_of(values: np.ndarray[Any, Any] | None) -> list[list[int]]:
    """The words of a word-list tensor [1, 2, N] (or [2, N])."""
    if values is None:
        return []
    rows = values.reshape(2, -1)
    ids, offsets = rows[0].tolist(), rows[1].tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        words.append(ids[start:end])
        start = end
    return words


def tensor(name: str, value: Any, dtype: Any) -> Any:
    return pb_utils.Tensor(name, np.asarray(value, dtype=dtype))


def error_response(message: str) -> Any:
    """An error response with TRITONSERVER_ERROR_INTERNAL, the code TensorRT-LLM's backend
    gives every error it sends (``model_instance_state.cc``); HTTP 500 over KServe v2."""
    return pb_utils.InferenceResponse(
        error=pb_utils.TritonError(message, pb_utils.TritonError.INTERNAL)
    )
