"""least_loaded: the replica with the fewest requests in flight."""

from __future__ import annotations

import pytest

from policies import (
    ReplicaView,
    make_policy,
)
from tests.policy_helpers import features, replica

# -- least_loaded --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fleet", "expected", "candidates"),
    [
        ([replica("r1", 4), replica("r2", 1), replica("r3", 2)], "r2", ("r2", "r3", "r1")),
        ([replica("r3", 1), replica("r2", 1), replica("r1", 5)], "r2", ("r2", "r3", "r1")),
        ([replica("b", 0), replica("a", 0)], "a", ("a", "b")),
        ([replica("r1", 2), replica("r2", 3, weight=2.0)], "r2", ("r2", "r1")),
        ([replica("r1", 0), replica("r2", 0, weight=2.0)], "r2", ("r2", "r1")),
    ],
    ids=["fewest", "tie-by-id", "tie-idle", "weighted", "weighted-idle"],
)
def test_least_loaded_picks_min_in_flight(
    fleet: list[ReplicaView], expected: str, candidates: tuple[str, ...]
) -> None:
    """Least loaded takes the replica with the fewest in flight per unit of weight."""
    decision = make_policy("least_loaded").select(features(""), fleet)
    assert (decision.replica, decision.candidates) == (expected, candidates)
    assert decision.policy == "least_loaded"
    assert decision.reason.startswith(f"least_loaded: {expected} at ")
