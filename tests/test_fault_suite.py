"""Faults, on replicas these tests start themselves: a replica made unresponsive (SIGSTOP), a
replica busy with someone else's endless request, a replica killed mid-stream, a proxy killed
with SIGKILL and restarted. No request hangs and no lineage record is lost or written twice."""

from __future__ import annotations

import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import redis
import tritonclient.grpc as grpcclient

from backends.sim.launcher import Replica, ReplicaSpec, config_snippet, launch
from backends.sim.repository import MODEL_NAME
from router.cli.local import ProxyProcess, create_key
from tests.hostile_http import Answer, bearer, post_json, request_bytes, send
from tests.ledger_view import LedgerView
from tests.servers import RedisServer
from tests.triton_helpers import engine_stop

BACKEND_TIMEOUT_S = 1.5
FAST_HEALTH = (
    "health_timeout_s = 1.0\n"
    f"\n[limits]\nbackend_timeout_s = {BACKEND_TIMEOUT_S}\nunhealthy_after_timeouts = 3\n"
)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[ProxyProcess, str, dict[str, Replica], LedgerView]]:
    """Two replicas of this module's own, round-robin behind a proxy with short deadlines."""
    redis_server = RedisServer()
    redis_server.start()
    with launch([ReplicaSpec("fa"), ReplicaSpec("fb")]) as running:
        proxy = ProxyProcess(
            config_snippet(running),
            redis_server.url,
            policy="round_robin",
            monitor_interval_s=0.5,
            extra=FAST_HEALTH,
        )
        proxy.start()
        try:
            key = create_key(redis_server.url, "faults")
            yield proxy, key, {r.id: r for r in running}, LedgerView(redis_server.url)
        finally:
            proxy.stop()
            redis_server.close()


def complete(proxy: ProxyProcess, key: str, max_tokens: int = 2) -> Answer:
    body = {"model": "ensemble", "prompt": uuid.uuid4().hex, "max_tokens": max_tokens}
    return post_json(proxy.port, "/v1/completions", body, bearer(key))


def healthy(proxy: ProxyProcess) -> dict[str, bool]:
    answer = send(proxy.port, "GET", "/readyz")
    return dict(answer.json()["replicas"])


def wait_health(proxy: ProxyProcess, replica: str, wanted: bool, limit_s: float = 60) -> float:
    """Seconds until /readyz says ``replica`` is ``wanted``; fails after ``limit_s`` (a safety
    net against a hang, not a measure)."""
    started = time.monotonic()
    while healthy(proxy)[replica] is not wanted:
        assert time.monotonic() - started < limit_s, f"{replica} never became {wanted}"
        time.sleep(0.1)
    return time.monotonic() - started


class Stream:
    """A streamed generate request read event by event from a raw socket."""

    def __init__(self, proxy: ProxyProcess, key: str, path: str, body: dict[str, Any]) -> None:
        data = request_bytes("POST", path, [bearer(key)], orjson.dumps(body))
        self.sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=120)
        self.sock.sendall(data)
        self.raw = b""
        self.frozen_at = 0.0  # when its replica was stopped, if it was
        while b"\r\n\r\n" not in self.raw:
            self.raw += self.sock.recv(1 << 16)
        head = self.raw.split(b"\r\n\r\n")[0].decode("latin-1").lower()
        self.status = int(head.split()[1])
        self.replica = next(
            (
                line.split(":", 1)[1].strip()
                for line in head.splitlines()
                if "x-kvl-replica" in line
            ),
            "",
        )
        self.request_id = next(
            (line.split(":", 1)[1].strip() for line in head.splitlines() if "x-request-id" in line),
            "",
        )

    def events(self) -> list[bytes]:
        return [line[6:] for line in self.raw.split(b"\n") if line.startswith(b"data: ")]

    def read_events(self, count: int) -> bool:
        """Read until ``count`` events arrived; False if the stream ended first."""
        while len(self.events()) < count:
            data = self.sock.recv(1 << 16)
            if not data or b"kvledger" in data:
                self.raw += data
                return False
            self.raw += data
        return True

    def unfinished(self, quiet_s: float = 0.5) -> bool:
        """With the replica frozen: True when what was in flight has arrived (nothing for
        ``quiet_s``) and the stream has not ended."""
        self.sock.settimeout(quiet_s)
        try:
            while data := self.sock.recv(1 << 16):
                self.raw += data
                if b"kvledger" in data:
                    return False
            return False
        except TimeoutError:
            return True
        finally:
            self.sock.settimeout(120)

    def read_to_end(self) -> list[bytes]:
        """Everything until the proxy closes the connection (``Connection: close``)."""
        while data := self.sock.recv(1 << 16):
            self.raw += data
        self.sock.close()
        return self.events()

    def close(self) -> None:
        self.sock.close()


def stream_on(
    proxy: ProxyProcess, key: str, replica: str, path: str, body: dict[str, Any]
) -> Stream:
    """A long stream that landed on ``replica`` and has sent a few events already."""
    for _ in range(20):
        stream = Stream(proxy, key, path, {**body, "max_tokens": 3000})
        if stream.replica == replica and stream.read_events(5):
            return stream
        stream.close()
    raise AssertionError(f"no long stream landed on {replica}")


GENERATE = ("/v2/models/ensemble/generate_stream", {"text_input": "long story"})


def frozen_mid_stream(
    proxy: ProxyProcess,
    key: str,
    replica: Replica,
    path: str,
    body: dict[str, Any],
    *,
    group: bool = True,
) -> Stream:
    """A stream on ``replica`` that has sent tokens, with the replica stopped (SIGSTOP: its
    server, and with ``group`` its model's stub too) before the model could end the stream by
    itself (its random weights do, now and then)."""
    assert replica.process is not None
    pid = replica.process.pid
    signal_it = os.killpg if group else os.kill
    for _ in range(5):
        stream = stream_on(proxy, key, replica.id, path, body)
        signal_it(pid, signal.SIGSTOP)
        stream.frozen_at = time.monotonic()
        if stream.unfinished():
            return stream
        stream.close()
        signal_it(pid, signal.SIGCONT)
    raise AssertionError(f"every stream on {replica.id} ended by itself")


def test_stopped_replica_is_routed_around_and_comes_back(
    pair: tuple[ProxyProcess, str, dict[str, Replica], LedgerView],
) -> None:
    """SIGSTOP a replica's server: its open stream ends with a 504 error event, /readyz calls it
    unhealthy and every request goes to the other one; after SIGCONT it serves again, and its
    cache generation did not move (a pause empties no cache)."""
    proxy, key, running, ledger = pair
    stopped = running["fa"]
    assert stopped.process is not None
    generation = ledger.head("fa")["generation"]
    stream = frozen_mid_stream(proxy, key, stopped, *GENERATE, group=False)
    try:
        last = orjson.loads(stream.read_to_end()[-1])
        assert last["error"]["code"] == "replica_timeout", last
        wait_health(proxy, "fa", False)
        print(
            f"\nfa unhealthy in /readyz {time.monotonic() - stream.frozen_at:.1f} s after SIGSTOP"
        )
        placed = [complete(proxy, key) for _ in range(6)]
        assert [a.status for a in placed] == [200] * 6
        assert {a.headers["x-kvl-replica"] for a in placed} == {"fb"}
    finally:
        os.kill(stopped.process.pid, signal.SIGCONT)
    wait_health(proxy, "fa", True)
    placed = [complete(proxy, key) for _ in range(4)]
    assert [a.status for a in placed] == [200] * 4
    assert "fa" in {a.headers["x-kvl-replica"] for a in placed}
    assert ledger.head("fa")["generation"] == generation


class Occupier:
    """Someone else's endless request straight to a replica's engine (the stand-in serves one
    request at a time, like a replica stuck on one huge prompt): its end token is banned, so
    it runs until cancelled."""

    def __init__(self, replica: Replica) -> None:
        self.tokens: queue.Queue[Any] = queue.Queue()
        self.client = grpcclient.InferenceServerClient(replica.grpc_url)
        self.client.start_stream(callback=lambda result, error: self.tokens.put(error or result))
        inputs = [
            self._input("text_input", b"occupy " + uuid.uuid4().hex.encode(), np.object_, "BYTES"),
            self._input("max_tokens", 30_000, np.int32, "INT32"),  # within max_seq_len
            self._input("stream", True, np.bool_, "BOOL"),
            self._input("end_id", 126, np.int32, "INT32"),  # '~' ends it, and '~' is banned
            self._input("bad_words", b"~", np.object_, "BYTES"),
        ]
        self.replica = replica
        self.request_id = "occupier-" + uuid.uuid4().hex
        self.client.async_stream_infer(MODEL_NAME, inputs, request_id=self.request_id)
        for _ in range(5):  # it is running: the engine is taken
            item = self.tokens.get(timeout=60)
            assert not isinstance(item, Exception), item

    @staticmethod
    def _input(name: str, value: Any, dtype: Any, kind: str) -> grpcclient.InferInput:
        array = np.array([[value]], dtype=dtype)
        tensor = grpcclient.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        return tensor

    def cancel(self) -> None:
        """Leave, as a TensorRT-LLM client must: an ensemble is cancelled only between its
        steps, so the engine model is also told to stop the request."""
        self.client.stop_stream(cancel_requests=True)
        self.client.close()
        engine_stop(self.replica, self.request_id)


def test_replica_whose_requests_time_out_is_stalled_until_idle(
    pair: tuple[ProxyProcess, str, dict[str, Replica], LedgerView],
) -> None:
    """A replica whose engine is taken: each request sent to it ends 504 after
    backend_timeout_s; after three in a row /readyz calls it unhealthy although its health API
    answers, requests go to the other replica, and it comes back once its engine is free."""
    proxy, key, running, _ = pair
    occupier = Occupier(running["fb"])
    try:
        timeouts = []
        while healthy(proxy)["fb"]:
            answer = complete(proxy, key)
            if answer.status != 200:
                timeouts.append(answer)
            assert len(timeouts) <= 3, "three timeouts in a row did not stall the replica"
        assert [a.status for a in timeouts] == [504] * 3
        assert {a.error()["code"] for a in timeouts} == {"replica_timeout"}
        placed = [complete(proxy, key) for _ in range(4)]
        assert [a.status for a in placed] == [200] * 4
        assert {a.headers["x-kvl-replica"] for a in placed} == {"fa"}
    finally:
        occupier.cancel()
    wait_health(proxy, "fb", True)
    placed = [complete(proxy, key) for _ in range(4)]
    assert "fb" in {a.headers["x-kvl-replica"] for a in placed}


def test_an_answer_longer_than_the_deadline_is_served_while_its_engine_progresses(
    pair: tuple[ProxyProcess, str, dict[str, Replica], LedgerView],
) -> None:
    """A non-streamed request whose cold prefill takes longer than backend_timeout_s sends
    nothing before its answer, but its engine is seen iterating with nothing waiting: it is
    answered, not cut off with a 504 (and no replica is stalled for it)."""
    proxy, key, _, _ = pair
    # Several thousand new tokens: prefill chunks of 512, each an iteration (a cold 2,048-token
    # prefill takes about a second on this kind of machine, and the cost grows with the prefix).
    body = {"model": "ensemble", "prompt": uuid.uuid4().hex + " x" * 2000, "max_tokens": 1}
    for _ in range(3):  # a machine fast enough answers within the deadline: try longer
        answer = post_json(proxy.port, "/v1/completions", body, bearer(key))
        assert answer.status == 200, answer.body[:300]
        if answer.json()["kvledger"]["latency_ms"] > 1.5 * BACKEND_TIMEOUT_S * 1000:
            break
        body["prompt"] = uuid.uuid4().hex + str(body["prompt"])[32:] * 2
    else:
        raise AssertionError("every prefill ended within the deadline: nothing was shown")
    assert all(healthy(proxy).values())


def test_replica_killed_mid_stream_ends_each_stream_with_an_error_event(
    redis_server: RedisServer,
) -> None:
    """A replica killed after tokens went out: the Triton stream's last event and the OpenAI
    stream's last event before [DONE] are errors, both streams end, both recorded as errors."""
    with launch([ReplicaSpec("ka"), ReplicaSpec("kb")]) as (ka, kb):
        proxies = [ProxyProcess(config_snippet([r]), redis_server.url) for r in (ka, kb)]
        try:
            for proxy in proxies:
                proxy.start()
            key = create_key(redis_server.url, "killed")
            chat = {
                "model": "ensemble",
                "stream": True,
                "messages": [{"role": "user", "content": "go"}],
            }
            streams = [
                frozen_mid_stream(proxies[0], key, ka, *GENERATE),
                frozen_mid_stream(proxies[1], key, kb, "/v1/chat/completions", chat),
            ]
            for replica in (ka, kb):
                assert replica.process is not None
                os.killpg(replica.process.pid, signal.SIGKILL)  # the server and its stub
            triton_events, openai_events = (s.read_to_end() for s in streams)
        finally:
            for proxy in proxies:
                proxy.stop()
    assert orjson.loads(triton_events[-1])["error"]["type"] == "upstream_error"
    assert openai_events[-1] == b"[DONE]"
    assert orjson.loads(openai_events[-2])["error"]["type"] == "upstream_error"
    # Records are written behind the response: each shows up shortly after its stream ended.
    ledger = LedgerView(redis_server.url)
    deadline = time.monotonic() + 30  # a safety net against a hang, not a measure
    while (records := [ledger.record(s.request_id) for s in streams]).count(None):
        assert time.monotonic() < deadline, records
        time.sleep(0.1)
    assert [r and r["status"] for r in records] == ["error", "error"]


class Traffic:
    """Clients sending completions in a loop; what each request got back."""

    def __init__(self, proxy: ProxyProcess, key: str, workers: int = 4) -> None:
        self.proxy, self.key = proxy, key
        self.answered: list[str] = []  # request ids of 200s
        self.failed = 0  # no answer: the proxy was gone
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                answer = complete(self.proxy, self.key, max_tokens=1)
            except (OSError, ValueError, IndexError):  # refused, reset, or cut off mid-answer
                self.failed += 1
                time.sleep(0.05)
                continue
            if answer.status == 200:
                self.answered.append(answer.headers["x-request-id"])

    def until(self, count: int, limit_s: float = 300) -> None:
        deadline = time.monotonic() + limit_s  # a safety net against a hang, not a measure
        while len(self.answered) < count:
            assert time.monotonic() < deadline, f"{len(self.answered)} of {count} answered"
            time.sleep(0.01)

    def end(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


def lineage_ids(redis_url: str) -> list[str]:
    """Every request id in every replica's lineage stream, repeats included (readers would
    drop them)."""
    client = redis.Redis.from_url(redis_url)
    try:
        streams = client.keys("kvl:{replica:*}:lineage")
        return [fields[b"id"].decode() for key in streams for _, fields in client.xrange(key)]
    finally:
        client.close()


def test_proxy_killed_and_restarted_loses_and_repeats_no_record(
    replicas: dict[str, Replica], redis_server: RedisServer, tmp_path: Path
) -> None:
    """SIGKILL the proxy under traffic and start it again on its spool: every answered request
    has exactly one record in the lineage, and no request has two."""
    toml = config_snippet([replicas["r1"], replicas["r2"]])
    first = ProxyProcess(toml, redis_server.url, workdir=tmp_path)
    first.start()
    key = create_key(redis_server.url, "restarted")
    traffic = Traffic(first, key)
    try:
        traffic.until(40)
        assert first.process is not None
        first.process.kill()
        first.process.wait(timeout=30)
        second = ProxyProcess(toml, redis_server.url, workdir=tmp_path, port=first.port)
        second.start()
        answered = len(traffic.answered)
        traffic.until(answered + 40)
    finally:
        traffic.end()
    second.stop()
    stored = Counter(lineage_ids(redis_server.url))
    assert [rid for rid, n in stored.items() if n > 1] == []
    assert [rid for rid in traffic.answered if stored[rid] != 1] == []
    print(
        f"\n{len(traffic.answered)} answered, {traffic.failed} unanswered while the proxy was"
        f" down, {sum(stored.values())} records"
    )
