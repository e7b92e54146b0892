"""The one protocol every engine client speaks, and the values that cross it.

Errors (translated from the engine client's own exceptions at this boundary)::

    BackendError                     anything that went wrong talking to a replica
     ├── BackendUnavailable          could not reach the replica or its model; nothing was streamed
     ├── BackendRejected             the replica refused the request as invalid (a client mistake)
     └── BackendFailed               the replica failed after the request was accepted

The values made once or more per request here, and in ``policies.base``, ``router.flight`` and
``router.ledger.records``, are slotted dataclasses that are not ``frozen``: a frozen one's
``__init__`` sets every field through ``object.__setattr__``, 2.9 us for ten fields against 0.28
us (timeit), some sixty fields a request. Nothing mutates them after they are made. On the
request path they are made with positional arguments (their field names in a comment):
keywords cost about 2k instructions a call on Python 3.11 (callgrind, ``ReplicaView``: 5.1k
against 2.9k).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol


class BackendError(Exception):
    """A replica could not serve a request."""

    def __init__(self, replica: str, message: str, *, written: bool = False) -> None:
        super().__init__(f"replica {replica}: {message}")
        self.replica = replica
        self.detail = message
        # The request reached the replica (its bytes were written) and no answer says what
        # became of it: the replica may have run it, so its cache state is unknown from here.
        # Such a request is never sent to that replica again.
        self.written = written


class BackendUnavailable(BackendError):
    """The replica or its model cannot be reached; no output was produced."""


class BackendRejected(BackendError):
    """The replica rejected the request's inputs."""


class BackendFailed(BackendError):
    """The replica failed while serving an accepted request."""


@dataclass(slots=True)
class GenerationRequest:
    """One generation, in engine terms (the fronts translate OpenAI and Triton shapes to it)."""

    request_id: str
    prompt: str
    max_tokens: int = 16
    stream: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    bad_words: tuple[str, ...] = ()
    # Inputs the served model declares that kvledger does not interpret, passed through as the
    # client sent them (the Triton fronts validate their types first): (name, Triton datatype
    # such as "BOOL" or "INT32", value: a scalar or a flat list).
    extra: tuple[tuple[str, str, Any], ...] = ()
    # Answer with each engine response's outputs (``Chunk.outputs``): the Triton fronts pass
    # Triton's protocol through, one event per engine response.
    raw: bool = False

    @classmethod
    def from_sampling(
        cls, request_id: str, prompt: str, params: dict[str, Any]
    ) -> GenerationRequest:
        """The request that ``sampling()`` described (snapshots store that form)."""
        return cls(
            request_id=request_id,
            prompt=prompt,
            max_tokens=int(params["max_tokens"]),
            temperature=params.get("temperature"),
            top_k=params.get("top_k"),
            top_p=params.get("top_p"),
            seed=params.get("seed"),
            stop=tuple(params.get("stop") or ()),
            bad_words=tuple(params.get("bad_words") or ()),
            extra=tuple((n, t, v) for n, (t, v) in (params.get("inputs") or {}).items()),
        )

    def sampling(self) -> dict[str, object]:
        """The parameters that decide the output, for digests and snapshots (passed-through
        inputs under ``inputs``, only when there are any: other digests stay as they were)."""
        sampling: dict[str, object] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": list(self.stop),
            "bad_words": list(self.bad_words),
        }
        if self.extra:
            sampling["inputs"] = {name: [kind, value] for name, kind, value in self.extra}
        return sampling


@dataclass(slots=True)
class EngineStats:
    """TensorRT-LLM's per-request statistics (``return_perf_metrics``)."""

    reused_blocks: int = 0
    new_blocks: int = 0
    total_blocks: int = 0
    arrival_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


@dataclass(slots=True)
class Chunk:
    """A piece of output; the last one (``final``) carries the statistics."""

    text: str
    final: bool = False
    stats: EngineStats | None = None
    outputs: dict[str, Any] | None = None  # one engine response's outputs (``raw`` requests)


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the engine's own files say the runtime admits (``backends.engine_limits``)."""

    prompt_limit: int | None = None  # the longest prompt the executor takes (trtGptModel.h)
    max_seq_len: int | None = None  # prompt + output past it: output clamped, not refused
    tokens_per_block: int | None = None  # plugin_config.tokens_per_block (not a gauge: 0 at load)
    rule: str = ""  # which of trtGptModel.h's cases set ``prompt_limit``
    # The served model's declared inputs, name -> Triton data type ("TYPE_BOOL", ...): what
    # the Triton fronts may pass through.
    model_inputs: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ReplicaCounters:
    """What the replica says about itself, for generation tracking and continuity checks."""

    ready: bool
    request_count: int = 0
    iteration_counter: float = 0.0
    reused_blocks: float = 0.0
    active: float = 0.0  # requests the engine holds now (queued or running), from any client
    scheduled: float = 0.0  # of those, the ones it is running now (the rest wait)
    # KV-cache blocks in use now (cached or held by a request); None when the metrics page has
    # no such gauge: then nothing proves the cache empty.
    used_blocks: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def waiting(self) -> float:
        """Requests the engine holds but does not run yet (queued behind the others)."""
        return max(0.0, self.active - self.scheduled)

    @property
    def proven_empty(self) -> bool:
        """No request since the model was loaded and none in the engine now: the request
        counter (Triton's, since the load) reads 0 and the engine holds no request.

        The block gauge is no proof: ``used`` counts allocated blocks, and released blocks kept
        for reuse count as free (``kvCacheManager.h``), so a warm idle replica reads ``used =
        0``; after a load every gauge reads 0 until the first request. It only *disproves*: a
        request counted nowhere yet (the C++ backend counts one at its final response) holds
        blocks. A page without TensorRT-LLM's gauge (another engine, a wrong metrics URL)
        proves nothing."""
        return (
            self.ready
            and self.request_count == 0
            and self.active == 0
            and self.used_blocks is not None
            and self.used_blocks == 0
        )


class Backend(Protocol):
    """An engine client for one replica: stream a generation, reset, health, metrics, close."""

    replica_id: str

    def stream(self, request: GenerationRequest) -> AsyncGenerator[Chunk, None]:
        """Yield the output as it is produced; cancelling the iteration cancels the request."""
        ...

    async def reset(self, timeout_s: float) -> None:
        """Empty the replica's KV cache (for TensorRT-LLM: unload and load the model), within
        ``timeout_s`` or BackendError saying which step did not finish."""
        ...

    async def load(self, timeout_s: float) -> None:
        """Load the model (blocks until it is ready or failed, at most ``timeout_s``)."""
        ...

    async def model_state(self) -> str:
        """The model's state: READY, LOADING, UNLOADING, UNAVAILABLE."""
        ...

    async def ready(self) -> bool:
        """Server live and model ready."""
        ...

    async def engine_digest(self) -> str:
        """A digest of what the replica computes with: server version, the configs of the model
        and of the models it is composed of, the engine files and whether blocks are reused."""
        ...

    async def max_input_len(self) -> int | None:
        """The longest prompt (in tokens) the engine admits, or None when it cannot be read."""
        ...

    async def engine_facts(self) -> EngineFacts:
        """The runtime's prompt limit, sequence limit and block size, from the engine's files
        and the engine model's parameters (unknown fields None)."""
        ...

    async def counters(self) -> ReplicaCounters:
        """Readiness, request counter and the engine's cache counters."""
        ...

    async def request_count(self) -> int:
        """Requests the engine has taken since it was loaded (restarts at 0 on a reload): every
        path to the KV cache counts here, whichever model a client called."""
        ...

    async def close(self) -> None: ...
