"""How the Triton backend reads a stream's responses (pure logic, over tritonclient's own types):
the statistics count wherever they arrive, whatever the final response carries."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import InferResult, service_pb2
from tritonclient.utils import serialize_byte_tensor

from backends.base import Chunk, EngineStats, GenerationRequest
from backends.triton import TritonBackend, TritonTarget, parse_stats, text_of

STATS = {"kv_cache_reused_blocks": 7, "kv_cache_alloc_total_blocks": 9, "num_output_tokens": 2}


def response(final: bool, text: str | None = None, **ints: int) -> InferResult:
    """One ModelInferResponse as Triton's gRPC frontend sends it."""
    message = service_pb2.ModelInferResponse(model_name="ensemble", id="r")
    if text is not None:
        message.outputs.add(name="text_output", datatype="BYTES", shape=[1, 1])
        value = np.array([[text.encode()]], dtype=np.object_)
        message.raw_output_contents.append(serialize_byte_tensor(value).item())
    for name, number in ints.items():
        message.outputs.add(name=name, datatype="INT32", shape=[1, 1])
        message.raw_output_contents.append(np.array([[number]], dtype=np.int32).tobytes())
    message.parameters["triton_final_response"].bool_param = final
    return InferResult(message)


class Replay:
    """A stream channel that answers with given responses (no Triton needed for this logic)."""

    def __init__(self, responses: list[InferResult]) -> None:
        self.responses = responses
        self.cancelled = False

    def open(self, request: Any, done: asyncio.Event) -> Any:
        replay = self

        class Call:
            def __aiter__(self) -> AsyncIterator[InferResult]:
                return self.gen()

            async def gen(self) -> AsyncIterator[InferResult]:
                for item in replay.responses:
                    yield item

            def cancel(self) -> None:
                replay.cancelled = True

        return Call()

    async def close(self) -> None:
        return None


async def chunks(responses: list[InferResult]) -> tuple[list[Chunk], Replay]:
    backend = TritonBackend(TritonTarget("t", "127.0.0.1:1", "http://127.0.0.1:1"), None)  # type: ignore[arg-type]
    replay = Replay(responses)
    backend._streams = replay  # type: ignore[assignment]
    seen = [c async for c in backend.stream(GenerationRequest("r", "prompt", stream=True))]
    await backend.close()
    return seen, replay


@pytest.mark.parametrize(
    "responses",
    [
        # A decoupled ensemble whose final flag came on its own: a flags-only final response.
        [response(False, "a"), response(False, "b"), response(False, "", **STATS), response(True)],
        # One whose final flag came with the last step's outputs.
        [response(False, "a"), response(True, "b", **STATS)],
        # Statistics early, more text after them (num_output_tokens per response: summed).
        [
            response(False, "a", **{**STATS, "num_output_tokens": 1}),
            response(False, "b", num_output_tokens=1),
            response(True),
        ],
    ],
    ids=["flags-only-final", "final-with-outputs", "stats-early"],
)
async def test_statistics_from_whichever_response_carries_them(
    responses: list[InferResult],
) -> None:
    """The text is every response's text; the final chunk carries the latest statistics."""
    seen, replay = await chunks(responses)
    assert "".join(c.text for c in seen) == "ab"
    assert [c.final for c in seen][-1] is True and sum(c.final for c in seen) == 1
    assert seen[-1].stats == EngineStats(reused_blocks=7, total_blocks=9, output_tokens=2)
    assert not replay.cancelled  # a finished stream is never cancelled


def test_parse_stats_reads_json_bodies_too() -> None:
    """The same parsing works on a dict of plain values (an HTTP generate body)."""
    body = {"text_output": "hi", "kv_cache_reused_blocks": 3, "num_input_tokens": [12]}
    assert parse_stats(body) == EngineStats(reused_blocks=3, input_tokens=12)
    assert parse_stats({"text_output": "x"}) is None
    assert text_of(body) == "hi" and text_of({}) == ""


def test_a_metrics_page_without_the_used_blocks_gauge_proves_no_cache_empty() -> None:
    """A replica whose page lacks TensorRT-LLM's block gauge (another engine, a wrong metrics
    URL) has an unknown number of blocks in use, so a zero request counter alone never makes
    its first state genesis nor a reset verified; with the gauge at 0 it does."""
    from backends.base import ReplicaCounters
    from backends.triton_control import found_sample, parse_metrics

    family, used = "nv_trt_llm_kv_cache_block_metrics", 'kv_cache_block_type="used"'
    bare = parse_metrics('nv_inference_count{model="ensemble",version="1"} 0\n')
    gauge = parse_metrics(
        f'{family}{{kv_cache_block_type="used",model="tensorrt_llm",version="1"}} 0\n'
        f'{family}{{kv_cache_block_type="free",model="tensorrt_llm",version="1"}} 64\n'
    )
    assert found_sample(bare, family, used) is None
    assert found_sample(gauge, family, used) == 0
    unknown = ReplicaCounters(ready=True, request_count=0, used_blocks=None)
    assert not unknown.proven_empty
    assert ReplicaCounters(ready=True, request_count=0, used_blocks=0.0).proven_empty
    assert not ReplicaCounters(ready=True, request_count=1, used_blocks=0.0).proven_empty
    assert not ReplicaCounters(ready=True, request_count=0, used_blocks=3.0).proven_empty
