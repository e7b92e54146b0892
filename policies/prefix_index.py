"""An approximate index of where prefixes were sent: chained block hash -> replica.

A prompt's block hashes are chained (``prefix_block_hashes``): hash i names every byte up to
the end of block i, so one map from hash to placement is a prefix tree without the tree, and
the longest prefix of a prompt that the index knows is its deepest hash found in the map.

Each placement says which replica the prefix ending at that block was last sent to, when, and
whether a longer prefix through it was ever sent (``extended``). That last bit tells the two
kinds of match apart: a prompt whose deepest known block is the *end* of an earlier prompt
continues that prompt (a follow-up turn), while a prompt that leaves a known path in its middle
branches off something others share (a system prompt).

Memory is bounded by ``max_entries`` (least recently used first out) and by age (``ttl_s``,
enforced when ``expire`` is called with the current time). A prompt's blocks are touched deepest
first, so a path's shallow blocks are the more recent and eviction trims paths from their ends,
as an engine's own cache evicts leaves: the index stays mostly prefix-closed.

Approximate by design: it knows where this proxy sent prompts, not what the engines still hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class Placement:
    """Where the prefix ending at one block was last sent."""

    replica: str
    at: float
    extended: bool  # a longer prefix through this block was sent too


@dataclass(frozen=True, slots=True)
class Match:
    """The longest known prefix of a prompt.

    ``depth`` is how many leading blocks the index knows (0: none). ``replica`` is where the
    prefix ending at block ``depth - 1`` was last sent; ``leaf`` is true when nothing longer
    through that block was sent, so the prompt continues an earlier prompt.
    """

    depth: int
    replica: str | None
    leaf: bool


NO_MATCH = Match(0, None, False)


class PrefixIndex:
    """Chained block hash -> ``Placement``, bounded by entry count and age."""

    def __init__(self, max_entries: int = 1 << 17, ttl_s: float = 900.0) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[str, Placement] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def match(self, hashes: Sequence[str]) -> Match:
        """The deepest of ``hashes`` in the index; a read, so it changes no recency."""
        entries = self._entries
        # Deepest first: a follow-up turn matches all but its last few blocks, so this stops
        # early on the common case; chained hashes make any hit a whole-prefix hit.
        for i in range(len(hashes) - 1, -1, -1):
            placement = entries.get(hashes[i])
            if placement is not None:
                return Match(i + 1, placement.replica, not placement.extended)
        return NO_MATCH

    def record(self, hashes: Sequence[str], replica: str, now: float) -> None:
        """Every prefix of the prompt went to ``replica`` at ``now``; evict beyond the bound."""
        entries = self._entries
        last = len(hashes) - 1
        for i in range(last, -1, -1):
            block = hashes[i]
            placement = entries.get(block)
            if placement is None:
                entries[block] = Placement(replica, now, i < last)
                continue
            placement.replica = replica
            placement.at = now
            placement.extended = placement.extended or i < last
            entries.move_to_end(block)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def expire(self, now: float) -> int:
        """Drop placements older than ``ttl_s`` at ``now``; how many were dropped.

        The least recently touched come first, so this stops at the first young one.
        """
        entries, horizon, dropped = self._entries, now - self.ttl_s, 0
        while entries:
            oldest = next(iter(entries.values()))
            if oldest.at >= horizon:
                break
            entries.popitem(last=False)
            dropped += 1
        return dropped
