"""What kvledger asks of Redis per request: executed commands from ``INFO commandstats`` over
the measured windows, and, from a short ``MONITOR`` sample, which of them the proxy sent and
which ran inside a Lua script."""

from __future__ import annotations

import socket
import threading
from collections import Counter
from urllib.parse import urlparse

import redis


def command_calls(url: str) -> Counter[str]:
    """Calls per command since Redis started (``INFO commandstats``)."""
    client = redis.Redis.from_url(url)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return Counter({name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()})


class MonitorSample:
    """Counts commands seen by ``MONITOR`` while running: ``sent`` (from a client connection)
    and ``in_lua`` (called by a script), by command name. Start, send traffic, stop."""

    def __init__(self, url: str) -> None:
        parsed = urlparse(url)
        self._address = (parsed.hostname or "127.0.0.1", parsed.port or 6379)
        self.sent: Counter[str] = Counter()
        self.in_lua: Counter[str] = Counter()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MonitorSample:
        self._thread.start()
        if not self._ready.wait(5):
            raise RuntimeError("MONITOR did not start")
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        with socket.create_connection(self._address, timeout=0.2) as sock:
            sock.sendall(b"MONITOR\r\n")
            buffer = b""
            while not self._stop.is_set():
                try:
                    data = sock.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    return
                buffer += data
                *lines, buffer = buffer.split(b"\r\n")
                for line in lines:
                    self._count(line)

    def _count(self, line: bytes) -> None:
        if line == b"+OK":
            self._ready.set()
            return
        # +1700000000.123456 [0 127.0.0.1:5000] "evalsha" "..." or [0 lua] for script calls
        _, _, rest = line.partition(b"[")
        source, _, command = rest.partition(b"] ")
        name = command.split(b" ", 1)[0].strip(b'"').decode(errors="replace").lower()
        if name:
            (self.in_lua if source.endswith(b" lua") else self.sent)[name] += 1
