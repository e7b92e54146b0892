"""The ``kvledger keys|lineage|replicas`` commands against a running proxy."""

from __future__ import annotations

import selectors
import signal
import subprocess
import sys
import time
from datetime import datetime

import openai
import orjson
import pytest

from router.ledger.keys import key_hash
from tests.admin_stack import Stack, chat, cli, cli_env, stack, stored

__all__ = ["stack"]  # the module fixture, used by name


def test_keys_create_prints_a_working_key(stack: Stack) -> None:
    """`keys create` prints the key alone on stdout, says it is not stored, and the key works."""
    result = cli(stack, "keys", "create", "cli-made", "--mode", "production")
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip()
    assert key.startswith("kvl-") and "\n" not in key
    assert "not stored" in result.stderr
    assert stored(stack, [chat(stack, key)])[0]["key"] == "cli-made"


def test_keys_list_shows_profiles_never_keys(stack: Stack) -> None:
    """`keys list` shows name, mode, cache and creation time, but neither the key nor its hash."""
    key = cli(stack, "keys", "create", "listed", "--mode", "eval", "--cache", "reset").stdout
    key = key.strip()
    table = cli(stack, "keys", "list")
    assert table.returncode == 0, table.stderr
    header = ["name", "mode", "cache", "replica", "created_at"]
    assert table.stdout.splitlines()[0].split() == header
    assert ["listed", "eval", "reset", "-"] == next(
        line.split()[:4] for line in table.stdout.splitlines() if line.startswith("listed ")
    )
    lines = cli(stack, "keys", "list", "--json").stdout
    for output in (table.stdout, lines):
        assert key not in output and key_hash(key) not in output
    profile = next(p for p in map(orjson.loads, lines.splitlines()) if p["name"] == "listed")
    assert datetime.fromisoformat(profile["created_at"]).tzinfo is not None


def test_revoked_key_is_refused_within_the_cache_ttl(stack: Stack) -> None:
    """After `keys revoke`, the same key gets 401 within the proxies' key-cache lifetime."""
    key = cli(stack, "keys", "create", "doomed", "--mode", "production").stdout.strip()
    chat(stack, key)  # the proxy now holds the key in its cache
    result = cli(stack, "keys", "revoke", "doomed")
    assert result.returncode == 0, result.stderr
    deadline = time.monotonic() + 8
    with pytest.raises(openai.AuthenticationError):
        while time.monotonic() < deadline:
            chat(stack, key)
            time.sleep(0.25)
    again = cli(stack, "keys", "revoke", "doomed")
    assert again.returncode == 1 and "no key named 'doomed'" in again.stderr


def test_keys_create_refuses_bad_profiles(stack: Stack) -> None:
    """A bad profile is a one-line usage error naming the flag; a taken name fails with exit 1."""
    bad = cli(stack, "keys", "create", "arm", "--mode", "eval", "--cache", "sometimes")
    assert bad.returncode == 2 and bad.stderr.startswith("kvledger: --cache:")
    assert len(bad.stderr.splitlines()) == 1 and not bad.stdout
    taken = cli(stack, "keys", "create", "cli-made", "--mode", "production")
    assert taken.returncode == 1 and "exists" in taken.stderr and not taken.stdout


def test_replicas_cli_table_and_errors(stack: Stack) -> None:
    """Bare `replicas` prints the table; a wrong token or no proxy is one line and exit 1."""
    table = cli(stack, "replicas")
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split()[:4] == ["id", "healthy", "draining", "lease"]
    assert sorted(row.split()[:3] for row in rows) == [["r1", "yes", "no"], ["r2", "yes", "no"]]
    wrong = cli(stack, "replicas", "list", KVL_ADMIN_TOKEN="wrong")
    assert wrong.returncode == 1 and "401" in wrong.stderr
    away = cli(stack, "replicas", "list", "--url", "http://127.0.0.1:9")
    assert away.returncode == 1 and "not reachable" in away.stderr
    for result in (wrong, away):
        assert len(result.stderr.splitlines()) == 1 and not result.stdout


def test_lineage_show_and_tail(stack: Stack) -> None:
    """`lineage show` prints a request's record; `lineage tail --key` lists that key's requests."""
    key = stack.proxy.create_key("lineage-cli")
    records = stored(stack, [chat(stack, key) for _ in range(3)])
    ids = [r["request_id"] for r in records]
    shown = cli(stack, "lineage", "show", ids[0])
    assert shown.returncode == 0 and orjson.loads(shown.stdout) == records[0]
    tail = cli(stack, "lineage", "tail", "--key", "lineage-cli", "--json")
    assert tail.returncode == 0, tail.stderr
    lines = tail.stdout.splitlines()
    assert [orjson.loads(line)["request_id"] for line in lines] == ids
    table = cli(stack, "lineage", "tail", "--key", "lineage-cli", "--count", "2")
    header, *rows = table.stdout.splitlines()
    assert header.split()[:3] == ["request_id", "at", "key"]
    assert [row.split()[0] for row in rows] == ids[1:]
    assert records[2]["state_before"][:12] in rows[1].split()
    other_run = cli(stack, "lineage", "tail", "--key", "lineage-cli", "--run", "nosuch", "--json")
    assert other_run.returncode == 0 and not other_run.stdout
    missing = cli(stack, "lineage", "show", "no-such-request")
    assert missing.returncode == 1 and "no lineage record" in missing.stderr


def test_lineage_tail_follow(stack: Stack) -> None:
    """`lineage tail --follow` prints requests as they happen and ends quietly on Ctrl-C."""
    key = stack.proxy.create_key("follower")
    command = [sys.executable, "-m", "router.cli", "lineage", "tail", "--follow", "--json"]
    process = subprocess.Popen(
        [*command, "--key", "follower"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(stack),
    )
    try:
        time.sleep(1)  # let it take its first look (nothing yet) before the request
        request_id = chat(stack, key)
        assert process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            assert selector.select(timeout=15), "no line within 15 s"
        assert orjson.loads(process.stdout.readline())["request_id"] == request_id
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=10)
        assert process.returncode == 0 and "Traceback" not in stderr
    finally:
        process.kill()


def test_keys_create_help_explains_every_cache_mode() -> None:
    """``keys create --help`` says what each cache mode does, without pointing at other files."""
    done = subprocess.run(
        [sys.executable, "-m", "router.cli", "keys", "create", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    for mode in ("reset", "off", "shared", "replay:SNAP"):
        assert f"\n  {mode} " in done.stdout, mode
    assert "--mode MODE" in done.stdout and "[--mode" not in done.stdout
    assert "DESIGN.md" not in done.stdout
