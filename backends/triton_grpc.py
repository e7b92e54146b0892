"""Triton's ``ModelStreamInfer`` over grpc.aio, with the request parameter the proxy needs.

tritonclient's asyncio client ignores ``enable_empty_final_response`` (only its threaded client
sets it) and refuses ``triton_``-prefixed request parameters. Without that parameter Triton sends
nothing for a flags-only final response, which is how a decoupled ensemble often ends (its final
flag comes with whichever step finishes last): the client then never learns that the request is
complete. So the proxy builds its ``ModelInferRequest`` itself, from tritonclient's generated
protobuf classes, and reads responses with tritonclient's ``InferResult``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import InferResult, KeepAliveOptions, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException, serialize_byte_tensor

Input = tuple[str, str, np.ndarray[Any, Any]]  # name, Triton datatype, value with batch dim
_MAX_MESSAGE = 2**31 - 1  # as tritonclient: a long prompt or output must not hit gRPC's 4 MiB
# gRPC's reconnect backoff (1 s, times 1.6 an attempt, up to 120 s) grows to many seconds while
# a replica's port refuses connections: a replica that was down for half a minute was back and
# ready while the channel still waited ~9 s before trying again, and every call meanwhile failed
# at once with UNAVAILABLE. Capped at 1 s; a channel that failed is also replaced by a fresh
# one (``StreamChannel.renew``, ``TritonControl``), which connects at its first call.
_BACKOFF = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def channel_options() -> list[tuple[str, Any]]:
    """The options of every channel to a replica: tritonclient's own (message sizes, keepalive)
    and a short reconnect backoff."""
    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", _MAX_MESSAGE),
        ("grpc.max_receive_message_length", _MAX_MESSAGE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        *_BACKOFF,
    ]


def tensor(name: str, value: Any, dtype: Any, triton_type: str) -> Input:
    """One input of one request: ``value`` (a scalar or a list) as a [1, n] tensor."""
    return name, triton_type, np.array([value], dtype=dtype).reshape(1, -1)


def infer_request(
    model: str, inputs: Sequence[Input], request_id: str
) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    for name, datatype, value in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=list(value.shape))
        if datatype == "BYTES":
            serialized = serialize_byte_tensor(value)
            request.raw_input_contents.append(serialized.item() if serialized.size else b"")
        else:
            request.raw_input_contents.append(value.tobytes())
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


class StreamCall:
    """One request's stream: iterate for its responses (an error response raises
    InferenceServerException); ``cancel()`` abandons it."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __aiter__(self) -> StreamCall:
        return self

    async def __anext__(self) -> InferResult:
        response = await self._call.__aiter__().__anext__()
        if response.error_message:
            raise InferenceServerException(msg=response.error_message)
        return InferResult(response.infer_response)

    def cancel(self) -> None:
        self._call.cancel()


class StreamChannel:
    """The gRPC channel that carries a replica's inference streams (HTTP/2, no set-up each)."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._closing: set[asyncio.Task[None]] = set()
        self._connect()

    def _connect(self) -> None:
        self._channel = grpc.aio.insecure_channel(self._url, options=channel_options())
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    def renew(self, grace_s: float) -> None:
        """Carry new streams on a fresh channel (one that waits out no backoff); the old one
        closes once its streams ended, or after ``grace_s``."""
        old = self._channel
        self._connect()
        task = asyncio.ensure_future(old.close(grace=grace_s))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def open(self, request: service_pb2.ModelInferRequest, done: asyncio.Event) -> StreamCall:
        """Send ``request`` and keep our side of the stream open until ``done`` is set: once a
        client has closed its side, Triton may end the stream before the final response."""

        async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
            yield request
            await done.wait()

        return StreamCall(self._stub.ModelStreamInfer(requests()))

    async def close(self) -> None:
        await self._channel.close()
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)
