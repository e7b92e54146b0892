"""The ``tensorrt_llm`` model: the stand-in for TensorRT-LLM's C++ Triton backend.

Decoupled, with the real model's tensor names (``input_ids``, ``input_lengths``,
``request_output_len``, ``end_id``, ``pad_id``, ``stop_words_list``, ``bad_words_list``,
``temperature``, ``runtime_top_k``, ``runtime_top_p``, ``seed`` / ``random_seed``, ``streaming``,
``exclude_input_in_output``, ``return_perf_metrics`` / ``return_kv_cache_reuse_stats``,
``return_num_input_tokens``, ``return_num_output_tokens``, ``stop``; ``output_ids``,
``sequence_length``, the ``kv_cache_*`` counts, the ``*_time_ns`` stamps, ``num_input_tokens``,
``num_output_tokens``) and parameters (``gpt_model_path`` names the engine directory,
``enable_kv_cache_reuse``, ``max_tokens_in_paged_kv_cache``).

As the real backend does, it rejects at admission a prompt longer than the engine's
``max_input_len`` (or one that cannot fit ``max_seq_len``), stops a request when its client
cancels it or when a request with ``stop: true`` names its request id, and answers:
- not streaming: one response with the output and the statistics, carrying the final flag;
- streaming: one response per token, one with the statistics, then a flags-only final response
  (as decoupled Python-backend models such as ``tensorrt_llm_bls`` end their streams).

Requests are served one at a time in arrival order by a worker thread, as an in-flight batcher
with batch size one would: the order requests reach the engine is the order they change its cache.
Its metrics (requests active, scheduled and waiting; KV-cache blocks; the iteration counter) are
published when a request arrives, starts and ends, and while one runs every
``stats_check_period_ms`` (100 by default), as the real backend's statistics thread publishes
the executor's latest iteration statistics.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.sim.engine import Engine, EngineConfig, EngineError, GenerationResult, SamplingParams
from backends.sim.engine_files import EngineBuild, load_engine
from backends.sim.models.common import (
    FINAL,
    InputError,
    array,
    error_response,
    flag,
    parameters,
    scalar,
    tensor,
    words_of,
)
from backends.sim.models.metrics import Metrics


@dataclass(frozen=True)
class Parsed:
    ids: list[int]
    params: SamplingParams
    streaming: bool
    exclude_input: bool
    perf: bool
    num_input: bool
    num_output: bool


@dataclass
class Job:
    request: Any
    sender: Any
    parsed: Parsed
    arrival_ns: int
    request_id: str
    stopped: threading.Event = field(default_factory=threading.Event)

    def cancelled(self) -> bool:
        return self.stopped.is_set() or bool(self.request.is_cancelled())


def _text(ids: list[int], what: str) -> str:
    try:
        return bytes(ids).decode("utf-8")
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{what}: token ids do not spell UTF-8 text") from exc


def admit(prompt_len: int, output_len: int, build: EngineBuild) -> None:
    """TensorRT-LLM's admission checks, with its messages."""
    if output_len < 0:
        raise InputError(f"request_output_len must be >= 0, got {output_len}")
    if prompt_len > build.max_input_len:
        raise InputError(
            f"Prompt length ({prompt_len}) exceeds maximum input length ({build.max_input_len})."
        )
    if prompt_len + output_len > build.max_seq_len:
        raise InputError(
            f"Prompt length + number of requested output tokens ({prompt_len} + {output_len})"
            f" exceeds maximum sequence length ({build.max_seq_len})."
        )


def sampling(request: Any, output_len: int) -> SamplingParams:
    seed = scalar(request, "seed", None)
    stops, bans = (words_of(array(request, n)) for n in ("stop_words_list", "bad_words_list"))
    return SamplingParams(
        max_tokens=output_len,
        temperature=float(scalar(request, "temperature", 0.0)),
        top_k=int(scalar(request, "runtime_top_k", 0)),
        top_p=float(scalar(request, "runtime_top_p", 1.0)),
        seed=int(scalar(request, "random_seed", 0) if seed is None else seed),
        end_id=int(scalar(request, "end_id", 256)),
        stop_words=tuple(_text(w, "stop_words_list") for w in stops),
        bad_words=tuple(_text(w, "bad_words_list") for w in bans),
    )


def parse(request: Any, build: EngineBuild) -> Parsed:
    """Read the inputs, and refuse at admission what the engine cannot take."""
    ids_array = array(request, "input_ids")
    if ids_array is None:
        raise InputError("input 'input_ids' is required")
    length = int(scalar(request, "input_lengths", ids_array.size))
    ids = ids_array.reshape(-1)[:length].tolist()
    output_len = int(scalar(request, "request_output_len", 16))
    admit(len(ids), output_len, build)
    return Parsed(
        ids=ids,
        params=sampling(request, output_len),
        streaming=bool(scalar(request, "streaming", False)),
        exclude_input=bool(scalar(request, "exclude_input_in_output", False)),
        perf=bool(scalar(request, "return_perf_metrics", False))
        or bool(scalar(request, "return_kv_cache_reuse_stats", False)),
        num_input=bool(scalar(request, "return_num_input_tokens", False)),
        num_output=bool(scalar(request, "return_num_output_tokens", False)),
    )


def _ids(tokens: list[int]) -> list[Any]:
    """``output_ids`` [1, beam 1, L] and ``sequence_length`` [1, 1]."""
    return [
        tensor("output_ids", np.array(tokens, dtype=np.int32).reshape(1, 1, -1), np.int32),
        tensor("sequence_length", [[len(tokens)]], np.int32),
    ]


def outputs(parsed: Parsed, tokens: list[int], result: GenerationResult) -> list[Any]:
    """The tensors of a request's last data response: its tokens and the statistics asked for."""
    tensors = _ids(tokens)
    if parsed.perf:
        for name, value in (
            ("kv_cache_alloc_new_blocks", result.new_blocks),
            ("kv_cache_reused_blocks", result.reused_blocks),
            ("kv_cache_alloc_total_blocks", result.total_blocks),
        ):
            tensors.append(tensor(name, [[value]], np.int32))
        for name, value in (
            ("arrival_time_ns", result.arrival_time_ns),
            ("first_scheduled_time_ns", result.first_scheduled_time_ns),
            ("first_token_time_ns", result.first_token_time_ns),
            ("last_token_time_ns", result.last_token_time_ns),
        ):
            tensors.append(tensor(name, [[value]], np.int64))
    if parsed.num_input:
        tensors.append(tensor("num_input_tokens", [[result.prompt_tokens]], np.int32))
    if parsed.num_output:
        tensors.append(tensor("num_output_tokens", [[len(result.output_tokens)]], np.int32))
    return tensors


def _end(job: Job, response: Any) -> None:
    """Send a failed job's final response. If even that cannot be sent (its client is gone, its
    sender closed), say so in the log and go on: the worker serves every later request."""
    try:
        job.sender.send(response, flags=FINAL)
    except Exception as exc:  # noqa: BLE001
        pb_utils.Logger.log_warn(f"request {job.request_id!r}: final response not sent: {exc!r}")


class TritonPythonModel:
    """Triton's entry point: admit or refuse each request, serve them in order on one thread."""

    def initialize(self, args: dict[str, str]) -> None:
        params = parameters(args)
        self.build, weights = load_engine(Path(params["gpt_model_path"]))
        tokens = int(params.get("max_tokens_in_paged_kv_cache") or 8192 * 16)
        tpb = self.build.tokens_per_block
        config = EngineConfig(
            d_model=self.build.d_model,
            n_layers=self.build.n_layers,
            n_heads=self.build.n_heads,
            d_ff=self.build.d_ff,
            tokens_per_block=tpb,
            capacity_blocks=max(1, tokens // tpb),
            reuse=flag(params, "enable_kv_cache_reuse", False),
            float_format=self.build.float_format,
            weight_bits=self.build.weight_bits,
            weight_seed=self.build.weight_seed,
            prefill_chunk=self.build.max_num_tokens,
        )
        self.engine = Engine(config, weights)
        self.metrics = Metrics(args["model_name"], args["model_version"])
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.lock = threading.Lock()
        self.live: dict[str, list[Job]] = {}  # request id -> admitted, unfinished jobs
        self.running: Job | None = None
        self.stats_period_s = int(params.get("stats_check_period_ms") or 100) / 1000
        self.published = time.monotonic()
        self.context_tokens = 0
        self.metrics.update(self.engine, 0, 0)
        self.worker = threading.Thread(target=self._serve, name="sim-engine", daemon=True)
        self.worker.start()

    def execute(self, requests: list[Any]) -> None:
        now = time.time_ns()
        for request in requests:
            self._admit(request, now)
        self._publish()
        return None

    def finalize(self) -> None:
        with self.lock:
            for jobs in self.live.values():
                for job in jobs:
                    job.stopped.set()
        self.jobs.put(None)
        self.worker.join(timeout=30)

    def _admit(self, request: Any, arrival_ns: int) -> None:
        sender = request.get_response_sender()
        request_id = str(request.request_id() or "")
        try:
            if scalar(request, "stop", False):
                self._stop(request_id)
                sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
                return
            job = Job(request, sender, parse(request, self.build), arrival_ns, request_id)
        except (InputError, EngineError, ValueError) as exc:
            sender.send(error_response(str(exc)), flags=FINAL)
            return
        with self.lock:
            self.live.setdefault(request_id, []).append(job)
        self.jobs.put(job)

    def _stop(self, request_id: str) -> None:
        if not request_id:
            raise InputError("Trying to stop a request but request ID is not provided")
        with self.lock:
            for job in self.live.get(request_id, []):
                job.stopped.set()

    def _publish(self, context_tokens: int = 0) -> None:
        running = 1 if self.running is not None else 0
        self.context_tokens = context_tokens
        self.published = time.monotonic()
        self.metrics.update(self.engine, self.jobs.qsize(), running, context_tokens)

    def _between_iterations(self, job: Job) -> bool:
        """Asked by the engine between iterations: publish the statistics when they are due
        (from the worker thread, as the real backend's statistics thread does); cancelled?"""
        if time.monotonic() - self.published >= self.stats_period_s:
            self._publish(self.context_tokens)
        return job.cancelled()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            self.running = job
            self._publish(len(job.parsed.ids))
            try:
                self._run(job)
            except Exception as exc:  # noqa: BLE001 - a crashed worker would hang every request
                _end(job, error_response(f"Executor failed: {exc!r}"))
            finally:
                with self.lock:
                    jobs = self.live.get(job.request_id, [])
                    if job in jobs:
                        jobs.remove(job)
                    if not jobs:
                        self.live.pop(job.request_id, None)
                self.running = None
                self._publish()

    def _run(self, job: Job) -> None:
        parsed, sender = job.parsed, job.sender

        def on_token(token: int, _piece: str) -> None:
            sender.send(pb_utils.InferenceResponse(output_tensors=_ids([token])))

        try:
            result = self.engine.generate(
                parsed.ids,
                parsed.params,
                on_token=on_token if parsed.streaming else None,
                is_cancelled=lambda: self._between_iterations(job),
                arrival_time_ns=job.arrival_ns,
            )
        except EngineError as exc:
            sender.send(error_response(str(exc)), flags=FINAL)
            return
        self.metrics.finished(result.prompt_tokens, len(result.output_tokens))
        # The engine's gauges move before the client hears the end, as TensorRT-LLM's do (its
        # statistics are taken at the iteration that finishes the request).
        self.running = None
        self._publish()
        if parsed.streaming:
            sender.send(pb_utils.InferenceResponse(output_tensors=outputs(parsed, [], result)))
            sender.send(flags=FINAL)
            return
        tokens = result.output_tokens if parsed.exclude_input else parsed.ids + result.output_tokens
        sender.send(
            pb_utils.InferenceResponse(output_tensors=outputs(parsed, tokens, result)), flags=FINAL
        )
