"""What the policy tests share: replica views, request features, prompts."""

from __future__ import annotations

import random
from typing import get_args

from policies import (
    PolicyName,
    ReplicaView,
    RequestFeatures,
    prefix_block_hashes,
)

ALL_POLICIES: tuple[PolicyName, ...] = get_args(PolicyName)


def replica(
    rid: str,
    in_flight: int = 0,
    *,
    healthy: bool = True,
    leased: bool = False,
    draining: bool = False,
    weight: float = 1.0,
    production: bool = True,
) -> ReplicaView:
    return ReplicaView(rid, healthy, leased, draining, in_flight, weight, production)


def features(prompt: str, max_blocks: int = 4) -> RequestFeatures:
    hashes = prefix_block_hashes(prompt, 16, max_blocks)
    return RequestFeatures(prefix_hashes=hashes, prompt_tokens=len(prompt.encode()), model="m")


def random_prompts(n: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.getrandbits(128):032x} system prompt and question" for _ in range(n)]


FLEET = [replica("r1"), replica("r2"), replica("r3")]
