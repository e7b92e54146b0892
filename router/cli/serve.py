"""``kvledger serve --config FILE``: run the proxy."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from router.ledger.errors import SpoolUnavailable
from router.logs import configure
from router.settings import Settings, SettingsError, load_settings


def register(commands: Any) -> None:
    serve = commands.add_parser("serve", help="run the proxy")
    serve.add_argument("--config", type=Path, required=True, help="the proxy's TOML config")
    serve.set_defaults(run=run_serve)


def _event_loop_policy() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


class _AnsweredBodyErrors(logging.Filter):
    """aiohttp drains a request's unread body after the handler answered; when that body could
    not be decoded, the drain raises the error again and aiohttp logs a traceback, although the
    client already has its 400. One traceback per hostile request would let anyone flood the
    log, so these records are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, web.RequestPayloadError)


def serve(settings: Settings, print_ready: bool = True) -> None:
    """Run until SIGINT or SIGTERM, as ``aiohttp.web.run_app`` runs an application (which this
    cannot use: the server's handler is the edge, see ``router.http.edge``); the cleanup
    contexts run on the way out."""
    from router.http.app import create_app  # imported here: other commands need not pay for it

    configure(settings.log_level)
    logging.getLogger("aiohttp.server").addFilter(_AnsweredBodyErrors())
    _event_loop_policy()
    app = create_app(settings)
    loop = asyncio.new_event_loop()
    main = loop.create_task(_serve(app, settings, print_ready))
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        try:
            if not main.done():
                main.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    loop.run_until_complete(main)
        finally:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
            asyncio.set_event_loop(None)


async def _serve(app: web.Application, settings: Settings, print_ready: bool) -> None:
    from router.http.edge import install

    # As run_app's: SIGINT and SIGTERM raise GracefulExit out of the loop, idle client
    # connections close after 75 s.
    runner = web.AppRunner(
        app,
        handle_signals=True,
        access_log=None,
        handler_cancellation=True,
        keepalive_timeout=75.0,
        auto_decompress=False,  # bodies are decoded by router.http.decode, every coding named
    )
    await runner.setup()
    try:
        install(runner)
        await web.TCPSite(runner, settings.host, settings.port).start()
        if print_ready:
            print(f"kvledger listening on http://{settings.host}:{settings.port}", flush=True)
        await asyncio.Event().wait()  # until a signal ends the loop
    finally:
        await runner.cleanup()


def run_serve(args: argparse.Namespace) -> int:
    """Exit 2 with one line naming the file and field when the config is wrong (checked before
    anything starts); exit 1 with one line when the spool cannot be opened (another instance
    holds it: see ``[lineage] spool_path``)."""
    try:
        settings = load_settings(args.config, os.environ)
    except SettingsError as exc:
        print(f"kvledger: {exc}", file=sys.stderr)
        return 2
    try:
        serve(settings)
    except SpoolUnavailable as exc:
        hint = "each instance needs its own [lineage] spool_path (by default it has one)"
        print(f"kvledger: {exc.__cause__ or exc}; {hint}", file=sys.stderr)
        return 1
    return 0
