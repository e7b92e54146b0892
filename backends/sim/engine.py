"""The stand-in engine: a tiny transformer behind a TensorRT-LLM-like paged KV cache.

Reruns of a workload diverge only because of cache state: a prompt whose prefix is cached is
computed page by page and merged by log-sum-exp instead of in one pass, and the 16-bit
rounding of that different order can flip a near-tied token. Nothing random is injected;
the same request from the same cache state yields the same bytes, always.

Errors: `EngineError` for bad parameters or configuration and for a request that cannot fit
in the KV cache ("KV cache capacity exceeded").

`Engine` is thread-safe: requests run one at a time, in the order they take its lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from backends.sim.kvcache import CapacityError, PagedKVCache, Session
from backends.sim.numerics import F64, keep_freed_memory
from backends.sim.params import (
    EngineConfig,
    EngineError,
    SamplingParams,
    validate_config,
    validate_params,
)
from backends.sim.tokenizer import VOCAB_SIZE, Sampler, encode, piece
from backends.sim.transformer import Check, Transformer

__all__ = [
    "CacheStats",
    "Engine",
    "EngineConfig",
    "EngineError",
    "FinishReason",
    "GenerationResult",
    "Progress",
    "SamplingParams",
]
FinishReason = Literal["stop", "length", "cancelled"]
_PREALLOCATE_MAX = 4096  # output tokens whose K/V buffer is allocated up front
_CHECK_EVERY_S = 0.05  # how often a long prefill asks whether its request was cancelled


class _Abandoned(Exception):
    """A cancelled request's forward pass stops here (raised by ``_Run._check``)."""


@dataclass
class GenerationResult:
    """Output, block accounting (as TensorRT-LLM reports it) and time.time_ns() stamps."""

    prompt_tokens: int
    output_tokens: list[int]
    text: str
    reused_blocks: int  # fully and partially matched blocks, as kv_cache_reused_blocks counts
    new_blocks: int
    total_blocks: int
    arrival_time_ns: int
    first_scheduled_time_ns: int
    first_token_time_ns: int
    last_token_time_ns: int
    finish_reason: FinishReason
    # log P(token) of each output token under the model's distribution (a log-softmax of the
    # logits it was picked from, before sampling's temperature, top-k and top-p), in fp32 values
    log_probs: list[float] = field(default_factory=list)
    reused_tokens: int = 0  # prompt tokens whose K/V came from the cache (full + partial)
    clamped_from: int | None = None  # requested output tokens, when over max_seq_len

    @property
    def cum_log_prob(self) -> float:
        return float(np.float32(sum(self.log_probs)))


@dataclass(frozen=True)
class Progress:
    """The running request's statistics so far, as the executor attaches them to each
    streamed result (``LlmRequest::createResult``: the request's perf metrics)."""

    reused_blocks: int
    new_blocks: int
    total_blocks: int
    first_scheduled_time_ns: int
    first_token_time_ns: int
    last_token_time_ns: int
    log_probs: list[float]


@dataclass(frozen=True)
class CacheStats:
    """Pool occupancy now, and cumulative counters for metrics."""

    max_blocks: int
    free_blocks: int
    used_blocks: int
    tokens_per_block: int
    reused_blocks_total: int  # cumulative since the engine started, across resets
    iterations: int  # cumulative forward steps: one per prefill chunk or decoded token
    requests_completed: int


class Engine:
    """Serial generation against one paged KV cache."""

    def __init__(self, config: EngineConfig, weights: Mapping[str, F64] | None = None) -> None:
        """``weights`` come from an engine file; without them they are made from the seed."""
        validate_config(config)
        keep_freed_memory()
        self.config = config
        self.model = Transformer(
            d_model=config.d_model,
            n_layers=config.n_layers,
            n_heads=config.n_heads,
            d_ff=config.d_ff,
            fmt=config.float_format,
            weight_bits=config.weight_bits,
            seed=config.weight_seed,
            weights=weights,
        )
        self._cache = PagedKVCache(
            capacity_blocks=config.capacity_blocks,
            tokens_per_block=config.tokens_per_block,
            reuse=config.reuse,
            partial_reuse=config.partial_reuse,
            layers=config.n_layers,
            heads=config.n_heads,
            head_dim=config.d_model // config.n_heads,
        )
        self._lock = threading.Lock()
        self._live: tuple[Session, _Run, int] | None = None  # the running request
        self._iterations = 0
        self._completed = 0

    def reset(self) -> None:
        """Empty the KV cache (weights and cumulative counters are kept)."""
        with self._lock:
            self._cache.clear()

    def stats(self) -> CacheStats:
        cache = self._cache
        return CacheStats(
            max_blocks=cache.capacity,
            free_blocks=cache.capacity - cache.used_blocks,
            used_blocks=cache.used_blocks,
            tokens_per_block=cache.tpb,
            reused_blocks_total=cache.reused_blocks_total,
            iterations=self._iterations,
            requests_completed=self._completed,
        )

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        on_token: Callable[[int, str], None] | None = None,
        is_cancelled: Callable[[], bool] | None = None,
        arrival_time_ns: int | None = None,
    ) -> GenerationResult:
        """Generate a completion of a text or of token ids; `on_token(id, text)` streams each
        emitted token but the last (which the caller sends with its final response: the output
        tokens after those streamed). `is_cancelled` is asked between prefill chunks and between
        tokens."""
        arrival = time.time_ns() if arrival_time_ns is None else arrival_time_ns
        validate_params(params)
        tokens = encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not tokens:
            raise EngineError("prompt must not be empty")
        if min(tokens) < 0 or max(tokens) >= VOCAB_SIZE:
            raise EngineError(f"input ids must be token ids in [0, {VOCAB_SIZE})")
        with self._lock:
            scheduled = time.time_ns()
            expected = len(tokens) + min(params.max_tokens, _PREALLOCATE_MAX)
            session = self._cache.begin(tokens, expected)
            try:
                run = _Run(self, session, params, on_token, is_cancelled)
                self._live = (session, run, scheduled)
                run.execute()
            except CapacityError as exc:
                self._cache.finish(session, register=False)
                raise EngineError(str(exc)) from exc
            except BaseException:
                self._cache.finish(session, register=False)
                raise
            finally:
                self._live = None
            self._cache.finish(session, register=True)
            self._completed += 1
        end = time.time_ns()
        return GenerationResult(
            prompt_tokens=len(tokens),
            output_tokens=run.output,
            text=run.text,
            reused_blocks=session.reused_blocks,
            new_blocks=session.new_blocks,
            total_blocks=session.reused_blocks + session.new_blocks,
            arrival_time_ns=arrival,
            first_scheduled_time_ns=scheduled,
            first_token_time_ns=run.first_token_ns or end,
            last_token_time_ns=run.last_token_ns or end,
            finish_reason=run.finish_reason,
            log_probs=run.log_probs,
            reused_tokens=session.reused_tokens,
        )

    def progress(self) -> Progress | None:
        """The running request's statistics (None when none runs); for ``on_token``."""
        live = self._live
        if live is None:
            return None
        session, run, scheduled = live
        return Progress(
            reused_blocks=session.reused_blocks,
            new_blocks=session.new_blocks,
            total_blocks=session.reused_blocks + session.new_blocks,
            first_scheduled_time_ns=scheduled,
            first_token_time_ns=run.first_token_ns,
            last_token_time_ns=run.last_token_ns,
            log_probs=list(run.log_probs),
        )

    def _forward(
        self, session: Session, start: int, end: int, decode: bool, check: Check | None = None
    ) -> F64:
        session.reserve(end)
        chunk = np.asarray(session.tokens[start:end], dtype=np.int64)
        logits = self.model.forward(
            chunk,
            start,
            session.kt,
            session.v,
            decode=decode,
            tokens_per_block=self.config.tokens_per_block,
            check=check,
        )
        session.computed = end
        self._iterations += 1
        return logits


class _Run:
    """The token loop of one request."""

    def __init__(
        self,
        engine: Engine,
        session: Session,
        params: SamplingParams,
        on_token: Callable[[int, str], None] | None,
        is_cancelled: Callable[[], bool] | None,
    ) -> None:
        self.engine, self.session, self.params = engine, session, params
        self.on_token = on_token
        self.is_cancelled = is_cancelled or (lambda: False)
        self.output: list[int] = []
        self.log_probs: list[float] = []
        self.text = ""
        self.first_token_ns = 0
        self.last_token_ns = 0
        self.finish_reason: FinishReason = "length"
        self._checked = time.monotonic()

    def execute(self) -> None:
        if self.is_cancelled():
            self.finish_reason = "cancelled"
            return
        logits = self._prefill()
        if logits is None:
            self.finish_reason = "cancelled"
            return
        if self.params.max_tokens == 0:
            return
        p = self.params
        sampler = Sampler(p.temperature, p.top_k, p.top_p, p.seed, p.end_id, p.bad_words)
        while True:
            token = sampler.pick(logits, self.text.encode("ascii"))
            if token == self.params.end_id:
                self.finish_reason = "stop"
                return
            text = self._emit(token, _log_prob(logits, token))
            if any(self.text.endswith(w) for w in self.params.stop_words):
                self.finish_reason = "stop"
                return
            if len(self.output) >= self.params.max_tokens:
                return
            if self.is_cancelled():
                self.finish_reason = "cancelled"
                return
            # Not the last token: stream it now. The last one is left to the caller to send
            # with the request's final response, as TensorRT-LLM's executor does.
            if self.on_token is not None:
                self.on_token(token, text)
            self.session.tokens.append(token)
            pos = self.session.computed
            logits = self.engine._forward(self.session, pos, pos + 1, decode=True)

    def _prefill(self) -> F64 | None:
        """Chunks of prefill_chunk tokens counted from the cache boundary; None when the
        request was cancelled between two chunks (as an engine stops between iterations)."""
        session, chunk = self.session, self.engine.config.prefill_chunk
        begin = start = session.computed
        n = len(session.tokens)
        logits: F64 = np.zeros(0)
        try:
            while start < n:
                if start > begin and self.is_cancelled():
                    return None
                end = min(start + chunk, n)
                logits = self.engine._forward(session, start, end, False, self._check)
                start = end
        except _Abandoned:
            return None
        return logits

    def _check(self) -> None:
        # Asked between passes over the cached pages: a chunk over a long prefix takes seconds
        # on a CPU, so a cancelled prefill stops within one pass, not one chunk.
        now = time.monotonic()
        if now - self._checked >= _CHECK_EVERY_S:
            self._checked = now
            if self.is_cancelled():
                raise _Abandoned

    def _emit(self, token: int, log_prob: float) -> str:
        text = piece(token)
        self.output.append(token)
        self.log_probs.append(log_prob)
        self.text += text
        self.last_token_ns = time.time_ns()
        self.first_token_ns = self.first_token_ns or self.last_token_ns
        return text


def _log_prob(logits: F64, token: int) -> float:
    """log softmax(logits)[token], computed in float64 and stored as fp32 (as a GPU returns it)."""
    top = float(np.max(logits))
    lse = top + float(np.log(np.sum(np.exp(logits - top))))
    return float(np.float32(logits[token] - lse))
