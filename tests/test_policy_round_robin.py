"""round_robin: the cursor cycles the eligible replicas in id order."""

from __future__ import annotations

import pytest

from policies import (
    Policy,
    ReplicaView,
    make_policy,
)
from tests.policy_helpers import FLEET, features, replica

# -- round_robin ---------------------------------------------------------------------------


def run_round_robin(policy: Policy, fleets: list[list[ReplicaView]]) -> list[str]:
    chosen = []
    for fleet in fleets:
        decision = policy.select(features(""), fleet)
        policy.on_start(decision.replica, features(""), 0.0)
        chosen.append(decision.replica)
    return chosen


@pytest.mark.parametrize(
    ("fleets", "expected"),
    [
        ([FLEET] * 7, ["r1", "r2", "r3", "r1", "r2", "r3", "r1"]),
        ([list(reversed(FLEET))] * 4, ["r1", "r2", "r3", "r1"]),
        (
            [FLEET, FLEET, [replica("r1"), replica("r2"), replica("r3", draining=True)], FLEET],
            ["r1", "r2", "r1", "r2"],
        ),
        ([FLEET, [replica("r1"), replica("r3")], FLEET], ["r1", "r3", "r1"]),
    ],
    ids=["cycles", "input-order-irrelevant", "skips-draining", "replica-removed"],
)
def test_round_robin_cycles_in_id_order(
    fleets: list[list[ReplicaView]], expected: list[str]
) -> None:
    """Round robin visits eligible replicas in id order and wraps around."""
    assert run_round_robin(make_policy("round_robin"), fleets) == expected


def test_round_robin_cursor_moves_only_on_start() -> None:
    """select alone does not advance the cursor; on_start does."""
    policy = make_policy("round_robin")
    assert policy.select(features(""), FLEET).replica == "r1"
    assert policy.select(features(""), FLEET).replica == "r1"
    policy.on_start("r1", features(""), 0.0)
    decision = policy.select(features(""), FLEET)
    assert (decision.replica, decision.candidates) == ("r2", ("r2", "r3", "r1"))
    assert decision.reason == "round_robin: next after r1 -> r2"
