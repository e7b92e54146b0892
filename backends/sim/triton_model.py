"""The stand-in replica as a Triton Python-backend model.

It presents TensorRT-LLM's ``ensemble`` interface (input and output names, decoupled streaming,
per-request KV-cache reuse statistics and timings) in front of :mod:`backends.sim.engine`, and
publishes the TensorRT-LLM metric families through the Python backend's custom metrics.

The launcher copies this file into a model repository as ``ensemble/1/model.py``; it runs inside
Triton's Python-backend stub, never inside the proxy. Requests are queued and served one at a
time by a worker thread, as an in-flight batcher with batch size one would: the order in which
requests reach the engine is the order in which they change its cache.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.sim.engine import Engine, EngineConfig, EngineError, GenerationResult, SamplingParams

_PRECISIONS: dict[str, tuple[str, int]] = {
    "bf16": ("bf16", 16),
    "fp16": ("fp16", 16),
    "fp32": ("fp32", 16),
    "int4": ("bf16", 4),
}
_MAX_IN_FLIGHT = 256
_FINAL = 1  # pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL, resolved at import in the stub


class InputError(ValueError):
    """A request the model refuses; its message goes back to the client as a Triton error."""


@dataclass(frozen=True)
class Job:
    request: Any
    arrival_ns: int


def engine_config(parameters: dict[str, Any]) -> EngineConfig:
    """Build the engine's config from the model config's ``parameters`` block."""

    def param(name: str, default: str) -> str:
        value = parameters.get(name, {}).get("string_value", default)
        return str(value) if not str(value).startswith("${") else default

    precision = param("weight_precision", "bf16")
    if precision not in _PRECISIONS:
        raise ValueError(
            f"weight_precision must be one of {sorted(_PRECISIONS)}, not {precision!r}"
        )
    float_format, bits = _PRECISIONS[precision]
    tokens_per_block = int(param("tokens_per_block", "16"))
    max_tokens = int(param("max_tokens_in_paged_kv_cache", str(8192 * tokens_per_block)))
    return EngineConfig(
        tokens_per_block=tokens_per_block,
        capacity_blocks=max(1, max_tokens // tokens_per_block),
        reuse=param("enable_kv_cache_reuse", "true").lower() in ("1", "true", "yes"),
        float_format=float_format,  # type: ignore[arg-type]
        weight_bits=bits,  # type: ignore[arg-type]
        weight_seed=int(param("weight_seed", "0")),
    )


def _scalar(request: Any, name: str, default: Any) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    array = tensor.as_numpy()
    if array.size != 1:
        raise InputError(f"input '{name}' must hold exactly one value, got shape {array.shape}")
    value = array.reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value


def _strings(request: Any, name: str) -> tuple[str, ...]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return ()
    values = tensor.as_numpy().reshape(-1)
    return tuple(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values if v)


@dataclass(frozen=True)
class Parsed:
    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input: bool
    perf: bool
    num_input: bool
    num_output: bool


def parse(request: Any) -> Parsed:
    """Read TensorRT-LLM's ensemble inputs, both the current and the older names."""
    text = _scalar(request, "text_input", None)
    if text is None:
        raise InputError("input 'text_input' is required")
    prompt = text.decode("utf-8", errors="strict") if isinstance(text, bytes) else str(text)
    max_tokens = int(_scalar(request, "max_tokens", 16))
    if max_tokens < 0:
        raise InputError(f"input 'max_tokens' must be >= 0, got {max_tokens}")
    seed = _scalar(request, "seed", None)
    if seed is None:
        seed = _scalar(request, "random_seed", 0)
    perf = bool(_scalar(request, "return_perf_metrics", False)) or bool(
        _scalar(request, "return_kv_cache_reuse_stats", False)
    )
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=float(_scalar(request, "temperature", 0.0)),
        top_k=int(_scalar(request, "top_k", 0)),
        top_p=float(_scalar(request, "top_p", 1.0)),
        seed=int(seed),
        end_id=int(_scalar(request, "end_id", 256)),
        stop_words=_strings(request, "stop_words"),
        bad_words=_strings(request, "bad_words"),
    )
    return Parsed(
        prompt=prompt,
        params=params,
        stream=bool(_scalar(request, "stream", False)),
        exclude_input=bool(_scalar(request, "exclude_input_in_output", False)),
        perf=perf,
        num_input=bool(_scalar(request, "return_num_input_tokens", False)),
        num_output=bool(_scalar(request, "return_num_output_tokens", False)),
    )


def _tensor(name: str, value: Any, dtype: Any) -> Any:
    return pb_utils.Tensor(name, np.array([[value]], dtype=dtype))


def outputs(parsed: Parsed, text: str, result: GenerationResult | None) -> list[Any]:
    """The response tensors: the text always, the statistics when the request asked for them."""
    tensors = [_tensor("text_output", text.encode("utf-8"), np.object_)]
    if result is None:
        return tensors
    if parsed.perf:
        for name, value in (
            ("kv_cache_alloc_new_blocks", result.new_blocks),
            ("kv_cache_reused_blocks", result.reused_blocks),
            ("kv_cache_alloc_total_blocks", result.total_blocks),
        ):
            tensors.append(_tensor(name, value, np.int32))
        for name, value in (
            ("arrival_time_ns", result.arrival_time_ns),
            ("first_scheduled_time_ns", result.first_scheduled_time_ns),
            ("first_token_time_ns", result.first_token_time_ns),
            ("last_token_time_ns", result.last_token_time_ns),
        ):
            tensors.append(_tensor(name, value, np.int64))
    if parsed.num_input:
        tensors.append(_tensor("num_input_tokens", result.prompt_tokens, np.int32))
    if parsed.num_output:
        tensors.append(_tensor("num_output_tokens", len(result.output_tokens), np.int32))
    return tensors


class Metrics:
    """TensorRT-LLM's metric families and labels, fed from the engine's statistics."""

    def __init__(self, model: str, version: str) -> None:
        labels = {"model": model, "version": version}
        gauge = pb_utils.MetricFamily.GAUGE
        kv = pb_utils.MetricFamily(
            name="nv_trt_llm_kv_cache_block_metrics",
            description="TRT LLM KV cache block metrics",
            kind=gauge,
        )
        req = pb_utils.MetricFamily(
            name="nv_trt_llm_request_metrics", description="TRT LLM request metrics", kind=gauge
        )
        gen = pb_utils.MetricFamily(
            name="nv_trt_llm_general_metrics", description="General TRT LLM metrics", kind=gauge
        )
        self._families = (kv, req, gen)

        def make(family: Any, key: str, names: tuple[str, ...]) -> dict[str, Any]:
            return {n: family.Metric(labels={key: n, **labels}) for n in names}

        kv_types = ("max", "free", "used", "tokens_per", "reused", "fraction")
        req_types = ("active", "max", "scheduled", "context", "waiting", "completed")
        self.kv = make(kv, "kv_cache_block_type", kv_types)
        self.req = make(req, "request_type", req_types)
        self.gen = make(gen, "general_type", ("iteration_counter", "timestamp"))
        self.req["max"].set(_MAX_IN_FLIGHT)

    def update(self, engine: Engine, waiting: int, running: int) -> None:
        s = engine.stats()
        for name, value in (
            ("max", s.max_blocks),
            ("free", s.free_blocks),
            ("used", s.used_blocks),
            ("tokens_per", s.tokens_per_block),
            ("reused", s.reused_blocks_total),
            ("fraction", s.used_blocks / s.max_blocks if s.max_blocks else 0.0),
        ):
            self.kv[name].set(value)
        self.req["active"].set(waiting + running)
        self.req["scheduled"].set(running)
        self.req["context"].set(running)
        self.req["waiting"].set(waiting)
        self.req["completed"].set(s.requests_completed)
        self.gen["iteration_counter"].set(s.iterations)
        self.gen["timestamp"].set(time.time_ns() // 1000)


class TritonPythonModel:
    """Triton's entry point: queue each request, serve them in order on one worker thread."""

    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        self.engine = Engine(engine_config(config.get("parameters", {})))
        self.metrics = Metrics(args["model_name"], args["model_version"])
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.running = 0
        self.metrics.update(self.engine, 0, 0)
        self.worker = threading.Thread(target=self._serve, name="sim-engine", daemon=True)
        self.worker.start()

    def execute(self, requests: list[Any]) -> None:
        now = time.time_ns()
        for request in requests:
            self.jobs.put(Job(request, now))
        self.metrics.update(self.engine, self.jobs.qsize(), self.running)
        return None

    def finalize(self) -> None:
        self.jobs.put(None)
        self.worker.join(timeout=30)

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            self.running = 1
            self.metrics.update(self.engine, self.jobs.qsize(), 1)
            self._run(job)
            self.running = 0
            self.metrics.update(self.engine, self.jobs.qsize(), 0)

    def _run(self, job: Job) -> None:
        sender = job.request.get_response_sender()
        try:
            parsed = parse(job.request)
            self._generate(job, parsed, sender)
        except (InputError, EngineError, UnicodeDecodeError) as exc:
            error = pb_utils.TritonError(str(exc))
            sender.send(pb_utils.InferenceResponse(error=error), flags=_final_flag())
        except Exception as exc:  # noqa: BLE001 - a crashed worker would hang every later request
            error = pb_utils.TritonError(f"internal error in the stand-in engine: {exc!r}")
            sender.send(pb_utils.InferenceResponse(error=error), flags=_final_flag())

    def _generate(self, job: Job, parsed: Parsed, sender: Any) -> None:
        def on_token(_token: int, piece: str) -> None:
            sender.send(pb_utils.InferenceResponse(output_tensors=outputs(parsed, piece, None)))

        result = self.engine.generate(
            parsed.prompt,
            parsed.params,
            on_token=on_token if parsed.stream else None,
            is_cancelled=job.request.is_cancelled,
            arrival_time_ns=job.arrival_ns,
        )
        if parsed.stream:
            text = ""
        else:
            text = result.text if parsed.exclude_input else parsed.prompt + result.text
        response = pb_utils.InferenceResponse(output_tensors=outputs(parsed, text, result))
        # The engine's gauges move before the client hears the end, as TensorRT-LLM's do (its
        # statistics are taken at the iteration that finishes the request).
        self.running = 0
        self.metrics.update(self.engine, self.jobs.qsize(), 0)
        sender.send(response, flags=_final_flag())


def _final_flag() -> int:
    return int(getattr(pb_utils, "TRITONSERVER_RESPONSE_COMPLETE_FINAL", _FINAL))
