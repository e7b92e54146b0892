"""prefix_affinity through the proxy: shared prefixes stick, distinct spread, hot ones spill."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
import urllib3
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backends.sim.launcher import Replica
from tests.proxy_harness import Proxy
from tests.servers import RedisServer

HTTP = urllib3.PoolManager(maxsize=16)
PREFIX = "Shared system prompt of a long-running agent, identical on every call. " * 4


@pytest.fixture(scope="module")
def routed(replicas: dict[str, Replica]) -> Iterator[tuple[Proxy, str]]:
    redis = RedisServer()
    redis.start()
    proxy = Proxy([replicas["r1"], replicas["r2"]], redis.url, policy="prefix_affinity")
    proxy.start()
    try:
        yield proxy, proxy.create_key("routing")
    finally:
        proxy.stop()
        redis.close()


def send(proxy: Proxy, key: str, path: str, body: object) -> urllib3.BaseHTTPResponse:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    return HTTP.request(
        "POST",
        proxy.url + path,
        body=data,
        timeout=120,
        retries=False,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )


def replica_of(proxy: Proxy, key: str, prompt: str, max_tokens: int = 2) -> str:
    body = {"model": "ensemble", "prompt": prompt, "max_tokens": max_tokens}
    response = send(proxy, key, "/v1/completions", body)
    assert response.status == 200, response.data
    return str(response.headers["X-Kvl-Replica"])


def test_shared_prefix_stays_on_one_replica(routed: tuple[Proxy, str]) -> None:
    """Requests that share their leading blocks all land on the same replica."""
    proxy, key = routed
    seen = {replica_of(proxy, key, PREFIX + f"question {i}") for i in range(8)}
    assert len(seen) == 1


def test_distinct_prefixes_spread(routed: tuple[Proxy, str]) -> None:
    """Different leading blocks are spread over the replicas."""
    proxy, key = routed
    counts = Counter(replica_of(proxy, key, uuid.uuid4().hex * 2 + PREFIX) for _ in range(24))
    assert set(counts) == {"r1", "r2"}
    assert min(counts.values()) >= 4


def test_hot_prefix_spills_under_bounded_load(routed: tuple[Proxy, str]) -> None:
    """A burst of one hot prefix overflows its home replica's bound onto the other one."""
    proxy, key = routed
    hot = uuid.uuid4().hex * 2 + PREFIX
    with ThreadPoolExecutor(max_workers=6) as pool:
        placed = list(pool.map(lambda i: replica_of(proxy, key, hot + str(i), 120), range(6)))
    assert set(placed) == {"r1", "r2"}


_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-5, 12)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=6,
)
_fields = [
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stream",
    "stop",
    "n",
    "text_input",
    "bad_words",
    "stop_words",
    "random_seed",
    "exclude_input_in_output",
    "max_completion_tokens",
]
_bodies = st.one_of(
    st.dictionaries(st.sampled_from(_fields), _values, max_size=6),
    st.fixed_dictionaries(
        {"model": st.sampled_from(["ensemble", "other", ""]), "max_tokens": st.integers(-2, 6)},
        optional={
            "messages": st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["user", "system", "bot"]), "content": _values}
                ),
                max_size=3,
            ),
            "prompt": _values,
            "text_input": _values,
            "stop": _values,
            "stream": _values,
        },
    ),
    st.binary(max_size=40),
)


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    path=st.sampled_from(
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/v2/models/ensemble/generate",
            "/v2/models/ensemble/generate_stream",
        ]
    ),
    body=_bodies,
)
def test_generated_bodies_never_get_a_5xx(
    routed: tuple[Proxy, str], path: str, body: object
) -> None:
    """Whatever a client sends to either front, the answer is a success or a clear 4xx."""
    proxy, key = routed
    response = send(proxy, key, path, body)
    assert response.status < 500, response.data
    if response.status >= 400:
        assert orjson.loads(response.data)["error"]["message"]
