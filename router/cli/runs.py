"""``kvledger runs begin|list|show|end|diff|explain``, ``kvledger snapshots save|list|show|delete``.

Beginning and ending runs and saving snapshots need a proxy (it leases, resets and replays),
so those go through the admin API; ``runs diff`` reads the two runs' records from Redis.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import orjson

from router.cli import explain
from router.cli.common import (
    AdminApi,
    CliError,
    add_admin_options,
    add_redis_options,
    cli_errors,
    print_json_lines,
    print_table,
    reader,
    redis_url,
    with_redis,
)

RUN_COLUMNS = ("id", "arm", "cache", "status", "replica", "generation", "began_at", "end_reason")
LONG_S = 900.0  # a begin waits for in-flight requests, a reload and maybe a replay


def register(commands: Any) -> None:
    runs = commands.add_parser("runs", help="eval runs: begin, list, show, end, diff, explain")
    actions = runs.add_subparsers(dest="action", required=True, metavar="ACTION")
    begin = actions.add_parser("begin", help="begin a run of an eval arm (ends its current run)")
    begin.add_argument("arm", help="the eval key's name")
    begin.add_argument("--model", help="the model the run serves (default: the first)")
    listing = actions.add_parser("list", help="recent runs, newest first")
    listing.add_argument("--arm", help="only this arm's runs")
    listing.add_argument("--count", type=int, default=50)
    show = actions.add_parser("show", help="a run and counts of its records")
    show.add_argument("run_id", metavar="RUN")
    end = actions.add_parser("end", help="end a run and release its replica")
    end.add_argument("run_id", metavar="RUN")
    for parser, run in ((begin, run_begin), (listing, run_list), (show, run_show), (end, run_end)):
        add_admin_options(parser)
        parser.set_defaults(run=run)
    diff = actions.add_parser(
        "diff", help="where two runs' outputs first differ, and what the ledger says of why"
    )
    diff.add_argument("run_a")
    diff.add_argument("run_b")
    diff.add_argument("--json", action="store_true", help="the whole comparison as JSON")
    diff.add_argument("--all", action="store_true", help="list identical episodes too")
    add_redis_options(diff)
    diff.set_defaults(run=run_diff)
    explain.register(actions)
    _register_snapshots(commands)


def _register_snapshots(commands: Any) -> None:
    snapshots = commands.add_parser("snapshots", help="saved cache states to replay")
    actions = snapshots.add_subparsers(dest="action", required=True, metavar="ACTION")
    save = actions.add_parser("save", help="save a snapshot from a run or a requests file")
    save.add_argument("name")
    source = save.add_mutually_exclusive_group(required=True)
    source.add_argument("--from-run", metavar="RUN", help="the run's requests, in order")
    source.add_argument(
        "--from-file",
        type=Path,
        metavar="JSONL",
        help="one /v1/completions body per line (prompt, max_tokens, ...), replayed to fingerprint",
    )
    save.add_argument("--upto", type=int, metavar="N", help="with --from-run: its first N requests")
    save.add_argument("--model", help="with --from-file: the model (default: the first)")
    listing = actions.add_parser("list", help="saved snapshots")
    show = actions.add_parser("show", help="one snapshot, with its requests")
    show.add_argument("name")
    delete = actions.add_parser("delete", help="delete a snapshot")
    delete.add_argument("name")
    for parser, run in (
        (save, run_save),
        (listing, run_snapshots),
        (show, run_snapshot),
        (delete, run_delete),
    ):
        add_admin_options(parser)
        parser.set_defaults(run=run)


def _print_runs(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    if args.json:
        print_json_lines(runs)
    else:
        print_table(RUN_COLUMNS, [[r.get(c) for c in RUN_COLUMNS] for r in runs])


@cli_errors
def run_begin(args: argparse.Namespace) -> int:
    api = AdminApi.from_args(args, os.environ)
    body: dict[str, Any] = {"arm": args.arm}
    if args.model:
        body["model"] = args.model
    print(f"beginning a run of '{args.arm}' (lease, then reset or replay)...", file=sys.stderr)
    meta = api.call("POST", "/admin/runs", body, timeout_s=LONG_S)["run"]
    if args.json:
        print_json_lines([meta])
        return 0
    print(meta["id"], flush=True)  # alone on stdout: RUN=$(kvledger runs begin ARM)
    took = f", reset {meta['reset_ms']} ms" if meta.get("reset_ms") else ""
    print(
        f"run {meta['id']} live on {meta['replica']} (cache {meta['cache']}, generation"
        f" {meta['generation']}, state {meta['state'][:12]}{took}); {meta.get('choice')}",
        file=sys.stderr,
    )
    return 0


@cli_errors
def run_list(args: argparse.Namespace) -> int:
    query = {"count": str(args.count)} | ({"arm": args.arm} if args.arm else {})
    runs = AdminApi.from_args(args, os.environ).call("GET", "/admin/runs?" + urlencode(query))
    _print_runs(args, runs["runs"])
    return 0


@cli_errors
def run_show(args: argparse.Namespace) -> int:
    api = AdminApi.from_args(args, os.environ)
    body = api.call("GET", f"/admin/runs/{quote(args.run_id, safe='')}")
    if args.json:
        print_json_lines([body])
        return 0
    run = dict(body["run"])
    moved = run.pop("moves", None) or []
    for name, value in {**run, **body["records"]}.items():
        print(f"{name:>18}  {value}")
    print(f"{'moves':>18}  {len(moved)}")
    for i, move in enumerate(moved, 1):
        print(
            f"{'move ' + str(i):>18}  {move['at']} {move['from']} -> {move['to']}:"
            f" {move['replayed']} replayed in {move['seconds']:.2f} s (reset"
            f" {move.get('reset_s', 0):.2f} s, replay {move.get('replay_s', 0):.2f} s;"
            f" {move['why']})"
        )
    return 0


@cli_errors
def run_end(args: argparse.Namespace) -> int:
    api = AdminApi.from_args(args, os.environ)
    meta = api.call("POST", f"/admin/runs/{quote(args.run_id, safe='')}/end")["run"]
    _print_runs(args, [meta])
    return 0


@cli_errors
def run_diff(args: argparse.Namespace) -> int:
    from router.eval.diff import diff_runs, render_table

    async def both(client: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        ledger = reader(client)
        return await ledger.run_records(args.run_a), await ledger.run_records(args.run_b)

    records_a, records_b = with_redis(redis_url(args, os.environ), both)
    for run, records in ((args.run_a, records_a), (args.run_b, records_b)):
        if not records:
            raise CliError(f"run '{run}' has no records")
    diff = diff_runs(args.run_a, records_a, args.run_b, records_b)
    if args.json:
        print_json_lines([diff.to_json()])
    else:
        print("\n".join(render_table(diff, all_episodes=args.all)))
    return 0


@cli_errors
def run_save(args: argparse.Namespace) -> int:
    api = AdminApi.from_args(args, os.environ)
    body: dict[str, Any] = {"name": args.name}
    if args.from_run:
        body["from_run"] = args.from_run
        if args.upto is not None:
            body["upto"] = args.upto
    else:
        body["requests"] = _read_requests(args.from_file)
        if args.model:
            body["model"] = args.model
        print(f"replaying {len(body['requests'])} requests after a reset...", file=sys.stderr)
    snapshot = api.call("POST", "/admin/snapshots", body, timeout_s=LONG_S)["snapshot"]
    print(
        f"saved snapshot '{snapshot['name']}': {snapshot['count']} requests,"
        f" fingerprint {snapshot['fingerprint']}"
    )
    return 0


def _read_requests(path: Path) -> list[Any]:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise CliError(f"cannot read {path}: {exc.strerror}", code=2) from None
    requests = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                requests.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise CliError(f"{path}:{number}: not JSON: {exc}", code=2) from None
    if not requests:
        raise CliError(f"{path} holds no requests", code=2)
    return requests


@cli_errors
def run_snapshots(args: argparse.Namespace) -> int:
    snapshots = AdminApi.from_args(args, os.environ).call("GET", "/admin/snapshots")["snapshots"]
    columns = ("name", "count", "fingerprint", "source", "created_at")
    if args.json:
        print_json_lines(snapshots)
    else:
        print_table(columns, [[s.get(c) for c in columns] for s in snapshots])
    return 0


@cli_errors
def run_snapshot(args: argparse.Namespace) -> int:
    api = AdminApi.from_args(args, os.environ)
    print_json_lines([api.call("GET", f"/admin/snapshots/{quote(args.name, safe='')}")])
    return 0


@cli_errors
def run_delete(args: argparse.Namespace) -> int:
    api = AdminApi.from_args(args, os.environ)
    api.call("DELETE", f"/admin/snapshots/{quote(args.name, safe='')}")
    print(f"deleted snapshot '{args.name}'")
    return 0
