"""The docker compose deployment (compose/): files that validate, and profiles that fit together.

There is no Docker engine here, so nothing is built or run in containers: ``docker-compose
config`` (Debian's docker-compose package; .ci/run installs it) validates the files, and the CPU
stand-in replica's container command runs as a plain process.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import orjson
import pytest

from backends.sim.launcher import free_ports
from router.settings import build_settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_DIR = ROOT / "compose"
BASE = "docker-compose.yml"
SCALE = "docker-compose.scale.yml"
DOCKER_COMPOSE = shutil.which("docker-compose")
PROFILES = {
    "cpu": {"redis", "kvledger-cpu", "sim-1", "sim-2", "sim-off"},
    "gpu": {"redis", "kvledger-gpu", "triton-gpu-0", "triton-gpu-1", "triton-gpu-off"},
}
TRITON_PORTS = {"--http-port": 8000, "--grpc-port": 8001, "--metrics-port": 8002}

needs_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None,
    reason="docker-compose is not installed (apt-get install docker-compose; .ci/run does)",
)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """compose/ as a user has it after `cp .env.example .env`, outside the checkout."""
    root = tmp_path_factory.mktemp("checkout")
    shutil.copytree(COMPOSE_DIR, root / "compose")
    shutil.copyfile(root / "compose" / ".env.example", root / "compose" / ".env")
    return root


def compose(project: Path, profile: str, *files: str, extra: tuple[str, ...] = ()) -> str:
    """Run `docker-compose -f ... --profile P config` as a user would, from the checkout."""
    assert DOCKER_COMPOSE is not None
    command = [DOCKER_COMPOSE]
    for name in files:
        command += ["-f", f"compose/{name}"]
    command += ["--profile", profile, "config", *extra]
    # Only the .env file configures it: nothing from the test's own environment leaks in.
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(project)}
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{shlex.join(command)} failed:\n{done.stderr}"
    return done.stdout


def parse_yaml(text: str) -> Any:
    """PyYAML if this environment has it, else the interpreter docker-compose runs on (v1 is a
    Python program depending on PyYAML); a compose v2 binary prints JSON instead (see below)."""
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        assert DOCKER_COMPOSE is not None
        shebang = Path(DOCKER_COMPOSE).read_bytes()[:200].split(b"\n")[0]
        if not shebang.startswith(b"#!"):
            return None
        python = shebang[2:].decode().split()
        code = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"
        done = subprocess.run([*python, "-c", code], input=text, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)
    return yaml.safe_load(text)


@cache
def _resolved(project: Path, profile: str, files: tuple[str, ...]) -> dict[str, Any]:
    config = parse_yaml(compose(project, profile, *files))
    if config is None:  # docker compose v2 as a standalone binary
        config = json.loads(compose(project, profile, *files, extra=("--format", "json")))
    assert isinstance(config, dict)
    return config


def active_services(project: Path, profile: str, *files: str) -> dict[str, Any]:
    """The services that `--profile P up` starts: those without profiles, and P's own.
    (docker-compose 1.29's `config` prints every service; v2 prints only these.)"""
    services: dict[str, Any] = _resolved(project, profile, files)["services"]
    return {
        name: service
        for name, service in services.items()
        if not service.get("profiles") or profile in service["profiles"]
    }


def host_of(address: str) -> str:
    """`sim-1:8001` or `http://sim-1:8002/metrics` -> `sim-1`."""
    return address.split("://")[-1].split("/")[0].rsplit(":", 1)[0]


def profile_settings(profile: str) -> Any:
    path = COMPOSE_DIR / f"kvledger.{profile}.toml"
    return build_settings(tomllib.loads(path.read_text()), {}, path.parent)


@needs_compose
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_each_profile_validates_with_its_services(project: Path, profile: str) -> None:
    """`docker-compose -f compose/docker-compose.yml --profile P config` succeeds for cpu and gpu,
    and P starts Redis, one proxy and its replicas, and nothing from the other profile."""
    assert set(active_services(project, profile, BASE)) == PROFILES[profile]


@needs_compose
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_scale_override_validates_and_adds_instances_behind_a_balancer(
    project: Path, profile: str
) -> None:
    """The scale override validates on top of either profile and adds proxy instances without a
    host port, reachable by the balancer's name for them, and a load balancer with its config."""
    services = active_services(project, profile, BASE, SCALE)
    pool = services[f"kvledger-{profile}-pool"]
    assert "ports" not in pool and pool["deploy"]["replicas"] >= 2
    for name in (f"kvledger-{profile}", f"kvledger-{profile}-pool"):
        assert "kvledger" in services[name]["networks"]["default"]["aliases"]
    balancer = services["lb"]
    config = next(v for v in balancer["volumes"] if "haproxy.cfg" in str(v))
    assert (COMPOSE_DIR / "haproxy.cfg").is_file(), config
    assert "server-template kvledger" in (COMPOSE_DIR / "haproxy.cfg").read_text()


@needs_compose
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_pool_instances_run_the_same_proxy_as_the_published_one(
    project: Path, profile: str
) -> None:
    """The override's instances differ from the base proxy only in host port and count."""
    services = active_services(project, profile, BASE, SCALE)
    base, pool = dict(services[f"kvledger-{profile}"]), dict(services[f"kvledger-{profile}-pool"])
    for service in (base, pool):
        service.pop("ports", None)
        service.pop("deploy", None)
    assert pool == base


@needs_compose
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_profile_config_names_exactly_the_profiles_replica_services(
    project: Path, profile: str
) -> None:
    """The TOML the profile's proxy mounts is a valid proxy config, and its replicas are that
    profile's replica services (gRPC and metrics hosts are service names), all of them."""
    services = active_services(project, profile, BASE)
    proxy = services[f"kvledger-{profile}"]
    mounts = [str(v) for v in proxy["volumes"]]
    assert any(f"kvledger.{profile}.toml:/etc/kvledger/kvledger.toml" in m for m in mounts)
    settings = profile_settings(profile)
    named = {host_of(r.grpc) for r in settings.replicas}
    assert {host_of(r.metrics) for r in settings.replicas} == named
    assert {r.id for r in settings.replicas} == named
    assert named == PROFILES[profile] - {"redis", f"kvledger-{profile}"}
    assert named <= set(services)


@needs_compose
def test_cpu_replicas_cache_reuse_matches_the_proxy_config(project: Path) -> None:
    """A replica the proxy treats as reuse-off (for cache=off keys) really runs --no-reuse."""
    services = active_services(project, "cpu", BASE)
    for replica in profile_settings("cpu").replicas:
        command = services[replica.id]["command"]
        assert command[:5] == ["kvledger", "replica", "serve", "--id", replica.id]
        assert ("--no-reuse" in command) == (not replica.reuse)


@needs_compose
@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_proxy_reads_each_replicas_engine_where_the_replica_keeps_it(
    project: Path, profile: str
) -> None:
    """Each replica's engine_dir in the proxy's config is a read-only mount of the files the
    replica serves from: its volume (cpu: under --workdir) or the engines directory (gpu)."""
    services = active_services(project, profile, BASE)
    proxy_mounts = mounts(services[f"kvledger-{profile}"])
    for replica in profile_settings(profile).replicas:
        assert replica.engine_model == "tensorrt_llm"
        source, inside = next(
            (src, Path(replica.engine_dir).relative_to(dst))
            for src, (dst, mode) in proxy_mounts.items()
            if mode == "ro" and Path(replica.engine_dir).is_relative_to(dst)
        )
        if profile == "gpu":
            assert mounts(services[replica.id])[source][0] == "/engines" == replica.engine_dir
            continue
        command = services[replica.id]["command"]
        workdir = Path(command[command.index("--workdir") + 1])
        volume = Path(mounts(services[replica.id])[source][0])
        assert volume / inside == workdir / replica.id / "engine"


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """A service's volumes as {source: (target, mode)}, for short or long syntax."""
    found = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mode = "ro" if volume.get("read_only") else "rw"
            found[str(volume["source"])] = (str(volume["target"]), mode)
        else:
            source, target, *rest = str(volume).split(":")
            found[source] = (target, rest[0] if rest else "rw")
    return found


@needs_compose
def test_gpu_replicas_load_only_the_ensemble_so_a_reset_reloads_the_engine(
    project: Path,
) -> None:
    """Explicit model control with only `ensemble` loaded: its composing models load as its
    dependents, so unloading it with dependents (a reset) unloads tensorrt_llm too."""
    services = active_services(project, "gpu", BASE)
    for name in PROFILES["gpu"] - {"redis", "kvledger-gpu"}:
        command = services[name]["command"]
        assert "--model-control-mode=explicit" in command
        assert [a for a in command if a.startswith("--load-model")] == ["--load-model=ensemble"]
        assert len(services[name]["deploy"]["resources"]["reservations"]["devices"]) == 1


@needs_compose
def test_redis_keeps_lineage_durably_and_never_evicts_it(project: Path) -> None:
    """Redis runs append-only on a named volume and refuses writes rather than evict keys."""
    redis = active_services(project, "cpu", BASE)["redis"]
    command = " ".join(redis["command"])
    assert "--appendonly yes" in command and "--maxmemory-policy noeviction" in command
    assert any(str(v).startswith("redis-data:/data") for v in redis["volumes"])


def copy_sources(dockerfile: Path) -> list[str]:
    """The context paths a Dockerfile's COPY/ADD instructions read (not --from=stage ones)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    sources: list[str] = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if any(w.startswith("--from=") for w in words[1:]):
            continue
        if args and args[0].startswith("["):
            args = json.loads(" ".join(args))
        sources.extend(args[:-1])
    return sources


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.sim"])
def test_dockerfiles_copy_only_files_that_exist(name: str) -> None:
    """Every COPY/ADD source exists in the build context (the repository root)."""
    sources = copy_sources(COMPOSE_DIR / name)
    assert "pyproject.toml" in sources
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert not missing, f"compose/{name} copies what the repository lacks: {missing}"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.sim"])
def test_images_take_no_admin_token_and_run_unprivileged(name: str) -> None:
    """The images set a non-root user and carry no token: it arrives from the environment."""
    text = (COMPOSE_DIR / name).read_text()
    assert re.search(r"^USER kvledger$", text, re.M)
    assert "KVL_ADMIN_TOKEN" not in text and "HEALTHCHECK" in text


def with_ports(command: list[str], ports: dict[str, int]) -> list[str]:
    """The command with each port flag's value replaced (or the flag added)."""
    command = list(command)
    for flag, port in ports.items():
        if flag in command:
            command[command.index(flag) + 1] = str(port)
        else:
            command += [flag, str(port)]
    return command


def kvledger_executable() -> list[str]:
    """The `kvledger` console script of this environment, as the image's PATH provides it."""
    script = Path(sys.executable).parent / "kvledger"
    return [str(script)] if script.exists() else [sys.executable, "-m", "router.cli"]


def http(method: str, url: str, body: object = None) -> tuple[int, bytes]:
    data = None if body is None else orjson.dumps(body)
    request = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


@pytest.fixture
def sim_1(
    project: Path, tmp_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], Path, dict[str, int]]]:
    """sim-1's container command, run as a process; the standard ports would clash with anything
    else on this machine (and with other tests), so they are swapped for free ones."""
    command = active_services(project, "cpu", BASE)["sim-1"]["command"]
    assert command[0] == "kvledger"
    ports = dict(zip(TRITON_PORTS, free_ports(3), strict=True))
    # Needs `kvledger replica` registered in router/cli.py (router.cli_replica.register).
    argv = kvledger_executable() + with_ports(command, ports)[1:]
    if "--workdir" in argv:  # the container's volume; here a directory of this test's
        argv[argv.index("--workdir") + 1] = str(tmp_path / "replica")
    log = tmp_path / "sim-1.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process, log, ports
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@needs_compose
@pytest.mark.triton
def test_cpu_replica_container_command_serves_generate_and_stops_on_sigterm(
    sim_1: tuple[subprocess.Popen[bytes], Path, dict[str, int]],
) -> None:
    """The cpu profile's replica command serves Triton's generate API on the ports it is given
    and exits 0 when stopped with SIGTERM, as `docker stop` does."""
    process, log, ports = sim_1
    base = f"http://127.0.0.1:{ports['--http-port']}"
    engine = log.parent / "replica" / "sim-1" / "engine"
    deadline = time.monotonic() + 60
    while http("GET", f"{base}/v2/models/ensemble/ready")[0] != 200:
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "sim-1 not ready in 60 s"
        time.sleep(0.2)
    body = {"text_input": "hi", "max_tokens": 4}
    status, answer = http("POST", f"{base}/v2/models/ensemble/generate", body)
    assert status == 200, answer
    assert isinstance(orjson.loads(answer)["text_output"], str)
    assert (engine / "config.json").is_file()  # where the proxy's engine_dir expects it
    metrics = http("GET", f"http://127.0.0.1:{ports['--metrics-port']}/metrics")
    assert metrics[0] == 200
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, log.read_text()[-3000:]
