"""``kvledger replicas``: the fleet.

``up`` starts CPU stand-in replicas (real tritonserver processes). ``list`` (also bare
``kvledger replicas``), ``drain`` and ``undrain`` ask a running proxy's admin API. ``check``
talks to the replicas themselves (:mod:`router.cli.replica_check`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

from router.cli.common import (
    AdminApi,
    CliError,
    add_admin_options,
    cli_errors,
    print_json_lines,
    print_table,
)

CHECK_HELP = """\
Prove that live replicas behave as the ledger assumes: one line per behaviour, PASS or FAIL,
what the check saw and, for a FAIL, the setting to change; exit 0 only when every line passes.
Name replicas of the proxy's config by ID (all of them if none), or one replica by its URLs.
Run it on replicas nobody else uses; --reset also unloads and loads the model (docs/deploy.md).
"""


def register(commands: Any) -> None:
    replicas = commands.add_parser("replicas", help="stand-in replicas and the fleet")
    actions = replicas.add_subparsers(dest="action", metavar="ACTION")
    up = actions.add_parser(
        "up",
        help="start N stand-in Triton replicas on loopback and keep them running until Ctrl-C",
    )
    up.add_argument("--count", type=int, default=2, help="replicas to start (default 2)")
    up.add_argument(
        "--reuse-off",
        type=int,
        default=0,
        metavar="K",
        help="how many of them run with KV-cache block reuse disabled (for cache=off keys)",
    )
    up.add_argument(
        "--precision",
        choices=("bf16", "fp16", "fp32", "int4"),
        default="bf16",
        help="weights and stored values: bf16 (default), fp16, fp32 (no 16-bit rounding), int4",
    )
    up.add_argument("--tokens-per-block", type=int, default=16)
    up.add_argument(
        "--cache-tokens",
        type=int,
        default=131072,
        help="KV-cache capacity in tokens (max_tokens_in_paged_kv_cache)",
    )
    up.add_argument("--weight-seed", type=int, default=0, help="seed of the random weights")
    up.add_argument("--prefix", default="r", help="replica ids are PREFIX1, PREFIX2, ...")
    up.add_argument("--workdir", type=Path, help="keep model repositories and logs here")
    up.add_argument("--config-out", type=Path, help="also write the proxy config snippet here")
    up.set_defaults(run=run_up)
    _register_admin(replicas, actions)


def _register_admin(replicas: argparse.ArgumentParser, actions: Any) -> None:
    # Bare ``kvledger replicas [--json]`` lists, so the parent takes list's options too.
    add_admin_options(replicas)
    replicas.set_defaults(run=run_list)
    listing = actions.add_parser(
        "list", help="the proxy's replicas: pool, health, lease, cache state"
    )
    add_admin_options(listing, suppress=True)
    listing.set_defaults(run=run_list)
    for name, help_ in (
        ("drain", "stop sending production traffic to a replica (this proxy instance)"),
        ("undrain", "send production traffic to a drained replica again"),
    ):
        action = actions.add_parser(name, help=help_)
        action.add_argument("replica_id", metavar="ID")
        if name == "drain":
            action.add_argument(
                "--move-runs",
                action="store_true",
                help="also move the eval runs leased on it elsewhere (verified reset and"
                " replay of each run's history; waits for them)",
            )
        add_admin_options(action, suppress=True)
        action.set_defaults(run=run_drain, drain=name == "drain")
    reset = actions.add_parser(
        "reset",
        help="verified reset: stop admitting, wait until idle, reload, confirm, new generation",
    )
    reset.add_argument("replica_id", metavar="ID")
    add_admin_options(reset, suppress=True)
    reset.set_defaults(run=run_reset)
    _register_check(actions)


@cli_errors
def run_list(args: argparse.Namespace) -> int:
    body = AdminApi.from_args(args, os.environ).call("GET", "/admin/replicas")
    replicas = body.get("replicas", [])
    if args.json:
        print_json_lines(replicas)
    else:
        columns = (
            *("id", "healthy", "draining", "lease", "in_flight", "generation", "seq"),
            *("state", "pool"),
        )
        fields = ("id", "healthy", "draining", "leased_by", "in_flight", "generation", "seq")
        rows = [
            [*(r.get(f) for f in fields), (r.get("state") or "")[:12] or None, r.get("pool")]
            for r in replicas
        ]
        print_table(columns, rows)
    if body.get("redis") is False:
        print("kvledger: the proxy cannot reach Redis: seq and state unknown", file=sys.stderr)
    return 0


@cli_errors
def run_drain(args: argparse.Namespace) -> int:
    api = AdminApi.from_args(args, os.environ)
    action = "drain" if args.drain else "undrain"
    if args.drain and args.move_runs:
        return _move_runs(api, args.replica_id)
    body = api.call("POST", f"/admin/replicas/{quote(args.replica_id, safe='')}/{action}")
    if args.drain:
        print(f"{args.replica_id}: draining, {body.get('in_flight', 0)} request(s) in flight")
    else:
        print(f"{args.replica_id}: taking production traffic again")
    return 0


def _move_runs(api: AdminApi, replica: str) -> int:
    print(f"{replica}: draining and moving its runs (reset and replay)...", file=sys.stderr)
    path = f"/admin/replicas/{quote(replica, safe='')}/move-runs"
    body = api.call("POST", path, timeout_s=900)
    failed = 0
    for entry in body.get("runs", []):
        if entry.get("moved"):
            move = entry["move"]
            print(
                f"run {entry['run']}: moved {move['from']} -> {move['to']},"
                f" {move['replayed']} request(s) replayed in {move['seconds']:.2f} s"
            )
        else:
            failed += 1
            print(f"run {entry['run']}: not moved: {entry.get('reason')}")
    state = "draining" if body.get("draining") else "not configured here"
    print(f"{replica}: {state}, {len(body.get('runs', []))} run(s) moved off or stopped")
    return 1 if failed else 0


@cli_errors
def run_reset(args: argparse.Namespace) -> int:
    api = AdminApi.from_args(args, os.environ)
    print(f"{args.replica_id}: resetting (waits for in-flight requests)...", file=sys.stderr)
    path = f"/admin/replicas/{quote(args.replica_id, safe='')}/reset"
    body = api.call("POST", path, timeout_s=900)
    if args.json:
        print_json_lines([body])
    else:
        print(
            f"{body['replica']}: generation {body['generation']}, state {body['state'][:12]}"
            f" (genesis); waited {body['waited_ms']} ms, reload {body['reload_ms']} ms,"
            f" total {body['duration_ms']} ms"
        )
    return 0


def run_up(args: argparse.Namespace) -> int:
    from backends.sim.launcher import LaunchError, config_snippet, launch
    from router.cli import local

    if args.count < 1 or not 0 <= args.reuse_off <= args.count:
        print("kvledger: need --count >= 1 and 0 <= --reuse-off <= --count", file=sys.stderr)
        return 2
    specs = local.stand_in_specs(
        args.count,
        args.count - args.reuse_off,
        args.prefix,
        tokens_per_block=args.tokens_per_block,
        max_tokens_in_paged_kv_cache=args.cache_tokens,
        precision=args.precision,
        weight_seed=args.weight_seed,
    )
    print(f"starting {args.count} stand-in replica(s)...", flush=True)
    try:
        with launch(specs, workdir=args.workdir) as running:
            print("\n".join(map(local.describe, running)))
            snippet = config_snippet(running)
            if args.config_out:
                args.config_out.write_text(snippet)
            print("\n# proxy config (kvledger serve --config):\n" + snippet, flush=True)
            print("ready; Ctrl-C stops them", flush=True)
            local.wait_for_signal()
            print("stopping...", flush=True)
    except LaunchError as exc:
        print(f"kvledger: {exc}", file=sys.stderr)
        return 1
    return 0


def _register_check(actions: Any) -> None:
    """``kvledger replicas check`` (:mod:`router.cli.replica_check`)."""
    parser = actions.add_parser(
        "check",
        help="prove a live replica behaves as the ledger assumes (PASS/FAIL per behaviour)",
        description=CHECK_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("replica_ids", nargs="*", metavar="ID", help="replicas of --config (all)")
    parser.add_argument("--config", type=Path, help="the proxy's TOML config (or $KVL_CONFIG)")
    parser.add_argument("--grpc", help="HOST:PORT of Triton's gRPC API (instead of an ID)")
    parser.add_argument("--http", help="Triton's HTTP URL, e.g. http://host:8000")
    parser.add_argument("--metrics", help="Triton's metrics URL, e.g. http://host:8002/metrics")
    parser.add_argument("--model", default="ensemble")
    parser.add_argument("--engine-model", default="tensorrt_llm")
    parser.add_argument("--engine-dir", default="", help="the engine directory as seen here")
    parser.add_argument("--seed-input", default="seed")
    parser.add_argument("--perf-input", default="return_perf_metrics")
    parser.add_argument("--no-token-counts", action="store_true")
    parser.add_argument("--reuse-off", action="store_true", help="the replica should not reuse")
    parser.add_argument("--reset", action="store_true", help="also unload + load (disturbs it)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.set_defaults(run=run_check)


def _targets(args: argparse.Namespace) -> list[tuple[Any, str, Any]]:
    from backends.triton_target import TritonTarget
    from router.cli.replica_check import Expect
    from router.settings import load_settings
    from router.settings_check import SettingsError

    if args.grpc or args.http or args.metrics:
        if not (args.grpc and args.http and args.metrics) or args.replica_ids:
            raise CliError("by URL: give --grpc, --http and --metrics (and no ID)", 2)
        target = TritonTarget(
            "replica",
            args.grpc,
            args.metrics,
            args.model,
            args.seed_input,
            args.perf_input,
            not args.no_token_counts,
            10.0,
            args.engine_model,
            args.engine_dir,
        )
        return [(target, args.http.rstrip("/"), Expect(reuse=not args.reuse_off))]
    path = args.config or (Path(os.environ["KVL_CONFIG"]) if "KVL_CONFIG" in os.environ else None)
    if path is None:
        raise CliError("give replica IDs with --config FILE, or --grpc, --http and --metrics", 2)
    try:
        settings = load_settings(path, os.environ)
    except SettingsError as exc:
        raise CliError(str(exc), 2) from exc
    wanted = set(args.replica_ids)
    unknown = wanted - {r.id for r in settings.replicas}
    if unknown:
        raise CliError(f"no replica {', '.join(sorted(unknown))} in {path}", 2)
    found = []
    for r in settings.replicas:
        if wanted and r.id not in wanted:
            continue
        if not r.http:
            raise CliError(f"replica {r.id}: the check needs its http URL in the config", 2)
        target = TritonTarget(
            r.id,
            r.grpc,
            r.metrics,
            r.model,
            r.seed_input,
            r.perf_input,
            r.token_counts,
            settings.limits.backend_timeout_s,
            r.engine_model,
            r.engine_dir,
        )
        found.append((target, r.http.rstrip("/"), Expect(r.reuse, r.tokens_per_block)))
    return found


@cli_errors
def run_check(args: argparse.Namespace) -> int:
    import asyncio

    from router.cli.replica_check import check

    passed = True
    for target, http_url, expect in _targets(args):
        lines = asyncio.run(check(target, http_url, expect, args.reset))
        passed = passed and all(line.ok for line in lines)
        if args.json:
            print_json_lines({"replica": target.replica_id, **vars(line)} for line in lines)
            continue
        print(f"replica {target.replica_id} ({target.grpc}):")
        for line in lines:
            print("  " + line.render().replace("\n", "\n  "))
    return 0 if passed else 1
