"""The stand-in's engine directory, laid out as ``trtllm-build`` leaves one for a GPU.

``config.json`` says what TensorRT-LLM's engine config says: ``pretrained_config`` (architecture,
dtype, sizes, quantization) and ``build_config`` (``max_input_len``, ``max_seq_len``,
``max_batch_size``, ``max_num_tokens``, ``plugin_config.tokens_per_block`` and the paged-cache
switches). ``rank0.engine`` holds the weights, already rounded to the engine's precision, so two
engines of different precision differ in their files exactly as two GPU engines do, and replacing
the files changes what the next load serves. The ``tensorrt_llm`` model reads the directory its
``gpt_model_path`` parameter names; the proxy may read it too (the engine digest, max_input_len).

``rank0.engine`` is ``MAGIC``, one JSON line naming each tensor's shape and byte offset, then the
tensors as little-endian float32. It is written byte for byte the same for the same build, so
identical replicas have identical files (no archive timestamps).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from backends.sim.numerics import F64
from backends.sim.tokenizer import VOCAB_SIZE
from backends.sim.transformer import make_weights

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "rank0.engine"
MAGIC = b"KVLSIM-ENGINE/1\n"
Precision = Literal["bf16", "fp16", "fp32", "int4"]
FloatFormat = Literal["bf16", "fp16", "fp32"]
_DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_FORMATS: dict[str, FloatFormat] = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
# Test-only: this file in the ``tensorrt_llm`` model's directory perturbs the numerics at load
# while the engine digest stays (``models/tensorrt_llm.py``: ``perturbed``).
PERTURB_FILE = "TEST_PERTURB_NUMERICS"
INT4_ALGO = "W4A16"  # weight-only int4, group-wise (groups of 32 along the input)


class EngineFileError(ValueError):
    """The engine directory is missing, unreadable or inconsistent; the message says which."""


@dataclass(frozen=True)
class EngineBuild:
    """What ``trtllm-build`` would be told, and the stand-in model's fixed shape."""

    precision: Precision = "bf16"
    weight_seed: int = 0
    tokens_per_block: int = 16
    max_input_len: int = 32768
    max_seq_len: int = 36864
    max_num_tokens: int = 512  # the prefill chunk: tokens per engine iteration
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 256

    @property
    def float_format(self) -> FloatFormat:
        return "bf16" if self.precision == "int4" else self.precision

    @property
    def weight_bits(self) -> Literal[16, 4]:
        return 4 if self.precision == "int4" else 16


def engine_config(build: EngineBuild) -> dict[str, Any]:
    """config.json, with TensorRT-LLM's section and key names."""
    quant: dict[str, Any] = {"quant_algo": None, "kv_cache_quant_algo": None}
    if build.precision == "int4":
        quant = {"quant_algo": INT4_ALGO, "kv_cache_quant_algo": None, "group_size": 32}
    return {
        "version": "kvledger-sim",
        "pretrained_config": {
            "architecture": "KvlSimForCausalLM",
            "dtype": _DTYPES[build.float_format],
            "vocab_size": VOCAB_SIZE,
            "hidden_size": build.d_model,
            "num_hidden_layers": build.n_layers,
            "num_attention_heads": build.n_heads,
            "intermediate_size": build.d_ff,
            "quantization": quant,
            "weight_seed": build.weight_seed,
        },
        "build_config": {
            "max_input_len": build.max_input_len,
            "max_seq_len": build.max_seq_len,
            "max_batch_size": 64,
            "max_beam_width": 1,
            "max_num_tokens": build.max_num_tokens,
            "plugin_config": {
                "paged_kv_cache": True,
                "tokens_per_block": build.tokens_per_block,
                "use_paged_context_fmha": True,
            },
        },
    }


def build_engine(directory: Path, build: EngineBuild) -> Path:
    """Write ``config.json`` and ``rank0.engine`` into ``directory`` (made if missing)."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = make_weights(
        d_model=build.d_model,
        n_layers=build.n_layers,
        d_ff=build.d_ff,
        fmt=build.float_format,
        weight_bits=build.weight_bits,
        seed=build.weight_seed,
    )
    config = json.dumps(engine_config(build), indent=2, sort_keys=True) + "\n"
    (directory / CONFIG_FILE).write_text(config)
    (directory / WEIGHTS_FILE).write_bytes(_serialize(weights))
    return directory


def _serialize(weights: dict[str, F64]) -> bytes:
    index, blobs, offset = [], [], 0
    for name in sorted(weights):
        # Every stored weight is a bf16, fp16 or fp32 value: float32 holds it exactly.
        blob = np.ascontiguousarray(weights[name], dtype="<f4").tobytes()
        index.append({"name": name, "shape": list(weights[name].shape), "offset": offset})
        blobs.append(blob)
        offset += len(blob)
    header = json.dumps({"dtype": "float32", "tensors": index}, sort_keys=True).encode()
    return MAGIC + header + b"\n" + b"".join(blobs)


def read_config(directory: Path) -> dict[str, Any]:
    """The engine's config.json as a dict (EngineFileError when missing or not JSON)."""
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise EngineFileError(f"engine config {directory / CONFIG_FILE}: {exc}") from exc
    if not isinstance(config, dict):
        raise EngineFileError(f"engine config {directory / CONFIG_FILE} is not a JSON object")
    return config


def load_engine(directory: Path) -> tuple[EngineBuild, dict[str, F64]]:
    """The build an engine directory describes and its weights (as float64)."""
    config = read_config(directory)
    try:
        pretrained, build_config = config["pretrained_config"], config["build_config"]
        quant = pretrained.get("quantization") or {}
        fmt = _FORMATS[pretrained["dtype"]]
        precision: Precision = "int4" if quant.get("quant_algo") == INT4_ALGO else fmt
        build = EngineBuild(
            precision=precision,
            weight_seed=int(pretrained.get("weight_seed", 0)),
            tokens_per_block=int(build_config["plugin_config"]["tokens_per_block"]),
            max_input_len=int(build_config["max_input_len"]),
            max_seq_len=int(build_config["max_seq_len"]),
            max_num_tokens=int(build_config["max_num_tokens"]),
            d_model=int(pretrained["hidden_size"]),
            n_layers=int(pretrained["num_hidden_layers"]),
            n_heads=int(pretrained["num_attention_heads"]),
            d_ff=int(pretrained["intermediate_size"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineFileError(f"engine config {directory / CONFIG_FILE}: bad {exc}") from exc
    return build, _deserialize(directory / WEIGHTS_FILE)


def _deserialize(path: Path) -> dict[str, F64]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise EngineFileError(f"engine weights {path}: {exc.strerror}") from exc
    if not data.startswith(MAGIC):
        raise EngineFileError(f"engine weights {path}: not a stand-in engine file")
    header_end = data.index(b"\n", len(MAGIC))
    header = json.loads(data[len(MAGIC) : header_end])
    body = memoryview(data)[header_end + 1 :]
    weights: dict[str, F64] = {}
    for tensor in header["tensors"]:
        count = int(np.prod(tensor["shape"]))
        flat = np.frombuffer(body, dtype="<f4", count=count, offset=tensor["offset"])
        weights[tensor["name"]] = flat.astype(np.float64).reshape(tensor["shape"])
    return weights
