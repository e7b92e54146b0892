"""The aiohttp application: ``create_app(settings, ...)`` wires fronts, dispatch and resources.

Resources are typed ``web.AppKey`` entries opened and closed by ``cleanup_ctx`` in order: Redis,
the HTTP session for metric scrapes, the backends, the ledger (its writer drains on close), the
fleet with its dispatcher, and the generation monitor. Tests inject their own backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import AsyncIterator, Callable, Mapping

import aiohttp
import structlog
from aiohttp import web

from backends.base import Backend
from backends.triton import TritonBackend, TritonTarget
from backends.triton_http import TritonHttpBackend
from policies import make_policy
from router.dispatch import Dispatcher
from router.eval.dispatch import EvalDispatcher
from router.eval.runs import Runs
from router.fleet import Fleet, ReplicaState
from router.http import admin, admin_explain, admin_runs, openai, ops, triton, ui
from router.http.context import (
    DISPATCH,
    EVAL,
    FLEET,
    HTTP,
    KEYS,
    LEDGER,
    METRICS,
    REDIS,
    RUNS,
    SETTINGS,
)
from router.http.errors import error_middleware
from router.ledger import Ledger, LedgerConfig
from router.ledger.connect import connect
from router.ledger.errors import LedgerError
from router.ledger.keys import KeyStore
from router.ledger.notices import Notices, listen
from router.ledger.runs import RunStore
from router.ledger.turns import Turns
from router.metrics import Metrics
from router.monitor import Monitor
from router.settings import Settings

BackendFactory = Callable[[Settings, aiohttp.ClientSession], Mapping[str, Backend]]


def triton_backends(settings: Settings, http: aiohttp.ClientSession) -> dict[str, Backend]:
    backends: dict[str, Backend] = {}
    for r in settings.replicas:
        target = TritonTarget(
            replica_id=r.id,
            grpc=r.grpc,
            metrics=r.metrics,
            model=r.model,
            seed_input=r.seed_input,
            perf_input=r.perf_input,
            token_counts=r.token_counts,
            timeout_s=settings.limits.backend_timeout_s,
            engine_model=r.engine_model,
            engine_dir=r.engine_dir,
        )
        if r.transport == "http":
            backends[r.id] = TritonHttpBackend(target, r.http, http)
        else:
            backends[r.id] = TritonBackend(target, http)
    return backends


def _ledger_config(settings: Settings) -> LedgerConfig:
    lineage = settings.lineage
    return LedgerConfig(
        lineage_maxlen=lineage.stream_maxlen,
        request_ttl_s=lineage.request_ttl_s,
        buffer_size=lineage.buffer_size,
        spool_path=lineage.spool_path,
        durable_wait_ms=settings.eval.durable_wait_ms,
        production_wait_ms=lineage.production_wait_ms,
    )


async def _resources(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    redis = connect(settings.redis_url)
    http = aiohttp.ClientSession()
    app[REDIS], app[HTTP] = redis, http
    app[KEYS] = KeyStore(redis)
    ledger = Ledger(redis, _ledger_config(settings), structlog.get_logger("kvledger.ledger"))
    app[LEDGER] = ledger
    try:
        await ledger.start()
    except BaseException:  # e.g. the spool is another instance's: close what was opened
        await http.close()
        await redis.aclose()
        raise
    try:
        yield
    finally:
        await ledger.close()
        await http.close()
        await redis.aclose()


def _fleet_ctx(factory: BackendFactory) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        settings = app[SETTINGS]
        backends = factory(settings, app[HTTP])
        limits = settings.limits
        fleet = Fleet(
            {
                r.id: ReplicaState(
                    r,
                    backends[r.id],
                    timeout_s=limits.backend_timeout_s,
                    unhealthy_after=limits.unhealthy_after_timeouts,
                )
                for r in settings.replicas
            }
        )
        app[FLEET] = fleet
        app[METRICS] = Metrics(fleet, app[LEDGER].stats)
        policy = make_policy(settings.policy, **dict(settings.policy_options))
        app[DISPATCH] = Dispatcher(fleet, app[LEDGER], policy, app[METRICS])
        turns, store = Turns(app[REDIS]), RunStore(app[REDIS])
        # Other proxies learn a new lease within one monitor interval: resets wait that long.
        runs = Runs(
            fleet,
            app[LEDGER],
            store,
            turns,
            settings.eval,
            notices=Notices(app[REDIS]),
            settle_s=settings.monitor_interval_s,
            owner=instance_id(settings),
            heartbeat_s=settings.eval.heartbeat_s,
        )
        app[RUNS] = runs
        app[EVAL] = EvalDispatcher(fleet, app[LEDGER], runs, turns, settings.eval, app[METRICS])
        with contextlib.suppress(LedgerError):  # the monitor's ticks register them later
            await runs.register()
        monitor = Monitor(
            fleet,
            app[LEDGER],
            settings.monitor_interval_s,
            hook=runs.tick,
            check_timeout_s=settings.health_timeout_s,
        )
        await monitor.tick()  # know health and generations before the first request
        tasks = [
            asyncio.create_task(monitor.run(), name="kvl-monitor"),
            asyncio.create_task(listen(settings.redis_url, runs.on_notice), name="kvl-notices"),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(*(b.close() for b in backends.values()))

    return ctx


def instance_id(settings: Settings) -> str:
    """This proxy instance, for the claims it holds in Redis (resets, begins)."""
    return f"{socket.gethostname()}:{settings.port}:{os.getpid()}:{secrets.token_hex(3)}"


def create_app(
    settings: Settings, *, backends: BackendFactory = triton_backends
) -> web.Application:
    app = web.Application(
        middlewares=[error_middleware], client_max_size=settings.limits.max_body_bytes
    )
    app[SETTINGS] = settings
    app.cleanup_ctx.append(_resources)
    app.cleanup_ctx.append(_fleet_ctx(backends))
    for module in (openai, triton, ops, admin, admin_explain, admin_runs):
        app.add_routes(module.routes())
    ui.setup(app)
    return app
