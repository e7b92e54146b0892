"""``kvledger audit chain [--replica ID]``: check every replica's chain from its records alone.

It reads the replicas' lineage streams straight from Redis (no proxy needed) and reports, per
replica, breaks (states that do not follow), gaps (records missing), duplicates, and the
records whose state is unknown, unordered or stale. It exits 1 when it finds a break, a gap or
a duplicate, so it can run in a cron job or a pipeline.

It also prints the ledger epochs it saw and where the ledger's history starts: when Redis lost
its data (a restart without persistence, a FLUSHALL), the chains that follow hold again, but
the records before are gone, and this says since when the ledger is whole.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from router.cli.common import (
    add_redis_options,
    cli_errors,
    print_json_lines,
    print_table,
    reader,
    redis_url,
    with_redis,
)

COLUMNS = ("replica", "records", "generations", "break", "gap", "duplicate", "unknown")
MORE = ("unordered", "stale", "trimmed")


def register(commands: Any) -> None:
    audit = commands.add_parser("audit", help="check the ledger's chains from the records alone")
    actions = audit.add_subparsers(dest="action", required=True, metavar="ACTION")
    chain = actions.add_parser(
        "chain",
        help="walk each replica's lineage and report breaks, gaps, duplicates, unknown states",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    chain.add_argument("--replica", metavar="ID", action="append", help="only this replica")
    chain.add_argument(
        "--json",
        action="store_true",
        help='one JSON line per replica, then one with the ledger\'s epochs ({"ledger": ...})',
    )
    add_redis_options(chain)
    chain.set_defaults(run=run_chain)


@cli_errors
def run_chain(args: argparse.Namespace) -> int:
    from router.ledger.audit import history, history_json
    from router.ledger.epoch import read_epochs

    url = redis_url(args, os.environ)
    audits = with_redis(url, lambda client: reader(client).audit(args.replica))
    epochs = with_redis(url, read_epochs)
    if args.json:
        print_json_lines([*(a.as_json() for a in audits), history_json(epochs)])
        return 0 if all(a.ok for a in audits) else 1
    counts = COLUMNS[3:] + MORE
    rows = [[a.replica, a.records, a.generations, *(a.counts[c] for c in counts)] for a in audits]
    print_table(COLUMNS + MORE, rows)
    for audit in audits:
        for finding in audit.findings:
            print(finding)
    for line in history(epochs):
        print(line)
    bad = [a.replica for a in audits if not a.ok]
    verdict = f"problems on {', '.join(bad)}" if bad else "every chain holds"
    print(f"{len(audits)} replica(s) audited: {verdict}")
    return 1 if bad else 0
