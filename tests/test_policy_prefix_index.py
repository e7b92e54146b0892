"""The prefix index: longest match, follow-up or branch, bounded memory, expiry."""

from __future__ import annotations

import pytest

from policies.prefix_index import Match, PrefixIndex

PATH = ("a0", "a1", "a2", "a3")


def test_longest_match_is_the_deepest_known_block() -> None:
    """A prompt that extends a recorded one matches all of the recorded blocks."""
    index = PrefixIndex()
    index.record(PATH[:2], "r1", 0.0)
    assert index.match(PATH) == Match(2, "r1", leaf=True)
    assert index.match(("b0", "b1")) == Match(0, None, leaf=False)


def test_a_prompt_that_leaves_a_path_in_its_middle_is_not_a_follow_up() -> None:
    """Matching a block that a longer prompt went through says 'shared', not 'continue'."""
    index = PrefixIndex()
    index.record(PATH, "r2", 0.0)
    assert index.match(("a0", "a1", "x2")) == Match(2, "r2", leaf=False)
    assert index.match((*PATH, "a4")) == Match(4, "r2", leaf=True)


def test_recording_a_shorter_prompt_keeps_its_block_shared() -> None:
    """A block once passed through stays 'extended' when a prompt ends on it later."""
    index = PrefixIndex()
    index.record(PATH, "r1", 0.0)
    index.record(PATH[:2], "r3", 1.0)
    assert index.match(("a0", "a1", "z")) == Match(2, "r3", leaf=False)


def test_the_latest_placement_wins() -> None:
    """Recording the same prefix on another replica moves it there."""
    index = PrefixIndex()
    index.record(PATH, "r1", 0.0)
    index.record(PATH, "r4", 1.0)
    assert index.match(PATH).replica == "r4"


def test_memory_is_bounded_and_paths_shrink_from_their_ends() -> None:
    """Past max_entries the least recently used go first: a path's deepest blocks, so what is
    left is still a prefix that matches."""
    index = PrefixIndex(max_entries=5)
    index.record(PATH, "r1", 0.0)
    index.record(("b0", "b1", "b2"), "r2", 1.0)
    assert len(index) == 5
    assert "a3" not in index and "a2" not in index and "a0" in index
    assert index.match(PATH) == Match(2, "r1", leaf=False)


def test_expire_drops_what_was_not_touched_within_ttl() -> None:
    """Placements older than ttl_s at 'now' are dropped; touched ones stay."""
    index = PrefixIndex(ttl_s=10)
    index.record(PATH, "r1", 0.0)
    index.record(("b0",), "r2", 5.0)
    assert index.expire(12.0) == 4
    assert len(index) == 1 and index.match(PATH) == Match(0, None, leaf=False)
    index.record(("b0",), "r2", 14.0)
    assert index.expire(20.0) == 0


@pytest.mark.parametrize(("entries", "ttl"), [(0, 1.0), (10, 0.0), (10, -1.0)])
def test_rejects_empty_or_timeless_index(entries: int, ttl: float) -> None:
    """An index that can hold nothing, or forgets at once, is a configuration error."""
    with pytest.raises(ValueError):
        PrefixIndex(entries, ttl)
