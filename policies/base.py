"""The vocabulary shared by every routing policy.

A policy is a synchronous pure function of its arguments (DESIGN.md §7.1):
``select(features, replicas) -> Decision``. The router builds the inputs from the
request and from its own view of the replicas; a policy never does I/O and never
imports from ``router`` or ``backends``.

Errors::

    Exception
     └── NoReplicaAvailable   no replica is eligible (each one is eval-only, unhealthy, leased
                              or draining)
"""

from __future__ import annotations

import hashlib
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

# How many leading blocks the router hashes for a policy: enough for conversations of a few
# thousand tokens, while hashing stays well under a millisecond (about 1 us per block).
MAX_PREFIX_BLOCKS = 256


@dataclass(slots=True)
class RequestFeatures:
    """What a policy may know about a request.

    ``prefix_hashes`` are chained hashes of the prompt's leading full blocks, block 0
    first (see ``prefix_block_hashes``); an empty tuple means the prompt has no full block.
    """

    prefix_hashes: tuple[str, ...]
    prompt_tokens: int
    model: str


@dataclass(slots=True)
class ReplicaView:
    """A snapshot of one replica as the router sees it when the request is admitted."""

    id: str
    healthy: bool
    leased: bool
    draining: bool
    in_flight: int
    capacity_weight: float = 1.0
    production: bool = True  # in the production pool (a reuse-off replica is not, by default)

    def __post_init__(self) -> None:
        # Caught here rather than in every policy: a zero weight would divide by zero in
        # the load maths, and a negative count means the router's bookkeeping is broken.
        if self.in_flight < 0:
            raise ValueError(f"replica {self.id}: in_flight must be >= 0, got {self.in_flight}")
        weight = self.capacity_weight
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(
                f"replica {self.id}: capacity_weight must be finite and > 0, got {weight}"
            )

    @property
    def ineligibility(self) -> tuple[str, ...]:
        """Why this replica may not take production traffic; empty when it may."""
        flags = {
            "eval-only": not self.production,
            "unhealthy": not self.healthy,
            "leased": self.leased,
            "draining": self.draining,
        }
        return tuple(word for word, on in flags.items() if on)


@dataclass(slots=True)
class Decision:
    """The outcome of ``Policy.select``.

    ``candidates`` are the eligible replica ids in this policy's order of preference, with
    ``replica`` first; the router may fall back to the later ones when the chosen replica
    fails before anything was streamed.
    """

    replica: str
    policy: str
    reason: str
    candidates: tuple[str, ...]


class NoReplicaAvailable(Exception):
    """No replica is eligible; ``reasons`` maps each replica id to why it was passed over."""

    def __init__(self, reasons: Mapping[str, tuple[str, ...]]) -> None:
        self.reasons: dict[str, tuple[str, ...]] = dict(reasons)
        if not self.reasons:
            detail = "no replicas configured"
        else:
            detail = "; ".join(
                f"{rid} {', '.join(why)}" for rid, why in sorted(self.reasons.items())
            )
        super().__init__(f"no eligible replica: {detail}")


@runtime_checkable
class Policy(Protocol):
    """A routing policy. The router calls ``on_start`` as soon as it commits a request to a
    replica (before it selects for the next request) and ``on_finish`` when that request
    ends, so a policy that keeps state updates it only through these hooks.

    ``on_start`` gets the request's features and ``now`` (seconds on a monotonic clock the
    caller chooses), so a policy that learns where prefixes went, and forgets them with age,
    stays a pure function of its inputs: a simulation drives it with simulated time.
    """

    name: str
    # How many of the prompt's leading block hashes ``select`` and ``on_start`` read (the
    # router hashes no more: about a microsecond a block, so 256 of a long prompt cost more
    # than the rest of the request's routing); ``MAX_PREFIX_BLOCKS`` for as many as there are.
    prefix_blocks: int

    def select(self, features: RequestFeatures, replicas: Sequence[ReplicaView]) -> Decision: ...

    def on_start(self, replica_id: str, features: RequestFeatures, now: float) -> None: ...

    def on_finish(self, replica_id: str) -> None: ...


_by_id = operator.attrgetter("id")


def eligible(replicas: Sequence[ReplicaView]) -> tuple[ReplicaView, ...]:
    """The replicas that may take production traffic, sorted by id.

    Raises ``NoReplicaAvailable`` listing every replica's reason when none may.
    """
    # The flags spelt out rather than ``not r.ineligibility``: this runs for every replica of
    # every request, and building the reasons is only needed when nothing is left.
    pool = tuple(
        sorted(
            [r for r in replicas if r.production and r.healthy and not r.leased and not r.draining],
            key=_by_id,
        )
    )
    if not pool:
        raise NoReplicaAvailable({r.id: r.ineligibility for r in replicas})
    return pool


def prefix_block_hashes(
    text: str, tokens_per_block: int = 16, max_blocks: int = 4
) -> tuple[str, ...]:
    """Chained hashes of the leading full blocks of ``text``, block 0 first.

    Tokens are UTF-8 bytes (the stand-in replica's byte vocabulary). Hash i covers every
    byte up to the end of block i, so equal hashes mean an equal prefix, as the engine's
    block reuse sees it. A partial trailing block is left out because the engine cannot
    reuse it either.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    if max_blocks < 0:
        raise ValueError(f"max_blocks must be >= 0, got {max_blocks}")
    data = text.encode("utf-8")
    n_blocks = min(len(data) // tokens_per_block, max_blocks)
    running = hashlib.blake2b(digest_size=8)
    hashes: list[str] = []
    for i in range(n_blocks):
        running.update(data[i * tokens_per_block : (i + 1) * tokens_per_block])
        # copy() so the running state keeps absorbing later blocks: one pass over the bytes.
        hashes.append(running.copy().hexdigest())
    return tuple(hashes)
