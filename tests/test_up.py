"""The README's run command: ``kvledger up`` brings up Redis, replicas and the proxy, and stops."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import orjson
import redis
import urllib3

from backends.sim.launcher import free_ports
from tests.servers import redis_answers


def start_up(
    port: int, workdir: Path, env: dict[str, str], *extra: str
) -> tuple[subprocess.Popen[bytes], str]:
    """``kvledger up`` and what it printed up to its "Ctrl-C stops everything"."""
    command = [sys.executable, "-m", "router.cli", "up", "--port", str(port)]
    command += ["--workdir", str(workdir), *extra]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert up.stdout is not None
    output = b""
    deadline = time.monotonic() + 120
    while b"Ctrl-C stops everything" not in output and time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        output += line
    return up, output.decode()


TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
CALL = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
TOOL_TURN = [
    {"role": "user", "content": "What time is it?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
]


def chat(
    port: int, key: str, content: str, **extra: Any
) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {
        "model": "ensemble",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }
    response = urllib3.request(
        "POST",
        f"http://127.0.0.1:{port}/v1/chat/completions",
        body=orjson.dumps(body),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    return response.status, dict(response.headers), orjson.loads(response.data)


def command_line(env: dict[str, str]) -> Any:
    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "router.cli", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    return cli


def test_up_serves_the_printed_first_request_and_stops_cleanly(tmp_path: Path) -> None:
    """The printed key and request work, as do the printed settings for the commands (an eval
    arm on the reuse-off replica); Ctrl-C stops every process it started."""
    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "KVL_REDIS_URL")}
    up, text = start_up(port, tmp_path, env)
    try:
        key = re.search(r"API key \(shown once\): (\S+)", text)
        assert key is not None, text
        status, _, body = chat(port, key.group(1), "Hello!")
        assert status == 200 and body["kvledger"]["replica"] in ("r1", "r2")
        # The stand-in model's chat template and parser are configured: tools are served.
        status, _, body = chat(port, key.group(1), "", messages=TOOL_TURN, tools=TOOLS)
        assert status == 200, body
        exported = re.search(r"export (KVL_URL=\S+ KVL_REDIS_URL=\S+ KVL_ADMIN_TOKEN=\S+)", text)
        assert exported is not None, text
        cli = command_line({**env, **dict(v.split("=", 1) for v in exported.group(1).split())})
        arm = cli("keys", "create", "my-arm", "--mode", "eval", "--cache", "off")
        run = cli("runs", "begin", "my-arm")
        status, headers, body = chat(port, arm, "An eval request")
        assert status == 200 and headers["X-Kvl-Run"] == run
        assert body["kvledger"]["replica"] == "r3"
    finally:
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
    assert up.returncode == 0, rest.decode()
    pids = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert pids.strip() == "", f"processes left behind: {pids}"


def _ids(redis_url: str) -> list[str]:
    """Every request id in the replicas' lineage streams (a request id twice is a duplicate)."""
    client = redis.Redis.from_url(redis_url)
    try:
        ids = []
        for stream in client.scan_iter(match="kvl:{replica:*}:lineage"):
            ids += [orjson.loads(f[b"r"])["request_id"] for _, f in client.xrange(stream)]
        return ids
    finally:
        client.close()


def _waiting(port: int) -> float:
    """Records the proxy still holds (spool and buffer)."""
    page = urllib3.request("GET", f"http://127.0.0.1:{port}/metrics").data.decode()
    wanted = ("kvl_ledger_spooled ", "kvl_ledger_buffer_depth ")
    return sum(float(ln.split()[1]) for ln in page.splitlines() if ln.startswith(wanted))


def _stop(up: subprocess.Popen[bytes]) -> str:
    up.send_signal(signal.SIGINT)
    rest, _ = up.communicate(timeout=90)
    assert up.returncode == 0, rest.decode()
    return rest.decode()


def test_up_keeps_records_and_keys_across_a_redis_crash_and_a_restart(tmp_path: Path) -> None:
    """kill -9 of up's Redis under traffic, restarted with its own command line: every record
    answered before is there once, the key works, the audit is clean. Then up stopped and
    started again on the same --workdir: the same key works and the lineage is still there."""
    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "KVL_REDIS_URL")}
    extra = ("--replicas", "2", "--reuse-off", "0")
    up, text = start_up(port, tmp_path, env, *extra)
    restarted: subprocess.Popen[bytes] | None = None
    try:
        key = re.search(r"API key \(shown once\): (\S+)", text)
        pid = re.search(r"redis: (redis://\S+) \(pid (\d+), append-only file", text)
        exported = re.search(r"export (KVL_URL=\S+ KVL_REDIS_URL=\S+ KVL_ADMIN_TOKEN=\S+)", text)
        assert key is not None and pid is not None and exported is not None, text
        redis_url = pid.group(1)
        answered: list[str] = []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                status, _, body = chat(port, key.group(1), f"hello {uuid.uuid4().hex}")
                assert status == 200, body
                answered.append(body["kvledger"]["request_id"])

        with ThreadPoolExecutor(2) as pool:
            clients = [pool.submit(traffic) for _ in range(2)]
            try:
                wait_for(lambda: len(answered) >= 20, "traffic")
                # Its own command line, as up.json keeps it (/proc shows redis-server's title).
                command = orjson.loads((tmp_path / "up.json").read_bytes())["redis_command"]
                os.kill(int(pid.group(2)), signal.SIGKILL)
                during = len(answered)
                wait_for(lambda: len(answered) >= during + 10, "answers while Redis is down")
                restarted = subprocess.Popen(
                    command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                wait_for(lambda: redis_answers(redis_url), "the restarted Redis")
                after = len(answered)
                wait_for(lambda: len(answered) >= after + 10, "answers after the restart")
            finally:
                stop.set()
            for done in clients:
                done.result()
        wait_for(lambda: _waiting(port) == 0, "the spool to drain")
        ids = _ids(redis_url)
        assert sorted(ids) == sorted(set(ids)), "a record written twice"
        assert set(answered) <= set(ids), f"{len(set(answered) - set(ids))} records lost"
        assert chat(port, key.group(1), "still me?")[0] == 200
        cli = command_line({**env, **dict(v.split("=", 1) for v in exported.group(1).split())})
        audit = cli("audit", "chain")
        assert "every chain holds" in audit and "): complete" in audit, audit
        restarted.terminate()
        restarted.wait(timeout=30)
        restarted = None
        _stop(up)

        up, text = start_up(port, tmp_path, env, *extra)
        assert f"API key (the one in {tmp_path / 'up.json'}): {key.group(1)}" in text, text
        status, _, body = chat(port, key.group(1), "back again")
        assert status == 200, body
        again = re.search(r"redis: (redis://\S+) ", text)
        assert again is not None, text
        assert set(ids) <= set(_ids(again.group(1))), "the lineage is gone after a restart"
        assert "every chain holds" in cli("audit", "chain", "--redis-url", again.group(1))
    finally:
        if restarted is not None:
            restarted.kill()
            restarted.wait()
        if up.poll() is None:
            _stop(up)
    pids = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert pids.strip() == "", f"processes left behind: {pids}"


def wait_for(condition: Any, what: str, timeout_s: float = 90) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
