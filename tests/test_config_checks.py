"""The config is checked when the proxy starts: a mistake stops `kvledger serve` with one line
naming the file, the field and what was expected; two instances on one config both start."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.sim.launcher import free_ports
from router.cli.local import proxy_env
from router.settings import SettingsError, build_settings
from tests.servers import RedisServer

REPLICA = {"id": "r1", "grpc": "127.0.0.1:1", "metrics": "http://127.0.0.1:1/metrics"}
REPLICA_TOML = '[[replicas]]\nid = "r1"\ngrpc = "127.0.0.1:1"\nmetrics = "http://127.0.0.1:1/m"\n'


def settings_of(**sections: Any) -> Any:
    raw = {"replicas": [REPLICA], **sections}
    return build_settings(raw, {}, Path("/cfg"), source="kvledger.toml", hostname="box")


@pytest.mark.parametrize(
    ("sections", "says"),
    [
        ({"limits": {"backend_timeout_s": "10"}}, "[limits] backend_timeout_s: expected a number"),
        ({"limits": {"max_tokens": 1.5}}, "[limits] max_tokens: expected an integer"),
        ({"limits": {"max_tokens": True}}, "[limits] max_tokens: expected an integer"),
        ({"limits": {"request_timeout_s": 0}}, "request_timeout_s: expected a duration above 0"),
        ({"limits": {"max_body_bytes": -1}}, "max_body_bytes: expected a number >= 0"),
        ({"limits": {"backend_timeout": 10}}, "[limits]: unknown key(s) ['backend_timeout']"),
        ({"server": {"port": "8000"}}, "[server] port: expected an integer"),
        ({"server": {"port": 70000}}, "[server] port: expected a port"),
        ({"server": {"allow_anonymous": "yes"}}, "allow_anonymous: expected true or false"),
        ({"server": {"log_level": "verbose"}}, "log_level: expected one of"),
        ({"server": {"hots": "x"}}, "[server]: unknown key(s) ['hots']"),
        ({"lineage": {"spool_path": 3}}, "[lineage] spool_path: expected a path"),
        ({"eval": {"turn_ttl_s": []}}, "[eval] turn_ttl_s: expected a number"),
        ({"routing": {"policy": "fastest"}}, "[routing] policy: expected one of"),
        ({"routing": {"load_factor": "1.5"}}, "[routing] load_factor: expected a number"),
        ({"routing": {"policy": "round_robin", "load_factor": 2}}, "unknown key(s) ['load_f"),
        ({"routing": {"load_factor": 0.5}}, "load_factor must be >= 1"),
        ({"chat_templates": {"ensemble": {"message": "{user}"}}}, "message: expected a template"),
        ({"chat_templates": {"ensemble": {"prompt": "x"}}}, "unknown key(s) ['prompt']"),
        ({"replicas": [{**REPLICA, "reuse": "true"}]}, "#1 reuse: expected true or false"),
        ({"replicas": [{**REPLICA, "max_input_len": "4k"}]}, "#1 max_input_len: expected an"),
        ({"replicas": [{"id": "r1"}]}, "[[replicas]] #1: missing ['grpc', 'metrics']"),
        ({"replicas": [REPLICA, REPLICA]}, "ids must be unique"),
        ({"replica": [REPLICA]}, "unknown section(s) ['replica']"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_config_mistakes_name_file_field_and_expectation(
    sections: dict[str, Any], says: str
) -> None:
    """Each wrong type, unknown key or out-of-range value is refused, saying where and what."""
    with pytest.raises(SettingsError) as caught:
        settings_of(**sections)
    message = str(caught.value)
    assert message.startswith("kvledger.toml: ") and says in message, message
    assert "\n" not in message


def test_config_values_arrive_typed() -> None:
    """Integers given for float fields become floats; paths are relative to the config file."""
    settings = settings_of(limits={"backend_timeout_s": 3}, lineage={"spool_path": "s.jsonl"})
    assert settings.limits.backend_timeout_s == 3.0
    assert isinstance(settings.limits.backend_timeout_s, float)
    assert settings.lineage.spool_path == Path("/cfg/s.jsonl")


def test_default_spool_is_named_after_host_name_and_port() -> None:
    """Without spool_path each instance gets its own spool, and placeholders work in one."""
    default = build_settings(
        {"replicas": [REPLICA]}, {"KVL_LISTEN": ":9001"}, Path("/c"), hostname="a"
    )
    assert default.lineage.spool_path == Path("/c/kvledger-spool-a-9001.jsonl")
    raw = {"replicas": [REPLICA], "lineage": {"spool_path": "/var/s-{port}.jsonl"}}
    assert build_settings(raw, {}, Path("/c")).lineage.spool_path == Path("/var/s-8000.jsonl")


def serve(
    config: Path, port: int, redis_url: str, log: Path | None = None
) -> subprocess.Popen[bytes]:
    """``kvledger serve`` on ``port``; its output piped, or appended to ``log`` if given (a
    long-running proxy must not block on a pipe nobody reads)."""
    env = {**proxy_env("admin"), "KVL_LISTEN": f"127.0.0.1:{port}", "KVL_REDIS_URL": redis_url}
    command = [sys.executable, "-m", "router.cli", "serve", "--config", str(config)]
    if log is None:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with log.open("ab") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.parametrize(
    ("toml", "says"),
    [
        ('[limits]\nbackend_timeout_s = "ten"\n', "[limits] backend_timeout_s: expected a number"),
        ("[server]\nmonitor_intervall_s = 2\n", "[server]: unknown key(s) ['monitor_intervall_s']"),
    ],
    ids=["wrong-type", "unknown-key"],
)
def test_serve_refuses_a_wrong_config_in_one_line(tmp_path: Path, toml: str, says: str) -> None:
    """`kvledger serve` exits 2 before starting anything, with one line on stderr."""
    config = tmp_path / "kvledger.toml"
    config.write_text(toml + REPLICA_TOML)
    process = serve(config, free_ports(1)[0], "redis://127.0.0.1:1/0")
    _, err = process.communicate(timeout=60)
    assert process.returncode == 2
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and str(config) in lines[0] and says in lines[0], lines


@pytest.fixture
def two_instances(
    tmp_path: Path, redis_server: RedisServer
) -> Iterator[tuple[Path, list[subprocess.Popen[bytes]], list[int]]]:
    config = tmp_path / "kvledger.toml"
    config.write_text(REPLICA_TOML)
    processes: list[subprocess.Popen[bytes]] = []
    ports = free_ports(2)
    try:
        yield config, processes, ports
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)


def answers(port: int, process: subprocess.Popen[bytes], timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2):
                return True
        except OSError:
            time.sleep(0.1)
    return False


def test_two_instances_on_one_config_both_start(
    two_instances: tuple[Path, list[subprocess.Popen[bytes]], list[int]],
    redis_server: RedisServer,
) -> None:
    """Copying a config to scale out works: each instance takes its own spool file."""
    config, processes, ports = two_instances
    log = config.parent / "proxies.log"
    for port in ports:
        processes.append(serve(config, port, redis_server.url, log))
    for port, process in zip(ports, processes, strict=True):
        assert answers(port, process), log.read_text()
    spools = sorted(p.name for p in config.parent.glob("kvledger-spool-*.jsonl"))
    assert len(spools) == 2 and all(str(p) in " ".join(spools) for p in ports)


def test_a_spool_held_by_another_instance_fails_in_one_line(
    two_instances: tuple[Path, list[subprocess.Popen[bytes]], list[int]],
    redis_server: RedisServer,
) -> None:
    """Two instances told to share one spool: the second exits 1 saying the spool is locked."""
    config, processes, ports = two_instances
    config.write_text('[lineage]\nspool_path = "shared.jsonl"\n' + REPLICA_TOML)
    processes.append(serve(config, ports[0], redis_server.url, config.parent / "first.log"))
    assert answers(ports[0], processes[0])
    second = serve(config, ports[1], redis_server.url)
    processes.append(second)
    _, err = second.communicate(timeout=60)
    assert second.returncode == 1
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1 and "locked by another process" in lines[0], lines
