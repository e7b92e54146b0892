"""``kvledger export``: rows equal the records the admin API returns, typed as documented."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import duckdb
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from backends.sim.launcher import Replica
from bench.workload import make_episodes
from router.ledger.export import COLUMNS
from tests.eval_helpers import Played, admin, begin, cli, client, end, play
from tests.proxy_harness import Proxy
from tests.servers import RedisServer

EPISODES = make_episodes(80)[:8]
ARROW = {
    "string": pa.string(),
    "int64": pa.int64(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "timestamp[ms, UTC]": pa.timestamp("ms", tz="UTC"),
}


@pytest.fixture(scope="module")
def stack(replicas: dict[str, Replica]) -> Iterator[tuple[Proxy, list[tuple[str, Played]]]]:
    """A proxy and two runs of a shared arm on r2, the second on the cache the first left
    warm (so episodes may diverge, as in tests/test_eval_runs.py)."""
    redis = RedisServer()
    redis.start()
    proxy = Proxy([replicas["r1"], replicas["r2"]], redis.url)
    proxy.start()
    try:
        assert cli(proxy, "replicas", "reset", "r2").returncode == 0
        key = proxy.create_key("export-arm", mode="eval", cache="shared", replica="r2")
        sdk = client(proxy, key)
        runs = []
        for i in range(2):
            if i:
                begin(proxy, "export-arm")
            played = play(sdk, EPISODES)  # the first request begins the first run
            (run,) = played.runs
            runs.append((run, played))
        end(proxy, runs[-1][0])
        yield proxy, runs
    finally:
        proxy.stop()
        redis.close()


def api_records(proxy: Proxy, run: str) -> list[dict[str, Any]]:
    status, body = admin(proxy, "GET", f"/admin/lineage?run={run}&count=1000")
    assert status == 200, body
    records: list[dict[str, Any]] = body["records"]
    return records


def export(proxy: Proxy, out: Path, *args: str) -> str:
    result = cli(proxy, "export", *args, "--out", str(out))
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_jsonl_rows_are_the_admin_api_records(
    stack: tuple[Proxy, list[tuple[str, Played]]], tmp_path: Path
) -> None:
    """JSON Lines: each row is the run's record as the admin API returns it, in order, plus the
    prompt and the output the client saw."""
    proxy, runs = stack
    run, played = runs[0]
    out = tmp_path / "run.jsonl"
    stderr = export(proxy, out, "--run", run, "--format", "jsonl")
    assert "100% |" in stderr and f"exported {len(played.records)} records" in stderr
    rows = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    records = api_records(proxy, run)
    assert [{k: v for k, v in r.items() if k not in ("prompt", "output")} for r in rows] == records
    outputs = [text for e in EPISODES for text in played.outputs[e.id]]
    assert [r["output"] for r in rows] == outputs
    assert rows[1]["prompt"] == EPISODES[0].render(played.outputs[EPISODES[0].id][:1])


def _typed(value: Any, kind: str) -> Any:
    if value is None or kind != "timestamp[ms, UTC]":
        return value
    return datetime.fromisoformat(value)


def test_parquet_columns_are_typed_and_equal_the_records(
    stack: tuple[Proxy, list[tuple[str, Played]]], tmp_path: Path
) -> None:
    """Parquet: the documented columns with their types; each row's values equal the admin
    API's record (``at`` as a UTC timestamp), nothing left in ``extra`` but what has no column."""
    proxy, runs = stack
    run, played = runs[1]
    out = tmp_path / "run.parquet"
    export(proxy, out, "--run", run)
    table = pq.read_table(out)
    assert [(f.name, f.type) for f in table.schema] == [(n, ARROW[k]) for n, k in COLUMNS]
    rows = table.to_pylist()
    records = api_records(proxy, run)
    assert len(rows) == len(records) == len(played.records)
    for row, record in zip(rows, records, strict=True):
        extra = orjson.loads(row["extra"]) if row["extra"] else {}
        for name, kind in COLUMNS:
            if name in ("extra", "prompt", "output"):
                continue
            assert row[name] == _typed(record.get(name), kind), name
        assert extra == {k: v for k, v in record.items() if k not in {n for n, _ in COLUMNS}}
    assert all(isinstance(r["output"], str) for r in rows)


def test_an_arm_export_reproduces_the_divergence_table(
    stack: tuple[Proxy, list[tuple[str, Played]]], tmp_path: Path
) -> None:
    """--arm exports every run of the arm; the DuckDB example of docs/ui.md finds, from the
    file alone, the episodes and first differing positions ``kvledger runs diff`` finds."""
    proxy, runs = stack
    (run_a, _), (run_b, _) = runs
    out = tmp_path / "arm.parquet"
    export(proxy, out, "--arm", "export-arm", "--quiet")
    per_run = duckdb.sql(f"SELECT run, count(*) FROM '{out}' GROUP BY run ORDER BY run").fetchall()
    assert per_run == sorted((run, len(p.records)) for run, p in runs)
    con = duckdb.connect()
    # docs/ui.md, "From a notebook", with this test's file and runs:
    con.sql(
        "CREATE VIEW r AS SELECT *,"
        ' row_number() OVER (PARTITION BY run, episode ORDER BY "at") - 1'
        f" AS pos FROM '{out}'"
    )
    table = con.sql(
        "SELECT a.episode, min(a.pos) AS first_diff FROM r a JOIN r b USING (episode, pos)"
        f" WHERE a.run = '{run_a}' AND b.run = '{run_b}' AND a.output_digest <> b.output_digest"
        " GROUP BY 1 ORDER BY 1"
    ).fetchall()
    found = orjson.loads(cli(proxy, "runs", "diff", run_a, run_b, "--json").stdout)
    diverged = [e for e in found["episodes"] if e["kind"] == "output"]
    assert diverged, "the warm rerun diverged in no episode (the stand-in is deterministic)"
    assert table == sorted((e["episode"], e["position"]) for e in diverged)


def test_a_time_window_and_bad_arguments(
    stack: tuple[Proxy, list[tuple[str, Played]]], tmp_path: Path
) -> None:
    """--since/--until alone read every replica's records in the window; an empty window
    exports nothing; no selection, or --run with --arm, is a usage error (2)."""
    proxy, runs = stack
    records = api_records(proxy, runs[0][0]) + api_records(proxy, runs[1][0])
    since, until = records[0]["at"], records[-1]["at"]
    out = tmp_path / "window.jsonl"
    export(proxy, out, "--since", since, "--until", until, "--format", "jsonl")
    ids = {orjson.loads(line)["request_id"] for line in out.read_bytes().splitlines()}
    assert {r["request_id"] for r in records} <= ids
    export(proxy, out, "--since", "2001-01-01", "--until", "2001-01-02", "--format", "jsonl")
    assert out.read_bytes() == b""
    assert cli(proxy, "export", "--out", str(out)).returncode == 2
    both = cli(proxy, "export", "--run", "a", "--arm", "b", "--out", str(out))
    assert both.returncode == 2 and "not both" in both.stderr
    missing = cli(proxy, "export", "--run", "nope.1", "--out", str(out))
    assert missing.returncode == 1 and "no run 'nope.1'" in missing.stderr
