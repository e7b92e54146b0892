"""The /ui/ page over real HTTP: the token guards every page and POST, CSRF, escaping, paging."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import urllib3

from backends.sim.launcher import Replica
from bench.workload import make_episodes
from tests.eval_helpers import TOKEN, begin, client, complete, end, play
from tests.proxy_harness import Proxy
from tests.servers import RedisServer

HOSTILE = '<script>window.kvlPwned=1</script><img src=x onerror="window.kvlPwned=2">'
HTTP = urllib3.PoolManager()
EPISODES = make_episodes(80)[:2]


@pytest.fixture(scope="module")
def stack(replicas: dict[str, Replica]) -> Iterator[tuple[Proxy, dict[str, Any]]]:
    """A proxy with a reset arm run once (two episodes, then one request with a hostile prompt
    and episode label)."""
    redis = RedisServer()
    redis.start()
    proxy = Proxy([replicas["r1"], replicas["r2"]], redis.url)
    proxy.start()
    try:
        sdk = client(proxy, proxy.create_key("ui-arm", mode="eval", cache="reset"))
        run = begin(proxy, "ui-arm")["id"]
        play(sdk, EPISODES)
        _, _, record = complete(_labelled(sdk), "A: " + HOSTILE)
        end(proxy, run)
        yield proxy, {"run": run, "hostile": record}
    finally:
        proxy.stop()
        redis.close()


def _labelled(sdk: openai.OpenAI) -> openai.OpenAI:
    return sdk.with_options(default_headers={"X-Kvl-Episode": HOSTILE})


def get(proxy: Proxy, path: str, **headers: str) -> urllib3.BaseHTTPResponse:
    return HTTP.request("GET", proxy.url + path, headers=headers, redirect=False, retries=False)


def post(
    proxy: Proxy, path: str, fields: dict[str, str], **headers: str
) -> urllib3.BaseHTTPResponse:
    return HTTP.request(
        "POST",
        proxy.url + path,
        fields=fields,
        encode_multipart=False,
        headers=headers,
        redirect=False,
        retries=False,
    )


def login(proxy: Proxy) -> dict[str, str]:
    """Log in through the form; the headers that carry the session cookie."""
    response = post(proxy, "/ui/login", {"token": TOKEN})
    assert response.status == 303 and response.headers["Location"] == "/ui/runs"
    cookie = response.headers["Set-Cookie"]
    return {"Cookie": cookie.split(";")[0]}


def csrf(html: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
    assert found is not None, html[:500]
    return found.group(1)


def pages(run: str) -> list[str]:
    return [
        "/ui/runs",
        f"/ui/runs/{run}",
        f"/ui/compare?a={run}&b={run}",
        "/ui/arms",
        "/ui/fleet",
        "/ui/explain/nope",
    ]


def test_every_page_and_post_wants_the_token(stack: tuple[Proxy, dict[str, Any]]) -> None:
    """Without the token (or with a wrong one) every page and every POST answers 401; the
    login form refuses a wrong token."""
    proxy, made = stack
    for path in pages(made["run"]):
        assert get(proxy, path).status == 401, path
        assert get(proxy, path, Authorization="Bearer wrong").status == 401, path
        assert get(proxy, path, Cookie="kvl_ui=forged").status == 401, path
    for path in ("/ui/explain", "/ui/logout"):
        assert post(proxy, path, {"csrf": "x", "a": made["run"], "b": made["run"]}).status == 401
    refused = post(proxy, "/ui/login", {"token": "wrong"})
    assert refused.status == 401 and "Set-Cookie" not in refused.headers
    shown = get(proxy, "/ui/runs")
    assert b"Admin token" in shown.data  # a 401 GET shows the login form


def test_login_cookie_and_bearer_open_the_pages(stack: tuple[Proxy, dict[str, Any]]) -> None:
    """The login sets an HttpOnly SameSite=Strict cookie; it, or the bearer token, opens each
    page, which forbids every script by its Content-Security-Policy."""
    proxy, made = stack
    response = post(proxy, "/ui/login", {"token": TOKEN})
    cookie = response.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and TOKEN not in cookie
    for headers in (login(proxy), {"Authorization": f"Bearer {TOKEN}"}):
        for path in pages(made["run"])[:-1]:
            shown = get(proxy, path, **headers)
            assert shown.status == 200, (path, shown.data[:300])
            csp = shown.headers["Content-Security-Policy"]
            assert "default-src 'none'" in csp and "script-src" not in csp


def test_a_post_without_csrf_is_refused(stack: tuple[Proxy, dict[str, Any]]) -> None:
    """A logged-in POST without the CSRF token, or with another one, answers 403; with it, the
    POST is done."""
    proxy, made = stack
    session = login(proxy)
    run = made["run"]
    assert post(proxy, "/ui/explain", {"a": run, "b": run}, **session).status == 403
    assert (
        post(proxy, "/ui/explain", {"a": run, "b": run, "csrf": "0" * 64}, **session).status == 403
    )
    assert post(proxy, "/ui/logout", {}, **session).status == 403
    token = csrf(get(proxy, "/ui/runs", **session).data.decode())
    done = post(proxy, "/ui/logout", {"csrf": token}, **session)
    assert done.status == 303 and "kvl_ui=" in done.headers["Set-Cookie"]


def test_hostile_values_are_shown_as_text(stack: tuple[Proxy, dict[str, Any]]) -> None:
    """A prompt and an episode label carrying markup appear escaped, never as markup."""
    proxy, made = stack
    session = login(proxy)
    run_page = get(proxy, f"/ui/runs/{made['run']}", **session).data.decode()
    assert "&lt;script&gt;window.kvlPwned=1&lt;/script&gt;" in run_page
    assert "<script" not in run_page and "<img" not in run_page
    entry = re.findall(rf'href="/ui/runs/{re.escape(made["run"])}/requests/([0-9-]+)"', run_page)
    shown = get(proxy, f"/ui/runs/{made['run']}/requests/{entry[-1]}", **session).data.decode()
    assert made["hostile"]["request_id"] in shown
    assert "A: &lt;script&gt;" in shown and "<script" not in shown and "<img" not in shown


def test_a_run_is_read_a_page_at_a_time(stack: tuple[Proxy, dict[str, Any]]) -> None:
    """A run's page shows `count` requests and links to the next and previous pages, which
    together hold every request once, in order."""
    proxy, made = stack
    session = login(proxy)
    path, seen = f"/ui/runs/{made['run']}?count=4", []
    pattern = re.compile(r"/requests/[0-9-]+\">([0-9a-f.]+)</a>")
    first = ""
    while True:
        html = get(proxy, path, **session).data.decode()
        ids = pattern.findall(html)
        assert 1 <= len(ids) <= 4
        first = first or html
        seen.extend(ids)
        later = re.search(r'href="([^"]+)" id="later"', html)
        if later is None:
            break
        path = later.group(1).replace("&amp;", "&")
    total = sum(e.turns for e in EPISODES) + 1
    assert len(seen) == len(set(seen)) == total
    assert 'id="earlier"' not in first and 'id="earlier"' in html
    earlier = re.search(r'href="([^"]+)" id="earlier"', html)
    assert earlier is not None
    back = get(proxy, earlier.group(1).replace("&amp;", "&"), **session).data.decode()
    assert pattern.findall(back) == seen[-4 - len(ids) : -len(ids)]


def test_runs_fleet_and_arms_show_what_the_ledger_holds(
    stack: tuple[Proxy, dict[str, Any]],
) -> None:
    """Runs lists the run with its arm and request count; a filter by another arm hides it;
    Fleet lists both replicas and their generations; Arms lists the arm."""
    proxy, made = stack
    session = login(proxy)
    runs = get(proxy, "/ui/runs", **session).data.decode()
    total = sum(e.turns for e in EPISODES) + 1
    assert made["run"] in runs and f'<td class="num">{total}</td>' in runs
    assert made["run"] not in get(proxy, "/ui/runs?arm=other", **session).data.decode()
    fleet = get(proxy, "/ui/fleet", **session).data.decode()
    assert "<td>r1</td>" in fleet and "<td>r2</td>" in fleet and "verified reset" in fleet
    arms = get(proxy, "/ui/arms", **session).data.decode()
    assert "ui-arm" in arms and "<svg" in arms
    bad = get(proxy, f"/ui/runs/{made['run']}?after=nonsense", **session)
    assert bad.status == 400 and b"stream entry id" in bad.data
