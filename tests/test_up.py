"""The README's run command: ``kvledger up`` brings up Redis, replicas and the proxy, and stops."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import urllib3

from backends.sim.launcher import free_ports


def start_up(port: int, workdir: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """``kvledger up`` and what it printed up to its "Ctrl-C stops everything"."""
    command = [sys.executable, "-m", "router.cli", "up", "--port", str(port)]
    command += ["--workdir", str(workdir)]
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
