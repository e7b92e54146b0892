"""Triton Inference Server with TensorRT-LLM's ``ensemble`` interface, over gRPC (asyncio).

Every generation goes through ``ModelStreamInfer`` (``stream_infer``): it serves decoupled and
non-decoupled models alike, and cancelling the call cancels the request inside Triton. One gRPC
channel per replica carries all requests (HTTP/2 streams), so no request pays a connection set-up.
Model control (unload, load) and statistics also go over gRPC; the metrics page over HTTP.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import numpy as np
import orjson
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput
from tritonclient.utils import InferenceServerException

from backends.base import (
    BackendFailed,
    BackendRejected,
    BackendUnavailable,
    Chunk,
    EngineStats,
    GenerationRequest,
    ReplicaCounters,
)

_STATS = {
    "kv_cache_reused_blocks": "reused_blocks",
    "kv_cache_alloc_new_blocks": "new_blocks",
    "kv_cache_alloc_total_blocks": "total_blocks",
    "arrival_time_ns": "arrival_ns",
    "first_token_time_ns": "first_token_ns",
    "last_token_time_ns": "last_token_ns",
    "num_input_tokens": "input_tokens",
    "num_output_tokens": "output_tokens",
}
_KV = "nv_trt_llm_kv_cache_block_metrics"


@dataclass(frozen=True)
class TritonTarget:
    """Where one replica listens and which TensorRT-LLM input names its version uses."""

    replica_id: str
    grpc: str
    metrics: str
    model: str = "ensemble"
    seed_input: str = "seed"  # "random_seed" before TensorRT-LLM 0.20
    perf_input: str = "return_perf_metrics"  # "return_kv_cache_reuse_stats" before 0.19
    token_counts: bool = True  # return_num_{input,output}_tokens: ensembles of 0.16-0.19 lack them
    timeout_s: float = 10.0


def _tensor(name: str, value: Any, dtype: Any, triton_type: str) -> InferInput:
    array = np.array([value], dtype=dtype).reshape(1, -1)
    tensor = InferInput(name, list(array.shape), triton_type)
    tensor.set_data_from_numpy(array)
    return tensor


def constant_inputs(target: TritonTarget) -> tuple[InferInput, ...]:
    """Inputs every request carries: never echo the prompt, always return the statistics.

    Built once per replica: an InferInput is only read when a request is serialised.
    """
    names = ["exclude_input_in_output", target.perf_input]
    if target.token_counts:
        names += ["return_num_input_tokens", "return_num_output_tokens"]
    return tuple(_tensor(name, True, np.bool_, "BOOL") for name in names)


def build_inputs(
    target: TritonTarget, request: GenerationRequest, constant: tuple[InferInput, ...]
) -> list[InferInput]:
    """The ensemble's inputs for one request."""
    inputs = [
        _tensor("text_input", request.prompt.encode(), np.object_, "BYTES"),
        _tensor("max_tokens", request.max_tokens, np.int32, "INT32"),
        _tensor("stream", request.stream, np.bool_, "BOOL"),
        *constant,
    ]
    optional: tuple[tuple[str, Any, Any, str], ...] = (
        ("temperature", request.temperature, np.float32, "FP32"),
        ("top_k", request.top_k, np.int32, "INT32"),
        ("top_p", request.top_p, np.float32, "FP32"),
        (target.seed_input, request.seed, np.uint64, "UINT64"),
    )
    inputs.extend(_tensor(n, v, d, t) for n, v, d, t in optional if v is not None)
    for name, words in (("stop_words", request.stop), ("bad_words", request.bad_words)):
        if words:
            inputs.append(_tensor(name, [w.encode() for w in words], np.object_, "BYTES"))
    return inputs


def parse_stats(result: Any) -> EngineStats:
    values: dict[str, int] = {}
    for output, field_name in _STATS.items():
        array = result.as_numpy(output)
        if array is not None:
            values[field_name] = int(array.reshape(-1)[0])
    return EngineStats(**values)


def parse_metrics(page: str) -> dict[str, float]:
    """A Prometheus text page as ``{'family{labels}': value}``."""
    values: dict[str, float] = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                values[key] = float(value)
            except ValueError:
                continue
    return values


def sample(values: dict[str, float], family: str, label: str) -> float:
    """Sum of a family's samples whose labels contain ``label``, e.g. ``general_type="x"``."""
    prefix = family + "{"
    return sum(v for k, v in values.items() if k.startswith(prefix) and label in k)


class TritonBackend:
    """The engine client for one Triton replica."""

    def __init__(self, target: TritonTarget, http: aiohttp.ClientSession) -> None:
        self.target = target
        self.replica_id = target.replica_id
        self._client = grpcaio.InferenceServerClient(target.grpc)
        self._http = http
        self._constant = constant_inputs(target)

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        inputs = build_inputs(self.target, request, self._constant)

        async def requests() -> AsyncIterator[dict[str, Any]]:
            yield {
                "model_name": self.target.model,
                "inputs": inputs,
                "request_id": request.request_id,
                "enable_empty_final_response": True,
            }

        try:
            call = self._client.stream_infer(requests())
        except InferenceServerException as exc:
            raise BackendUnavailable(self.replica_id, str(exc)) from exc
        produced = finished = False
        try:
            async for result, error in call:
                if error is not None:
                    raise self._translate(error, produced)
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                text_array = result.as_numpy("text_output") if response.outputs else None
                text = text_array.reshape(-1)[0].decode() if text_array is not None else ""
                produced = produced or bool(text)
                finished = final
                yield Chunk(text, final, parse_stats(result) if final else None)
                if final:
                    return
            raise BackendFailed(self.replica_id, "stream ended without a final response")
        except InferenceServerException as exc:
            raise self._translate(exc, produced) from exc
        except grpc.RpcError as exc:  # tritonclient passes errors of the stream itself through
            raise self._translate_rpc(exc, produced) from exc
        finally:
            # Cancel only a stream that is still producing. Cancelling one whose final response
            # already arrived races Triton's own end of the stream and, intermittently, leaves a
            # reference to the model behind: the next unload then never finishes (seen on the
            # stand-in under load; python_backend notes the same for cancelled senders).
            if not finished:
                call.cancel()

    def _translate_rpc(self, error: grpc.RpcError, produced: bool) -> Exception:
        code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
        message = f"{code.name if code else 'RPC error'}: " + (
            error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
        )
        if code == grpc.StatusCode.UNAVAILABLE and not produced:
            return BackendUnavailable(self.replica_id, message)
        if code == grpc.StatusCode.INVALID_ARGUMENT and not produced:
            return BackendRejected(self.replica_id, message)
        return BackendFailed(self.replica_id, message)

    def _translate(self, error: InferenceServerException, produced: bool) -> Exception:
        message = error.message() or str(error)
        status = error.status() or ""
        if "UNAVAILABLE" in status or "unavailable" in message.lower() or "not found" in message:
            kind: type[Exception] = BackendFailed if produced else BackendUnavailable
            return kind(self.replica_id, message)
        if produced or "internal" in message.lower():
            return BackendFailed(self.replica_id, message)
        return BackendRejected(self.replica_id, message)

    async def ready(self) -> bool:
        try:
            timeout = self.target.timeout_s
            live = await self._client.is_server_ready(client_timeout=timeout)
            model_ready = await self._client.is_model_ready(
                self.target.model, client_timeout=timeout
            )
        except InferenceServerException:
            return False
        return bool(live and model_ready)

    async def unload(self) -> None:
        await self._call(self._client.unload_model(self.target.model, unload_dependents=True))

    async def load(self) -> None:
        await self._call(self._client.load_model(self.target.model))

    async def reset(self) -> None:
        """Unload (returns at once), wait until the model is gone, then load (blocks till ready).
        A model that is not loaded (an earlier reset was interrupted) is only loaded."""
        if await self.model_state() in ("READY", "UNLOADING", "LOADING"):
            await self.unload()
        for _ in range(1200):
            if await self.model_state() not in ("READY", "UNLOADING"):
                break
            await asyncio.sleep(0.05)
        else:
            raise BackendFailed(self.replica_id, "model did not finish unloading in 60 s")
        await self.load()

    async def model_state(self) -> str:
        """The model's state in the repository index: READY, UNLOADING, UNAVAILABLE, ..."""
        index = await self._call(self._client.get_model_repository_index(as_json=True))
        for model in index.get("models", []):
            if model.get("name") == self.target.model:
                return str(model.get("state", "UNAVAILABLE"))
        return "UNAVAILABLE"

    async def engine_digest(self) -> str:
        server = await self._call(self._client.get_server_metadata(as_json=True))
        config = await self._call(self._client.get_model_config(self.target.model, as_json=True))
        material = {
            "server": {"name": server.get("name"), "version": server.get("version")},
            "model": self.target.model,
            "config": config.get("config", config),
        }
        return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()

    async def request_count(self) -> int:
        """Triton's count of requests the model has completed since it was loaded."""
        stats = await self._call(
            self._client.get_inference_statistics(self.target.model, as_json=True)
        )
        total = 0
        for model in stats.get("model_stats", []):
            inference = model.get("inference_stats", {})
            total += int(inference.get("success", {}).get("count", 0))
            total += int(inference.get("fail", {}).get("count", 0))
        return total

    async def counters(self) -> ReplicaCounters:
        if not await self.ready():
            return ReplicaCounters(ready=False)
        count = await self.request_count()
        page = await self.scrape()
        return ReplicaCounters(
            ready=True,
            request_count=count,
            iteration_counter=sample(page, "nv_trt_llm_general_metrics", "iteration_counter"),
            reused_blocks=sample(page, _KV, 'kv_cache_block_type="reused"'),
            active=sample(page, "nv_trt_llm_request_metrics", 'request_type="active"'),
            used_blocks=sample(page, _KV, 'kv_cache_block_type="used"'),
            metrics=page,
        )

    async def scrape(self) -> dict[str, float]:
        try:
            timeout = aiohttp.ClientTimeout(total=self.target.timeout_s)
            async with self._http.get(self.target.metrics, timeout=timeout) as response:
                return parse_metrics(await response.text())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendUnavailable(self.replica_id, f"metrics: {exc}") from exc

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await asyncio.wait_for(awaitable, self.target.timeout_s * 6)
        except (InferenceServerException, TimeoutError) as exc:
            raise BackendUnavailable(self.replica_id, str(exc)) from exc

    async def close(self) -> None:
        await self._client.close()
