"""The stand-in behaves as TensorRT-LLM's C++ Triton backend where kvledger reads it.

Each test names the real file that defines the behaviour (docs/stand-in.md has the table):
streamed responses (model_instance_state.cc fillTritonResponse, llmRequest.cpp createResult),
the request counter (model_instance_state.cc reportBaseMetrics, handleStopRequest), partial block
reuse (kvCacheManager.cpp loadOrAllocateBlocks), log probs (llmRequest.cpp createResult).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from backends.sim.engine import Engine, EngineConfig, SamplingParams
from backends.sim.engine_files import load_engine
from backends.sim.launcher import Replica, ReplicaSpec, launch
from backends.sim.repository import ENGINE_MODEL, MODEL_NAME, ModelSettings
from tests.triton_helpers import (
    _tensor,
    engine_inputs,
    engine_stop,
    metric,
    metrics,
    request_count,
    reset,
    wait_for,
)

BACKEND = "kvledger_sim_backend_requests"
SYSTEM = "You are a careful agent. Use the tools. Answer briefly and precisely.\n" * 3


@dataclass
class Response:
    outputs: dict[str, np.ndarray[Any, Any]]
    final: bool


def stream(replica: Replica, model: str, inputs: list[Any], request_id: str = "") -> list[Response]:
    """Every response of one request over gRPC stream_infer (enable_empty_final_response)."""
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(replica.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        client.async_stream_infer(
            model, inputs, request_id=request_id, enable_empty_final_response=True
        )
        seen: list[Response] = []
        while True:
            item = results.get(timeout=120)
            if isinstance(item, Exception):
                raise item
            response = item.get_response()
            names = [o.name for o in response.outputs]
            final = bool(response.parameters["triton_final_response"].bool_param)
            seen.append(Response({n: item.as_numpy(n) for n in names}, final))
            if final:
                return seen
    finally:
        client.stop_stream()
        client.close()


def ids(response: Response) -> list[int]:
    return [int(t) for t in response.outputs["output_ids"].reshape(-1)]


def one(response: Response, name: str) -> int:
    return int(response.outputs[name].reshape(-1)[0])


def test_a_stream_carries_the_statistics_on_every_response_and_counts_each_responses_tokens(
    replicas: dict[str, Replica],
) -> None:
    """Streamed straight from tensorrt_llm: every response carries the kv_cache_* statistics and
    num_output_tokens = that response's tokens; the last token comes with the final flag (no
    empty final response); the sum over the stream equals the non-streamed count, with the
    same reused blocks."""
    r2 = replicas["r2"]
    prompt, follow = SYSTEM + "First?", SYSTEM + "Second?"
    shapes = {}
    for streaming in (False, True):
        reset(r2)
        stream(r2, ENGINE_MODEL, engine_inputs(prompt, 6, streaming))
        shapes[streaming] = stream(r2, ENGINE_MODEL, engine_inputs(follow, 7, streaming))
    whole, streamed = shapes[False], shapes[True]
    assert len(whole) == 1 and whole[0].final
    assert len(streamed) == 7 and streamed[-1].final and ids(streamed[-1])
    for response in streamed:
        assert one(response, "num_output_tokens") == len(ids(response)) == 1
        assert one(response, "kv_cache_reused_blocks") == one(whole[0], "kv_cache_reused_blocks")
        assert "kv_cache_alloc_total_blocks" in response.outputs
    assert sum(one(r, "num_output_tokens") for r in streamed) == one(whole[0], "num_output_tokens")
    assert [t for r in streamed for t in ids(r)] == ids(whole[0])
    assert one(whole[0], "kv_cache_reused_blocks") > 0


def _counts(replica: Replica) -> tuple[float, float]:
    page = metrics(replica)
    return metric(page, BACKEND, outcome="success"), metric(page, BACKEND, outcome="failure")


def test_the_request_counter_counts_as_the_cpp_backend(replicas: dict[str, Replica]) -> None:
    """kvledger_sim_backend_requests moves once per request at its final response; a stop
    request (answered without statistics) does not move it, while the Python backend's
    Triton statistics count it. An abandoned request is counted once."""
    r1 = replicas["r1"]
    reset(r1)
    assert _counts(r1) == (0, 0)
    stream(r1, ENGINE_MODEL, engine_inputs(SYSTEM + "Count me.", 3, False))
    assert _counts(r1) == (1, 0)
    python_before = request_count(r1)
    answer = engine_stop(r1, "nobody-runs-this")
    assert not answer.final_has_outputs
    assert _counts(r1) == (1, 0)
    assert request_count(r1) == python_before + 1  # the Python backend counted it
    # A long request abandoned by a stop request mid-prefill: one final response, counted once.
    done: list[list[Response]] = []
    long_prompt = engine_inputs("Go on. " * 3000, 8, True)
    long = threading.Thread(
        target=lambda: done.append(stream(r1, ENGINE_MODEL, long_prompt, "gone"))
    )
    long.start()
    wait_for(lambda: metric(metrics(r1), "nv_trt_llm_request_metrics", request_type="active") == 1)
    engine_stop(r1, "gone")
    long.join(timeout=120)
    assert done and done[0][-1].final and not ids(done[0][-1])
    assert _counts(r1) == (2, 0)


@pytest.fixture(scope="module")
def no_partial() -> Iterator[Replica]:
    with launch([ReplicaSpec("nopartial", ModelSettings(partial_reuse=False))]) as running:
        yield running[0]


def test_partial_block_reuse_is_on_by_default_and_counted(
    replicas: dict[str, Replica], no_partial: Replica
) -> None:
    """A prompt sharing 2 full blocks and 9 tokens of a third with a cached one: with partial
    reuse (the default) the third block is reused too and counted; switched off, it is not.
    The cumulative reused gauge counts it as well."""
    base = "abcdefghijklmnop" * 2 + "0123456789ABCDEF" + "tail of the first prompt"
    other = base[:41] + "another ending entirely"
    reused = {}
    for name, replica in (("on", replicas["r1"]), ("off", no_partial)):
        reset(replica)
        stream(replica, ENGINE_MODEL, engine_inputs(base, 2, False))
        second = stream(replica, ENGINE_MODEL, engine_inputs(other, 2, False))[-1]
        reused[name] = one(second, "kv_cache_reused_blocks")
        gauge = metric(
            metrics(replica), "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="reused"
        )
        assert gauge == reused[name]
    assert reused == {"on": 3, "off": 2}


def test_log_probs_come_from_the_models_logits(replicas: dict[str, Replica]) -> None:
    """return_log_probs through the ensemble: output_log_probs [1, 1, n] and cum_log_probs
    [1, 1], equal to what the same engine computes in-process for the same request."""
    r1 = replicas["r1"]
    reset(r1)
    prompt = "Log probs, please."
    inputs = [
        _tensor("text_input", prompt.encode(), np.object_, "BYTES"),
        _tensor("max_tokens", 5, np.int32, "INT32"),
        _tensor("return_log_probs", True, np.bool_, "BOOL"),
        _tensor("exclude_input_in_output", True, np.bool_, "BOOL"),
    ]
    got = [r for r in stream(r1, MODEL_NAME, inputs) if "output_log_probs" in r.outputs][-1]
    log_probs = got.outputs["output_log_probs"]
    assert log_probs.shape == (1, 1, 5) and log_probs.dtype == np.float32
    build, weights = load_engine(Path(r1.workdir) / "engine")
    engine = Engine(
        EngineConfig(
            tokens_per_block=build.tokens_per_block,
            float_format=build.float_format,
            weight_bits=build.weight_bits,
            weight_seed=build.weight_seed,
            prefill_chunk=build.max_num_tokens,
        ),
        weights,
    )
    local = engine.generate(prompt, SamplingParams(max_tokens=5))
    assert log_probs.reshape(-1).tolist() == local.log_probs
    assert all(lp < 0 for lp in local.log_probs)
    cum = got.outputs["cum_log_probs"]
    assert cum.shape == (1, 1) and abs(float(cum[0, 0]) - sum(local.log_probs)) < 1e-5
