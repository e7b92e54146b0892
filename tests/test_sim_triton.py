"""The stand-in replica behind a real tritonserver: TensorRT-LLM's interface and cache behaviour."""

from __future__ import annotations

import pytest

from backends.sim.launcher import Replica
from tests.triton_helpers import (
    grpc_generate,
    http_generate,
    metric,
    metrics,
    request_count,
    reset,
)

SYSTEM = "You are a careful agent. Use the tools. Answer briefly and precisely.\n" * 3
KV = "nv_trt_llm_kv_cache_block_metrics"


def history(replica: Replica) -> list[str]:
    """A short multi-turn history, each prompt extending the previous one."""
    outputs, context = [], SYSTEM
    for turn in ("Task: count the apples.", "Tool: 3 apples.", "Tool: done."):
        context += turn + "\n"
        text = grpc_generate(replica, context, max_tokens=16).text
        outputs.append(text)
        context += text + "\n"
    return outputs


def test_same_history_from_reset_gives_same_bytes(replicas: dict[str, Replica]) -> None:
    """After a reset, the same sequence of requests returns byte-identical outputs every time."""
    r1 = replicas["r1"]
    reset(r1)
    first = history(r1)
    reset(r1)
    second = history(r1)
    assert first == second
    assert all(first), "the model produced empty outputs"


def test_same_request_same_state_over_grpc_and_http(replicas: dict[str, Replica]) -> None:
    """One request from an empty cache gives the same bytes over gRPC stream_infer and HTTP."""
    r1 = replicas["r1"]
    reset(r1)
    via_grpc = grpc_generate(r1, SYSTEM + "Question?", max_tokens=10).text
    reset(r1)
    status, body = http_generate(
        r1, {"text_input": SYSTEM + "Question?", "max_tokens": 10, "exclude_input_in_output": True}
    )
    assert status == 200
    assert body["text_output"] == via_grpc


def test_streaming_matches_non_streaming(replicas: dict[str, Replica]) -> None:
    """Streamed tokens concatenate to the non-streamed text; the last event carries the stats."""
    r1 = replicas["r1"]
    reset(r1)
    whole = grpc_generate(r1, "Stream me a line.", max_tokens=8).text
    reset(r1)
    streamed = grpc_generate(r1, "Stream me a line.", max_tokens=8, stream=True)
    assert streamed.text == whole
    assert streamed.responses >= len(whole)
    reset(r1)
    status, events = http_generate(
        r1,
        {
            "text_input": "Stream me a line.",
            "max_tokens": 8,
            "stream": True,
            "return_perf_metrics": True,
        },
        stream=True,
    )
    assert status == 200
    assert "".join(e["text_output"] for e in events) == whole
    assert "kv_cache_alloc_total_blocks" in events[-1]


def test_shared_prefix_reuses_blocks(replicas: dict[str, Replica]) -> None:
    """A prompt that starts with cached blocks reports reused blocks; reuse off never does."""
    for name, expect_reuse in (("r1", True), ("r3", False)):
        replica = replicas[name]
        reset(replica)
        cold = grpc_generate(replica, SYSTEM + "First question?", max_tokens=4)
        warm = grpc_generate(replica, SYSTEM + "Second question?", max_tokens=4)
        assert cold.stats["kv_cache_reused_blocks"] == 0
        if expect_reuse:
            assert warm.stats["kv_cache_reused_blocks"] >= len(SYSTEM) // 16 - 1
        else:
            assert warm.stats["kv_cache_reused_blocks"] == 0
        assert warm.stats["kv_cache_alloc_total_blocks"] == (
            warm.stats["kv_cache_reused_blocks"] + warm.stats["kv_cache_alloc_new_blocks"]
        )


def test_reload_empties_cache_and_restarts_counters(replicas: dict[str, Replica]) -> None:
    """Unload and load: the next request reuses nothing and Triton's request counter restarts."""
    r2 = replicas["r2"]
    reset(r2)
    for _ in range(3):
        grpc_generate(r2, SYSTEM + "Again.", max_tokens=2)
    assert request_count(r2) == 3
    reset(r2)
    assert request_count(r2) == 0
    after = grpc_generate(r2, SYSTEM + "Again.", max_tokens=2)
    assert after.stats["kv_cache_reused_blocks"] == 0


def test_metrics_follow_the_cache(replicas: dict[str, Replica]) -> None:
    """The TensorRT-LLM metric families read 0 after a load (max and tokens_per too) until the
    first request, then follow the executor's statistics: an idle warm cache has used = 0 (its
    reusable blocks are free), the reused counter and the iteration counter have moved."""
    r2 = replicas["r2"]
    reset(r2)
    before = metrics(r2)
    for kind in ("max", "tokens_per", "used", "free", "reused"):
        assert metric(before, KV, kv_cache_block_type=kind) == 0, kind
    grpc_generate(r2, SYSTEM + "One.", max_tokens=8)
    grpc_generate(r2, SYSTEM + "Two.", max_tokens=8)
    after = metrics(r2)
    assert metric(after, KV, kv_cache_block_type="tokens_per") == 16
    assert metric(after, KV, kv_cache_block_type="max") > 0
    assert metric(after, KV, kv_cache_block_type="used") == 0
    assert metric(after, KV, kv_cache_block_type="free") == metric(
        after, KV, kv_cache_block_type="max"
    )
    assert metric(after, KV, kv_cache_block_type="reused") > 0
    assert metric(after, "nv_trt_llm_general_metrics", general_type="iteration_counter") > 0
    assert metric(after, "nv_trt_llm_request_metrics", request_type="active") == 0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"max_tokens": 4}, "text_input"),
        ({"text_input": "hi", "max_tokens": -1}, "request_output_len"),
        ({"text_input": "hi", "max_tokens": "four"}, ""),
        ({"text_input": "hi", "max_tokens": 4, "top_p": 7.0}, "top_p"),
    ],
)
def test_bad_input_is_a_clear_error_and_the_replica_keeps_serving(
    replicas: dict[str, Replica], body: dict[str, object], message: str
) -> None:
    """Missing text_input, negative max_tokens, a wrong type: an error, then normal service."""
    r1 = replicas["r1"]
    status, error = http_generate(r1, body)
    assert status in (400, 500)
    assert message in error["error"]
    assert error["error"]
    status, ok = http_generate(r1, {"text_input": "still there?", "max_tokens": 3})
    assert status == 200
    assert ok["text_output"].startswith("still there?")
