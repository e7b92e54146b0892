"""The real run: chat conversations through ``kvledger serve`` in front of three stand-ins.

One private Redis and three stand-in replicas (real ``tritonserver`` processes, block reuse on)
serve every policy in turn; for each, a fresh proxy process routes with that policy, every
replica gets a verified reset through the admin API, and the same seeded conversations are
played through the openai SDK: Poisson arrivals, one thread per conversation, a think time
between turns, so requests overlap as production traffic does. The figures come from the
lineage records the proxy returns (``"kvledger"`` in each response): ``cached_tokens`` summed
over ``prompt_tokens``, and requests per replica.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import openai
import urllib3

from backends.sim.launcher import config_snippet, launch
from bench.routing_report import POLICIES
from router.cli.local import ProxyProcess, RedisServer, create_key, stand_in_specs

ADMIN_TOKEN = "routing-bench"
WORDS = (
    "cache replica prefix token block route proxy engine batch latency request stream model"
    " answer tool query config deploy metric trace error retry queue shard index"
).split()


@dataclass(frozen=True)
class Chat:
    """One conversation: when it starts, its system prompt, user turns and think times."""

    start_s: float
    system: str
    users: tuple[str, ...]
    think_s: tuple[float, ...]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def make_chats(n: int, seed: int, systems: int = 3, rate_per_s: float = 1.5) -> list[Chat]:
    """``n`` seeded conversations on ``systems`` shared system prompts (Zipf popularity)."""
    rng = random.Random(seed)
    prompts = [f"System prompt {j}: " + _text(rng, rng.randint(90, 160)) for j in range(systems)]
    weights = [1 / (rank + 1) ** 1.1 for rank in range(systems)]
    chats, clock = [], 0.0
    for _ in range(n):
        clock += rng.expovariate(rate_per_s)
        turns = rng.randint(3, 5)
        chats.append(
            Chat(
                start_s=clock,
                system=rng.choices(prompts, weights)[0],
                users=tuple(_text(rng, rng.randint(10, 30)) for _ in range(turns)),
                think_s=tuple(rng.expovariate(1.0) for _ in range(turns)),
            )
        )
    return chats


def play(sdk: openai.OpenAI, chat: Chat, t0: float) -> list[dict[str, Any]]:
    """One conversation, turn by turn; the lineage record of each response."""
    time.sleep(max(0.0, t0 + chat.start_s - time.monotonic()))
    messages: list[Any] = [{"role": "system", "content": chat.system}]
    records = []
    for user, think in zip(chat.users, chat.think_s, strict=True):
        messages.append({"role": "user", "content": user})
        reply = sdk.chat.completions.create(model="ensemble", max_tokens=16, messages=messages)
        records.append((reply.model_extra or {})["kvledger"])
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        time.sleep(think)
    return records


def reset_all(proxy: ProxyProcess, ids: Sequence[str]) -> None:
    http = urllib3.PoolManager()
    for rid in ids:
        response = http.request(
            "POST",
            f"{proxy.url}/admin/replicas/{rid}/reset",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            timeout=300,
            retries=False,
        )
        if response.status != 200:
            raise RuntimeError(f"reset of {rid} failed: {response.status} {response.data!r}")


def one_policy(
    name: str, replicas_toml: str, ids: Sequence[str], redis_url: str, chats: Sequence[Chat]
) -> dict[str, Any]:
    """A fresh proxy with this policy, reset replicas, every conversation; its figures."""
    proxy = ProxyProcess(
        replicas_toml, redis_url, policy=name, monitor_interval_s=0.5, admin_token=ADMIN_TOKEN
    )
    proxy.start()
    try:
        reset_all(proxy, ids)
        key = create_key(redis_url, f"routing-{name}", replace=True)
        sdk = openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0, timeout=300)
        started = t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(chats)) as pool:
            played = list(pool.map(lambda chat: play(sdk, chat, t0), chats))
        seconds = time.monotonic() - started
    finally:
        proxy.stop()
    return summarise(name, [r for conv in played for r in conv], ids, seconds)


def summarise(
    name: str, records: list[dict[str, Any]], ids: Sequence[str], seconds: float
) -> dict[str, Any]:
    per_replica = Counter({rid: 0 for rid in ids})
    per_replica.update(r["replica"] for r in records)
    counts = list(per_replica.values())
    prompt = sum(int(r["prompt_tokens"]) for r in records)
    return {
        "policy": name,
        "requests": len(records),
        "prompt_tokens": prompt,
        "cached_tokens": sum(int(r["cached_tokens"]) for r in records),
        "cached_share": sum(int(r["cached_tokens"]) for r in records) / prompt,
        "per_replica": dict(per_replica),
        "max_over_mean": max(counts) * len(counts) / sum(counts),
        "seconds": seconds,
    }


def run_real(
    conversations: int, seed: int, command: str, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Every policy through the proxy on the same conversations; the figures for the note."""
    chats = make_chats(conversations, seed)
    specs = stand_in_specs(3, 3, prefix="p")
    ids = [s.id for s in specs]
    redis = RedisServer(appendonly=False)
    redis.start()
    rows = []
    try:
        progress("starting three stand-in replicas")
        with launch(specs) as running:
            for name in POLICIES:
                progress(f"{name}: {conversations} conversations through the proxy")
                row = one_policy(name, config_snippet(running), ids, redis.url, chats)
                rows.append(row)
                progress(
                    f"{name}: cached {100 * row['cached_share']:.1f}% of"
                    f" {row['prompt_tokens']:,} prompt tokens; per replica {row['per_replica']}"
                )
    finally:
        redis.close()
    return {
        "command": command,
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "conversations": conversations,
        "requests": rows[0]["requests"],
        "systems": 3,
        "policies": rows,
    }
