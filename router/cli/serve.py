"""``kvledger serve --config FILE``: run the proxy."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
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


class PortBusy(OSError):
    """The proxy's port cannot be bound (another process listens there)."""


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything else starts: a port in use must fail before
    the monitor runs or this proxy appears in the proxies' registry."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as exc:
        raise PortBusy(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def serve(settings: Settings, print_ready: bool = True) -> None:
    """Run until SIGINT or SIGTERM, as ``aiohttp.web.run_app`` runs an application (which this
    cannot use: the server's handler is the edge, see ``router.http.edge``); the cleanup
    contexts run on the way out. The port is bound first (PortBusy: nothing else started)."""
    sock = bind(settings.host, settings.port)
    try:
        _run(settings, sock, print_ready)
    finally:
        sock.close()


def _run(settings: Settings, sock: socket.socket, print_ready: bool) -> None:
    from router.http.app import create_app  # imported here: other commands need not pay for it

    configure(settings.log_level)
    logging.getLogger("aiohttp.server").addFilter(_AnsweredBodyErrors())
    _event_loop_policy()
    app = create_app(settings)
    loop = asyncio.new_event_loop()
    main = loop.create_task(_serve(app, settings, sock, print_ready))
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


async def _serve(
    app: web.Application, settings: Settings, sock: socket.socket, print_ready: bool
) -> None:
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
        await web.SockSite(runner, sock).start()
        if print_ready:
            print(f"kvledger listening on http://{settings.host}:{settings.port}", flush=True)
        await asyncio.Event().wait()  # until a signal ends the loop
    finally:
        await runner.cleanup()


def run_serve(args: argparse.Namespace) -> int:
    """Exit 2 with one line naming the file and field when the config is wrong (checked before
    anything starts), and when its port is in use (checked before anything starts either: no
    monitor, no registry entry); exit 1 with one line when the spool cannot be opened (another
    instance holds it: see ``[lineage] spool_path``)."""
    try:
        settings = load_settings(args.config, os.environ)
    except SettingsError as exc:
        print(f"kvledger: {exc}", file=sys.stderr)
        return 2
    try:
        serve(settings)
    except PortBusy as exc:
        print(f"kvledger: {exc}", file=sys.stderr)
        return 2
    except SpoolUnavailable as exc:
        hint = "each instance needs its own [lineage] spool_path (by default it has one)"
        print(f"kvledger: {exc.__cause__ or exc}; {hint}", file=sys.stderr)
        return 1
    return 0
