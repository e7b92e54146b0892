"""Longest prefix: follow a conversation to the replica holding it, spread new ones.

The policy keeps a ``PrefixIndex`` of where it sent each prompt's prefixes (its own state,
updated in ``on_start`` only; ``select`` reads it). For a prompt with block hashes h0..hn-1:

1. The index's longest match ends on a block where an earlier prompt *ended* (a leaf): the
   prompt continues that prompt, a follow-up turn, so it goes where that prompt went.
2. Otherwise the prompt is new past its match: nothing matched, or it branches off a path that
   others share (a system prompt). Its home is the rendezvous winner for the first block it does
   not share, ``h[depth]`` (``h[n-1]`` when the whole prompt is a known inner prefix). Two
   conversations that share only a system prompt differ in that block, so they spread out;
   one conversation keeps that block in every later turn.

Rule 2 is what lets proxies that never talked agree. A follow-up turn that reaches another
proxy finds, in that proxy's index, the shared system prompt (learnt from other conversations)
and branches off it at the same block, so rendezvous sends it to the same home. With nothing in
common yet (a cold proxy) the key is h0: every cold proxy agrees on it too.

Load is bounded as in ``prefix_affinity``: a replica may hold at most
``ceil(c * (total_in_flight + 1) * weight / total_weight)`` requests, counting the new one. A
new prefix whose home is over that bound walks down the rendezvous ranking (the same walk on
every proxy). A follow-up has a looser bound (``follow_load_factor``), because elsewhere it
recomputes its whole conversation; over it, it goes to the least loaded replica and lives on
there, since the index records the replica that took it.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.base import MAX_PREFIX_BLOCKS, Decision, ReplicaView, RequestFeatures, eligible
from policies.least_loaded import least_loaded_order
from policies.prefix_affinity import first_within, least_loaded_decision, load_bound
from policies.prefix_index import Match, PrefixIndex
from policies.rendezvous import cached_order


class LongestPrefix:
    """Route on the longest prefix this proxy has sent somewhere, with bounded load.

    ``load_factor`` (c >= 1) bounds the load a new prefix may add to its home;
    ``follow_load_factor`` (>= c) bounds a replica that holds the conversation a follow-up
    continues, looser because sending it elsewhere recomputes the whole conversation;
    ``max_entries`` bounds the index (one entry per distinct block prefix, about 200 bytes
    each); ``ttl_s`` is how long a placement is trusted after its last use.
    """

    name = "longest_prefix"
    prefix_blocks = MAX_PREFIX_BLOCKS

    def __init__(
        self,
        load_factor: float = 1.25,
        follow_load_factor: float = 2.0,
        max_entries: int = 1 << 17,
        ttl_s: float = 900.0,
    ) -> None:
        # c < 1 can leave every replica over its bound, with nowhere to place the request.
        if not load_factor >= 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        if not follow_load_factor >= load_factor:
            raise ValueError(
                f"follow_load_factor must be >= load_factor ({load_factor}),"
                f" got {follow_load_factor}"
            )
        self.load_factor = load_factor
        self.follow_load_factor = follow_load_factor
        self.index = PrefixIndex(max_entries, ttl_s)

    def select(self, features: RequestFeatures, replicas: Sequence[ReplicaView]) -> Decision:
        pool = eligible(replicas)
        hashes = features.prefix_hashes
        if not hashes:
            return least_loaded_decision(pool, self.name, "prompt has no full block")
        match = self.index.match(hashes)
        if match.leaf:
            home = next((r for r in pool if r.id == match.replica), None)
            if home is not None:
                return self._follow(match, len(hashes), home, pool)
        return self._branch(match, hashes, pool)

    def _follow(
        self, match: Match, n_blocks: int, home: ReplicaView, pool: Sequence[ReplicaView]
    ) -> Decision:
        """A follow-up: its conversation's replica, unless that is over the looser bound."""
        why = f"longest prefix: {match.depth} of {n_blocks} blocks continue a prompt sent to"
        total = sum(r.in_flight for r in pool)
        total_weight = sum(r.capacity_weight for r in pool)
        bound = load_bound(total, home.capacity_weight, total_weight, self.follow_load_factor)
        # No rendezvous here: the common case needs no ranking, and a fallback only needs load.
        others = [r for r in least_loaded_order(pool) if r is not home]
        if home.in_flight < bound or not others:
            candidates = (home.id, *(r.id for r in others))
            return Decision(home.id, self.name, f"{why} {home.id} -> {home.id}", candidates)
        chosen = others[0]
        reason = (
            f"spill: {why} {home.id}, at {home.in_flight} in flight, bound {bound}"
            f" -> {chosen.id} (least loaded)"
        )
        rest = (r.id for r in others[1:])
        return Decision(chosen.id, self.name, reason, (chosen.id, home.id, *rest))

    def _branch(self, match: Match, hashes: Sequence[str], pool: Sequence[ReplicaView]) -> Decision:
        """A new prefix past its match: the rendezvous home of its first unshared block."""
        block = min(match.depth, len(hashes) - 1)
        key = hashes[block]
        ids, weights = tuple([r.id for r in pool]), tuple([r.capacity_weight for r in pool])
        ranking = cached_order(key, ids, weights)
        rank, bounds = first_within(ranking, pool, self.load_factor)
        if rank is None:
            # Unreachable for c >= 1 (the bounds sum to more than the total load); kept so
            # a rounding corner case degrades to a sane choice rather than an exception.
            return least_loaded_decision(pool, self.name, "every replica over its load bound")
        if match.depth == 0:
            why = f"new prefix: home of block 0 ({key[:8]})"
        else:
            why = (
                f"new branch: {match.depth} of {len(hashes)} blocks shared,"
                f" home of block {block} ({key[:8]})"
            )
        chosen, home = ranking[rank], ranking[0]
        if rank == 0:
            reason = f"{why} -> {chosen}"
        else:
            load = next(r.in_flight for r in pool if r.id == home)
            reason = (
                f"spill: {why}, {home} at {load} in flight, bound {bounds[home]}"
                f" -> {chosen} (rank {rank + 1})"
            )
        return Decision(chosen, self.name, reason, (chosen, *(r for r in ranking if r != chosen)))

    def on_start(self, replica_id: str, features: RequestFeatures, now: float) -> None:
        self.index.expire(now)
        self.index.record(features.prefix_hashes, replica_id, now)

    def on_finish(self, replica_id: str) -> None:
        # Load comes in through ReplicaView.in_flight; placements outlive the request.
        return None
