"""The pure parts behind hostile-input handling: chat parsing, the prompt-length rule, the
stream deadline (and the engine's progress it credits) and stall bookkeeping, the bounded key
cache."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncGenerator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backends.base import Chunk, ReplicaCounters
from router.errors import BadRequest, GatewayTimeout, PromptTooLong
from router.fleet import ReplicaState
from router.http.chat_request import render_chat
from router.http.context import new_request_id
from router.http.parse import check_prompt_length
from router.ledger.keys import KeyStore, Profile, key_hash
from router.ledger.schema import KEYS_HASH
from router.settings import ChatTemplate, ModelChat, ReplicaSettings
from tests.servers import RedisServer

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(messages=_json)
def test_any_json_as_chat_messages_is_text_or_a_400(messages: Any) -> None:
    """Whatever JSON arrives as 'messages', rendering gives text or a 400 on 'messages'."""
    try:
        assert isinstance(render_chat(messages, ModelChat(None, ChatTemplate(), None)), str)
    except BadRequest as error:
        assert error.param == "messages"


def replica(max_input_len: int, max_token_bytes: int) -> ReplicaSettings:
    return ReplicaSettings(
        "r", "g", "m", max_input_len=max_input_len, max_token_bytes=max_token_bytes
    )


@pytest.mark.parametrize(
    ("prompt", "limits", "refused"),
    [
        ("a" * 100, [(100, 1)], False),
        ("a" * 101, [(100, 1)], True),
        ("é" * 50, [(100, 1)], False),  # 100 bytes
        ("é" * 51, [(100, 1)], True),  # 102 bytes
        ("a" * 399, [(100, 4)], False),
        ("a" * 401, [(100, 4)], True),
        ("a" * 10_000, [(100, 1), (100, 0)], False),  # one replica's limit unknown: it decides
        ("a" * 10_000, [(0, 1)], False),
        ("a" * 150, [(100, 1), (200, 1)], False),  # fits the widest replica of the model
        ("a" * 10_000, [], False),
    ],
)
def test_prompt_is_refused_only_when_certainly_too_long(
    prompt: str, limits: list[tuple[int, int]], refused: bool
) -> None:
    """More UTF-8 bytes than max_input_len * max_token_bytes on every replica: refused."""
    if refused:
        with pytest.raises(PromptTooLong) as caught:
            check_prompt_length("m", prompt, limits, "prompt")
        assert caught.value.param == "prompt" and caught.value.code == "context_length_exceeded"
    else:
        check_prompt_length("m", prompt, limits, "prompt")


class _Backend:
    replica_id = "r"


def state(timeout_s: float = 0.05) -> ReplicaState:
    return ReplicaState(replica(0, 0), _Backend(), healthy=True, timeout_s=timeout_s)


async def _silent(closed: list[bool]) -> AsyncGenerator[Chunk, None]:
    try:
        yield Chunk("first")
        await asyncio.Event().wait()  # never another chunk
        yield Chunk("never")
    finally:
        closed.append(True)


async def test_stream_without_progress_ends_in_504_and_is_closed() -> None:
    """No chunk within the deadline: GatewayTimeout, and the backend stream is closed."""
    closed: list[bool] = []
    watched = state().watch(_silent(closed))
    assert (await anext(watched)).text == "first"
    with pytest.raises(GatewayTimeout):
        await anext(watched)
    assert closed == [True]


async def test_closing_a_watched_stream_closes_the_backend_stream() -> None:
    """A client gone: closing the watched stream closes (cancels) the backend's stream."""
    closed: list[bool] = []
    watched = state(timeout_s=30).watch(_silent(closed))
    await anext(watched)
    await watched.aclose()
    assert closed == [True]


async def test_a_cancel_from_elsewhere_is_not_a_timeout() -> None:
    """A client gone while waiting for a chunk cancels the request; it is not a 504."""
    closed: list[bool] = []
    replica = state(timeout_s=30)
    watched = replica.watch(_silent(closed))
    await anext(watched)
    waiting = asyncio.ensure_future(anext(watched))
    await asyncio.sleep(0)  # let it start waiting
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert closed == [True] and replica.timeouts == 0


async def _answer_after(delay_s: float) -> AsyncGenerator[Chunk, None]:
    await asyncio.sleep(delay_s)  # a prefill, or a whole non-streamed answer: nothing before
    yield Chunk("answer", True)


async def _engine_progress(replica: ReplicaState, every_s: float) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(every_s)
        replica.progressed_at = loop.time()  # as the monitor sets it


async def test_the_engines_progress_keeps_a_first_chunk_waiting() -> None:
    """A first chunk that takes four deadlines arrives while the engine is seen progressing;
    the same wait without that progress ends in a 504 after one deadline."""
    replica = state(timeout_s=0.1)
    progress = asyncio.ensure_future(_engine_progress(replica, 0.03))
    try:
        assert (await anext(replica.watch(_answer_after(0.4)))).text == "answer"
    finally:
        progress.cancel()
    assert replica.timeouts == 0
    started = asyncio.get_running_loop().time()
    with pytest.raises(GatewayTimeout):
        await anext(state(timeout_s=0.1).watch(_answer_after(0.4)))
    assert asyncio.get_running_loop().time() - started < 0.3


async def test_progress_seen_before_a_wait_or_after_the_first_chunk_does_not_count() -> None:
    """Engine progress seen before the wait began is no credit, and once a chunk came only
    chunks count: a stream stuck after its first token ends after one deadline."""
    replica = state(timeout_s=0.1)
    replica.progressed_at = asyncio.get_running_loop().time() - 0.05  # seen just before
    started = asyncio.get_running_loop().time()
    with pytest.raises(GatewayTimeout):
        await anext(replica.watch(_answer_after(0.4)))
    assert asyncio.get_running_loop().time() - started < 0.3
    watched = replica.watch(_silent([]))
    assert (await anext(watched)).text == "first"
    progress = asyncio.ensure_future(_engine_progress(replica, 0.03))
    try:
        async with asyncio.timeout(1.0):  # credited still, it would wait for ever
            with pytest.raises(GatewayTimeout):
                await anext(watched)
    finally:
        progress.cancel()


def test_the_engine_progresses_for_a_request_only_when_none_waits() -> None:
    """The monitor credits progress when the iteration counter rose and no request waits in
    the engine (each one it holds is running); a queue, or no new iteration, is no credit."""
    r = state()
    before = ReplicaCounters(ready=True, iteration_counter=10, active=1, scheduled=1)
    r.engine_seen(before, ReplicaCounters(ready=True, iteration_counter=10, active=1), 5.0)
    assert r.progressed_at == float("-inf")  # no new iteration
    queued = ReplicaCounters(ready=True, iteration_counter=20, active=2, scheduled=1)
    r.engine_seen(before, queued, 6.0)
    assert r.progressed_at == float("-inf")  # one request waits: maybe this one
    running = ReplicaCounters(ready=True, iteration_counter=20, active=1, scheduled=1)
    r.engine_seen(None, running, 7.0)
    assert r.progressed_at == float("-inf")  # nothing to compare with yet
    r.engine_seen(before, running, 8.0)
    assert r.progressed_at == 8.0


def test_timeouts_in_a_row_stall_until_idle_or_cooled_off() -> None:
    """Three timeouts in a row: unhealthy while busy; back when idle, or on probation later."""
    r = state(timeout_s=1.0)
    r.timed_out()
    r.timed_out()
    assert r.healthy and not r.stalled
    r.timed_out()
    assert not r.healthy and r.stalled and r.stalled_at is not None
    busy, idle = ReplicaCounters(ready=True, active=2), ReplicaCounters(ready=True, active=0)
    r.answered(busy, r.stalled_at + 1)
    assert not r.healthy
    r.answered(idle, r.stalled_at + 1)
    assert r.healthy and not r.stalled and r.timeouts == 0
    for _ in range(3):
        r.timed_out()
    assert r.stalled_at is not None
    r.answered(busy, r.stalled_at + 10)  # cooled off, still busy: on probation
    assert r.healthy and r.timeouts == 2
    r.timed_out()
    assert not r.healthy


async def test_key_cache_is_bounded_and_misses_expire(redis_server: RedisServer) -> None:
    """Known and unknown keys each stay within their cache size; a key created after a miss
    works once the miss entry expires; made-up keys never push out known ones."""
    from router.ledger.connect import connect

    client = connect(redis_server.url)
    try:
        store = KeyStore(client, miss_ttl_s=0.0, cache_size=4, miss_cache_size=8)
        raw = await store.create(Profile(name="real"))
        assert (await store.lookup(raw)) is not None
        for i in range(100):
            assert await store.lookup(f"made-up-{i}") is None
        assert store.cached <= 4 + 8
        await client.hdel(KEYS_HASH, key_hash(raw))  # Redis no longer answers for it...
        assert await store.lookup(raw) == Profile(name="real")  # ...the cached profile does
        late = "kvl-created-late"
        assert await store.lookup(late) is None
        await client.hset(KEYS_HASH, key_hash(late), Profile(name="late").to_json())
        assert await store.lookup(late) == Profile(name="late")
    finally:
        await client.aclose()


def test_key_hash_takes_undecodable_bytes() -> None:
    """A key holding an undecodable header byte hashes instead of raising."""
    assert len(key_hash("bad\udcff")) == 64


def test_a_monitor_whose_tick_swallowed_its_cancellation_still_stops() -> None:
    """Shutdown cancels the monitor; when a library inside a tick turns that cancellation into a
    result (Python 3.11's ``asyncio.wait_for`` does when both arrive together), the monitor
    still ends after the tick instead of ticking on, and the proxy exits on SIGTERM."""
    from router.fleet import Fleet
    from router.monitor import Monitor

    entered = asyncio.Event()
    swallowed: list[bool] = []

    async def swallowing_hook() -> None:
        entered.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if swallowed:
                raise
            swallowed.append(True)  # once, as the race does: the cancellation becomes a return

    async def scenario() -> bool:
        monitor = Monitor(Fleet({}), None, 0.01, hook=swallowing_hook)  # type: ignore[arg-type]
        task = asyncio.create_task(monitor.run())
        await entered.wait()
        task.cancel()
        async with asyncio.timeout(5):  # without the guard it ticks on and this times out
            await asyncio.gather(task, return_exceptions=True)
        return task.cancelled()

    assert asyncio.run(scenario())


def test_request_ids_are_unique_within_and_across_proxy_processes() -> None:
    """Two proxies sharing Redis must never mint the same request id (a second request would
    look like a retry of the first to its chain step, and leave no record of its own)."""
    ids = [new_request_id() for _ in range(50_000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 24 and set(i) <= set("0123456789abcdef") for i in ids[:1000])
    mint = "from router.http.context import new_request_id; print(new_request_id())"
    others = {
        subprocess.run(
            [sys.executable, "-c", mint], capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(3)
    }
    assert len(others) == 3 and not others & set(ids)
