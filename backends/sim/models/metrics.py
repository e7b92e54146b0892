"""TensorRT-LLM's custom metric families, as its Triton backend publishes them.

Family names, descriptions, the category label of each family and its values follow the C++
backend's ``custom_metrics_reporter``; every sample also carries ``model`` and ``version``.
The stand-in fills what it knows (requests, KV-cache blocks, iterations, token counts) and
publishes the rest (runtime memory, disaggregated serving, micro-batch ids) at zero.

Every gauge reads 0 from a load until the first request's statistics (``max`` and
``tokens_per`` included): the C++ backend publishes only what the executor's iteration
statistics say (``model_instance_state.cc``, ``WaitForStats``), and there are none before the
first iteration.

``kvledger_sim_backend_requests{outcome="success"|"failure"}`` is the stand-in's own gauge
(no TensorRT-LLM family; a gauge so that it restarts at 0 with each load, as Triton's statistics
do): the count the C++ backend reports to Triton's statistics
(``reportBaseMetrics``: once per request, at its final response; stop requests and inputs refused
before the executor not at all). The Python backend running the stand-in counts differently in
Triton's statistics (every ``execute``), so a reader wanting the C++ count on the stand-in reads
this counter.
"""

from __future__ import annotations

import time
from typing import Any

import triton_python_backend_utils as pb_utils

from backends.sim.engine import Engine

MAX_IN_FLIGHT = 256
REQUESTS_FAMILY = "kvledger_sim_backend_requests"
_TOKEN_BUCKETS = [10.0, 50.0, 100.0, 500.0, 1000.0]
# (family, description, category label, values, kind)
_GAUGES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "nv_trt_llm_request_metrics",
        "TRT LLM request metrics",
        "request_type",
        ("active", "max", "scheduled", "context", "waiting"),
    ),
    (
        "nv_trt_llm_runtime_memory_metrics",
        "TRT LLM runtime memory metrics",
        "memory_type",
        ("cpu", "gpu", "pinned"),
    ),
    (
        "nv_trt_llm_kv_cache_block_metrics",
        "TRT LLM KV cache block metrics",
        "kv_cache_block_type",
        ("max", "free", "used", "tokens_per", "reused", "fraction"),
    ),
    (
        "nv_trt_llm_inflight_batcher_metrics",
        "TRT LLM inflight_batcher-specific metrics",
        "inflight_batcher_specific_metric",
        ("total_context_tokens", "generation_requests", "micro_batch_id", "paused_requests"),
    ),
    (
        "nv_trt_llm_general_metrics",
        "General TRT LLM metrics",
        "general_type",
        ("timestamp", "iteration_counter"),
    ),
)


class Metrics:
    """The families for one loaded model; ``update`` after every change of the engine."""

    def __init__(self, model: str, version: str) -> None:
        labels = {"model": model, "version": version}
        self._families: list[Any] = []  # a family must outlive its metrics
        self.g: dict[str, dict[str, Any]] = {}
        for name, description, category, values in _GAUGES:
            family = pb_utils.MetricFamily(
                name=name, description=description, kind=pb_utils.MetricFamily.GAUGE
            )
            self._families.append(family)
            self.g[name] = {v: family.Metric(labels={**labels, category: v}) for v in values}
        serving = pb_utils.MetricFamily(
            name="nv_trt_llm_disaggregated_serving_metrics",
            description="TRT LLM disaggregated serving metrics",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        self._families.append(serving)
        self._serving = [
            serving.Metric(labels={**labels, "disaggregated_serving_type": v})
            for v in ("kv_cache_transfer_ms", "request_count")
        ]
        self.tokens = {
            kind: self._histogram(name, kind, labels)
            for name, kind in (
                ("nv_llm_output_token_len", "total_output_tokens"),
                ("nv_llm_input_token_len", "total_input_tokens"),
            )
        }
        requests = pb_utils.MetricFamily(
            name=REQUESTS_FAMILY,
            description="Requests as TensorRT-LLM's C++ backend counts them in Triton's"
            " statistics: once, at the final response; stop requests not counted",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self._families.append(requests)
        self._requests = {
            outcome: requests.Metric(labels={**labels, "outcome": outcome})
            for outcome in ("success", "failure")
        }
        self.zero()

    def zero(self) -> None:
        """Every gauge to 0: a family of the same name and labels outlives a reload in
        Triton's registry, so a new instance must clear what the old one published."""
        for gauges in self.g.values():
            for gauge in gauges.values():
                gauge.set(0)
        for gauge in self._requests.values():
            gauge.set(0)

    def _histogram(self, name: str, kind: str, labels: dict[str, str]) -> Any:
        family = pb_utils.MetricFamily(
            name=name, description="TRT LLM response metrics", kind=pb_utils.MetricFamily.HISTOGRAM
        )
        self._families.append(family)
        return family.Metric(
            labels={**labels, "response_metric_type": kind}, buckets=_TOKEN_BUCKETS
        )

    def update(self, engine: Engine, waiting: int, running: int, context_tokens: int = 0) -> None:
        s = engine.stats()
        kv = self.g["nv_trt_llm_kv_cache_block_metrics"]
        for name, value in (
            ("max", s.max_blocks),
            ("free", s.free_blocks),
            ("used", s.used_blocks),
            ("tokens_per", s.tokens_per_block),
            ("reused", s.reused_blocks_total),
            ("fraction", s.used_blocks / s.max_blocks if s.max_blocks else 0.0),
        ):
            kv[name].set(value)
        req = self.g["nv_trt_llm_request_metrics"]
        req["max"].set(MAX_IN_FLIGHT)
        req["active"].set(waiting + running)
        req["scheduled"].set(running)
        req["context"].set(running if context_tokens else 0)
        req["waiting"].set(waiting)
        batcher = self.g["nv_trt_llm_inflight_batcher_metrics"]
        batcher["total_context_tokens"].set(context_tokens)
        batcher["generation_requests"].set(running if not context_tokens else 0)
        general = self.g["nv_trt_llm_general_metrics"]
        general["iteration_counter"].set(s.iterations)
        general["timestamp"].set(time.time_ns() // 1000)

    def counted(self, success: bool) -> None:
        """A request's final response went out (``reportBaseMetrics``)."""
        self._requests["success" if success else "failure"].increment(1.0)

    def finished(self, input_tokens: int, output_tokens: int) -> None:
        self.tokens["total_input_tokens"].observe(input_tokens)
        self.tokens["total_output_tokens"].observe(output_tokens)
