"""Where one Triton replica listens and which TensorRT-LLM input names its version uses.

Its own module so that the generation client (:mod:`backends.triton`) and the management side
(:mod:`backends.triton_control`) both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    engine_model: str = "tensorrt_llm"  # the model every path to the KV cache goes through
    engine_dir: str = ""  # its engine directory as this process reads it ("" = gpt_model_path)
