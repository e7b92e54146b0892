"""The four model configs of the stand-in's repository, in Triton's text protobuf format.

Names, types, shapes and the ``ensemble_scheduling`` wiring follow TensorRT-LLM's
``inflight_batcher_llm`` models (``preprocessing``, ``tensorrt_llm``, ``postprocessing``,
``ensemble``), restricted to the inputs the stand-in implements. The ensemble declares both the
current and the older names of two inputs (``seed`` and ``random_seed``,
``return_perf_metrics`` and ``return_kv_cache_reuse_stats``), so a proxy configured for either
TensorRT-LLM version can talk to it; a real ensemble declares one of each.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BATCH = 64
_T = {
    "s": "TYPE_STRING",
    "i": "TYPE_INT32",
    "l": "TYPE_INT64",
    "f": "TYPE_FP32",
    "u": "TYPE_UINT64",
    "b": "TYPE_BOOL",
}


@dataclass(frozen=True)
class Tensor:
    name: str
    kind: str  # a key of _T
    dims: str = "[ 1 ]"
    optional: bool = False
    extra: str = ""  # reshape, allow_ragged_batch


def _block(section: str, tensors: tuple[Tensor, ...]) -> str:
    rows = []
    for t in tensors:
        opt = " optional: true" if t.optional else ""
        extra = f" {t.extra}" if t.extra else ""
        rows.append(f'  {{ name: "{t.name}" data_type: {_T[t.kind]} dims: {t.dims}{opt}{extra} }}')
    return f"{section} [\n" + ",\n".join(rows) + "\n]\n"


def _parameters(values: dict[str, str]) -> str:
    return "".join(
        f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
        for k, v in values.items()
    )


def _header(name: str, backend: str) -> str:
    return f'name: "{name}"\nbackend: "{backend}"\nmax_batch_size: {MAX_BATCH}\n'


_CPU = "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
_SCALAR = "reshape: { shape: [ ] }"
_RAGGED = "allow_ragged_batch: true"


def preprocessing(tokenizer_dir: str) -> str:
    inputs = (
        Tensor("QUERY", "s"),
        Tensor("REQUEST_OUTPUT_LEN", "i"),
        Tensor("BAD_WORDS_DICT", "s", "[ -1 ]", True),
        Tensor("STOP_WORDS_DICT", "s", "[ -1 ]", True),
        Tensor("END_ID", "i", optional=True),
        Tensor("PAD_ID", "i", optional=True),
    )
    outputs = (
        Tensor("INPUT_ID", "i", "[ -1 ]"),
        Tensor("REQUEST_INPUT_LEN", "i"),
        Tensor("BAD_WORDS_IDS", "i", "[ 2, -1 ]"),
        Tensor("STOP_WORDS_IDS", "i", "[ 2, -1 ]"),
        Tensor("REQUEST_OUTPUT_LEN", "i", "[ -1 ]"),
        Tensor("OUT_END_ID", "i"),
        Tensor("OUT_PAD_ID", "i"),
    )
    params = {"tokenizer_dir": tokenizer_dir, "add_special_tokens": "false"}
    return (
        _header("preprocessing", "python")
        + _block("input", inputs)
        + _block("output", outputs)
        + _parameters(params)
        + _CPU
    )


# tensorrt_llm inputs: (name, kind) with dims [ 1 ] reshaped to a scalar, all optional.
_ENGINE_SCALARS = (
    ("end_id", "i"),
    ("pad_id", "i"),
    ("temperature", "f"),
    ("runtime_top_k", "i"),
    ("runtime_top_p", "f"),
    ("seed", "u"),
    ("random_seed", "u"),
    ("return_perf_metrics", "b"),
    ("return_kv_cache_reuse_stats", "b"),
    ("return_num_input_tokens", "b"),
    ("return_num_output_tokens", "b"),
    ("exclude_input_in_output", "b"),
    ("stop", "b"),
    ("streaming", "b"),
    ("return_log_probs", "b"),
    ("beam_width", "i"),
)
STATS_OUTPUTS = (
    ("kv_cache_alloc_new_blocks", "i"),
    ("kv_cache_reused_blocks", "i"),
    ("kv_cache_alloc_total_blocks", "i"),
    ("arrival_time_ns", "l"),
    ("first_scheduled_time_ns", "l"),
    ("first_token_time_ns", "l"),
    ("last_token_time_ns", "l"),
    ("num_input_tokens", "i"),
    ("num_output_tokens", "i"),
)
# Outputs of tensorrt_llm the real ensemble also returns: (name, kind, dims).
EXTRA_OUTPUTS = (
    ("output_log_probs", "f", "[ -1, -1 ]"),
    ("cum_log_probs", "f", "[ -1 ]"),
    ("sequence_index", "i", "[ 1 ]"),
)


def tensorrt_llm(
    engine_dir: str,
    reuse: bool,
    max_tokens_in_paged_kv_cache: int,
    *,
    partial_reuse: bool = True,
    chunked_context: bool = True,
) -> str:
    inputs = (
        Tensor("input_ids", "i", "[ -1 ]", True, _RAGGED),
        Tensor("input_lengths", "i", extra=_SCALAR),
        Tensor("request_output_len", "i", extra=_SCALAR),
        Tensor("stop_words_list", "i", "[ 2, -1 ]", True, _RAGGED),
        Tensor("bad_words_list", "i", "[ 2, -1 ]", True, _RAGGED),
        *(Tensor(name, kind, optional=True, extra=_SCALAR) for name, kind in _ENGINE_SCALARS),
    )
    outputs = (
        Tensor("output_ids", "i", "[ -1, -1 ]"),
        Tensor("sequence_length", "i", "[ -1 ]"),
        *(Tensor(name, kind) for name, kind in STATS_OUTPUTS),
        *(Tensor(name, kind, dims) for name, kind, dims in EXTRA_OUTPUTS),
    )
    params = {
        "max_beam_width": "1",
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": engine_dir,
        "max_tokens_in_paged_kv_cache": str(max_tokens_in_paged_kv_cache),
        "batch_scheduler_policy": "guaranteed_no_evict",
        "enable_kv_cache_reuse": "true" if reuse else "false",
        # KvCacheConfig::enablePartialReuse. TensorRT-LLM's Triton backend leaves it at its
        # default (on) and reads no parameter for it; the stand-in takes one to switch it.
        "enable_partial_reuse": "true" if partial_reuse else "false",
        "enable_chunked_context": "true" if chunked_context else "false",
        "exclude_input_in_output": "false",
        "cancellation_check_period_ms": "50",
        "stats_check_period_ms": "100",
    }
    return (
        _header("tensorrt_llm", "python")
        + "model_transaction_policy { decoupled: true }\n"
        + _block("input", inputs)
        + _block("output", outputs)
        + _CPU
        + _parameters(params)
    )


def postprocessing(tokenizer_dir: str) -> str:
    inputs = (Tensor("TOKENS_BATCH", "i", "[ -1, -1 ]"), Tensor("SEQUENCE_LENGTH", "i", "[ -1 ]"))
    params = {"tokenizer_dir": tokenizer_dir, "skip_special_tokens": "true"}
    return (
        _header("postprocessing", "python")
        + _block("input", inputs)
        + _block("output", (Tensor("OUTPUT", "s", "[ -1 ]"),))
        + _parameters(params)
        + _CPU
    )


# Ensemble inputs: (name, kind, dims, optional) and where each goes: (model, its input).
_ENSEMBLE_INPUTS = (
    ("text_input", "s", "[ 1 ]", False, "preprocessing", "QUERY"),
    ("max_tokens", "i", "[ 1 ]", False, "preprocessing", "REQUEST_OUTPUT_LEN"),
    ("bad_words", "s", "[ -1 ]", True, "preprocessing", "BAD_WORDS_DICT"),
    ("stop_words", "s", "[ -1 ]", True, "preprocessing", "STOP_WORDS_DICT"),
    ("end_id", "i", "[ 1 ]", True, "preprocessing", "END_ID"),
    ("pad_id", "i", "[ 1 ]", True, "preprocessing", "PAD_ID"),
    ("exclude_input_in_output", "b", "[ 1 ]", True, "tensorrt_llm", "exclude_input_in_output"),
    ("top_k", "i", "[ 1 ]", True, "tensorrt_llm", "runtime_top_k"),
    ("top_p", "f", "[ 1 ]", True, "tensorrt_llm", "runtime_top_p"),
    ("temperature", "f", "[ 1 ]", True, "tensorrt_llm", "temperature"),
    ("seed", "u", "[ 1 ]", True, "tensorrt_llm", "seed"),
    ("random_seed", "u", "[ 1 ]", True, "tensorrt_llm", "random_seed"),
    ("return_perf_metrics", "b", "[ 1 ]", True, "tensorrt_llm", "return_perf_metrics"),
    (
        "return_kv_cache_reuse_stats",
        "b",
        "[ 1 ]",
        True,
        "tensorrt_llm",
        "return_kv_cache_reuse_stats",
    ),
    ("return_num_input_tokens", "b", "[ 1 ]", True, "tensorrt_llm", "return_num_input_tokens"),
    ("return_num_output_tokens", "b", "[ 1 ]", True, "tensorrt_llm", "return_num_output_tokens"),
    ("stream", "b", "[ 1 ]", True, "tensorrt_llm", "streaming"),
    ("return_log_probs", "b", "[ 1 ]", True, "tensorrt_llm", "return_log_probs"),
    ("beam_width", "i", "[ 1 ]", True, "tensorrt_llm", "beam_width"),
)
# Tensors passed between steps: (producer, its output, ensemble tensor, consumer, its input).
_WIRES = (
    ("preprocessing", "INPUT_ID", "_INPUT_ID", "tensorrt_llm", "input_ids"),
    ("preprocessing", "REQUEST_INPUT_LEN", "_REQUEST_INPUT_LEN", "tensorrt_llm", "input_lengths"),
    (
        "preprocessing",
        "REQUEST_OUTPUT_LEN",
        "_REQUEST_OUTPUT_LEN",
        "tensorrt_llm",
        "request_output_len",
    ),
    ("preprocessing", "STOP_WORDS_IDS", "_STOP_WORDS_IDS", "tensorrt_llm", "stop_words_list"),
    ("preprocessing", "BAD_WORDS_IDS", "_BAD_WORDS_IDS", "tensorrt_llm", "bad_words_list"),
    ("preprocessing", "OUT_END_ID", "_PREPROCESSOR_END_ID", "tensorrt_llm", "end_id"),
    ("preprocessing", "OUT_PAD_ID", "_PREPROCESSOR_PAD_ID", "tensorrt_llm", "pad_id"),
    ("tensorrt_llm", "output_ids", "_TOKENS_BATCH", "postprocessing", "TOKENS_BATCH"),
    ("tensorrt_llm", "sequence_length", "_SEQUENCE_LENGTH", "postprocessing", "SEQUENCE_LENGTH"),
)
STEPS = ("preprocessing", "tensorrt_llm", "postprocessing")


def _step(model: str) -> str:
    lines = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in _inputs_of(model)]
    for producer, output, wire, _, _ in _WIRES:
        if producer == model:
            lines.append(f'output_map {{ key: "{output}" value: "{wire}" }}')
    if model == "tensorrt_llm":
        lines += [f'output_map {{ key: "{n}" value: "{n}" }}' for n, _ in STATS_OUTPUTS]
        lines += [f'output_map {{ key: "{n}" value: "{n}" }}' for n, *_ in EXTRA_OUTPUTS]
    if model == "postprocessing":
        lines.append('output_map { key: "OUTPUT" value: "text_output" }')
    body = "\n      ".join(lines)
    return f'    {{\n      model_name: "{model}"\n      model_version: -1\n      {body}\n    }}'


def _inputs_of(model: str) -> list[tuple[str, str]]:
    """(the model's input, the ensemble tensor feeding it) for one step."""
    pairs = [(key, name) for name, *_, m, key in _ENSEMBLE_INPUTS if m == model]
    pairs += [(key, wire) for _, _, wire, m, key in _WIRES if m == model]
    return pairs


def ensemble() -> str:
    inputs = tuple(
        Tensor(name, kind, dims, optional) for name, kind, dims, optional, *_ in _ENSEMBLE_INPUTS
    )
    outputs = (
        Tensor("text_output", "s", "[ -1 ]"),
        *(Tensor(n, k) for n, k in STATS_OUTPUTS),
        *(Tensor(n, k, d) for n, k, d in EXTRA_OUTPUTS),
    )
    steps = ",\n".join(_step(model) for model in STEPS)
    return (
        f'name: "ensemble"\nplatform: "ensemble"\nmax_batch_size: {MAX_BATCH}\n'
        + _block("input", inputs)
        + _block("output", outputs)
        + f"ensemble_scheduling {{\n  step [\n{steps}\n  ]\n}}\n"
    )
