"""Prefix affinity: rendezvous hashing of the prompt's leading blocks, with bounded load.

Prompts that share their leading block(s) go to the same replica, where the engine can
reuse the cached blocks. The rendezvous ranking needs no shared state, so independent
proxy instances send a given prefix to the same replica. A hot prefix would otherwise
swamp its home replica, so each replica's load is bounded (consistent hashing with
bounded loads, Mirrokni, Thorup & Zadimoghaddam 2018): a replica is over the bound when

    in_flight + 1 > ceil(c * (total_in_flight + 1) * weight / total_weight)

(with equal weights, ``ceil(c * (total_in_flight + 1) / n_eligible)``), and the request
walks down the ranking to the first replica within it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.base import Decision, ReplicaView, RequestFeatures, eligible
from policies.least_loaded import describe_load, least_loaded_order
from policies.rendezvous import cached_order


def load_bound(total_in_flight: int, weight: float, total_weight: float, load_factor: float) -> int:
    """The most requests a replica may hold, counting the one being placed."""
    return math.ceil(load_factor * (total_in_flight + 1) * weight / total_weight)


def load_bounds(pool: Sequence[ReplicaView], load_factor: float) -> dict[str, int]:
    """Each replica's load bound; ``in_flight < bound`` is ``in_flight + 1 <= bound``."""
    total = sum([r.in_flight for r in pool])
    total_weight = sum([r.capacity_weight for r in pool])
    # load_bound's expression, evaluated in the same order (so bit for bit the same bounds),
    # without a call per replica.
    scale = load_factor * (total + 1)
    return {r.id: math.ceil(scale * r.capacity_weight / total_weight) for r in pool}


def first_within(
    ranking: Sequence[str], pool: Sequence[ReplicaView], load_factor: float
) -> tuple[int | None, dict[str, int]]:
    """The rank of the first replica in ``ranking`` within its bound (None if none is), and
    the bounds."""
    in_flight = {r.id: r.in_flight for r in pool}
    bounds = load_bounds(pool, load_factor)
    for rank, rid in enumerate(ranking):
        if in_flight[rid] < bounds[rid]:
            return rank, bounds
    return None, bounds


def least_loaded_decision(pool: Sequence[ReplicaView], policy: str, why: str) -> Decision:
    """The least loaded replica, saying why the policy fell back to it."""
    order = least_loaded_order(pool)
    return Decision(
        replica=order[0].id,
        policy=policy,
        reason=f"least_loaded fallback: {why}; {describe_load(order[0])}",
        candidates=tuple(r.id for r in order),
    )


class PrefixAffinity:
    """Route by the prompt's leading block hash, spilling over when the home is full.

    ``affinity_blocks`` is how many leading blocks make the key: deeper keys split a
    shared system prompt's traffic by what follows it. A prompt with fewer full blocks
    uses its deepest one; a prompt with none goes to the least loaded replica.
    ``load_factor`` (c >= 1) is how far above the mean a replica may be loaded.
    """

    name = "prefix_affinity"

    def __init__(self, load_factor: float = 1.25, affinity_blocks: int = 1) -> None:
        # c < 1 can leave every replica over its bound, with nowhere to place the request.
        if not load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        if affinity_blocks < 1:
            raise ValueError(f"affinity_blocks must be >= 1, got {affinity_blocks}")
        self.load_factor = load_factor
        self.affinity_blocks = affinity_blocks
        self.prefix_blocks = affinity_blocks

    def select(self, features: RequestFeatures, replicas: Sequence[ReplicaView]) -> Decision:
        pool = eligible(replicas)
        if not features.prefix_hashes:
            return self._least_loaded(pool, "prompt has no full block")
        block = min(self.affinity_blocks, len(features.prefix_hashes)) - 1
        key = features.prefix_hashes[block]
        ids, weights = tuple([r.id for r in pool]), tuple([r.capacity_weight for r in pool])
        ranking = cached_order(key, ids, weights)
        rank, bounds = first_within(ranking, pool, self.load_factor)
        if rank is None:
            # Unreachable for c >= 1 (the bounds sum to more than the total load); kept so
            # a rounding corner case degrades to a sane choice rather than an exception.
            return self._least_loaded(pool, "every replica over its load bound")
        chosen = ranking[rank]
        if rank == 0:
            reason = f"affinity: prefix block {block} ({key[:8]}) -> {chosen}"
        else:
            home = next(r for r in pool if r.id == ranking[0])
            reason = (
                f"spill: home {home.id} at {home.in_flight} in flight, bound {bounds[home.id]}"
                f" -> {chosen} (rank {rank + 1})"
            )
        candidates = (chosen, *ranking[:rank], *ranking[rank + 1 :])
        return Decision(chosen, self.name, reason, candidates)

    def _least_loaded(self, pool: Sequence[ReplicaView], why: str) -> Decision:
        return least_loaded_decision(pool, self.name, why)

    def on_start(self, replica_id: str, features: RequestFeatures, now: float) -> None:
        # Load comes in through ReplicaView.in_flight; the policy itself keeps no state.
        return None

    def on_finish(self, replica_id: str) -> None:
        return None
