"""Driving eval arms through a running proxy: the workload over the openai SDK, admin calls, CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import openai
import orjson
import urllib3

from bench.workload import DEFAULT_MAX_TOKENS, Episode
from router.cli.local import ProxyProcess as Proxy

TOKEN = "admin-secret"  # what tests.proxy_harness gives the proxy
HTTP = urllib3.PoolManager()


@dataclass
class Played:
    """What a client saw playing episodes: outputs per episode and every response's headers."""

    outputs: dict[int, list[str]] = field(default_factory=dict)
    headers: list[dict[str, str]] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)

    @property
    def runs(self) -> set[str]:
        return {h.get("x-kvl-run", "") for h in self.headers}


def client(proxy: Proxy, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0, timeout=120)


def complete(
    sdk: openai.OpenAI, prompt: str, episode: int | None = None
) -> tuple[str, dict[str, str], dict[str, Any]]:
    """One completion: its text, headers (lower-case) and the kvledger record."""
    extra = {"X-Kvl-Episode": str(episode)} if episode is not None else {}
    raw = sdk.completions.with_raw_response.create(
        model="ensemble", prompt=prompt, max_tokens=DEFAULT_MAX_TOKENS, extra_headers=extra
    )
    body = raw.parse()
    record: dict[str, Any] = body.model_extra["kvledger"]  # type: ignore[index]
    return body.choices[0].text, {k.lower(): v for k, v in raw.headers.items()}, record


def play(sdk: openai.OpenAI, episodes: list[Episode]) -> Played:
    """Every episode turn by turn, each request labelled with its episode."""
    played = Played()
    for episode in episodes:
        outputs: list[str] = []
        for _ in range(episode.turns):
            text, headers, record = complete(sdk, episode.render(outputs), episode.id)
            outputs.append(text)
            played.headers.append(headers)
            played.records.append(record)
        played.outputs[episode.id] = outputs
    return played


def admin(proxy: Proxy, method: str, path: str, body: object = None) -> tuple[int, Any]:
    data = None if body is None else orjson.dumps(body)
    response = HTTP.request(
        method,
        proxy.url + path,
        body=data,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        retries=False,
        timeout=urllib3.Timeout(total=300),
    )
    return response.status, orjson.loads(response.data)


def begin(proxy: Proxy, arm: str) -> dict[str, Any]:
    status, body = admin(proxy, "POST", "/admin/runs", {"arm": arm})
    assert status == 201, body
    run: dict[str, Any] = body["run"]
    return run


def end(proxy: Proxy, run: str) -> dict[str, Any]:
    status, body = admin(proxy, "POST", f"/admin/runs/{run}/end")
    assert status == 200, body
    meta: dict[str, Any] = body["run"]
    return meta


def cli(proxy: Proxy, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KVL_REDIS_URL": proxy.redis_url, "KVL_URL": proxy.url}
    env["KVL_ADMIN_TOKEN"] = TOKEN
    env.pop("REDIS_URL", None)
    command = [sys.executable, "-m", "router.cli", *args]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def chained(records: list[dict[str, Any]]) -> bool:
    """Each record's state_before is the previous one's state_after: one unbroken chain."""
    return all(
        b["state_before"] == a["state_after"] for a, b in zip(records, records[1:], strict=False)
    )
