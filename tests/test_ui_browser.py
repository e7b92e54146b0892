"""The /ui/ page in a real headless browser (Debian's chromium driven by Playwright for Python).

Two runs of a ``shared`` arm on a warm cache diverge (as in tests/test_eval_runs.py); the test
logs in, compares them, sees the diverged episodes with their first differing request and
causes, starts explain and reads its verdict; an output carrying a script runs nothing.
With ``KVL_SCREENSHOTS=1`` it saves the compare, explain, arms and fleet views to docs/ui/
(otherwise it leaves the tree alone, so CI does not dirty it).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from backends.sim.launcher import Replica
from bench.workload import make_episodes
from router.ledger.runs import requests_key
from tests.eval_helpers import TOKEN, begin, cli, client, complete, end, play
from tests.proxy_harness import Proxy
from tests.servers import RedisServer

sync_api = pytest.importorskip("playwright.sync_api")

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
EPISODES = make_episodes(80)[:8]
HOSTILE = '<script>window.kvlPwned=1</script><img src=x onerror="window.kvlPwned=2">'
SHOTS = Path(__file__).resolve().parents[1] / "docs" / "ui"
EXPLAIN_WAIT_MS = 300_000

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="no chromium (scripts/setup)")


def _keep_hostile_output(redis_url: str, run: str) -> str:
    """Store a hostile text as the kept output of the run's request. The stand-in's byte
    model cannot be steered to write markup, so the test stores, as the dispatcher would, what
    a real model might answer; the page must show it as text."""

    async def go() -> str:
        client = aioredis.Redis.from_url(redis_url)
        try:
            ((entry_id, fields),) = await client.xrange(requests_key(run), "-", "+")
            entry = {**orjson.loads(fields[b"e"]), "output": "answer: " + HOSTILE}
            await client.xdel(requests_key(run), entry_id)
            await client.xadd(requests_key(run), {"e": orjson.dumps(entry)})
            return str(entry["request_id"])
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def study(replicas: dict[str, Replica]) -> Iterator[dict[str, Any]]:
    """A proxy over r1, r2 and r3 (reuse off); a shared arm's two runs on r2, the second on
    the cache the first left warm; one request of another arm with a hostile output."""
    redis = RedisServer()
    redis.start()
    proxy = Proxy(list(replicas.values()), redis.url)
    proxy.start()
    try:
        assert cli(proxy, "replicas", "reset", "r2").returncode == 0
        sdk = client(proxy, proxy.create_key("shared", mode="eval", cache="shared", replica="r2"))
        (run_a,) = play(sdk, EPISODES).runs
        run_b = begin(proxy, "shared")["id"]
        play(sdk, EPISODES)
        end(proxy, run_b)
        found = orjson.loads(cli(proxy, "runs", "diff", run_a, run_b, "--json").stdout)
        assert found["summary"]["diverged"] > 0, "the warm rerun did not diverge"
        other = client(proxy, proxy.create_key("hostile", mode="eval", cache="shared"))
        run_h = begin(proxy, "hostile")["id"]
        complete(other, "A: ls")
        end(proxy, run_h)
        rid = _keep_hostile_output(redis.url, run_h)
        yield {"proxy": proxy, "a": run_a, "b": run_b, "diff": found, "hostile": (run_h, rid)}
    finally:
        proxy.stop()
        redis.close()


@pytest.fixture(scope="module")
def browser(study: dict[str, Any]) -> Iterator[Any]:
    """Chromium; after the study, whose set-up runs event loops Playwright's would block."""
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield launched
        finally:
            launched.close()


def _page(browser: Any, study: dict[str, Any]) -> tuple[Any, Any, list[str]]:
    """A fresh context and page; every console message and page error lands in the list."""
    context = browser.new_context(
        base_url=study["proxy"].url, viewport={"width": 1400, "height": 900}
    )
    page = context.new_page()
    messages: list[str] = []
    page.on("console", lambda m: messages.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: messages.append(f"pageerror: {e}"))
    return context, page, messages


def _login(page: Any) -> None:
    answer = page.goto("/ui/runs")
    assert answer.status == 401
    page.fill("#token", TOKEN)
    page.click("form.login button")
    page.wait_for_url("**/ui/runs")
    # Once logged in, the console hears nothing at all (the login form's 401 is the only error).


def _shot(page: Any, name: str) -> None:
    if os.environ.get("KVL_SCREENSHOTS") == "1":
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / name), full_page=True)


def test_compare_shows_the_divergence_and_explain_gives_a_verdict(
    study: dict[str, Any], browser: Any
) -> None:
    """Log in, pick the two runs on Runs, see each diverged episode with its first differing
    request, causes and marked outputs; start explain, see its progress and then its verdict
    while the page stays usable; the arms view charts the arm."""
    context, page, messages = _page(browser, study)
    _login(page)
    messages.clear()
    page.check(f"input[name=a][value='{study['a']}']")
    page.check(f"input[name=b][value='{study['b']}']")
    page.click("#compare")
    page.wait_for_url("**/ui/compare?*")
    summary = study["diff"]["summary"]
    text = page.locator("#summary").inner_text()
    assert f"diverged: {summary['diverged']} of {summary['episodes']} episodes" in text
    assert f"{summary['reuse']} reuse, {summary['state']} state" in text
    expected = [e for e in study["diff"]["episodes"] if e["kind"] != "identical"]
    sections = page.locator("section.episode")
    assert sections.count() == len(expected)
    for i, episode in enumerate(expected):
        section = sections.nth(i)
        assert section.locator(".position").inner_text() == str(episode["position"])
        assert f"cause: {episode['cause']}" in section.locator(".cause").inner_text()
        assert section.locator("tr.first").count() == 1
        assert section.locator("pre.output-a mark").count() == 1
    _shot(page, "compare.png")
    page.locator("form.explain button").first.click()
    page.wait_for_url("**/ui/explain/*")
    sync_api.expect(page.locator("#verdict")).to_be_visible(timeout=EXPLAIN_WAIT_MS)
    assert "divergence(s) proven caused by cache state" in page.locator("#verdict").inner_text()
    row = page.locator("table.cases tbody tr").first.inner_text()
    assert "proven" in row and any(s in row for s in ("A (the", "B (the", "both", "neither"))
    _shot(page, "explain.png")
    page.goto("/ui/arms")
    assert page.locator("#divergence-chart rect").count() >= 2  # shared and hostile arms
    assert "shared" in page.locator("table.arms").inner_text()
    _shot(page, "arms.png")
    page.goto("/ui/fleet")
    assert page.locator("#generations-chart rect").count() >= 2  # r2's reset among them
    assert "r2" in page.locator("table.fleet").inner_text()
    _shot(page, "fleet.png")
    assert not [m for m in messages if m.startswith(("error", "warning", "pageerror"))], messages
    context.close()


def test_a_hostile_output_is_text_and_runs_nothing(study: dict[str, Any], browser: Any) -> None:
    """An output with <script> and <img onerror> shows as text: no element made of it, no
    flag set by it, nothing in the console (not even a blocked script)."""
    context, page, messages = _page(browser, study)
    _login(page)
    messages.clear()
    run, rid = study["hostile"]
    page.goto(f"/ui/runs/{run}")
    page.click(f"text={rid}")
    output = page.locator("#output")
    assert output.inner_text() == "answer: " + HOSTILE
    assert output.locator("script, img").count() == 0
    assert page.evaluate("window.kvlPwned") is None
    assert not [m for m in messages if not m.startswith("verbose")], messages
    context.close()


def test_without_the_token_pages_answer_401_and_posts_without_csrf_403(
    study: dict[str, Any], browser: Any
) -> None:
    """From the browser: every page and POST without the token is a 401; a logged-in POST
    without the CSRF token is a 403."""
    context, page, _ = _page(browser, study)
    a, b = study["a"], study["b"]
    for path in ("/ui/runs", f"/ui/runs/{a}", f"/ui/compare?a={a}&b={b}", "/ui/arms", "/ui/fleet"):
        assert context.request.get(path).status == 401, path
    form = {"a": a, "b": b, "episode": ""}
    for path in ("/ui/explain", "/ui/logout"):
        assert context.request.post(path, form=form).status == 401, path
    _login(page)
    assert context.request.post("/ui/explain", form=form).status == 403
    assert context.request.post("/ui/logout", form={}).status == 403
    context.close()
