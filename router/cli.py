"""The ``kvledger`` command.

Subcommands register themselves on one argparse tree; each lives in its own module and imports
its heavy dependencies (the stand-in engine, Redis, aiohttp) only when it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from router import (
    cli_keys,
    cli_lineage,
    cli_replica,
    cli_replicas,
    cli_runs,
    cli_serve,
    cli_up,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvledger",
        description="Record and control the KV-cache state behind every LLM response.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    cli_up.register(commands)
    cli_serve.register(commands)
    cli_replicas.register(commands)
    cli_replica.register(commands)
    cli_keys.register(commands)
    cli_lineage.register(commands)
    cli_runs.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
