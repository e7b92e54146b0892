"""The ``tensorrt_llm`` model: the stand-in for TensorRT-LLM's C++ Triton backend.

Decoupled, with the real model's tensor names (``input_ids``, ``input_lengths``,
``request_output_len``, ``end_id``, ``pad_id``, ``stop_words_list``, ``bad_words_list``,
``temperature``, ``runtime_top_k``, ``runtime_top_p``, ``seed`` / ``random_seed``, ``streaming``,
``exclude_input_in_output``, ``return_perf_metrics`` / ``return_kv_cache_reuse_stats``,
``return_num_input_tokens``, ``return_num_output_tokens``, ``return_log_probs``, ``beam_width``,
``stop``; ``output_ids``, ``sequence_length``, the ``kv_cache_*`` counts, the ``*_time_ns``
stamps, ``num_input_tokens``, ``num_output_tokens``, ``output_log_probs``, ``cum_log_probs``)
and parameters (``gpt_model_path`` names the engine directory, ``enable_kv_cache_reuse``,
``enable_partial_reuse``, ``enable_chunked_context``, ``max_tokens_in_paged_kv_cache``).

Where each behaviour comes from in TensorRT-LLM (docs/stand-in.md has the full table):
- the prompt limit is the executor's (``backends/engine_limits.py``, after ``trtGptModel.h``); a
  prompt over it gets the executor's error response, "Executor failed process requestId N due
  to the following error: Prompt length (N) exceeds maximum input length (M). ..."
  (``llmRequest.cpp`` ``validate``, ``model_instance_state.cc`` ``fillTritonResponse``);
  prompt + output over ``max_seq_len`` is not refused: the output is clamped, with a warning;
- responses (``model_instance_state.cc`` ``fillTritonResponse``, ``llmRequest.cpp``
  ``createResult``): the statistics asked for ride on every response, streamed or not;
  ``num_output_tokens`` counts the ids of that response's ``output_ids``; streaming sends one
  response per token and the last token(s) with the final flag (no flags-only final response);
- a stop request (``stop: true``) cancels the named request id and is answered with an empty
  final response; inputs refused before the executor get an error response; neither counts in
  the request statistics, which count every other request once, at its final response
  (``reportBaseMetrics``) -- published here as ``kvledger_sim_backend_requests`` since a Python
  backend cannot report Triton's statistics that way;
- the metrics are published while requests run (every ``stats_check_period_ms``, 100 by
  default, as ``WaitForStats`` publishes the executor's latest iteration statistics) and once
  more when the last one leaves; nothing is published before the first request after a load.

Requests are served one at a time in arrival order by a worker thread, as an in-flight batcher
with batch size one would: the order requests reach the engine is the order they change its cache.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.engine_limits import (
    EngineLimits,
    clamped_output_len,
    engine_limits,
    prompt_too_long,
)
from backends.sim.engine import (
    Engine,
    EngineConfig,
    EngineError,
    GenerationResult,
    Progress,
    SamplingParams,
)
from backends.sim.engine_files import PERTURB_FILE, EngineBuild, load_engine, read_config
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
    log_probs: bool
    requested_output: int  # request_output_len as asked, before any clamp


@dataclass
class Job:
    request: Any
    sender: Any
    parsed: Parsed
    arrival_ns: int
    request_id: str
    executor_id: int
    stopped: threading.Event = field(default_factory=threading.Event)

    def cancelled(self) -> bool:
        return self.stopped.is_set() or bool(self.request.is_cancelled())


def _text(ids: list[int], what: str) -> str:
    try:
        return bytes(ids).decode("utf-8")
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{what}: token ids do not spell UTF-8 text") from exc


def limits_of(build: EngineBuild, config: dict[str, Any], params: dict[str, str]) -> EngineLimits:
    """The executor's limits for this engine and these parameters (``trtGptModel.h``)."""
    found = engine_limits(config, params)
    if found is not None:
        return found
    return EngineLimits(build.max_input_len, build.max_seq_len, "max_input_len (as built)")


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


def parse(request: Any) -> Parsed:
    """Read the inputs; refuse what the backend refuses before the executor sees it."""
    ids_array = array(request, "input_ids")
    if ids_array is None:
        raise InputError("input 'input_ids' is required")
    length = int(scalar(request, "input_lengths", ids_array.size))
    ids = ids_array.reshape(-1)[:length].tolist()
    output_len = int(scalar(request, "request_output_len", 16))
    if output_len < 0:
        raise InputError(f"request_output_len must be >= 0, got {output_len}")
    beam_width = int(scalar(request, "beam_width", 1))
    if beam_width != 1:
        raise InputError(
            f"beam_width ({beam_width}) must not exceed the engine's max_beam_width (1)"
        )
    return Parsed(
        ids=ids,
        params=sampling(request, output_len),
        streaming=bool(scalar(request, "streaming", False)),
        exclude_input=bool(scalar(request, "exclude_input_in_output", False)),
        perf=bool(scalar(request, "return_perf_metrics", False))
        or bool(scalar(request, "return_kv_cache_reuse_stats", False)),
        num_input=bool(scalar(request, "return_num_input_tokens", False)),
        num_output=bool(scalar(request, "return_num_output_tokens", False)),
        log_probs=bool(scalar(request, "return_log_probs", False)),
        requested_output=output_len,
    )


def _ids(tokens: list[int]) -> list[Any]:
    """``output_ids`` [1, beam 1, L] and ``sequence_length`` [1, 1]."""
    return [
        tensor("output_ids", np.array(tokens, dtype=np.int32).reshape(1, 1, -1), np.int32),
        tensor("sequence_length", [[len(tokens)]], np.int32),
    ]


def outputs(
    parsed: Parsed, tokens: list[int], stats: GenerationResult | Progress, arrival_ns: int
) -> list[Any]:
    """The tensors of one response: its tokens and the statistics asked for, as they stand
    (TensorRT-LLM attaches the request's perf metrics to every result)."""
    tensors = _ids(tokens)
    if parsed.perf:
        for name, value in (
            ("kv_cache_alloc_new_blocks", stats.new_blocks),
            ("kv_cache_reused_blocks", stats.reused_blocks),
            ("kv_cache_alloc_total_blocks", stats.total_blocks),
        ):
            tensors.append(tensor(name, [[value]], np.int32))
        for name, value in (
            ("arrival_time_ns", arrival_ns),
            ("first_scheduled_time_ns", stats.first_scheduled_time_ns),
            ("first_token_time_ns", stats.first_token_time_ns),
            ("last_token_time_ns", stats.last_token_time_ns),
        ):
            tensors.append(tensor(name, [[value]], np.int64))
    if parsed.num_input:
        tensors.append(tensor("num_input_tokens", [[len(parsed.ids)]], np.int32))
    if parsed.num_output:
        # fillTritonResponse: outputTokensSize += outputIds[beam].size(), this response only
        tensors.append(tensor("num_output_tokens", [[len(tokens)]], np.int32))
    if parsed.log_probs:
        # llmRequest.cpp createResult: logProbs (every generated token so far) and cumLogProbs
        lps = np.array(stats.log_probs, dtype=np.float32).reshape(1, 1, -1)
        tensors.append(tensor("output_log_probs", lps, np.float32))
        tensors.append(
            tensor("cum_log_probs", [[np.float32(lps.sum(dtype=np.float64))]], np.float32)
        )
    return tensors


def _end(job: Job, response: Any) -> None:
    """Send a failed job's final response. If even that cannot be sent (its client is gone, its
    sender closed), say so in the log and go on: the worker serves every later request."""
    try:
        job.sender.send(response, flags=FINAL)
    except Exception as exc:  # noqa: BLE001
        pb_utils.Logger.log_warn(f"request {job.request_id!r}: final response not sent: {exc!r}")


def perturbed(model_dir: Path, weights: dict[str, Any]) -> dict[str, Any]:
    """Test-only switch: with a file named ``PERTURB_FILE`` in this model's directory at load,
    every weight tensor is rolled by one along its first axis, so the engine computes other
    numbers while its engine digest (server, configs, engine files) stays the same: a replica
    that cannot reproduce a history recorded on its twins (tests/test_eval_failover.py)."""
    if not (model_dir / PERTURB_FILE).exists():
        return weights
    return {name: np.roll(tensor, 1, axis=0) for name, tensor in weights.items()}


class TritonPythonModel:
    """Triton's entry point: admit or refuse each request, serve them in order on one thread."""

    def initialize(self, args: dict[str, str]) -> None:
        params = parameters(args)
        engine_path = Path(params["gpt_model_path"])
        self.build, weights = load_engine(engine_path)
        weights = perturbed(Path(args["model_repository"]), weights)
        self.limits = limits_of(self.build, read_config(engine_path), params)
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
            partial_reuse=flag(params, "enable_partial_reuse", True),
            float_format=self.build.float_format,
            weight_bits=self.build.weight_bits,
            weight_seed=self.build.weight_seed,
            prefill_chunk=self.build.max_num_tokens,
        )
        self.engine = Engine(config, weights)
        # Every gauge stays at 0 until the first request (the executor has no iteration
        # statistics before it), max and tokens_per included.
        self.metrics = Metrics(args["model_name"], args["model_version"])
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.lock = threading.Lock()
        self.live: dict[str, list[Job]] = {}  # request id -> admitted, unfinished jobs
        self.running: Job | None = None
        self.executor_ids = 0  # the executor's request ids, as in its error messages
        self.stats_period_s = int(params.get("stats_check_period_ms") or 100) / 1000
        self.published = time.monotonic()
        self.context_tokens = 0
        self.worker = threading.Thread(target=self._serve, name="sim-engine", daemon=True)
        self.worker.start()

    def execute(self, requests: list[Any]) -> None:
        now = time.time_ns()
        admitted = [self._admit(request, now) for request in requests]
        if any(admitted):
            self._publish()
        return None

    def finalize(self) -> None:
        with self.lock:
            for jobs in self.live.values():
                for job in jobs:
                    job.stopped.set()
        self.jobs.put(None)
        self.worker.join(timeout=30)
        self.metrics.zero()  # the families outlive this instance (see Metrics.zero)

    def _admit(self, request: Any, arrival_ns: int) -> bool:
        """Queue a request for the engine (True), or answer it here: a stop request, inputs
        the backend refuses, a prompt the executor refuses."""
        sender = request.get_response_sender()
        request_id = str(request.request_id() or "")
        try:
            if scalar(request, "stop", False):
                self._stop(request_id)
                sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)
                return False
            parsed = parse(request)
        except (InputError, EngineError, ValueError) as exc:
            sender.send(error_response(str(exc)), flags=FINAL)
            return False
        self.executor_ids += 1
        refusal = prompt_too_long(len(parsed.ids), self.limits)
        if refusal is not None:
            message = (
                f"Executor failed process requestId {self.executor_ids} due to the following"
                f" error: {refusal}"
            )
            sender.send(error_response(message), flags=FINAL)
            self.metrics.counted(success=False)
            return False
        allowed = clamped_output_len(len(parsed.ids), parsed.params.max_tokens, self.limits)
        if allowed < parsed.params.max_tokens:
            pb_utils.Logger.log_warn(
                f"Prompt length + number of requested output tokens ({len(parsed.ids)} +"
                f" {parsed.params.max_tokens}) exceeds maximum sequence length"
                f" ({self.limits.max_seq_len}). Number of requested output tokens is changed"
                f" to ({allowed})."
            )
            parsed = replace(parsed, params=replace(parsed.params, max_tokens=allowed))
        job = Job(request, sender, parsed, arrival_ns, request_id, self.executor_ids)
        with self.lock:
            self.live.setdefault(request_id, []).append(job)
        self.jobs.put(job)
        return True

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
                self.metrics.counted(success=False)
            finally:
                with self.lock:
                    jobs = self.live.get(job.request_id, [])
                    if job in jobs:
                        jobs.remove(job)
                    if not jobs:
                        self.live.pop(job.request_id, None)
                self.running = None
                self._publish()  # the last flush (or the next request's first statistics)

    def _run(self, job: Job) -> None:
        parsed, sender = job.parsed, job.sender
        sent = 0

        def on_token(token: int, _piece: str) -> None:
            # One response per token, the request's statistics as they stand attached to it.
            nonlocal sent
            progress = self.engine.progress()
            assert progress is not None  # called from inside the running request
            tensors = outputs(parsed, [token], progress, job.arrival_ns)
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors))
            sent += 1

        try:
            result = self.engine.generate(
                parsed.ids,
                parsed.params,
                on_token=on_token if parsed.streaming else None,
                is_cancelled=lambda: self._between_iterations(job),
                arrival_time_ns=job.arrival_ns,
            )
        except EngineError as exc:
            message = (
                f"Executor failed process requestId {job.executor_id} due to the following"
                f" error: {exc}"
            )
            sender.send(error_response(message), flags=FINAL)
            self.metrics.counted(success=False)
            return
        self.metrics.finished(result.prompt_tokens, len(result.output_tokens))
        # The engine's gauges move before the client hears the end, as TensorRT-LLM's do (its
        # statistics are taken at the iteration that finishes the request).
        self.running = None
        self._publish()
        if parsed.streaming:
            tokens = result.output_tokens[sent:]  # the last token(s), with the final flag
        elif parsed.exclude_input:
            tokens = result.output_tokens
        else:
            tokens = parsed.ids + result.output_tokens
        tensors = outputs(parsed, tokens, result, job.arrival_ns)
        sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL)
        self.metrics.counted(success=True)
