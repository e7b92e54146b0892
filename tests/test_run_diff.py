"""runs diff: aligning two eval runs and classifying each first divergence, falsifiably."""

from __future__ import annotations

from typing import Any

import pytest

from router.eval.diff import EpisodeDiff, RunDiff, diff_runs, render_table


def rec(
    run: str,
    episode: str | None,
    n: int,
    *,
    state: str | None = "s0",
    known: bool = True,
    reused: int = 2,
    prompt: str = "p",
    params: str = "k",
    output: str = "o",
    status: str = "ok",
) -> dict[str, Any]:
    """One lineage record; ids and digests derive from (run, episode, n) unless overridden."""
    return {
        "request_id": f"{run}-{episode}-{n}",
        "run": run,
        "seq": n,
        "episode": episode,
        "state_before": state,
        "state_known": known,
        "reused_blocks": reused,
        "cached_tokens": reused * 16,
        "prompt_digest": f"{prompt}-{episode}-{n}",
        "params_digest": params,
        "output_digest": f"{output}-{episode}-{n}",
        "status": status,
        "verified": None,
    }


def episode(
    run: str, name: str | None, count: int, at: dict[int, dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """``count`` records of one episode; ``at={2: {...}}`` overrides rec() options of record 2."""
    return [rec(run, name, i, **(at or {}).get(i, {})) for i in range(count)]


def only(diff: RunDiff) -> EpisodeDiff:
    assert len(diff.episodes) == 1
    return diff.episodes[0]


def test_identical_runs_have_no_divergence() -> None:
    """Same inputs and outputs in both runs: every episode identical, nothing diverged."""
    a = episode("A", "e1", 3) + episode("A", "e2", 2)
    b = episode("B", "e1", 3) + episode("B", "e2", 2)
    diff = diff_runs("A", a, "B", b)
    assert diff.aligned_by == "episode"
    assert (diff.identical, diff.diverged) == (2, 0)
    assert all(e.position is None and e.cause is None for e in diff.episodes)


def test_different_reuse_is_the_first_suspect() -> None:
    """Same request, different output, a different number of reused blocks: reuse differed."""
    a = episode("A", "e1", 3)
    b = episode("B", "e1", 3, {1: {"output": "x", "state": "s9", "reused": 5}})
    e = only(diff_runs("A", a, "B", b))
    assert (e.position, e.kind, e.cause) == (1, "output", "reuse")
    assert (e.request_a, e.request_b) == ("A-e1-1", "B-e1-1")
    assert (e.state_a, e.state_b, e.reused_a, e.reused_b) == ("s0", "s9", 2, 5)


def test_equal_reuse_from_different_states_says_state() -> None:
    """Equal reuse but different states: the reused blocks held different contents."""
    a = episode("A", "e1", 2)
    b = episode("B", "e1", 2, {1: {"output": "x", "state": "s9"}})
    diff = diff_runs("A", a, "B", b)
    assert only(diff).cause == "state"
    assert diff.counts()["state"] == 1 and diff.counts()["reuse"] == 0


def test_output_difference_on_equal_state_and_reuse_is_unexplained() -> None:
    """Same request, same state, same reuse, different output: not the cache."""
    a = episode("A", "e1", 2)
    b = episode("B", "e1", 2, {0: {"output": "x"}})
    diff = diff_runs("A", a, "B", b)
    e = only(diff)
    assert (e.position, e.kind, e.cause) == (0, "output", "unexplained")
    assert [diff.caused(c) for c in ("reuse", "state", "unexplained", "unknown")] == [0, 0, 1, 0]


@pytest.mark.parametrize(
    "override", [{"state": None}, {"known": False}, {"known": False, "reused": 9}]
)
def test_a_divergence_from_an_unknown_state_is_never_classified(override: dict[str, Any]) -> None:
    """A missing or unknown state on either side leaves the cause unknown, whatever else
    differs: the ledger cannot say what the cache held."""
    a = episode("A", "e1", 2, {1: override})
    b = episode("B", "e1", 2, {1: {"output": "x", "state": "s9"}})
    diff = diff_runs("A", a, "B", b)
    assert (only(diff).kind, only(diff).cause) == ("output", "unknown")
    assert diff.caused("unknown") == 1


def test_interleaved_episodes_align_by_episode() -> None:
    """Episodes served in a different interleaving compare the same as when served in order."""
    a1, a2 = episode("A", "e1", 3), episode("A", "e2", 3, {2: {"output": "x"}})
    b1, b2 = episode("B", "e1", 3), episode("B", "e2", 3)
    interleaved = [b2[0], b1[0], b1[1], b2[1], b2[2], b1[2]]
    mixed = diff_runs("A", [a1[0], a2[0], a1[1], a2[1], a1[2], a2[2]], "B", interleaved)
    sorted_ = diff_runs("A", a1 + a2, "B", b1 + b2)
    assert mixed.aligned_by == "episode"
    assert mixed.episodes == sorted_.episodes
    assert [(e.episode, e.kind, e.position) for e in mixed.episodes] == [
        ("e1", "identical", None),
        ("e2", "output", 2),
    ]


def test_falls_back_to_order_when_a_record_lacks_an_episode() -> None:
    """One record without an episode makes both runs a single sequence labelled '-'."""
    a = episode("A", "e1", 2) + episode("A", "e2", 2)
    b = episode("B", "e1", 2) + episode("B", "e2", 2)
    b[3] = {**b[3], "episode": None, "output_digest": "x"}
    diff = diff_runs("A", a, "B", b)
    assert diff.aligned_by == "order"
    e = only(diff)
    assert (e.episode, e.requests_a, e.requests_b, e.position) == ("-", 4, 4, 3)
    assert e.kind == "output"


def test_empty_episode_string_counts_as_missing() -> None:
    """An empty X-Kvl-Episode value is no episode, so alignment falls back to order."""
    a = episode("A", "", 2)
    b = episode("B", "", 2)
    assert diff_runs("A", a, "B", b).aligned_by == "order"


def test_prompt_difference_is_input() -> None:
    """A different prompt digest means the clients sent different requests: kind 'input'."""
    a = episode("A", "e1", 2)
    b = episode("B", "e1", 2, {1: {"prompt": "q", "output": "x", "state": "s9"}})
    diff = diff_runs("A", a, "B", b)
    assert (only(diff).kind, only(diff).cause) == ("input", None)
    assert (diff.caused("state"), diff.other) == (0, 1)


def test_params_difference_is_input() -> None:
    """A different params digest is also an input difference."""
    a = episode("A", "e1", 1)
    b = episode("B", "e1", 1, {0: {"params": "k2"}})
    assert only(diff_runs("A", a, "B", b)).kind == "input"


def test_cancelled_against_ok_is_status() -> None:
    """A cancelled request aligned with an ok one is a status difference."""
    a = episode("A", "e1", 2)
    b = episode("B", "e1", 2, {0: {"status": "cancelled", "output": "x"}})
    e = only(diff_runs("A", a, "B", b))
    assert (e.position, e.kind, e.cause) == (0, "status", None)


def test_same_failure_on_both_sides_is_not_a_difference() -> None:
    """Two errors at the same position compare equal even though their outputs differ."""
    a = episode("A", "e1", 2, {0: {"status": "error"}})
    b = episode("B", "e1", 2, {0: {"status": "error", "output": "x"}})
    assert only(diff_runs("A", a, "B", b)).kind == "identical"


def test_longer_run_is_length() -> None:
    """All shared positions equal but one side has more requests: kind 'length'."""
    a = episode("A", "e1", 3)
    b = episode("B", "e1", 2)
    e = only(diff_runs("A", a, "B", b))
    assert (e.requests_a, e.requests_b, e.position, e.kind) == (3, 2, 2, "length")
    assert (e.request_a, e.request_b) == ("A-e1-2", None)


def test_episode_in_one_run_only_is_missing_and_ordered_last() -> None:
    """Episodes present in one run only are 'missing'; B-only episodes come after A's."""
    a = episode("A", "e2", 1) + episode("A", "e1", 1)
    b = episode("B", "e3", 2) + episode("B", "e1", 1)
    diff = diff_runs("A", a, "B", b)
    assert [(e.episode, e.kind) for e in diff.episodes] == [
        ("e2", "missing"),
        ("e1", "identical"),
        ("e3", "missing"),
    ]
    e3 = diff.episodes[2]
    assert (e3.requests_a, e3.requests_b, e3.request_a, e3.request_b) == (0, 2, None, "B-e3-0")


def test_only_the_first_difference_is_reported() -> None:
    """A later unexplained difference does not override an earlier classified one."""
    a = episode("A", "e1", 4)
    b = episode("B", "e1", 4, {1: {"output": "x", "state": "s9"}, 3: {"output": "y"}})
    e = only(diff_runs("A", a, "B", b))
    assert (e.position, e.kind, e.cause) == (1, "output", "state")


def test_summary_and_json_counts() -> None:
    """summary() and to_json() report the same counts for a mix of outcomes."""
    a = episode("A", "e1", 1) + episode("A", "e2", 1) + episode("A", "e3", 1)
    a += episode("A", "e4", 1)
    b = episode("B", "e1", 1) + episode("B", "e2", 1, {0: {"output": "x", "state": "s9"}})
    b += episode("B", "e3", 1, {0: {"output": "x"}}) + episode("B", "e4", 2)
    diff = diff_runs("A", a, "B", b)
    assert diff.summary() == (
        "4 episodes: 1 identical, 3 diverged (0 reuse differed, 1 state differed with equal"
        " reuse, 1 unexplained, 0 from an unknown state, 1 other)"
    )
    doc = diff.to_json()
    assert (doc["run_a"], doc["run_b"], doc["aligned_by"]) == ("A", "B", "episode")
    assert doc["summary"] == {
        "episodes": 4,
        "identical": 1,
        "diverged": 3,
        "reuse": 0,
        "state": 1,
        "unexplained": 1,
        "unknown": 0,
        "other": 1,
    }
    assert doc["episodes"][2]["kind"] == "output"
    assert doc["episodes"][2]["cause"] == "unexplained"
    assert set(doc["episodes"][0]) == set(EpisodeDiff.__dataclass_fields__)


def test_table_lists_diverged_episodes_only_by_default() -> None:
    """The table skips identical episodes unless asked, flags UNEXPLAINED, cuts states to 12."""
    long = "ab" * 32
    a = episode("A", "ep-same", 2) + episode("A", "ep-bad", 2, {1: {"state": long}})
    b = episode("B", "ep-same", 2) + episode("B", "ep-bad", 2, {1: {"state": long, "output": "x"}})
    diff = diff_runs("run-a", a, "run-b", b)
    lines = render_table(diff)
    assert lines[0] == "run A: run-a   run B: run-b   aligned by episode"
    assert lines[1].split("  ")[:4] == ["episode", "requests", "first diff", "kind"]
    row = ["ep-bad", "2/2", "1", "output", "UNEXPLAINED", "2/2", long[:12], long[:12]]
    assert lines[2].split() == row
    assert lines[1].index("cause") == lines[2].index("UNEXPLAINED")
    assert lines[-1] == diff.summary()
    assert len(lines) == 4
    assert any(line.startswith("ep-same") for line in render_table(diff, all_episodes=True))


def test_table_without_divergence_is_header_and_summary() -> None:
    """With nothing diverged the table is just the header line and the summary."""
    diff = diff_runs("A", episode("A", "e1", 1), "B", episode("B", "e1", 1))
    assert render_table(diff) == [
        "run A: A   run B: B   aligned by episode",
        "1 episodes: 1 identical, 0 diverged (0 reuse differed, 0 state differed with equal"
        " reuse, 0 unexplained, 0 from an unknown state, 0 other)",
    ]
