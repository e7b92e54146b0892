"""Triton Inference Server with TensorRT-LLM's ``ensemble`` interface, over gRPC (asyncio).

Every generation goes through ``ModelStreamInfer`` (:mod:`backends.triton_grpc`): it serves
decoupled and non-decoupled models alike. One gRPC channel per replica carries all generations
(HTTP/2 streams), so no request pays a connection set-up. Model control (unload, load) and
statistics go over tritonclient's gRPC client; the metrics page over HTTP.

What a replica is made of (TensorRT-LLM's ``inflight_batcher_llm`` repository): the served model
(``ensemble``) and the *engine model* (``tensorrt_llm``) that every path to the KV cache goes
through, whether a request comes through the ensemble, a BLS model or straight to it. So:
- per-request statistics are read from whichever response carries them: through a decoupled
  ensemble the final response may carry them or be flags-only (``enable_empty_final_response``);
- the request counter (continuity, verified resets) is the engine model's;
- the engine digest covers the configs of the served model and every model it is composed of,
  the engine files' checksum and the reuse flag (:mod:`backends.engine_dir`);
- abandoning a request also sends the engine model a ``stop`` request for its request id:
  Triton does not pass a cancelled ensemble request's cancellation on to a step already running
  (it checks only between steps), so without it the engine would finish an abandoned request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Mapping
from dataclasses import replace
from typing import Any

import aiohttp
import grpc
import numpy as np
from tritonclient.utils import InferenceServerException

from backends.base import (
    BackendError,
    BackendFailed,
    BackendRejected,
    BackendUnavailable,
    Chunk,
    EngineFacts,
    EngineStats,
    GenerationRequest,
    ReplicaCounters,
)
from backends.engine_limits import is_prompt_refusal
from backends.triton_control import TritonControl
from backends.triton_grpc import Input, StreamCall, StreamChannel, infer_request
from backends.triton_grpc import tensor as _tensor
from backends.triton_target import TritonTarget

__all__ = ["TritonBackend", "TritonTarget", "build_inputs", "parse_stats", "text_of"]

_NUMBERS = (int, float)
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


def constant_inputs(target: TritonTarget) -> tuple[Input, ...]:
    """Inputs every request carries: never echo the prompt, always return the statistics.

    Built once per replica: an Input is only read when a request is serialised.
    """
    names = ["exclude_input_in_output", target.perf_input]
    if target.token_counts:
        names += ["return_num_input_tokens", "return_num_output_tokens"]
    return tuple(_tensor(name, True, np.bool_, "BOOL") for name in names)


# What grpc core says of a channel that could not connect (the request cannot have left).
_NOT_CONNECTED = ("failed to connect to all addresses", "connection refused", "dns resolution")


def never_connected(details: str) -> bool:
    """The stream failed because its channel never connected (grpc's status details)."""
    lowered = details.lower()
    return any(phrase in lowered for phrase in _NOT_CONNECTED)


def build_inputs(
    target: TritonTarget, request: GenerationRequest, constant: tuple[Input, ...]
) -> list[Input]:
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
    for name, kind, value in request.extra:  # passed through, types checked by the front
        if kind == "BYTES":
            value = [v.encode() for v in value] if isinstance(value, list) else value.encode()
        inputs.append(_tensor(name, value, _NUMPY.get(kind, np.object_), kind))
    return inputs


_NUMPY: dict[str, Any] = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}


def jsonable(outputs: Mapping[str, Any]) -> dict[str, Any]:
    """A tritonclient response's outputs as Triton's HTTP generate answers them: each tensor
    flattened, one element as a scalar, bytes as text."""
    found: dict[str, Any] = {}
    for name, value in outputs.items():
        items = np.asarray(value).reshape(-1).tolist()
        items = [i.decode(errors="replace") if isinstance(i, bytes) else i for i in items]
        found[name] = items[0] if len(items) == 1 else items
    return found


def parse_stats(outputs: Mapping[str, Any], base: EngineStats | None = None) -> EngineStats | None:
    """TensorRT-LLM's per-request statistics in one response's outputs (output name -> numpy
    array, list or scalar, as tritonclient or a JSON body gives them), over ``base`` (what
    earlier responses of the stream carried); None when neither has any.

    The request's statistics (blocks, token times, ``num_input_tokens``) are the same on every
    response that carries them: the last one counts. ``num_output_tokens`` counts the tokens of
    *that* response (``model_instance_state.cc``, ``fillTritonResponse``: ``outputTokensSize``
    per response), so a stream's count is the sum over its responses; a flags-only final
    response (the ensemble's extra end, ``ensemble_scheduler.cc``) adds nothing."""
    if outputs.keys().isdisjoint(_STATS):  # most responses of a stream carry a token only
        return base
    values: dict[str, int] = {}
    for output, field_name in _STATS.items():
        value = outputs.get(output)
        if value is None:
            continue
        if isinstance(value, list):  # a JSON body's one-element array
            value = value[0]
        # Plain numbers (JSON) are taken as they are; numpy arrays (tritonclient) unpacked.
        values[field_name] = int(
            value if isinstance(value, _NUMBERS) else np.asarray(value).reshape(-1)[0]
        )
    if not values:
        return base
    if base is None:
        return EngineStats(**values)
    if "output_tokens" in values:
        values["output_tokens"] += base.output_tokens
    return replace(base, **values)


def text_of(outputs: Mapping[str, Any]) -> str:
    """The ``text_output`` of one response ('' when it has none)."""
    value = outputs.get("text_output")
    if value is None:
        return ""
    first = np.asarray(value, dtype=np.object_).reshape(-1)
    item = first[0] if first.size else b""
    return item.decode() if isinstance(item, bytes) else str(item)


def result_outputs(result: Any) -> dict[str, Any]:
    """A tritonclient result's outputs as ``{name: numpy array}``."""
    return {output.name: result.as_numpy(output.name) for output in result.get_response().outputs}


class TritonBackend:
    """The engine client for one Triton replica."""

    def __init__(self, target: TritonTarget, http: aiohttp.ClientSession) -> None:
        self.target = target
        self.replica_id = target.replica_id
        self._streams = StreamChannel(target.grpc)  # generations
        self._constant = constant_inputs(target)
        self.control = TritonControl(target, None, http)  # model control, statistics
        self._stops: set[asyncio.Task[None]] = set()
        # Stop requests sent to the engine model (continuity: a C++ backend does not count
        # them in the request counter, a Python one does; router.eval.continuity).
        self.stops_sent = 0

    async def stream(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        inputs = build_inputs(self.target, request, self._constant)
        done = asyncio.Event()
        call = self._open(self.target.model, inputs, request.request_id, done)
        produced = finished = failed = False
        stats: EngineStats | None = None
        try:
            async for result in call:
                response = result.get_response()
                final = response.parameters["triton_final_response"].bool_param
                outputs = result_outputs(result) if response.outputs else {}
                text, stats = text_of(outputs), parse_stats(outputs, stats)
                produced = produced or bool(text)
                finished = final
                if final:
                    done.set()  # our side of the stream may close now (see _open)
                raw = jsonable(outputs) if request.raw and outputs else None
                yield Chunk(text, final, stats if final else None, raw)
                if final:
                    return
            failed = True
            raise BackendFailed(self.replica_id, "stream ended without a final response")
        except InferenceServerException as exc:
            failed = True
            raise self._translate(exc, produced) from exc
        except grpc.RpcError as exc:  # tritonclient passes errors of the stream itself through
            failed = True
            raise self._translate_rpc(exc, produced) from exc
        finally:
            done.set()
            # Cancel only a stream that is still producing: one whose final or error response
            # arrived is over. Cancelling it races Triton's own end of the stream and,
            # intermittently, leaves a reference to the model behind: the next unload then
            # never finishes (seen on the stand-in, with an ensemble's error responses too).
            if not finished and not failed:
                call.cancel()
                await self._stop(request.request_id)

    def _open(
        self, model: str, inputs: list[Input], request_id: str, done: asyncio.Event
    ) -> StreamCall:
        try:
            return self._streams.open(infer_request(model, inputs, request_id), done)
        except (InferenceServerException, grpc.RpcError) as exc:
            raise BackendUnavailable(self.replica_id, str(exc)) from exc

    async def _stop(self, request_id: str) -> None:
        """Ask the engine model to stop an abandoned request (see the module docstring)."""
        if self.target.engine_model == self.target.model:
            return  # the call's cancellation reaches the engine itself
        self.stops_sent += 1
        task = asyncio.ensure_future(self._send_stop(request_id))
        self._stops.add(task)
        task.add_done_callback(self._stops.discard)
        with contextlib.suppress(BackendError):
            # Shielded: a request abandoned because its own task was cancelled still stops.
            await asyncio.shield(task)

    async def _send_stop(self, request_id: str) -> None:
        inputs = [
            _tensor("input_ids", 0, np.int32, "INT32"),
            _tensor("input_lengths", 1, np.int32, "INT32"),
            _tensor("request_output_len", 1, np.int32, "INT32"),
            _tensor("stop", True, np.bool_, "BOOL"),
        ]
        done = asyncio.Event()
        call = self._open(self.target.engine_model, inputs, request_id, done)
        try:
            async with asyncio.timeout(self.target.timeout_s):
                async for result in call:
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        return
        except (InferenceServerException, grpc.RpcError, TimeoutError) as exc:
            call.cancel()
            raise BackendFailed(self.replica_id, f"stop request: {exc}") from exc
        finally:
            done.set()

    def _translate_rpc(self, error: grpc.RpcError, produced: bool) -> Exception:
        code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
        details = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
        message = f"{code.name if code else 'RPC error'}: {details}"
        if code == grpc.StatusCode.INVALID_ARGUMENT and not produced:
            return BackendRejected(self.replica_id, message)
        # grpc does not say whether the request message left before the stream failed: only a
        # channel that never connected proves it did not. Otherwise the replica may have run
        # it (``written``: its state is unknown from here, and it is not sent there again).
        written = not never_connected(details or "")
        if code == grpc.StatusCode.UNAVAILABLE and not produced:
            return BackendUnavailable(self.replica_id, message, written=written)
        return BackendFailed(self.replica_id, message, written=written)

    def _translate(self, error: InferenceServerException, produced: bool) -> Exception:
        message = error.message() or str(error)
        status = error.status() or ""
        if is_prompt_refusal(message) and not produced:
            # The executor refusing a prompt over its limit (INTERNAL on a GPU replica): the
            # client's mistake, not the replica's (``llmRequest.cpp``, ``validate``).
            return BackendRejected(self.replica_id, message)
        if "UNAVAILABLE" in status or "unavailable" in message.lower() or "not found" in message:
            kind: type[Exception] = BackendFailed if produced else BackendUnavailable
            return kind(self.replica_id, message)
        if "exceeds maximum sequence length" in message and not produced:
            return BackendRejected(self.replica_id, message)  # engines before the output clamp
        if produced or "internal" in message.lower():
            return BackendFailed(self.replica_id, message)
        return BackendRejected(self.replica_id, message)

    async def ready(self) -> bool:
        return await self.control.ready()

    async def reset(self, timeout_s: float) -> None:
        await self.control.reset(timeout_s)

    async def load(self, timeout_s: float) -> None:
        await self.control.load(timeout_s)

    async def model_state(self) -> str:
        return await self.control.model_state()

    async def engine_digest(self) -> str:
        return await self.control.engine_digest()

    async def max_input_len(self) -> int | None:
        return await self.control.max_input_len()

    async def engine_facts(self) -> EngineFacts:
        return await self.control.engine_facts()

    async def counters(self) -> ReplicaCounters:
        counters = await self.control.counters()
        if counters.ready and self.control.take_renewed():
            # Ready on a fresh control channel after failed probes (a restart): the streams'
            # channel failed too and may be waiting out its backoff; generations use a new one.
            self._streams.renew(self.target.timeout_s)
        return counters

    async def request_count(self) -> int:
        return await self.control.request_count()

    async def close(self) -> None:
        for task in list(self._stops):
            task.cancel()
        await self._streams.close()
        await self.control.close()
