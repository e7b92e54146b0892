"""A trivial Triton model with the ``ensemble`` interface, which answers at once.

The overhead benchmark puts it behind every proxy so that only the proxies are timed. It takes
TensorRT-LLM's ensemble inputs (the ones kvledger sends), is decoupled as the real ensemble is,
and answers from ``execute`` itself: with ``stream`` one response per token and a final one
carrying the statistics, else a single final response with the text and the statistics.

``write_repository`` lays out ``ROOT/ensemble/{config.pbtxt,1/model.py}``; ``MODEL_SOURCE`` is
what Triton's Python backend runs (a string: it imports ``triton_python_backend_utils``, which
exists only inside the backend's stub).
"""

from __future__ import annotations

from pathlib import Path

MODEL = "ensemble"

_INPUTS = (
    ("text_input", "TYPE_STRING"),
    ("max_tokens", "TYPE_INT32"),
    ("stream", "TYPE_BOOL"),
    ("temperature", "TYPE_FP32"),
    ("top_k", "TYPE_INT32"),
    ("top_p", "TYPE_FP32"),
    ("seed", "TYPE_UINT64"),
    ("exclude_input_in_output", "TYPE_BOOL"),
    ("return_perf_metrics", "TYPE_BOOL"),
    ("return_num_input_tokens", "TYPE_BOOL"),
    ("return_num_output_tokens", "TYPE_BOOL"),
)
_LISTS = (("stop_words", "TYPE_STRING"), ("bad_words", "TYPE_STRING"))
_OUTPUTS = (
    ("text_output", "TYPE_STRING"),
    ("kv_cache_alloc_new_blocks", "TYPE_INT32"),
    ("kv_cache_reused_blocks", "TYPE_INT32"),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32"),
    ("arrival_time_ns", "TYPE_INT64"),
    ("first_token_time_ns", "TYPE_INT64"),
    ("last_token_time_ns", "TYPE_INT64"),
    ("num_input_tokens", "TYPE_INT32"),
    ("num_output_tokens", "TYPE_INT32"),
)

MODEL_SOURCE = """
import time

import numpy as np
import triton_python_backend_utils as pb_utils

_FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _get(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0]


def _t(name, value, dtype):
    return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            arrival = time.time_ns()
            sender = request.get_response_sender()
            prompt = _get(request, "text_input", b"")
            tokens = int(_get(request, "max_tokens", 16))
            if bool(_get(request, "stream", False)):
                for _ in range(tokens):
                    sender.send(pb_utils.InferenceResponse([_t("text_output", b"x", object)]))
                text = b""
            else:
                text = b"x" * tokens
            now = time.time_ns()
            outputs = [
                _t("text_output", text, object),
                _t("kv_cache_alloc_new_blocks", 1, np.int32),
                _t("kv_cache_reused_blocks", 0, np.int32),
                _t("kv_cache_alloc_total_blocks", 1, np.int32),
                _t("arrival_time_ns", arrival, np.int64),
                _t("first_token_time_ns", now, np.int64),
                _t("last_token_time_ns", now, np.int64),
                _t("num_input_tokens", len(prompt), np.int32),
                _t("num_output_tokens", tokens, np.int32),
            ]
            sender.send(pb_utils.InferenceResponse(outputs), flags=_FINAL)
        return None
"""


def config_pbtxt() -> str:
    """The model config: the ensemble's names, decoupled, on the CPU."""
    inputs = [f'  {{ name: "{n}" data_type: {t} dims: [ 1 ] optional: true }}' for n, t in _INPUTS]
    inputs += [f'  {{ name: "{n}" data_type: {t} dims: [ -1 ] optional: true }}' for n, t in _LISTS]
    outputs = [f'  {{ name: "{n}" data_type: {t} dims: [ -1 ] }}' for n, t in _OUTPUTS]
    return (
        f'name: "{MODEL}"\nbackend: "python"\nmax_batch_size: 64\n'
        "model_transaction_policy { decoupled: true }\n"
        "input [\n" + ",\n".join(inputs) + "\n]\n"
        "output [\n" + ",\n".join(outputs) + "\n]\n"
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
    )


def write_repository(root: Path) -> Path:
    """``root/ensemble/{config.pbtxt,1/model.py}``; returns ``root``."""
    (root / MODEL / "1").mkdir(parents=True, exist_ok=True)
    (root / MODEL / "config.pbtxt").write_text(config_pbtxt())
    (root / MODEL / "1" / "model.py").write_text(MODEL_SOURCE.lstrip())
    return root
