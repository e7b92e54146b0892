"""In-process tests of the stand-in engine: numerics, paged KV cache, sampling, stopping."""

from __future__ import annotations

import numpy as np
import pytest

from backends.sim.engine import Engine, EngineConfig, EngineError, SamplingParams
from backends.sim.numerics import F64, dequantize_int4, quantize_int4, round_bf16
from backends.sim.transformer import Transformer
from bench.workload import make_episodes, run_episode

PROMPT = "You are a helpful agent.\nTask: list the files in src and explain them.\nA: "
SMALL = EngineConfig(tokens_per_block=4, capacity_blocks=6)


def _greedy(engine: Engine, prompt: str = PROMPT, **kw: object) -> str:
    return engine.generate(prompt, SamplingParams(**kw)).text  # type: ignore[arg-type]


def _run(engine: Engine, n: int) -> list[list[str]]:
    params = SamplingParams(max_tokens=20)
    episodes = make_episodes(n)
    return [run_episode(lambda p: engine.generate(p, params).text, ep) for ep in episodes]


def test_bf16_rounds_to_nearest_even() -> None:
    """bf16 rounding keeps 8 significant bits and breaks ties to even."""
    ulp = 2.0**-7  # bf16 spacing in [1, 2)
    x = np.array([1 + ulp / 2, 1 + 3 * ulp / 2, 1 + ulp / 2 + 2.0**-20, -(1 + ulp / 2), 3.0])
    expected = np.array([1.0, 1 + 2 * ulp, 1 + ulp, -1.0, 3.0])
    assert np.array_equal(round_bf16(x), expected)


def test_int4_dequantizes_within_half_a_step() -> None:
    """Group-wise int4 (groups of 32 along the input) is within half a step of the weight."""
    w = np.random.default_rng(0).standard_normal((64, 8))
    codes, scale = quantize_int4(w)
    assert codes.min() >= -7 and codes.max() <= 7 and scale.shape == (2, 8)
    step = np.repeat(scale, 32, axis=0)
    assert np.all(np.abs(dequantize_int4(codes, scale) - w) <= step / 2 + 1e-12)


def test_cached_prefix_path_differs_only_by_rounding() -> None:
    """Prefill after a cached prefix gives close but not bit-identical logits to a fresh pass."""
    model = Transformer(
        d_model=64, n_layers=4, n_heads=4, d_ff=256, fmt="bf16", weight_bits=16, seed=0
    )
    tokens = np.frombuffer(PROMPT.encode() * 3, dtype=np.uint8).astype(np.int64)
    n, pages = len(tokens), -(-len(tokens) // 16)

    def buffers() -> tuple[F64, F64]:
        return np.zeros((4, 4, 16, 16, pages)), np.zeros((4, 4, pages * 16, 16))

    kt, v = buffers()
    fresh = model.forward(tokens, 0, kt, v, decode=False, tokens_per_block=16)
    kt2, v2 = buffers()
    model.forward(tokens[:64], 0, kt2, v2, decode=False, tokens_per_block=16)
    cached = model.forward(tokens[64:], 64, kt2, v2, decode=False, tokens_per_block=16)
    assert n > 64 and not np.array_equal(fresh, cached)
    assert np.max(np.abs(fresh - cached)) < 0.1 * np.max(np.abs(fresh))


def test_same_request_same_state_same_bytes() -> None:
    """Identical request sequences on identical engines give identical outputs."""
    a, b = Engine(EngineConfig()), Engine(EngineConfig())
    for prompt in (PROMPT, PROMPT + "ls src\nT: 3 files\nA: ", PROMPT):
        ra = a.generate(prompt, SamplingParams(max_tokens=12))
        rb = b.generate(prompt, SamplingParams(max_tokens=12))
        assert ra.output_tokens == rb.output_tokens and ra.reused_blocks == rb.reused_blocks


def test_output_is_printable_ascii() -> None:
    """Generated text only contains printable ASCII and newlines."""
    result = Engine(EngineConfig()).generate(PROMPT, SamplingParams(max_tokens=60))
    assert len(result.text) == len(result.output_tokens) > 0
    assert all(c == "\n" or 32 <= ord(c) <= 126 for c in result.text)


def test_shared_prefix_reuses_blocks_and_reuse_off_does_not() -> None:
    """A prompt extending a finished one reuses its full blocks; with reuse off it reuses none."""
    engine = Engine(EngineConfig())
    first = engine.generate(PROMPT, SamplingParams(max_tokens=4))
    assert first.reused_blocks == 0 and first.total_blocks == first.new_blocks
    second = engine.generate(PROMPT + first.text + " more", SamplingParams(max_tokens=4))
    fed_back = max(len(first.output_tokens) - 1, 0)  # the last output token has no K/V
    assert second.reused_blocks == (len(PROMPT) + fed_back) // 16
    assert second.total_blocks == second.reused_blocks + second.new_blocks
    assert engine.stats().reused_blocks_total == second.reused_blocks
    off = Engine(EngineConfig(reuse=False))
    off.generate(PROMPT, SamplingParams(max_tokens=4))
    again = off.generate(PROMPT, SamplingParams(max_tokens=4))
    assert again.reused_blocks == 0 and off.stats().used_blocks == 0


def test_reuse_always_recomputes_the_last_prompt_token() -> None:
    """A prompt of exactly k full blocks reuses k - 1 of them whole and, with partial reuse
    (on by default, as in TensorRT-LLM), all but the last token of the k-th."""
    prompt = "abcdefghijkl"  # three full blocks
    for partial, blocks, tokens in ((False, 2, 8), (True, 3, 11)):
        engine = Engine(EngineConfig(tokens_per_block=4, partial_reuse=partial))
        engine.generate(prompt, SamplingParams(max_tokens=1))
        again = engine.generate(prompt, SamplingParams(max_tokens=1))
        assert (again.reused_blocks, again.reused_tokens) == (blocks, tokens)


def test_lru_evicts_least_recently_used_leaf() -> None:
    """A full pool evicts the least recently used leaf block, never a block with children."""
    engine = Engine(SMALL)  # 6 blocks of 4 tokens
    one = SamplingParams(max_tokens=1)  # no generated token gets K/V: only prompt blocks
    engine.generate("aaaabbbbccccX", one)  # caches 3 blocks
    engine.generate("xxxxyyyyX", one)  # 2 more: 5 cached
    assert engine.generate("aaaabbbbccccX", one).reused_blocks == 3  # touches a-chain
    engine.generate("mmmmnnnnX", one)  # needs 3 blocks: evicts leaf "yyyy", then "xxxx"
    assert engine.generate("aaaabbbbccccX", one).reused_blocks == 3
    assert engine.generate("xxxxyyyyX", one).reused_blocks == 0
    assert engine.stats().used_blocks <= SMALL.capacity_blocks


def test_request_larger_than_cache_raises() -> None:
    """A request needing more blocks than the pool holds raises a capacity EngineError."""
    engine = Engine(EngineConfig(tokens_per_block=4, capacity_blocks=2))
    with pytest.raises(EngineError, match="capacity"):
        engine.generate("a" * 20, SamplingParams(max_tokens=2))
    assert engine.stats().used_blocks == 0


def test_fresh_engine_and_reset_reruns_are_identical() -> None:
    """Reruns from an empty cache (new engine or reset) reproduce the outputs exactly."""
    engine = Engine(EngineConfig())
    cold = _run(engine, 3)
    engine.reset()
    assert _run(engine, 3) == cold
    assert _run(Engine(EngineConfig()), 3) == cold


def test_warm_cache_rerun_diverges_and_reuse_off_does_not() -> None:
    """Rerunning episodes on a warm cache changes some outputs; with reuse off none change."""
    engine = Engine(EngineConfig())
    cold = _run(engine, 4)
    assert sum(a != b for a, b in zip(cold, _run(engine, 4), strict=True)) >= 1
    off = Engine(EngineConfig(reuse=False))
    assert _run(off, 2) == _run(off, 2)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=-1),
        SamplingParams(top_p=0.0),
        SamplingParams(top_p=1.5),
        SamplingParams(top_k=-1),
        SamplingParams(temperature=-0.5),
        SamplingParams(temperature=float("nan")),
        SamplingParams(seed=-1),
        SamplingParams(end_id=300),
        SamplingParams(stop_words=("",)),
    ],
)
def test_bad_sampling_params_raise(params: SamplingParams) -> None:
    """Invalid sampling parameters raise EngineError before any work."""
    engine = Engine(EngineConfig())
    with pytest.raises(EngineError):
        engine.generate(PROMPT, params)
    assert engine.stats().iterations == 0


def test_bad_config_and_empty_prompt_raise() -> None:
    """An impossible configuration or an empty prompt raises EngineError."""
    with pytest.raises(EngineError):
        Engine(EngineConfig(d_model=60))
    with pytest.raises(EngineError):
        Engine(EngineConfig(tokens_per_block=0))
    with pytest.raises(EngineError):
        Engine(EngineConfig()).generate("", SamplingParams())


def test_stop_word_end_id_and_max_tokens() -> None:
    """Stop words end the output (kept), end_id ends it (not emitted), max_tokens caps it."""
    engine = Engine(EngineConfig(reuse=False))
    full = engine.generate(PROMPT, SamplingParams(max_tokens=20))
    text = full.text
    assert full.finish_reason == "length" and len(full.output_tokens) == 20  # no EOS here
    stop = text[4:6]
    cut = next(i for i in range(1, 21) if text[:i].endswith(stop))
    stopped = engine.generate(PROMPT, SamplingParams(max_tokens=20, stop_words=(stop,)))
    assert (stopped.text, stopped.finish_reason) == (text[:cut], "stop")
    ended = engine.generate(PROMPT, SamplingParams(max_tokens=20, end_id=ord(text[5])))
    assert (ended.text, ended.finish_reason) == (text[: text.index(text[5])], "stop")
    assert engine.generate(PROMPT, SamplingParams(max_tokens=0)).output_tokens == []


def test_bad_words_are_never_completed() -> None:
    """A bad word never appears in the output; the rest of the vocabulary still does."""
    engine = Engine(EngineConfig(reuse=False))
    text = _greedy(engine, max_tokens=30)
    banned = (text[2:4], text[10])
    out = engine.generate(PROMPT, SamplingParams(max_tokens=30, bad_words=banned))
    assert out.text[:2] == text[:2] and all(word not in out.text for word in banned)


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    """The same seed samples the same tokens; different seeds give different samples."""
    engine = Engine(EngineConfig(reuse=False))

    def sample(seed: int, **kw: float) -> str:
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, **kw)  # type: ignore[arg-type]
        return engine.generate(PROMPT, params).text

    assert sample(1) == sample(1) and sample(1) != sample(2)
    assert sample(3, top_k=5) == sample(3, top_k=5)
    assert sample(4, top_p=0.5) != sample(5, top_p=0.5)
    assert sample(6, top_p=1e-9) == _greedy(engine, max_tokens=24)


def test_streaming_and_cancellation() -> None:
    """on_token streams every emitted token but the last (the caller sends that one with the
    final response); a cancelled request still caches its blocks."""
    engine = Engine(EngineConfig(tokens_per_block=4))
    seen: list[tuple[int, str]] = []
    result = engine.generate(
        PROMPT,
        SamplingParams(max_tokens=50),
        on_token=lambda tok, piece: seen.append((tok, piece)),
        is_cancelled=lambda: len(seen) >= 9,
    )
    assert result.finish_reason == "cancelled" and len(result.output_tokens) == 10
    assert [t for t, _ in seen] == result.output_tokens[:-1]
    assert "".join(p for _, p in seen) == result.text[:-1]
    again = engine.generate(PROMPT + result.text, SamplingParams(max_tokens=1))
    assert again.reused_blocks == (len(PROMPT) + 9) // 4
    assert result.arrival_time_ns <= result.first_scheduled_time_ns <= result.first_token_time_ns
    assert result.first_token_time_ns <= result.last_token_time_ns


def test_cancelled_prefill_stops_between_passes() -> None:
    """A long prompt cancelled during its prefill stops there: the chunks after it are never
    computed, and only the blocks computed before it are cached."""
    engine = Engine(EngineConfig(prefill_chunk=64))
    prompt = PROMPT * 40  # about 2,900 tokens: 45 chunks

    def cancelled() -> bool:
        return engine.stats().iterations >= 5

    result = engine.generate(prompt, SamplingParams(max_tokens=4), is_cancelled=cancelled)
    assert result.finish_reason == "cancelled" and result.output_tokens == []
    assert engine.stats().iterations == 5
    again = engine.generate(prompt, SamplingParams(max_tokens=1))
    assert again.reused_blocks == 5 * 64 // 16


def test_partial_reuse_claims_a_free_leaf_and_copies_a_block_in_use() -> None:
    """kvCacheManager.cpp: a partially matched leaf nobody uses is claimed (it leaves the
    cache), any other block is copied (the cache keeps it); either way it counts as reused.
    A warm idle pool has no allocated blocks: used = 0, free = max."""
    one = SamplingParams(max_tokens=1)
    engine = Engine(EngineConfig(tokens_per_block=4))
    engine.generate("aaaabbbbccccX", one)  # caches aaaa, bbbb, cccc
    assert engine.stats().used_blocks == 0 and engine.stats().free_blocks == 8192
    claimed = engine.generate("aaaabbbbccZZ", one)  # cccc is a free leaf: claimed
    assert (claimed.reused_blocks, claimed.reused_tokens) == (3, 10)
    # "ccZZ" is now cached in its place (the claimed block, refilled): cccc is gone.
    assert engine.generate("aaaabbbbccccY", one).reused_tokens == 10
    copied = engine.generate("aaaabbZZ", one)  # bbbb has children: copied, kept
    assert (copied.reused_blocks, copied.reused_tokens) == (2, 6)
    assert engine.generate("aaaabbbbccccY", one).reused_tokens == 12
    off = Engine(EngineConfig(tokens_per_block=4, partial_reuse=False))
    off.generate("aaaabbbbccccX", one)
    assert off.generate("aaaabbbbccZZ", one).reused_blocks == 2


def test_log_probs_are_the_models_log_softmax() -> None:
    """Greedy picks the most probable token: each log prob is the max of log softmax; the
    cumulative log prob is their sum."""
    engine = Engine(EngineConfig())
    result = engine.generate(PROMPT, SamplingParams(max_tokens=5))
    assert len(result.log_probs) == len(result.output_tokens) == 5
    assert all(-20 < lp < 0 for lp in result.log_probs)
    assert abs(result.cum_log_prob - sum(result.log_probs)) < 1e-4
