"""The stand-in engine's configuration and per-request sampling parameters, and their checks.

Errors: `EngineError` for bad parameters or configuration (and, raised by the engine, for a
request that cannot fit in the KV cache).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from backends.sim.tokenizer import EOS_ID, VOCAB_SIZE


class EngineError(Exception):
    """A request or configuration the engine rejects, or a request that does not fit."""


@dataclass(frozen=True)
class EngineConfig:
    """Model shape, cache geometry and numerics; the defaults are the demo replica's."""

    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 256
    tokens_per_block: int = 16
    capacity_blocks: int = 8192
    reuse: bool = True
    partial_reuse: bool = True  # KvCacheConfig::enablePartialReuse, on by default
    float_format: Literal["bf16", "fp16", "fp32"] = "bf16"
    weight_bits: Literal[16, 4] = 16
    weight_seed: int = 0
    prefill_chunk: int = 512


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; max_tokens=0 runs (and caches) the prefill and emits nothing."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    end_id: int = EOS_ID
    stop_words: tuple[str, ...] = ()
    bad_words: tuple[str, ...] = ()


def validate_config(c: EngineConfig) -> None:
    sizes = (c.d_model, c.n_layers, c.n_heads, c.d_ff, c.tokens_per_block, c.prefill_chunk)
    if min(sizes) < 1 or c.capacity_blocks < 1:
        raise EngineError("model sizes, tokens_per_block, prefill_chunk, capacity must be >= 1")
    if c.d_model % c.n_heads or (c.d_model // c.n_heads) % 2:
        raise EngineError("d_model must split into n_heads heads of even size")
    if c.float_format not in ("bf16", "fp16", "fp32"):
        raise EngineError(f"float_format must be bf16, fp16 or fp32, not {c.float_format!r}")
    if c.weight_bits not in (16, 4):
        raise EngineError(f"weight_bits must be 16 or 4, not {c.weight_bits!r}")
    if c.weight_bits == 4 and (c.d_model % 32 or c.d_ff % 32):
        raise EngineError("int4 weights need d_model and d_ff to be multiples of 32")
    if c.weight_seed < 0:
        raise EngineError("weight_seed must be >= 0")


def validate_params(p: SamplingParams) -> None:
    if p.max_tokens < 0:
        raise EngineError(f"max_tokens must be >= 0, got {p.max_tokens}")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise EngineError(f"temperature must be a finite number >= 0, got {p.temperature}")
    if p.top_k < 0:
        raise EngineError(f"top_k must be >= 0 (0 means no limit), got {p.top_k}")
    if not 0.0 < p.top_p <= 1.0:
        raise EngineError(f"top_p must be in (0, 1], got {p.top_p}")
    if p.seed < 0:
        raise EngineError(f"seed must be >= 0, got {p.seed}")
    if not 0 <= p.end_id < VOCAB_SIZE:
        raise EngineError(f"end_id must be a token id in [0, {VOCAB_SIZE}), got {p.end_id}")
    if any(not w for w in p.stop_words + p.bad_words):
        raise EngineError("stop_words and bad_words must not contain empty strings")
