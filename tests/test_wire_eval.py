"""A request written to a replica that then fails without an answer, end to end: ``kvledger
serve`` in front of stand-in replicas, one of them behind a forwarder that reads a generate
request and drops the connection. The replica receives the request once; the ledger marks its
state unknown from there; production moves the request (and says so), an eval run breaks with
the reason; the audit stays clean. The same over the gRPC transport, behind a relay that
passes the request on and withholds the answer."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import orjson
import urllib3

from backends.sim.launcher import Replica
from backends.triton import never_connected
from router.ledger import Ledger
from tests.ledger_view import LedgerView
from tests.proxy_harness import Proxy
from tests.servers import RedisServer

HTTP = urllib3.PoolManager(maxsize=16)


class Relay:
    """A server on its own thread and loop, on a free port, in front of a replica's port
    (``upstream``); ``drop`` arms the subclass's misbehaviour."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.drop = False
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def __enter__(self) -> Self:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError


class Forwarder(Relay):
    """HTTP/1.1 requests passed to a replica; while ``drop`` is set, a generate request is read
    (its id kept in ``dropped``) and its connection closed, unanswered."""

    def __init__(self, upstream: int) -> None:
        super().__init__(upstream)
        self.dropped: list[str] = []
        self.connections = 0

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)

        async def down() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await up_reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        back = asyncio.create_task(down())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                if self.drop and b"/generate" in head.split(b"\r\n", 1)[0]:
                    self.dropped.append(str(orjson.loads(body)["id"]))
                    return  # read, never answered: the connection closes
                up_writer.write(head + body)
                await up_writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            up_writer.close()
            back.cancel()


@contextlib.contextmanager
def forwarded(replica: Replica) -> Iterator[tuple[Forwarder, Replica]]:
    with Forwarder(replica.http_port) as forwarder:
        yield forwarder, dataclasses.replace(replica, http_port=forwarder.port)


class GrpcDropper(Relay):
    """A TCP relay in front of a replica's gRPC port; while ``drop`` is set, the next large
    chunk from the proxy (a generate request: HTTP/2 headers and the request message) is passed
    to the replica, whose answer is withheld, and the connection is closed a moment later: the
    replica received the request, the proxy gets no answer (``dropped`` keeps the chunk)."""

    LARGE = 256  # bytes: HTTP/2 pings and settings are smaller, a generate request larger

    def __init__(self, upstream: int) -> None:
        super().__init__(upstream)
        self.dropped: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        withheld = asyncio.Event()

        async def down() -> None:
            with contextlib.suppress(ConnectionError):
                while data := await up_reader.read(65536):
                    if not withheld.is_set():
                        writer.write(data)
                        await writer.drain()

        back = asyncio.create_task(down())
        try:
            while data := await reader.read(65536):
                if self.drop and len(data) >= self.LARGE and not self.dropped:
                    withheld.set()
                    self.dropped.append(data)
                    up_writer.write(data)
                    await up_writer.drain()
                    await asyncio.sleep(0.5)  # the replica reads and runs it
                    return
                up_writer.write(data)
                await up_writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            up_writer.close()
            back.cancel()


def complete(proxy: Proxy, key: str, prompt: str) -> urllib3.BaseHTTPResponse:
    body = orjson.dumps({"model": "ensemble", "prompt": prompt, "max_tokens": 4})
    return HTTP.request(
        "POST",
        proxy.url + "/v1/completions",
        body=body,
        timeout=60,
        headers={"Authorization": f"Bearer {key}"},
        retries=False,
    )


def audit(view: LedgerView, replica: str) -> Any:
    async def go(ledger: Ledger) -> Any:
        (found,) = await ledger.audit([replica])
        return found

    return view._run(go)


def known(view: LedgerView, replica: str) -> bool:
    async def go(ledger: Ledger) -> bool:
        return (await ledger.head(replica)).known

    return view._run(go)


def until_dropped(
    proxy: Proxy, key: str, relay: Forwarder | GrpcDropper, prompt: str, tries: int
) -> list[urllib3.BaseHTTPResponse]:
    """Requests with the relay's drop armed, until one was dropped; every one answered 200
    (the dropped one by another replica)."""
    relay.drop = True
    answers = []
    for i in range(tries):
        answers.append(complete(proxy, key, f"{prompt} {i}"))
        if relay.dropped:
            break
    relay.drop = False
    assert all(a.status == 200 for a in answers), proxy.log[-3000:]
    return answers


def assert_lost_on_r1_and_moved_to_r2(url: str, lost_id: str) -> None:
    """One record of the lost request on r1 (error, unordered, saying why), r1's state unknown
    since, the request served by r2 saying it moved; both chains audit clean."""
    view = LedgerView(url)
    on_r1 = [r for r in view.tail(replica="r1") if r["request_id"] == lost_id]
    assert len(on_r1) == 1, on_r1
    assert on_r1[0]["status"] == "error" and on_r1[0]["unordered"]
    assert "failed without an answer" in on_r1[0]["warning"]
    served = view.record(lost_id)
    assert served is not None and served["replica"] == "r2"
    assert "moved after" in served["warning"]
    assert not known(view, "r1")  # unknown since the lost request
    for replica in ("r1", "r2"):
        found = audit(view, replica)
        assert found.ok, found.findings


def test_production_request_dropped_after_the_write_runs_once_there_and_moves(
    replicas: dict[str, Replica], redis_server: RedisServer
) -> None:
    with forwarded(replicas["r1"]) as (forwarder, r1):
        proxy = Proxy([r1, replicas["r2"]], redis_server.url, policy="round_robin")
        proxy.start()
        try:
            key = proxy.create_key("lost-prod")
            with ThreadPoolExecutor(8) as pool:  # several idle connections to r1
                warm = list(pool.map(lambda i: complete(proxy, key, f"warm {i}"), range(8)))
            assert all(r.status == 200 for r in warm)
            assert forwarder.connections >= 2
            answers = until_dropped(proxy, key, forwarder, "dropped", 8)
            (lost_id,) = forwarder.dropped  # one copy reached r1, whatever was idle
            answer = next(a for a in answers if a.headers["X-Request-Id"] == lost_id)
            assert answer.headers["X-Kvl-Replica"] == "r2"
            assert_lost_on_r1_and_moved_to_r2(redis_server.url, lost_id)
        finally:
            proxy.stop()


def test_eval_request_dropped_after_the_write_breaks_its_run_with_the_reason(
    replicas: dict[str, Replica], redis_server: RedisServer
) -> None:
    with forwarded(replicas["r2"]) as (forwarder, r2):
        proxy = Proxy([r2, replicas["r1"]], redis_server.url)
        proxy.start()
        try:
            key = proxy.create_key("lost-eval", mode="eval", cache="shared", replica="r2")
            first = complete(proxy, key, "first turn")
            assert first.status == 200, first.data
            forwarder.drop = True
            failed = complete(proxy, key, "second turn")
            forwarder.drop = False
            assert failed.status == 503
            message = orjson.loads(failed.data)["error"]["message"]
            assert "broken" in message and "failed without an answer" in message
            (lost_id,) = forwarder.dropped
            after = complete(proxy, key, "third turn")
            assert after.status == 503 and "broken" in orjson.loads(after.data)["error"]["message"]
            assert forwarder.dropped == [lost_id]
            view = LedgerView(redis_server.url)
            lost = view.record(lost_id)
            assert lost is not None and lost["status"] == "error" and lost["unordered"]
            assert not known(view, "r2")
            found = audit(view, "r2")
            assert found.ok, found.findings
        finally:
            proxy.stop()


def test_a_grpc_request_whose_stream_breaks_after_it_left_is_recorded_and_moves(
    replicas: dict[str, Replica], redis_server: RedisServer
) -> None:
    """The gRPC transport cannot tell whether its request left before the connection broke:
    it takes the request as written unless the channel never connected. The replica got it
    once; its record there makes the state unknown; the request moves to r2 and says so."""
    with GrpcDropper(replicas["r1"].grpc_port) as dropper:
        r1 = dataclasses.replace(replicas["r1"], grpc_port=dropper.port)
        proxy = Proxy([r1, replicas["r2"]], redis_server.url, policy="round_robin")
        config = proxy.config.read_text()
        proxy.config.write_text(
            config.replace("[[replicas]]\n", '[[replicas]]\ntransport = "grpc"\n')
        )
        proxy.start()
        try:
            key = proxy.create_key("lost-grpc")
            warm = [complete(proxy, key, f"warm {i}") for i in range(4)]
            assert all(r.status == 200 for r in warm)
            assert {r.headers["X-Kvl-Replica"] for r in warm} == {"r1", "r2"}
            answers = until_dropped(proxy, key, dropper, "dropped over grpc", 4)
            (chunk,) = dropper.dropped
            (answer,) = [a for a in answers if a.headers["X-Request-Id"].encode() in chunk]
            assert answer.headers["X-Kvl-Replica"] == "r2"
            assert_lost_on_r1_and_moved_to_r2(redis_server.url, answer.headers["X-Request-Id"])
        finally:
            proxy.stop()


def test_a_grpc_channel_that_never_connected_did_not_send_its_request() -> None:
    """Only grpc's own words for a channel that could not connect prove the request did not
    leave (pure logic over the status details)."""
    assert never_connected(
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1:"
        " Failed to connect to remote host: Connection refused"
    )
    assert not never_connected("Socket closed")
    assert not never_connected("recvmsg:Connection reset by peer")
    assert not never_connected("GOAWAY received")
