"""The ``kvledger`` command.

Subcommands register themselves on one argparse tree; each lives in its own module and imports
its heavy dependencies (the stand-in engine, Redis, aiohttp) only when it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from router.cli import audit, export, keys, lineage, replica, replicas, runs, serve, up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvledger",
        description="Record and control the KV-cache state behind every LLM response.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up.register(commands)
    serve.register(commands)
    replicas.register(commands)
    replica.register(commands)
    keys.register(commands)
    lineage.register(commands)
    runs.register(commands)
    audit.register(commands)
    export.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code
