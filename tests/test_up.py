"""The README's run command: ``kvledger up`` brings up Redis, replicas and the proxy, and stops."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import urllib3

from backends.sim.launcher import free_ports


def test_up_serves_the_printed_first_request_and_stops_cleanly(tmp_path: Path) -> None:
    """The printed key and request work, as do the printed settings for the commands (an eval
    arm on the reuse-off replica); Ctrl-C stops every process it started."""
    port = free_ports(1)[0]
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "KVL_REDIS_URL")}
    command = [
        sys.executable,
        "-m",
        "router.cli",
        "up",
        "--port",
        str(port),
        "--workdir",
        str(tmp_path),
    ]
    up = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert up.stdout is not None
    output = b""
    deadline = time.monotonic() + 120
    while b"Ctrl-C stops everything" not in output and time.monotonic() < deadline:
        line = up.stdout.readline()
        if not line:
            break
        output += line
    text = output.decode()
    try:
        key = re.search(r"API key \(shown once\): (\S+)", text)
        assert key is not None, text
        body = {
            "model": "ensemble",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "Hello!"}],
        }
        response = urllib3.request(
            "POST",
            f"http://127.0.0.1:{port}/v1/chat/completions",
            body=orjson.dumps(body),
            headers={"Authorization": f"Bearer {key.group(1)}", "Content-Type": "application/json"},
        )
        assert response.status == 200
        assert orjson.loads(response.data)["kvledger"]["replica"] in ("r1", "r2")
        exported = re.search(r"export (KVL_URL=\S+ KVL_REDIS_URL=\S+ KVL_ADMIN_TOKEN=\S+)", text)
        assert exported is not None, text
        cli_env = {**env, **dict(v.split("=", 1) for v in exported.group(1).split())}

        def cli(*args: str) -> str:
            done = subprocess.run(
                [sys.executable, "-m", "router.cli", *args],
                capture_output=True,
                text=True,
                env=cli_env,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr
            return done.stdout.strip()

        arm = cli("keys", "create", "my-arm", "--mode", "eval", "--cache", "off")
        run = cli("runs", "begin", "my-arm")
        body["messages"][0]["content"] = "An eval request"  # type: ignore[index]
        response = urllib3.request(
            "POST",
            f"http://127.0.0.1:{port}/v1/chat/completions",
            body=orjson.dumps(body),
            headers={"Authorization": f"Bearer {arm}", "Content-Type": "application/json"},
        )
        assert response.status == 200 and response.headers["X-Kvl-Run"] == run
        assert orjson.loads(response.data)["kvledger"]["replica"] == "r3"
    finally:
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
    assert up.returncode == 0, rest.decode()
    pids = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert pids.strip() == "", f"processes left behind: {pids}"
