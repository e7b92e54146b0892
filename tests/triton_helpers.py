"""Talking to a stand-in replica the way any Triton client does: gRPC stream_infer and HTTP."""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, field
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
    text: str
    stats: dict[str, int] = field(default_factory=dict)
    responses: int = 0


def _inputs(prompt: str, max_tokens: int, stream: bool) -> list[grpcclient.InferInput]:
    def make(name: str, value: Any, dtype: Any, triton: str) -> grpcclient.InferInput:
        array = np.array([[value]], dtype=dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), triton)
        tensor.set_data_from_numpy(array)
        return tensor

    return [
        make("text_input", prompt.encode(), np.object_, "BYTES"),
        make("max_tokens", max_tokens, np.int32, "INT32"),
        make("stream", stream, np.bool_, "BOOL"),
        make("exclude_input_in_output", True, np.bool_, "BOOL"),
        make("return_perf_metrics", True, np.bool_, "BOOL"),
    ]


_STATS = ("kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks")


def grpc_generate(
    replica: Replica, prompt: str, max_tokens: int = 12, stream: bool = False
) -> Generation:
    """One generation through tritonclient's gRPC ``stream_infer``, as the proxy sends it."""
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(replica.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        client.async_stream_infer(
            MODEL_NAME, _inputs(prompt, max_tokens, stream), enable_empty_final_response=True
        )
        generation = Generation(text="")
        while True:
            item = results.get(timeout=60)
            if isinstance(item, Exception):
                raise item
            response = item.get_response()
            if response.outputs:
                generation.responses += 1
                generation.text += item.as_numpy("text_output").reshape(-1)[0].decode()
                for name in _STATS:
                    value = item.as_numpy(name)
                    if value is not None:
                        generation.stats[name] = int(value.reshape(-1)[0])
            if response.parameters["triton_final_response"].bool_param:
                return generation
    finally:
        client.stop_stream()
        client.close()


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
