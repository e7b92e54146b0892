"""The stand-in as TensorRT-LLM's model repository: four models, the engine directory, admission,
stop requests, and a server killed with SIGKILL leaving nothing behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backends.engine_limits import engine_limits
from backends.sim.engine_files import CONFIG_FILE, WEIGHTS_FILE, read_config
from backends.sim.launcher import Replica, ReplicaSpec, launch, stop
from backends.sim.repository import ENGINE_MODEL, MODEL_NAME
from tests.triton_helpers import (
    engine_generate,
    engine_stop,
    group_members,
    grpc_generate,
    metric,
    metrics,
    reset,
    wait_for,
)

SYSTEM = "You are a careful agent. Use the tools. Answer briefly and precisely.\n" * 3
ACTIVE = "nv_trt_llm_request_metrics"


def test_repository_has_tensorrt_llms_models_and_engine(replicas: dict[str, Replica]) -> None:
    """A Triton client finds the ensemble of preprocessing, tensorrt_llm (decoupled) and
    postprocessing, and the engine (config.json, rank0.engine) where gpt_model_path says."""
    client = grpcclient.InferenceServerClient(replicas["r1"].grpc_url)
    try:
        index = client.get_model_repository_index(as_json=True)["models"]
        ensemble = client.get_model_config(MODEL_NAME, as_json=True)["config"]
        engine = client.get_model_config(ENGINE_MODEL, as_json=True)["config"]
    finally:
        client.close()
    assert {m["name"]: m["state"] for m in index} == {
        "ensemble": "READY",
        "preprocessing": "READY",
        "tensorrt_llm": "READY",
        "postprocessing": "READY",
    }
    assert ensemble["platform"] == "ensemble"
    steps = [s["model_name"] for s in ensemble["ensemble_scheduling"]["step"]]
    assert steps == ["preprocessing", "tensorrt_llm", "postprocessing"]
    assert engine["model_transaction_policy"]["decoupled"] is True
    params = {k: v["string_value"] for k, v in engine["parameters"].items()}
    assert params["enable_kv_cache_reuse"] == "true"
    engine_dir = Path(params["gpt_model_path"])
    assert sorted(p.name for p in engine_dir.iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
    assert read_config(engine_dir)["build_config"]["plugin_config"]["tokens_per_block"] == 16


def test_engine_model_reports_what_the_ensemble_passes_on(replicas: dict[str, Replica]) -> None:
    """The same request from the same cache state, through the ensemble (streamed or not) or
    straight to tensorrt_llm: the same tokens and the same statistics; one final response."""
    r2 = replicas["r2"]
    prompt, follow = SYSTEM + "First question?", SYSTEM + "Second question?"
    seen = []
    for send, stream in (
        (grpc_generate, False),
        (grpc_generate, True),
        (engine_generate, False),
        (engine_generate, True),
    ):
        reset(r2)
        send(r2, prompt, 6, stream)
        seen.append(send(r2, follow, 6, stream))
    texts = [g.text or bytes(g.ids).decode() for g in seen]
    assert len(set(texts)) == 1 and texts[0]
    # The block statistics are the request's; num_output_tokens is per response (the last
    # response's count here; tests/test_sim_backend_parity.py sums a stream's).
    blocks = [{k: v for k, v in g.stats.items() if k != "num_output_tokens"} for g in seen]
    assert all(b == blocks[0] for b in blocks), blocks
    assert seen[0].stats["kv_cache_reused_blocks"] >= len(SYSTEM) // 16 - 1
    assert seen[0].stats["num_output_tokens"] == seen[2].stats["num_output_tokens"] == 6
    assert seen[1].stats["num_output_tokens"] == seen[3].stats["num_output_tokens"] == 1
    # Straight from the engine, a stream's last token comes with the final flag (as the
    # executor sends it), one response per token; through the ensemble too, one per token
    # (whether its final flag rides on the last one or on a flags-only response is the
    # ensemble scheduler's business: docs/stand-in.md).
    assert seen[3].final_has_outputs and seen[3].responses == 6
    assert seen[1].responses == 6


def test_prompt_over_max_input_len_is_refused_at_admission(replicas: dict[str, Replica]) -> None:
    """A prompt longer than the executor's limit (with chunked context, max_seq_len - 1, not
    the built max_input_len: trtGptModel.h) is refused before any work with the executor's
    message, and the replica goes on serving."""
    r1 = replicas["r1"]
    config = read_config(Path(r1.workdir) / "engine")
    limits = engine_limits(config, {"enable_chunked_context": "true"})
    assert limits is not None and limits.max_input_len == config["build_config"]["max_seq_len"] - 1
    limit = limits.max_input_len
    before = metric(metrics(r1), "nv_trt_llm_general_metrics", general_type="iteration_counter")
    try:
        grpc_generate(r1, "x" * (limit + 1), max_tokens=2)
    except InferenceServerException as exc:
        assert "Executor failed process requestId" in str(exc)
        assert f"Prompt length ({limit + 1}) exceeds maximum input length ({limit})" in str(exc)
    else:
        raise AssertionError("the replica admitted a prompt over its limit")
    after = metric(metrics(r1), "nv_trt_llm_general_metrics", general_type="iteration_counter")
    assert after == before
    assert grpc_generate(r1, "still serving?", max_tokens=3).text


def test_stop_request_ends_a_long_prefill(replicas: dict[str, Replica]) -> None:
    """A stop request naming a running request's id (how TensorRT-LLM ends a request that an
    ensemble's cancellation cannot reach) ends its 30,000-token prefill; serving goes on."""
    r3 = replicas["r3"]
    client = grpcclient.InferenceServerClient(r3.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    client.async_stream_infer(MODEL_NAME, prompt_inputs("y" * 30000, 4), request_id="long-1")
    wait_for(lambda: active(r3) == 1)
    client.stop_stream(cancel_requests=True)
    client.close()
    stopped = engine_stop(r3, "long-1")
    assert stopped.responses == 0  # an empty final response, as the C++ backend answers
    wait_for(lambda: active(r3) == 0)
    assert grpc_generate(r3, "still serving?", max_tokens=2).text


def active(replica: Replica) -> float:
    return metric(metrics(replica), ACTIVE, request_type="active")


def prompt_inputs(prompt: str, max_tokens: int) -> list[grpcclient.InferInput]:
    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[prompt.encode()]], dtype=np.object_))
    tokens = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    tokens.set_data_from_numpy(np.array([[max_tokens]], dtype=np.int32))
    return [text, tokens]


def test_killed_server_leaves_no_stub_behind(tmp_path: Path) -> None:
    """SIGKILL the tritonserver: its Python-backend stubs outlive it until the launcher stops
    the replica, which empties the whole process group."""
    with launch([ReplicaSpec("k1")], workdir=tmp_path) as (replica,):
        assert replica.process is not None
        members = group_members(replica)
        assert len(members) >= 4  # the server and one stub per Python model
        os.kill(replica.process.pid, signal.SIGKILL)
        replica.process.wait(timeout=30)
        orphans = group_members(replica)
        assert orphans, "the stubs were gone without the launcher"
        stop(replica)
        assert group_members(replica) == []


def test_metrics_are_tensorrt_llms_families_and_labels(replicas: dict[str, Replica]) -> None:
    """The metrics page carries the C++ backend's families, each sample labelled with
    model="tensorrt_llm", version="1" and the family's own category label."""
    page = metrics(replicas["r1"])
    categories = {
        "nv_trt_llm_request_metrics": ("request_type", {"active", "max", "scheduled"}),
        "nv_trt_llm_kv_cache_block_metrics": ("kv_cache_block_type", {"used", "reused", "max"}),
        "nv_trt_llm_inflight_batcher_metrics": (
            "inflight_batcher_specific_metric",
            {"total_context_tokens", "generation_requests"},
        ),
        "nv_trt_llm_runtime_memory_metrics": ("memory_type", {"cpu", "gpu", "pinned"}),
        "nv_trt_llm_general_metrics": ("general_type", {"iteration_counter", "timestamp"}),
    }
    for family, (label, values) in categories.items():
        samples = [key for key in page if key.startswith(family + "{")]
        assert samples, family
        assert all('model="tensorrt_llm"' in k and 'version="1"' in k for k in samples)
        assert values <= {k.split(f'{label}="')[1].split('"')[0] for k in samples}
    assert any(k.startswith("nv_llm_input_token_len_bucket{") for k in page)
