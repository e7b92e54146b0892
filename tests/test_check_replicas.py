"""``kvledger replicas check`` against real stand-in replicas: every line passes on replicas as
``kvledger up`` starts them; it exits 1 naming the failing lines on a replica whose block reuse
is off (while the config says on), and on one whose ensemble does not return the statistics."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import tritonclient.http as httpclient

from backends.sim.launcher import Replica, ReplicaSpec, config_snippet, launch
from backends.sim.repository import MODEL_NAME
from router.cli.local import proxy_config

pytestmark = pytest.mark.triton


def without_stats(replica: Replica) -> None:
    """Rewrite the replica's ensemble as one that returns no reuse statistics (a repository
    from before TensorRT-LLM 0.16, or one whose outputs were trimmed), and load it again."""
    config = replica.workdir / "models" / MODEL_NAME / "config.pbtxt"
    names = ("kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks")
    kept = [line for line in config.read_text().splitlines() if not any(n in line for n in names)]
    config.write_text("\n".join(kept) + "\n")
    client = httpclient.InferenceServerClient(replica.http_url.removeprefix("http://"))
    try:
        client.load_model(MODEL_NAME)
    finally:
        client.close()


@pytest.fixture(scope="module")
def fleet(replicas: dict[str, Replica], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A config naming a fresh replica ("ok"), one with a stats-less ensemble ("bare") and the
    session's reuse-off r3 claimed as a reuse replica ("off")."""
    with launch([ReplicaSpec("ok"), ReplicaSpec("bare")]) as (ok, bare):
        without_stats(bare)
        snippet = config_snippet([ok, bare, replicas["r3"]])
        snippet = snippet.replace('id = "r3"', 'id = "off"').replace(
            "reuse = false", "reuse = true"
        )
        path = tmp_path_factory.mktemp("check") / "kvledger.toml"
        path.write_text(proxy_config(8000, "redis://127.0.0.1:1/0", snippet, path.parent / "spool"))
        yield path


def check(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "router.cli", "replicas", "check", "--config", str(config)]
    result = subprocess.run([*command, *args], capture_output=True, text=True, timeout=600)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def lines(result: subprocess.CompletedProcess[str]) -> dict[str, dict[str, object]]:
    return {str(o["name"]): o for o in map(orjson.loads, result.stdout.splitlines())}


def test_every_line_passes_on_a_stand_in_replica_reset_included(fleet: Path) -> None:
    """A replica as `kvledger up` starts it: every line PASS, the unload + load line too."""
    result = check(fleet, "ok", "--reset")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout
    for name in (
        "topology",
        "stats outputs",
        "request counter",
        "prompt limit",
        "block reuse",
        "reset",
    ):
        assert f"PASS  {name}" in result.stdout, result.stdout


def test_a_replica_that_reuses_no_block_fails_naming_the_lines(fleet: Path) -> None:
    """Block reuse off while kvledger expects it: exit 1, the reuse flag and block reuse lines
    fail and say what to change; the rest still pass."""
    result = check(fleet, "off", "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    found = lines(result)
    failed = {name for name, line in found.items() if not line["ok"]}
    assert failed == {"reuse flag", "block reuse"}, found
    assert "enable_kv_cache_reuse" in str(found["reuse flag"]["fix"])


def test_an_ensemble_without_the_stats_outputs_fails_naming_the_lines(fleet: Path) -> None:
    """An ensemble that does not return kv_cache_*: exit 1, the stats outputs line names what
    it lacks, and the lines that need the statistics fail too."""
    result = check(fleet, "bare", "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    found = lines(result)
    assert not found["stats outputs"]["ok"]
    assert "kv_cache_reused_blocks" in str(found["stats outputs"]["saw"])
    assert not found["generation"]["ok"] and not found["stream stats"]["ok"]
    assert found["topology"]["ok"] and found["prompt limit"]["ok"]


def test_by_urls_and_a_usage_error(fleet: Path, replicas: dict[str, Replica]) -> None:
    """The same check by URLs needs all three; a missing one is a usage error (exit 2)."""
    r1 = replicas["r1"]
    base = [sys.executable, "-m", "router.cli", "replicas", "check"]
    missing = subprocess.run([*base, "--grpc", r1.grpc_url], capture_output=True, text=True)
    assert missing.returncode == 2 and "--http" in missing.stderr
    del fleet
