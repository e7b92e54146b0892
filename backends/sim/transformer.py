"""A tiny random-weight decoder-only transformer whose arithmetic imitates GPU kernels.

Pre-norm RMSNorm blocks, RoPE, GELU (tanh) MLP, untied output projection, byte vocabulary.
Everything is computed in float64 and rounded where a kernel would store a narrower value
(see `numerics`): weights, linear outputs, the residual stream, stored K/V, attention
outputs and the softmax probabilities before P.V go to the storage format; scores,
exponentials, row sums, maxima and the log-sum-exp merge stay in fp32. Norm outputs, the
GELU output and q after RoPE are left unrounded (float64) as they feed straight into a GEMM.

Attention comes in three shapes, as in paged-attention engines:
- fresh prefill (nothing cached before the chunk): one causal single pass;
- prefill after a cached prefix: one partial softmax per KV page of the prefix plus a causal
  single pass over the chunk, merged by log-sum-exp;
- decode: one partial softmax per page over everything, merged by log-sum-exp.
The cached and the fresh path so differ only in floating-point order and rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
from numpy.typing import NDArray

from backends.sim.numerics import (
    F32,
    F64,
    Format,
    dequantize_int4,
    fmt_f32,
    quantize_int4,
    rounder,
    to_f32,
)
from backends.sim.tokenizer import VOCAB_SIZE

# Weight scales (std = gain / sqrt(fan_in)). With these, greedy continuations are varied
# rather than constant, and top-2 logit gaps are sometimes small enough for the rounding
# differences between cache paths to flip a token: bf16 warm reruns of the calibration
# workload diverge in 25-54% of episodes across weight seeds 0-2 (bench/calibrate_engine.py).
EMBED_STD = 1.0
LINEAR_GAIN = 1.0
QK_GAIN = 2.0  # sharper attention makes the output depend on context, not only the last byte
LOGIT_GAIN = 1.0
ROPE_THETA = 10000.0
NORM_EPS = 1e-6
# Scores per head in one vectorized split-KV pass: bounds the temporaries of a long prefill.
_SCORES_PER_PASS = 1 << 19
Check = Callable[[], None]


def make_weights(
    *, d_model: int, n_layers: int, d_ff: int, fmt: Format, weight_bits: int, seed: int
) -> dict[str, F64]:
    """The random weights of a seed, rounded to ``fmt`` (int4 groups first when 4-bit)."""
    rnd = rounder(fmt)
    rng = np.random.Generator(np.random.PCG64(seed))

    def linear(fan_in: int, fan_out: int, gain: float) -> F64:
        w = rng.standard_normal((fan_in, fan_out)) * (gain / math.sqrt(fan_in))
        if weight_bits == 4:
            w = dequantize_int4(*quantize_int4(w))
        return rnd(w)

    weights = {"embed": rnd(rng.standard_normal((VOCAB_SIZE, d_model)) * EMBED_STD)}
    for i in range(n_layers):
        wq = linear(d_model, d_model, QK_GAIN)
        wk = linear(d_model, d_model, QK_GAIN)
        wv = linear(d_model, d_model, LINEAR_GAIN)
        # One fused QKV matrix: element-wise rounding makes it identical to three GEMMs.
        weights[f"layers.{i}.wqkv"] = np.concatenate([wq, wk, wv], axis=1)
        weights[f"layers.{i}.wo"] = linear(d_model, d_model, LINEAR_GAIN)
        weights[f"layers.{i}.w1"] = linear(d_model, d_ff, LINEAR_GAIN)
        weights[f"layers.{i}.w2"] = linear(d_ff, d_model, LINEAR_GAIN)
    # The output projection stays 16-bit, as weight-only quantization usually leaves it.
    out = rng.standard_normal((d_model, VOCAB_SIZE)) * (LOGIT_GAIN / math.sqrt(d_model))
    weights["wout"] = rnd(out)
    return weights


class Transformer:
    """Weights and forward passes; the KV working buffers are owned by the caller."""

    def __init__(
        self,
        *,
        d_model: int,
        n_layers: int,
        n_heads: int,
        d_ff: int,
        fmt: Format,
        weight_bits: int,
        seed: int,
        weights: Mapping[str, F64] | None = None,
    ) -> None:
        """Weights from ``weights`` (an engine file's) or, when None, made from ``seed``."""
        if d_model % n_heads or (d_model // n_heads) % 2:
            raise ValueError("d_model must split into n_heads heads of even size")
        self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
        self.head_dim = d_model // n_heads
        self.fmt: Format = fmt
        self._rnd = rounder(fmt)
        if weights is None:
            weights = make_weights(
                d_model=d_model,
                n_layers=n_layers,
                d_ff=d_ff,
                fmt=fmt,
                weight_bits=weight_bits,
                seed=seed,
            )
        self.embed = weights["embed"]
        self.wqkv = [weights[f"layers.{i}.wqkv"] for i in range(n_layers)]
        self.wo = [weights[f"layers.{i}.wo"] for i in range(n_layers)]
        self.w1 = [weights[f"layers.{i}.w1"] for i in range(n_layers)]
        self.w2 = [weights[f"layers.{i}.w2"] for i in range(n_layers)]
        self.wout = weights["wout"]
        half = self.head_dim // 2
        self._inv_freq = ROPE_THETA ** (-np.arange(half, dtype=np.float64) / half)
        # rotate_half(x) = concat(-x2, x1) as a gather and an exact sign flip.
        self._rot_index = np.concatenate([np.arange(half, 2 * half), np.arange(half)])
        self._rot_sign = np.concatenate([-np.ones(half), np.ones(half)])
        # 1/sqrt(head_dim) is applied to q before the QK^T product, as kernels fold it in.
        self._scale = 1.0 / math.sqrt(self.head_dim)

    def forward(
        self,
        tokens: NDArray[np.int64],
        start: int,
        kt: F64,
        v: F64,
        *,
        decode: bool,
        tokens_per_block: int,
        check: Check | None = None,
    ) -> F64:
        """Run `tokens` at positions start.. and return the logits of the last one.

        ``check`` is called between passes over the cached pages and may raise to abandon
        the forward (the working K/V of the abandoned positions are then meaningless).

        The working K/V hold positions < start and receive the new tokens' K/V:
        `kt` is [layers, heads, tokens_per_block, head_dim, pages] (position b*tpb + t at
        [.., t, :, b], so that per-page reductions run over an outer axis) and `v` is
        [layers, heads, pages * tpb, head_dim].
        """
        n, d = len(tokens), self.d_model
        cos, sin = self._rope_tables(start, n)
        tpb = tokens_per_block
        where = np.arange(start, start + n)
        slot_t, slot_b = where % tpb, where // tpb
        h = self.embed[tokens]
        for layer in range(self.n_layers):
            qkv = self._rnd(_rmsnorm(h) @ self.wqkv[layer])
            qk = qkv[:, : 2 * d].reshape(n, 2 * self.n_heads, self.head_dim)
            qk = qk * cos + qk[..., self._rot_index] * sin
            q = qk[:, : self.n_heads].transpose(1, 0, 2) * self._scale
            k_new = self._rnd(qk[:, self.n_heads :])  # [n, H, hd]
            v_new = qkv[:, 2 * d :].reshape(n, self.n_heads, self.head_dim)
            kt[layer][:, slot_t, :, slot_b] = k_new
            v[layer][:, start : start + n] = v_new.transpose(1, 0, 2)
            if decode:
                o = _merge(*_paged(q, kt[layer], v[layer], start + n, self.fmt))
            else:
                o = self._prefill_attention(q, k_new, v_new, kt[layer], v[layer], start, check)
            att = fmt_f32(o, self.fmt, owned=True).astype(np.float64)
            h = self._rnd(h + self._rnd(att.transpose(1, 0, 2).reshape(n, d) @ self.wo[layer]))
            u = self._rnd(_rmsnorm(h) @ self.w1[layer])
            h = self._rnd(h + self._rnd(_gelu(u) @ self.w2[layer]))
        logits: F64 = self._rnd(_rmsnorm(h[-1:]) @ self.wout)[0]
        return logits

    def _rope_tables(self, start: int, n: int) -> tuple[F64, F64]:
        """cos and signed sin for positions start.., shaped [n, 1, head_dim]."""
        angles = np.arange(start, start + n, dtype=np.float64)[:, None] * self._inv_freq
        cos = np.cos(angles)
        sin = np.sin(angles)
        full_cos = np.concatenate([cos, cos], axis=1)[:, None]
        full_sin = (np.concatenate([sin, sin], axis=1) * self._rot_sign)[:, None]
        return full_cos, full_sin

    def _prefill_attention(
        self, q: F64, k_new: F64, v_new: F64, kt: F64, v: F64, start: int, check: Check | None
    ) -> F32:
        """Single pass over the chunk, merged with split-KV over a cached prefix if any."""
        k_c, v_c = k_new.transpose(1, 0, 2), v_new.transpose(1, 0, 2)
        o_c, lse_c = _single_pass(q, k_c, v_c, self.fmt)
        if start == 0:
            return o_c
        o_pages, lse_pages = _paged(q, kt, v, start, self.fmt, check)
        o_all = np.concatenate([o_pages, o_c[:, None]], axis=1)
        lse_all = np.concatenate([lse_pages, lse_c[..., None]], axis=-1)
        return _merge(o_all, lse_all)


def _rmsnorm(x: F64) -> F64:
    # Gains are all one (exactly representable), so they are left out of the arithmetic.
    ms = np.einsum("nd,nd->n", x, x)[:, None] / x.shape[-1]
    out: F64 = x / np.sqrt(ms + NORM_EPS)
    return out


def _gelu(x: F64) -> F64:
    out: F64 = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * (x * x * x))))
    return out


def _exp_f32(x: F32) -> F32:
    # exp in float64 then one rounding: float32 exp kernels differ across CPUs' SIMD paths.
    return to_f32(np.exp(x.astype(np.float64)))


def _softmax_parts(s: F32, fmt: Format) -> tuple[F32, F32, F64]:
    """Row max m, fp32 row sum l of exp(s - m), and P = exp(s - m) rounded to `fmt`."""
    m = s.max(axis=-1, keepdims=True)
    e = _exp_f32(s - m)
    denom = to_f32(e.sum(axis=-1, dtype=np.float64))
    p = fmt_f32(e, fmt, owned=True).astype(np.float64)
    return m[..., 0], denom, p


def _lse(m: F32, denom: F32) -> F32:
    out: F32 = m + to_f32(np.log(denom.astype(np.float64)))
    return out


def _single_pass(q: F64, k: F64, v: F64, fmt: Format) -> tuple[F32, F32]:
    """Causal attention of a chunk over itself: (o [H, n, hd], lse [H, n]), both fp32."""
    n = q.shape[1]
    s = to_f32(np.matmul(q, k.transpose(0, 2, 1)))
    s[:, np.triu(np.ones((n, n), dtype=np.bool_), 1)] = -np.inf
    m, denom, p = _softmax_parts(s, fmt)
    o = to_f32(np.matmul(p, v) / denom[..., None])
    return o, _lse(m, denom)


def _paged(
    q: F64, kt: F64, v: F64, length: int, fmt: Format, check: Check | None = None
) -> tuple[F32, F32]:
    """Split-KV over the pages holding positions < length, one partial softmax per page.

    Returns (o [H, pages, n, hd], lse [H, n, pages]), fp32; a partial last page is masked.
    Pages go through vectorized passes of at most _SCORES_PER_PASS scores per head (every
    page's partial is computed alone, so the grouping changes no result); between passes
    ``check`` may raise to abandon the request, as an engine stops between iterations.
    """
    tpb, n = kt.shape[1], q.shape[1]
    pages = -(-length // tpb)
    group = max(1, _SCORES_PER_PASS // (tpb * n))
    if pages <= group:
        return _page_span(q, kt, v, 0, pages, length, fmt)
    parts = []
    for first in range(0, pages, group):
        if check is not None:
            check()
        parts.append(_page_span(q, kt, v, first, min(first + group, pages), length, fmt))
    return (
        np.concatenate([o for o, _ in parts], axis=1),
        np.concatenate([lse for _, lse in parts], axis=-1),
    )


def _page_span(
    q: F64, kt: F64, v: F64, first: int, end: int, length: int, fmt: Format
) -> tuple[F32, F32]:
    """Partials of pages first..end; scores are laid out [H, tpb, n, pages] so that the
    per-page max and sum reduce over an outer axis, which numpy does fast."""
    heads, tpb, hd, _ = kt.shape
    s = to_f32(np.matmul(q[:, None], kt[..., first:end]))
    if end * tpb > length:  # the last page is partial: mask the positions past the end
        s[:, length - (end - 1) * tpb :, :, end - 1 - first] = -np.inf
    m = s.max(axis=1)
    e = _exp_f32(s - m[:, None])
    denom = to_f32(e.sum(axis=1, dtype=np.float64))
    p = fmt_f32(e, fmt, owned=True)
    p_pages = np.ascontiguousarray(p.transpose(0, 3, 2, 1), dtype=np.float64)
    pv = np.matmul(p_pages, v[:, first * tpb : end * tpb].reshape(heads, end - first, tpb, hd))
    o = to_f32(pv / denom.transpose(0, 2, 1).astype(np.float64)[..., None])
    return o, _lse(m, denom)


def _merge(o: F32, lse: F32) -> F32:
    """Log-sum-exp merge of partials o [H, B, n, hd], lse [H, n, B] over B, in fp32."""
    w = _exp_f32(lse - lse.max(axis=-1, keepdims=True))
    # fp32 x fp32 products are exact in float64, so only the sum's rounding remains.
    weighted = np.matmul(
        w.astype(np.float64)[:, :, None], o.astype(np.float64).transpose(0, 2, 1, 3)
    )
    num = to_f32(weighted[:, :, 0])
    den = to_f32(w.sum(axis=-1, dtype=np.float64))
    merged: F32 = num / den[..., None]
    return merged
