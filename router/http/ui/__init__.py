"""The page under ``/ui/``: runs, a run, two runs compared, the arms' table, the fleet.

Server-rendered with aiohttp-jinja2 (autoescape on: every value from a model, a prompt or a
header is escaped), no script at all (the Content-Security-Policy forbids one), behind the
admin token (``router.http.ui.auth``). ``setup(app)`` adds the templates, the routes, the
stylesheet and the explain jobs' cleanup to the proxy's app.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp_jinja2
import jinja2
from aiohttp import web

from router.http.ui import auth, compare, study, views

HERE = Path(__file__).resolve().parent


def _short(value: object, n: int = 12) -> str:
    return "" if value is None else str(value)[:n]


def _share(value: float | None) -> str:
    """A share from 0 to 1 as a percentage."""
    return "-" if value is None else f"{value:.0%}"


async def _root(request: web.Request) -> web.StreamResponse:
    return auth.see_other("/ui/runs")


def routes() -> list[web.AbstractRouteDef]:
    return [
        web.get("/ui", _root),
        web.get("/ui/", _root),
        web.get("/ui/login", auth.login_form),
        web.post("/ui/login", auth.login),
        web.post("/ui/logout", auth.logout),
        web.get("/ui/runs", views.runs_list),
        web.get("/ui/runs/{id}", views.run_view),
        web.get("/ui/runs/{id}/requests/{entry}", views.request_view),
        web.get("/ui/compare", compare.compare),
        web.post("/ui/explain", compare.start_explain),
        web.get("/ui/explain/{id}", compare.explain_job),
        web.get("/ui/arms", study.arms_view),
        web.get("/ui/fleet", study.fleet_view),
        web.static("/ui/static", HERE / "static"),
    ]


def setup(app: web.Application) -> None:
    env = aiohttp_jinja2.setup(
        app,
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["short"] = _short
    env.filters["share"] = _share
    app.cleanup_ctx.append(compare.jobs_ctx)
    app.add_routes(routes())
