"""Write the stand-in replica's Triton model repository: ``ensemble`` with TensorRT-LLM's names.

The config mirrors the ``ensemble`` model of TensorRT-LLM's Triton backend (input and output names,
types and shapes, decoupled streaming) so that a client written for a real replica works against
the stand-in unchanged. Its ``parameters`` block carries the cache settings a real
``tensorrt_llm`` model config would (``enable_kv_cache_reuse``, ``tokens_per_block``,
``max_tokens_in_paged_kv_cache``) plus the stand-in's own (``weight_precision``, ``weight_seed``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

MODEL_NAME = "ensemble"
Precision = Literal["bf16", "fp16", "fp32", "int4"]

# (name, Triton type, dims, optional)
_INPUTS: tuple[tuple[str, str, str, bool], ...] = (
    ("text_input", "TYPE_STRING", "[ 1 ]", False),
    ("max_tokens", "TYPE_INT32", "[ 1 ]", True),
    ("stream", "TYPE_BOOL", "[ 1 ]", True),
    ("temperature", "TYPE_FP32", "[ 1 ]", True),
    ("top_k", "TYPE_INT32", "[ 1 ]", True),
    ("top_p", "TYPE_FP32", "[ 1 ]", True),
    ("seed", "TYPE_UINT64", "[ 1 ]", True),
    ("random_seed", "TYPE_UINT64", "[ 1 ]", True),
    ("end_id", "TYPE_INT32", "[ 1 ]", True),
    ("pad_id", "TYPE_INT32", "[ 1 ]", True),
    ("stop_words", "TYPE_STRING", "[ -1 ]", True),
    ("bad_words", "TYPE_STRING", "[ -1 ]", True),
    ("exclude_input_in_output", "TYPE_BOOL", "[ 1 ]", True),
    ("return_perf_metrics", "TYPE_BOOL", "[ 1 ]", True),
    ("return_kv_cache_reuse_stats", "TYPE_BOOL", "[ 1 ]", True),
    ("return_num_input_tokens", "TYPE_BOOL", "[ 1 ]", True),
    ("return_num_output_tokens", "TYPE_BOOL", "[ 1 ]", True),
)
_OUTPUTS: tuple[tuple[str, str], ...] = (
    ("text_output", "TYPE_STRING"),
    ("kv_cache_alloc_new_blocks", "TYPE_INT32"),
    ("kv_cache_reused_blocks", "TYPE_INT32"),
    ("kv_cache_alloc_total_blocks", "TYPE_INT32"),
    ("arrival_time_ns", "TYPE_INT64"),
    ("first_scheduled_time_ns", "TYPE_INT64"),
    ("first_token_time_ns", "TYPE_INT64"),
    ("last_token_time_ns", "TYPE_INT64"),
    ("num_input_tokens", "TYPE_INT32"),
    ("num_output_tokens", "TYPE_INT32"),
)


@dataclass(frozen=True)
class ModelSettings:
    """What one replica's model is: its cache behaviour and its weights."""

    reuse: bool = True
    tokens_per_block: int = 16
    max_tokens_in_paged_kv_cache: int = 131072
    precision: Precision = "bf16"
    weight_seed: int = 0


def config_pbtxt(settings: ModelSettings) -> str:
    """The model config, in Triton's text protobuf format."""
    inputs = ",\n".join(
        f'  {{ name: "{n}" data_type: {t} dims: {d}{" optional: true" if o else ""} }}'
        for n, t, d, o in _INPUTS
    )
    outputs = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ -1 ] }}' for n, t in _OUTPUTS)
    params = {
        "enable_kv_cache_reuse": "true" if settings.reuse else "false",
        "tokens_per_block": str(settings.tokens_per_block),
        "max_tokens_in_paged_kv_cache": str(settings.max_tokens_in_paged_kv_cache),
        "weight_precision": settings.precision,
        "weight_seed": str(settings.weight_seed),
    }
    parameters = "\n".join(
        f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items()
    )
    return (
        f'name: "{MODEL_NAME}"\nbackend: "python"\nmax_batch_size: 64\n'
        "model_transaction_policy { decoupled: true }\n"
        f"input [\n{inputs}\n]\noutput [\n{outputs}\n]\n"
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        f"{parameters}\n"
    )


def write_repository(root: Path, settings: ModelSettings) -> Path:
    """Lay out ``root/ensemble/{config.pbtxt,1/model.py}`` and return ``root``."""
    model_dir = root / MODEL_NAME
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(config_pbtxt(settings))
    shutil.copyfile(Path(__file__).with_name("triton_model.py"), model_dir / "1" / "model.py")
    return root
