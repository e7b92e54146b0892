"""Rendezvous (highest-random-weight) hashing.

Every replica gets a pseudo-random score for a key; replicas are ranked by score. Any
process that knows the key and the replica ids computes the same ranking, so independent
proxy instances (and reruns of an eval arm) agree without sharing state, and removing a
replica moves only the keys it ranked first.
"""

from __future__ import annotations

import functools
import hashlib
import math
import operator
from collections.abc import Mapping, Sequence


def _key_prefix(key: str) -> bytes:
    # Length-prefix the key so ("ab", "c") and ("a", "bc") cannot hash alike.
    key_bytes = key.encode("utf-8")
    return len(key_bytes).to_bytes(8, "big") + key_bytes


def _score(prefix: bytes, replica_id: str) -> int:
    digest = hashlib.blake2b(prefix + replica_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _scores(prefix: bytes, ids: Sequence[str]) -> list[int]:
    """``_score`` of every id: the prefix hashed once, each id from a copy of that state
    (blake2b is a stream, so the digests are the same)."""
    base = hashlib.blake2b(prefix, digest_size=8)
    scores = []
    for replica_id in ids:
        state = base.copy()
        state.update(replica_id.encode("utf-8"))
        scores.append(int.from_bytes(state.digest(), "big"))
    return scores


def rendezvous_weight(key: str, replica_id: str) -> int:
    """The 64-bit score of ``replica_id`` for ``key``: blake2b, never ``hash()``, whose
    per-process salt would make every proxy instance disagree."""
    return _score(_key_prefix(key), replica_id)


def _weighted_score(prefix: bytes, replica_id: str, weight: float) -> float:
    # Weighted rendezvous (Schindelhauer & Schomaker): score = -w / ln(u) gives each
    # replica a share of keys proportional to its weight. u is built from 52 bits so it is
    # exact and strictly inside (0, 1), keeping ln(u) finite and negative.
    u = ((_score(prefix, replica_id) >> 12) * 2 + 1) / 2.0**53
    return -weight / math.log(u)


def rendezvous_order(
    key: str, ids: Sequence[str], weights: Mapping[str, float] | None = None
) -> list[str]:
    """``ids`` ranked for ``key``, most preferred first; ties broken by id.

    With no ``weights`` (or all equal) the ranking uses exact integer scores, identical on
    every platform. Unequal ``weights`` (> 0) skew each replica's share of keys towards
    its weight.
    """
    prefix = _key_prefix(key)  # encoded once per ranking, not once per replica
    if weights is None or len(set(map(weights.__getitem__, ids))) <= 1:
        # (score, id) pairs sorted as they are: no key function called per replica.
        ranked = sorted(zip(map(operator.neg, _scores(prefix, ids)), ids, strict=True))
        return [replica_id for _, replica_id in ranked]
    return [i for _, i in sorted([(-_weighted_score(prefix, i, weights[i]), i) for i in ids])]


@functools.lru_cache(maxsize=4096)
def cached_order(key: str, ids: tuple[str, ...], weights: tuple[float, ...]) -> tuple[str, ...]:
    """``rendezvous_order`` of ``ids`` with their ``weights`` (in the same order), remembered:
    a key's ranking over the same replicas never changes, and the requests of a workload share
    few keys (every turn of a conversation, every user of one system prompt, has the same first
    block). A routing decision would otherwise hash the key with every replica id again."""
    return tuple(rendezvous_order(key, ids, dict(zip(ids, weights, strict=True))))
