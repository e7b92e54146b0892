"""Who may see the page: the admin token, as a session cookie or a bearer header; CSRF on POST.

The login form takes the admin token and sets ``kvl_ui``, an HttpOnly, SameSite=Strict cookie
whose value is an HMAC of the token (so it holds no secret, dies with the token, and needs no
server-side session). A script client may send ``Authorization: Bearer <admin token>``
instead. Anything else is a 401 (a GET gets the login form with it). Every POST but the login
carries ``csrf``, an HMAC of the session; without it, 403. Every answer carries a
Content-Security-Policy that allows no script at all: the page has none, and an output that
smuggles one in (it is escaped anyway) could not run.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp_jinja2
import structlog
from aiohttp import web

from router.errors import KvlError
from router.http.context import SETTINGS, single_header

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
COOKIE = "kvl_ui"
CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self';"
    " frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}
_log = structlog.get_logger("kvledger.ui")


def _mac(token: str, purpose: str) -> str:
    key = token.encode("utf-8", "surrogateescape")
    return hmac.new(key, purpose.encode(), hashlib.sha256).hexdigest()


def session_value(token: str) -> str:
    return _mac(token, "kvledger-ui-session")


def csrf_token(token: str) -> str:
    return _mac(token, "kvledger-ui-csrf|" + session_value(token))


def see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location})


def secure(response: web.StreamResponse) -> web.StreamResponse:
    response.headers.update(HEADERS)
    return response


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(
        a.encode("utf-8", "surrogateescape"), b.encode("utf-8", "surrogateescape")
    )


def authenticated(request: web.Request, token: str) -> bool:
    header = single_header(request, "Authorization")
    if header is not None:
        scheme, _, sent = header.partition(" ")
        return scheme.lower() == "bearer" and _same(sent.strip(), token)
    cookie = request.cookies.get(COOKIE)
    return cookie is not None and _same(cookie, session_value(token))


def render(
    request: web.Request, template: str, context: Mapping[str, Any], status: int = 200
) -> web.StreamResponse:
    token = request.app[SETTINGS].admin_token or ""
    context = {"csrf": csrf_token(token) if token else "", "path": request.path, **context}
    return secure(aiohttp_jinja2.render_template(template, request, context, status=status))


def _refuse(request: web.Request, status: int, message: str) -> web.StreamResponse:
    if request.method == "GET":
        return render(request, "login.html", {"message": message}, status=status)
    return secure(web.Response(status=status, text=message + "\n"))


def page(handler: Handler) -> Handler:
    """The guard of every /ui/ handler: token or 401, CSRF on POST or 403, HTML errors."""

    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.StreamResponse:
        token = request.app[SETTINGS].admin_token
        if token is None:
            message = "the page is off: the proxy runs without an admin token"
            return secure(web.Response(status=403, text=message + "\n"))
        if not authenticated(request, token):
            return _refuse(request, 401, "log in with the admin token")
        if request.method == "POST":
            form = await request.post()
            sent = form.get("csrf")
            if not isinstance(sent, str) or not _same(sent, csrf_token(token)):
                _log.warning("ui_csrf_refused", path=request.path)
                return secure(web.Response(status=403, text="missing or wrong CSRF token\n"))
        try:
            return secure(await handler(request))
        except KvlError as exc:
            return render(request, "error.html", {"error": exc.message}, status=exc.status)

    return guarded


async def login_form(request: web.Request) -> web.StreamResponse:
    return render(request, "login.html", {"message": ""})


async def login(request: web.Request) -> web.StreamResponse:
    token = request.app[SETTINGS].admin_token
    if token is None:
        return secure(web.Response(status=403, text="the proxy runs without an admin token\n"))
    sent = (await request.post()).get("token")
    if not isinstance(sent, str) or not _same(sent.strip(), token):
        _log.warning("ui_login_refused", remote=request.remote)
        return render(request, "login.html", {"message": "wrong admin token"}, status=401)
    response = see_other("/ui/runs")
    response.set_cookie(COOKIE, session_value(token), path="/ui/", httponly=True, samesite="Strict")
    return secure(response)


@page
async def logout(request: web.Request) -> web.StreamResponse:
    response = see_other("/ui/login")
    response.del_cookie(COOKIE, path="/ui/")
    return response
