"""``kvledger lineage show|tail``: read lineage records from Redis through the ledger's readers."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from router.cli.common import (
    CliError,
    add_redis_options,
    cli_errors,
    print_json_lines,
    print_table,
    reader,
    redis_url,
    with_redis,
)

if TYPE_CHECKING:
    from router.ledger import Ledger
    from router.ledger.connect import RedisClient

Records = list[dict[str, Any]]
Emit = Callable[[Records], None]
COLUMNS = (
    "request_id",
    "at",
    "key",
    "replica",
    "gen",
    "seq",
    "state",
    "status",
    "reused",
    "latency_ms",
)
# Minimum widths, so the batches --follow prints one by one line up.
WIDTHS = (24, 29, 10, 7, 3, 5, 12, 9, 7, 10)
POLL_S = 1.0
# --follow remembers this many request ids to recognise what it printed already.
SEEN_LIMIT = 10_000
SKIPPED = "kvledger: over {count} new records within a second; some may be missing (raise --count)"


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def register(commands: Any) -> None:
    lineage = commands.add_parser("lineage", help="lineage records: one request, or the tail")
    actions = lineage.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = actions.add_parser("show", help="print one request's record as JSON")
    show.add_argument("request_id", metavar="REQUEST_ID", help="from the X-Request-Id header")
    add_redis_options(show)
    show.set_defaults(run=run_show)

    tail = actions.add_parser("tail", help="the newest records, newest last")
    tail.add_argument("--count", type=_positive, default=20, metavar="N", help="default 20")
    tail.add_argument("--replica", metavar="ID", help="only this replica's records")
    tail.add_argument("--key", metavar="NAME", help="only this key's records")
    # dest run_id: ``args.run`` is the function that runs the command.
    tail.add_argument("--run", dest="run_id", metavar="RUN", help="only this eval run's records")
    tail.add_argument("--json", action="store_true", help="JSON lines, not a table")
    tail.add_argument("--follow", action="store_true", help="keep printing new records (Ctrl-C)")
    add_redis_options(tail)
    tail.set_defaults(run=run_tail)


@cli_errors
def run_show(args: argparse.Namespace) -> int:
    record = with_redis(redis_url(args, os.environ), lambda r: reader(r).record(args.request_id))
    if record is None:
        raise CliError(f"no lineage record for request '{args.request_id}' (unknown or expired)")
    print(orjson.dumps(record, option=orjson.OPT_INDENT_2).decode())
    return 0


@cli_errors
def run_tail(args: argparse.Namespace) -> int:
    emit = _emitter(args.json)
    url = redis_url(args, os.environ)
    if not args.follow:
        with_redis(url, lambda r: _print_tail(reader(r), args, emit))
        return 0
    try:
        with_redis(url, lambda r: _follow(r, args, emit))
    except KeyboardInterrupt:
        pass  # Ctrl-C is how --follow ends
    return 0


def _row(record: dict[str, Any]) -> list[object]:
    state = record.get("state_before")
    return [
        record.get("request_id"),
        record.get("at"),
        record.get("key"),
        record.get("replica"),
        record.get("generation"),
        record.get("seq"),
        state[:12] if isinstance(state, str) else None,
        record.get("status"),
        f"{record.get('reused_blocks', 0)}/{record.get('total_blocks', 0)}",
        record.get("latency_ms"),
    ]


def _emitter(as_json: bool) -> Emit:
    printed_header = False

    def emit(records: Records) -> None:
        nonlocal printed_header
        if as_json:
            print_json_lines(records)
        elif records or not printed_header:
            print_table(COLUMNS, map(_row, records), widths=WIDTHS, header=not printed_header)
            printed_header = True

    return emit


async def _tail(ledger: Ledger, args: argparse.Namespace, count: int) -> Records:
    return await ledger.tail(count, replica=args.replica, key=args.key, run=args.run_id)


async def _print_tail(ledger: Ledger, args: argparse.Namespace, emit: Emit) -> None:
    emit(await _tail(ledger, args, args.count))


async def _follow(client: RedisClient, args: argparse.Namespace, emit: Emit) -> None:
    """Print the tail, then every second what arrived since, until cancelled.

    Each poll reads the newest ``--count`` records: a deeper window would make a filtered poll
    scan far back through the stream every second. When a whole window is new, records may
    have been skipped, and stderr says so.
    """
    ledger = reader(client)
    records = await _tail(ledger, args, args.count)
    emit(records)
    seen = dict.fromkeys(_ids(records))  # insertion-ordered: the oldest ids are forgotten first
    while True:
        await asyncio.sleep(POLL_S)
        records = await _tail(ledger, args, args.count)
        fresh = [r for r in records if str(r.get("request_id")) not in seen]
        if len(fresh) == args.count:
            print(SKIPPED.format(count=args.count), file=sys.stderr, flush=True)
        emit(fresh)
        seen.update(dict.fromkeys(_ids(fresh)))
        for old in list(seen)[: max(0, len(seen) - SEEN_LIMIT)]:
            del seen[old]


def _ids(records: Records) -> list[str]:
    return [str(r.get("request_id")) for r in records]
