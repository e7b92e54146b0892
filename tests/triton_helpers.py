"""Talking to a stand-in replica the way any Triton client does: gRPC stream_infer and HTTP."""

from __future__ import annotations

import contextlib
import os
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import urllib3

from backends.sim.launcher import Replica
from backends.sim.repository import ENGINE_MODEL, MODEL_NAME

_HTTP = urllib3.PoolManager()


@dataclass
class Generation:
    """What a client saw: the text (or, from the engine model, the token ids), every statistic
    any response carried, how many responses had outputs, and whether the final one did."""

    text: str
    stats: dict[str, int] = field(default_factory=dict)
    responses: int = 0
    ids: list[int] = field(default_factory=list)
    final_has_outputs: bool = False


def _tensor(name: str, value: Any, dtype: Any, triton: str) -> grpcclient.InferInput:
    array = np.array([value], dtype=dtype).reshape(1, -1)
    tensor = grpcclient.InferInput(name, list(array.shape), triton)
    tensor.set_data_from_numpy(array)
    return tensor


_FLAGS = ("exclude_input_in_output", "return_perf_metrics")
_COUNTS = ("return_num_input_tokens", "return_num_output_tokens")


def _inputs(prompt: str, max_tokens: int, stream: bool) -> list[grpcclient.InferInput]:
    return [
        _tensor("text_input", prompt.encode(), np.object_, "BYTES"),
        _tensor("max_tokens", max_tokens, np.int32, "INT32"),
        _tensor("stream", stream, np.bool_, "BOOL"),
        *(_tensor(name, True, np.bool_, "BOOL") for name in _FLAGS + _COUNTS),
    ]


def engine_inputs(prompt: str, max_tokens: int, stream: bool) -> list[grpcclient.InferInput]:
    """The same request as ``tensorrt_llm`` takes it, the byte tokenizer's ids already made."""
    ids = list(prompt.encode())
    return [
        _tensor("input_ids", ids, np.int32, "INT32"),
        _tensor("input_lengths", len(ids), np.int32, "INT32"),
        _tensor("request_output_len", max_tokens, np.int32, "INT32"),
        _tensor("streaming", stream, np.bool_, "BOOL"),
        *(_tensor(name, True, np.bool_, "BOOL") for name in _FLAGS + _COUNTS),
    ]


STATS = (
    "kv_cache_reused_blocks",
    "kv_cache_alloc_new_blocks",
    "kv_cache_alloc_total_blocks",
    "num_input_tokens",
    "num_output_tokens",
)


def _collect(generation: Generation, item: Any) -> bool:
    """Add one response to ``generation``; True when it was the final one."""
    response = item.get_response()
    names = {output.name for output in response.outputs}
    if names:
        generation.responses += 1
    if "text_output" in names:
        generation.text += item.as_numpy("text_output").reshape(-1)[0].decode()
    if "output_ids" in names:
        generation.ids += item.as_numpy("output_ids").reshape(-1).tolist()
    for name in STATS:
        if name in names:
            generation.stats[name] = int(item.as_numpy(name).reshape(-1)[0])
    final = bool(response.parameters["triton_final_response"].bool_param)
    if final:
        generation.final_has_outputs = bool(names)
    return final


def infer_stream(
    replica: Replica, model: str, inputs: list[grpcclient.InferInput], request_id: str = ""
) -> Generation:
    """One request through tritonclient's gRPC ``stream_infer`` with
    ``enable_empty_final_response``, as the proxy sends it; every response until the final."""
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(replica.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        client.async_stream_infer(
            model, inputs, request_id=request_id, enable_empty_final_response=True
        )
        generation = Generation(text="")
        while True:
            item = results.get(timeout=120)
            if isinstance(item, Exception):
                raise item
            if _collect(generation, item):
                return generation
    finally:
        client.stop_stream()
        client.close()


def engine_stop(replica: Replica, request_id: str) -> Generation:
    """TensorRT-LLM's stop request: ``stop: true`` to tensorrt_llm, naming a request's id."""
    inputs = [
        _tensor("input_ids", 0, np.int32, "INT32"),
        _tensor("input_lengths", 1, np.int32, "INT32"),
        _tensor("request_output_len", 1, np.int32, "INT32"),
        _tensor("stop", True, np.bool_, "BOOL"),
    ]
    return infer_stream(replica, ENGINE_MODEL, inputs, request_id)


def wait_for(condition: Callable[[], bool], limit_s: float = 60.0) -> None:
    """Poll until ``condition()`` holds (a bounded wait, not a timing assertion)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def grpc_generate(
    replica: Replica, prompt: str, max_tokens: int = 12, stream: bool = False
) -> Generation:
    """One generation through the ``ensemble``."""
    return infer_stream(replica, MODEL_NAME, _inputs(prompt, max_tokens, stream))


def engine_generate(
    replica: Replica, prompt: str, max_tokens: int = 12, stream: bool = False
) -> Generation:
    """The same generation sent straight to ``tensorrt_llm``, bypassing the ensemble."""
    return infer_stream(replica, ENGINE_MODEL, engine_inputs(prompt, max_tokens, stream))


def http_generate(replica: Replica, body: dict[str, Any], stream: bool = False) -> tuple[int, Any]:
    """POST to Triton's generate (or generate_stream) endpoint; returns status and parsed body."""
    path = "generate_stream" if stream else "generate"
    response = _HTTP.request(
        "POST",
        f"{replica.http_url}/v2/models/{MODEL_NAME}/{path}",
        body=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
    )
    if stream and response.status == 200:
        events = [
            orjson.loads(line[5:])
            for line in response.data.splitlines()
            if line.startswith(b"data:")
        ]
        return response.status, events
    return response.status, orjson.loads(response.data)


def reset(replica: Replica) -> None:
    """Empty the cache the only way TensorRT-LLM allows: unload and load the model."""
    client = httpclient.InferenceServerClient(replica.http_url.removeprefix("http://"))
    try:
        client.unload_model(MODEL_NAME, unload_dependents=True)
        deadline = time.monotonic() + 30
        # Not ready is not enough: a load issued while the old instance is UNLOADING may keep it.
        while time.monotonic() < deadline:
            states = {m["name"]: m.get("state") for m in client.get_model_repository_index()}
            if all(states.get(m) not in ("READY", "UNLOADING") for m in (MODEL_NAME, ENGINE_MODEL)):
                break
            time.sleep(0.05)
        client.load_model(MODEL_NAME)
    finally:
        client.close()


def request_count(replica: Replica, model: str = ENGINE_MODEL) -> int:
    """Requests the engine model took since it was loaded, from Triton's statistics API.

    (The Prometheus counter ``nv_inference_request_success`` is not reliable for this: after a
    reload it can carry the old instance's count while that instance is still referenced.)
    """
    client = httpclient.InferenceServerClient(replica.http_url.removeprefix("http://"))
    try:
        stats = client.get_inference_statistics(model)["model_stats"]
        return sum(
            int(m["inference_stats"]["success"].get("count", 0))
            + int(m["inference_stats"]["fail"].get("count", 0))
            for m in stats
        )
    finally:
        client.close()


def metrics(replica: Replica) -> dict[str, float]:
    """The replica's Prometheus page as ``{'family{labels}': value}``."""
    page = _HTTP.request("GET", replica.metrics_url).data.decode()
    values: dict[str, float] = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def metric(values: dict[str, float], family: str, **labels: str) -> float:
    """The one sample of ``family`` whose labels include ``labels``."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    matches = [
        v for k, v in values.items() if k.startswith(family + "{") and all(w in k for w in wanted)
    ]
    if len(matches) != 1:
        raise KeyError(f"{family}{labels}: {len(matches)} samples")
    return matches[0]


def group_members(replica: Replica) -> list[int]:
    """Pids of the processes in the replica's process group (its server and stubs), from /proc."""
    assert replica.process is not None
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getpgid(int(entry.name)) == replica.process.pid:
                    members.append(int(entry.name))
    return members
