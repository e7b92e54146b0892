"""``kvledger export``: records to Parquet or JSON Lines, for notebooks.

One row a request. Select a run (``--run``), every run of an arm (``--arm``), or a time window
(``--since/--until``, ISO 8601; alone they read every replica's stream, with a run or an arm
they filter its records by ``at``). Parquet has the typed columns of
``router.ledger.export.COLUMNS`` (docs/ui.md); JSON Lines writes each record as the admin API
returns it, plus ``prompt`` and ``output`` when the run kept them. A progress bar goes to
stderr; the output file is written beside its name and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from router.cli.common import CliError, add_redis_options, cli_errors, redis_url, with_redis

if TYPE_CHECKING:
    from router.ledger.connect import RedisClient
    from router.ledger.export import RecordPages

Record = dict[str, Any]
BAR = 30


def register(commands: Any) -> None:
    export = commands.add_parser(
        "export", help="records of a run, an arm or a time window to Parquet or JSON Lines"
    )
    export.add_argument("--run", dest="run_id", metavar="RUN", help="the records of this run")
    export.add_argument("--arm", help="the records of every run of this arm, oldest run first")
    export.add_argument("--since", type=_when, help="from this time (ISO 8601, UTC if no zone)")
    export.add_argument("--until", type=_when, help="up to this time (ISO 8601)")
    export.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    export.add_argument("--out", type=Path, required=True, metavar="FILE")
    export.add_argument("--quiet", action="store_true", help="no progress bar")
    add_redis_options(export)
    export.set_defaults(run=run_export)


def _when(value: str) -> int:
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {value!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return round(moment.timestamp() * 1000)


class Progress:
    """A one-line bar on stderr, redrawn at most ten times a second."""

    def __init__(self, total: int | None, quiet: bool) -> None:
        self.total, self.quiet = total, quiet
        self.done, self.started, self.drawn = 0, time.monotonic(), 0.0

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if not self.quiet and now - self.drawn >= 0.1:
            self.drawn = now
            self._draw(now)

    def close(self) -> None:
        if not self.quiet:
            self._draw(time.monotonic())
            print(file=sys.stderr)

    def _draw(self, now: float) -> None:
        took = now - self.started
        rate = self.done / took if took > 0 else 0.0
        if self.total:
            share = min(1.0, self.done / self.total)
            bar = "#" * round(share * BAR)
            head = f"{share:4.0%} |{bar.ljust(BAR)}| {self.done}/{self.total}"
        else:
            head = f"{self.done}"
        sys.stderr.write(f"\rexport {head} records [{took:.1f}s, {rate:,.0f}/s]")
        sys.stderr.flush()


class Sink(Protocol):
    def write(self, records: list[Record], kept: list[Record | None]) -> None: ...
    def close(self) -> None: ...


class JsonLines:
    def __init__(self, path: Path) -> None:
        self.file = path.open("wb")

    def write(self, records: list[Record], kept: list[Record | None]) -> None:
        for record, k in zip(records, kept, strict=True):
            if k is not None:
                extra = {n: k[n] for n in ("prompt", "output") if k.get(n) is not None}
                record = {**record, **extra}
            self.file.write(orjson.dumps(record) + b"\n")

    def close(self) -> None:
        self.file.close()


class Parquet:
    def __init__(self, path: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from router.ledger.export import COLUMNS

        types = {
            "string": pa.string(),
            "int64": pa.int64(),
            "float64": pa.float64(),
            "bool": pa.bool_(),
            "timestamp[ms, UTC]": pa.timestamp("ms", tz="UTC"),
        }
        self.pa = pa
        self.kinds = dict(COLUMNS)
        self.schema = pa.schema([(name, types[kind]) for name, kind in COLUMNS])
        self.writer = pq.ParquetWriter(path, self.schema, compression="zstd")

    def write(self, records: list[Record], kept: list[Record | None]) -> None:
        from router.ledger.export import columns

        data = columns(records, kept)
        arrays = [self._array(data[f.name], f) for f in self.schema]
        self.writer.write_table(self.pa.Table.from_arrays(arrays, schema=self.schema))

    def _array(self, values: list[Any], column: Any) -> Any:
        """pyarrow converts a column at once; ``at`` is parsed from its ISO 8601 text."""
        from router.ledger.export import coerce

        pa, kind = self.pa, self.kinds[column.name]
        try:
            if kind == "timestamp[ms, UTC]":
                return pa.array(values, pa.string()).cast(column.type)
            return pa.array(values, column.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
            return pa.array(
                coerce(values, kind), pa.int64() if kind.startswith("time") else column.type
            ).cast(column.type)

    def close(self) -> None:
        self.writer.close()


@cli_errors
def run_export(args: argparse.Namespace) -> int:
    if not (args.run_id or args.arm or args.since is not None or args.until is not None):
        raise CliError("say what to export: --run, --arm, or --since/--until", code=2)
    if args.run_id and args.arm:
        raise CliError("give --run or --arm, not both", code=2)
    out: Path = args.out
    partial = out.with_name(out.name + ".partial")
    sink: Sink = Parquet(partial) if args.format == "parquet" else JsonLines(partial)
    try:
        count = with_redis(redis_url(args, os.environ), lambda r: _export(r, args, sink))
        sink.close()
        partial.replace(out)
    finally:
        partial.unlink(missing_ok=True)
    print(f"exported {count} records to {out}", file=sys.stderr)
    return 0


async def _export(client: RedisClient, args: argparse.Namespace, sink: Sink) -> int:
    from router.ledger.export import RecordPages, at_ms

    pages = RecordPages(client, timeout_s=10.0)
    since = -1 if args.since is None else int(args.since)
    until = 2**62 if args.until is None else int(args.until)
    runs = [args.run_id] if args.run_id else await pages.runs_of(args.arm) if args.arm else []
    if args.arm and not runs:
        raise CliError(f"no runs of arm '{args.arm}'")
    total = sum([await pages.run_length(r) for r in runs]) if runs else None
    progress = Progress(total, args.quiet)
    kept: dict[str, dict[str, Record]] = {}  # each run's kept inputs, read once
    count = 0
    async for records in _batches(pages, runs, since, until):
        progress.add(len(records))
        if runs and (args.since is not None or args.until is not None):
            records = [r for r in records if since <= (at_ms(r.get("at")) or 0) <= until]
        for run in {str(r["run"]) for r in records if r.get("run")} - set(kept):
            kept[run] = await pages.inputs(run)
        inputs = [kept.get(str(r.get("run")), {}).get(str(r.get("request_id"))) for r in records]
        sink.write(records, inputs)
        count += len(records)
    progress.close()
    return count


async def _batches(
    pages: RecordPages, runs: list[str], since: int, until: int
) -> AsyncIterator[list[Record]]:
    if not runs:
        async for records in pages.window(max(0, since), min(until, 2**48)):
            yield records
        return
    for run in runs:
        if await pages.run_length(run) == 0 and await pages.store.get(run) is None:
            raise CliError(f"no run '{run}'")
        async for records in pages.run_records(run):
            yield records
