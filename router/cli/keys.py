"""``kvledger keys create|list|revoke``: API keys and their profiles, straight in Redis.

These talk to Redis rather than to a proxy, so keys can be made before any proxy runs. A proxy
caches lookups for a few seconds (``KeyStore``), so a revoked key may work that much longer.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict
from typing import Any

from router.cli.common import (
    CliError,
    add_redis_options,
    cli_errors,
    print_json_lines,
    print_table,
    redis_url,
    with_redis,
)

# How ProfileError's field names read on the command line.
FLAGS = {
    "name": "NAME",
    "mode": "--mode",
    "cache": "--cache",
    "replica": "--replica",
    "idle_timeout_s": "--idle-timeout",
}


CREATE_HELP = """\
Create an API key and print it; it is shown only this once (Redis keeps its sha256).

--mode production: requests are routed by the proxy's policy and recorded.
--mode eval: the key is an arm; its requests form runs on one leased replica, one at a
time, each checked for continuity. --cache says how each run's cache starts:
  reset          a verified reset (drain, unload and load the model, counters at zero)
  off            a replica with KV-cache block reuse disabled (needs one configured)
  shared         nothing: pinned and recorded, the cache as it is (to measure)
  replay:SNAP    a verified reset, then snapshot SNAP replayed, its fingerprint checked
"""


def register(commands: Any) -> None:
    keys = commands.add_parser("keys", help="create, list and revoke API keys (in Redis)")
    actions = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser(
        "create",
        help="create a key and print it (shown only once)",
        description=CREATE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    create.add_argument("name", help="the key's name, recorded with every request it sends")
    create.add_argument("--mode", required=True, metavar="MODE", help="production or eval")
    create.add_argument(
        "--cache",
        metavar="CACHE",
        help="eval keys: how each run's cache starts: reset | off | shared | replay:SNAPSHOT",
    )
    create.add_argument("--replica", metavar="ID", help="eval keys: pin runs to this replica")
    create.add_argument(
        "--idle-timeout", type=float, metavar="S", help="eval keys: end a run after S idle seconds"
    )
    add_redis_options(create)
    create.set_defaults(run=run_create)

    listing = actions.add_parser("list", help="list the keys' profiles (never the keys)")
    listing.add_argument("--json", action="store_true", help="JSON lines, not a table")
    add_redis_options(listing)
    listing.set_defaults(run=run_list)

    revoke = actions.add_parser("revoke", help="revoke a key by name")
    revoke.add_argument("name")
    add_redis_options(revoke)
    revoke.set_defaults(run=run_revoke)


@cli_errors
def run_create(args: argparse.Namespace) -> int:
    from router.eval.profiles import ProfileError, now_iso, validate_profile
    from router.ledger.keys import KeyStore

    fields = {
        "name": args.name,
        "mode": args.mode,
        "cache": args.cache,
        "replica": args.replica,
        "idle_timeout_s": args.idle_timeout,
    }
    try:
        profile = validate_profile(fields, created_at=now_iso())
    except ProfileError as exc:
        raise CliError(f"{FLAGS.get(exc.param, exc.param)}: {exc.message}", code=2) from None

    async def create(client: Any) -> str:
        from router.eval.profiles import REPLAY, check_fleet
        from router.ledger.runs import RunStore

        store = RunStore(client)
        snapshot = (profile.cache or "").removeprefix(REPLAY)
        exists = snapshot != profile.cache and await store.snapshot(snapshot) is not None
        try:
            check_fleet(profile, await store.registry(), exists)
        except ProfileError as exc:
            raise CliError(f"{FLAGS.get(exc.param, exc.param)}: {exc.message}", code=2) from None
        return await KeyStore(client).create(profile)

    try:
        raw = with_redis(redis_url(args, os.environ), create)
    except ValueError as exc:  # the name is taken
        raise CliError(str(exc)) from None
    # The key alone on stdout, so KEY=$(kvledger keys create ...) captures just the key.
    print(raw, flush=True)
    cache = f", cache {profile.cache}" if profile.cache else ""
    print(f"created {profile.mode} key '{profile.name}'{cache}", file=sys.stderr)
    print("this key is shown only once and is not stored anywhere: save it now", file=sys.stderr)
    return 0


@cli_errors
def run_list(args: argparse.Namespace) -> int:
    from router.ledger.keys import KeyStore

    profiles = with_redis(redis_url(args, os.environ), lambda r: KeyStore(r).list())
    if args.json:
        print_json_lines(asdict(p) for p in profiles)
    else:
        columns = ("name", "mode", "cache", "replica", "created_at")
        print_table(columns, [[getattr(p, c) for c in columns] for p in profiles])
    return 0


@cli_errors
def run_revoke(args: argparse.Namespace) -> int:
    from router.ledger.keys import KeyStore

    revoked = with_redis(redis_url(args, os.environ), lambda r: KeyStore(r).revoke(args.name))
    if not revoked:
        raise CliError(f"no key named '{args.name}'")
    print(f"revoked key '{args.name}'; proxies may accept it for a few more seconds (their cache)")
    return 0
