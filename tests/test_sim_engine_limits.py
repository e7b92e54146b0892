"""The prompt limit as TensorRT-LLM's runtime computes it, on the stand-in and as a pure function.

trtGptModel.h: chunked context -> max_seq_len - 1; else context FMHA + packed input ->
min(max_seq_len - 1, max_num_tokens); else the built max_input_len. llmRequest.cpp
(``LlmRequest::validate``): a prompt over the limit is an error response; prompt + output over
max_seq_len is not refused, the output is clamped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from tritonclient.utils import InferenceServerException

from backends.engine_limits import clamped_output_len, engine_limits, prompt_too_long
from backends.sim.launcher import Replica, ReplicaSpec, launch
from backends.sim.repository import ModelSettings
from tests.triton_helpers import engine_generate, grpc_generate, http_generate, metric, metrics

BACKEND = "kvledger_sim_backend_requests"


def _config(**build: Any) -> dict[str, Any]:
    plugins = build.pop("plugin_config", {})
    return {
        "build_config": {
            "max_input_len": 1024,
            "max_seq_len": 4096,
            "max_num_tokens": 2048,
            "plugin_config": plugins,
            **build,
        }
    }


def test_the_limit_follows_the_runtime_not_the_built_max_input_len() -> None:
    chunked = engine_limits(_config(), {"enable_chunked_context": "true"})
    assert chunked is not None and chunked.max_input_len == 4095
    # Context FMHA and packed input are on unless the engine says otherwise.
    fmha = engine_limits(_config(), {})
    assert fmha is not None and fmha.max_input_len == 2048
    short = engine_limits(_config(max_seq_len=1500), {"enable_chunked_context": "false"})
    assert short is not None and short.max_input_len == 1499
    padded = engine_limits(_config(plugin_config={"remove_input_padding": False}), {})
    assert padded is not None and padded.max_input_len == 1024
    no_fmha = engine_limits(_config(plugin_config={"context_fmha": False}), {})
    assert no_fmha is not None and no_fmha.max_input_len == 1024
    assert engine_limits({"build_config": {"max_input_len": 8}}, {}) is None


def test_refusal_and_clamp() -> None:
    limits = engine_limits(_config(), {"enable_chunked_context": "true"})
    assert limits is not None
    assert prompt_too_long(4095, limits) is None
    message = prompt_too_long(4096, limits)
    assert (
        message is not None
        and "Prompt length (4096) exceeds maximum input length (4095)" in message
    )
    assert clamped_output_len(4000, 500, limits) == 96
    assert clamped_output_len(10, 500, limits) == 500


@pytest.fixture(scope="module")
def limited() -> Iterator[dict[str, Replica]]:
    """``chunked``: chunked context, max_seq_len 160 (limit 159, not the built 64);
    ``packed``: no chunked context, max_seq_len 1024, max_num_tokens 512 (limit 512)."""
    specs = [
        ReplicaSpec("chunked", ModelSettings(max_input_len=64, max_seq_len=160)),
        ReplicaSpec(
            "packed", ModelSettings(max_input_len=64, max_seq_len=1024, chunked_context=False)
        ),
    ]
    with launch(specs) as running:
        yield {r.id: r for r in running}


def test_the_stand_in_refuses_over_its_runtime_limit_with_the_executors_error(
    limited: dict[str, Replica],
) -> None:
    """One token over the runtime limit: Triton INTERNAL with the executor's message, counted
    as a failed request; at the limit, and over the built max_input_len, served."""
    for replica, limit in ((limited["chunked"], 159), (limited["packed"], 512)):
        before = metrics(replica)
        with pytest.raises(InferenceServerException) as refused:
            engine_generate(replica, "y" * (limit + 1), max_tokens=1)
        text = str(refused.value)
        assert "Executor failed process requestId" in text
        assert f"Prompt length ({limit + 1}) exceeds maximum input length ({limit})" in text
        after = metrics(replica)
        failed = metric(after, BACKEND, outcome="failure")
        assert failed == metric(before, BACKEND, outcome="failure") + 1
        assert engine_generate(replica, "y" * limit, max_tokens=1).stats["num_input_tokens"] == (
            limit
        )
    # Over HTTP, Triton 2.51's generate endpoint answers this INTERNAL error with a 400
    # (docs/stand-in.md): a client must classify it by its message, whatever the status.
    status, body = http_generate(limited["chunked"], {"text_input": "z" * 160, "max_tokens": 1})
    assert status == 400 and "exceeds maximum input length (159)" in body["error"]


def test_prompt_plus_output_over_max_seq_len_is_clamped_not_refused(
    limited: dict[str, Replica],
) -> None:
    """150 prompt tokens + 40 requested in a 160-token sequence: 10 tokens come back."""
    got = engine_generate(limited["chunked"], "q" * 150, max_tokens=40)
    assert got.stats["num_output_tokens"] == 10 and len(got.ids) == 10
    through_ensemble = grpc_generate(limited["chunked"], "q" * 150, max_tokens=40)
    assert len(through_ensemble.text) == 10
