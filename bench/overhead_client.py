"""The benchmark's client: one aiohttp session, every response checked, failures counted apart.

A phase sends ``n`` identical requests to one target at a given concurrency and keeps, per
successful request, its latency (non-streamed) or its time to the first streamed event. A
response that fails its check (status, body shape, the kvledger record) is a failure with its
reason, never a latency.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench.overhead_model import MODEL
from bench.overhead_targets import Target, cpu_seconds

PROMPT = "The benchmark prompt, the same every time: only the proxies are timed."
# What kvledger asks of the replica for every request; a direct client asks the same.
_ENGINE_FLAGS = {
    "exclude_input_in_output": True,
    "return_perf_metrics": True,
    "return_num_input_tokens": True,
    "return_num_output_tokens": True,
}


@dataclass
class Phase:
    """One measured window on one target."""

    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    cpu_s: float = 0.0

    def p(self, q: float) -> float:
        """Latency quantile in ms (nearest rank)."""
        ordered = sorted(self.latencies)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def rps(self) -> float:
        return len(self.latencies) / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def cpu_per_request_us(self) -> float:
        return self.cpu_s / len(self.latencies) * 1e6 if self.latencies else float("nan")


def request_for(target: Target, stream: bool, max_tokens: int) -> tuple[str, bytes]:
    """The URL and body of one request to ``target``."""
    if target.openai:
        payload: dict[str, object] = {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "stream": stream,
        }
        return target.base + target.path, orjson.dumps(payload)
    payload = {"text_input": PROMPT, "max_tokens": max_tokens}
    if not target.kvledger:
        payload |= {**_ENGINE_FLAGS, "stream": stream}
    return target.base + target.path + ("_stream" if stream else ""), orjson.dumps(payload)


def check_body(target: Target, data: bytes) -> str | None:
    """Why a non-streamed 200 body is wrong, or None."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return "body is not JSON"
    if target.kvledger:
        record = body.get("kvledger")
        if not isinstance(record, dict) or not record.get("request_id"):
            return "no kvledger record in the body"
        return None
    return None if "text_output" in body else "no text_output in the body"


def check_stream(target: Target, data: bytes) -> str | None:
    """Why a streamed 200 body is wrong, or None."""
    if b'"error"' in data:
        return "error event: " + data[-300:].decode(errors="replace")
    if target.kvledger and b'"kvledger"' not in data:
        return "no kvledger event at the end of the stream"
    if data.count(b"data: ") < 1:
        return "no event"
    return None


async def _one(
    session: aiohttp.ClientSession, target: Target, stream: bool, max_tokens: int, into: Phase
) -> None:
    url, body = request_for(target, stream, max_tokens)
    headers = {"Content-Type": "application/json", **target.headers}
    start = time.perf_counter()
    first = 0.0
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if not stream:
                data = await response.read()
                end = time.perf_counter()
            else:
                pieces = []
                async for chunk in response.content.iter_any():
                    if not first and b"data: " in chunk:
                        first = time.perf_counter()
                    pieces.append(chunk)
                data = b"".join(pieces)
            if response.status != 200:
                into.failures.append(f"{response.status}: {data[:200]!r}")
                return
    except (aiohttp.ClientError, TimeoutError) as exc:
        into.failures.append(f"{type(exc).__name__}: {exc}")
        return
    problem = check_stream(target, data) if stream else check_body(target, data)
    if problem is not None:
        into.failures.append(problem)
        return
    into.latencies.append((first if stream else end) - start)


async def run_phase(
    session: aiohttp.ClientSession,
    target: Target,
    *,
    n: int,
    concurrency: int,
    stream: bool,
    max_tokens: int,
) -> Phase:
    """``n`` requests at ``concurrency``; the target's CPU over exactly this window."""
    phase = Phase()
    remaining = [n]

    async def worker() -> None:
        while remaining[0] > 0:
            remaining[0] -= 1
            await _one(session, target, stream, max_tokens, phase)

    cpu_before = cpu_seconds(target.pids)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    phase.elapsed_s = time.perf_counter() - start
    phase.cpu_s = cpu_seconds(target.pids) - cpu_before
    return phase
