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

from router.cli import replica_check
from router.cli.common import AdminApi, add_admin_options, cli_errors, print_json_lines, print_table


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
        add_admin_options(action, suppress=True)
        action.set_defaults(run=run_drain, drain=name == "drain")
    reset = actions.add_parser(
        "reset",
        help="verified reset: stop admitting, wait until idle, reload, confirm, new generation",
    )
    reset.add_argument("replica_id", metavar="ID")
    add_admin_options(reset, suppress=True)
    reset.set_defaults(run=run_reset)
    replica_check.register(actions)


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
    body = api.call("POST", f"/admin/replicas/{quote(args.replica_id, safe='')}/{action}")
    if args.drain:
        print(f"{args.replica_id}: draining, {body.get('in_flight', 0)} request(s) in flight")
    else:
        print(f"{args.replica_id}: taking production traffic again")
    return 0


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
