"""The routing part of the config: the default policy, its options, each replica's pool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.settings import SettingsError, build_settings


def config(routing: dict[str, Any] | None = None, **replica: Any) -> dict[str, Any]:
    table = {"id": "r1", "grpc": "127.0.0.1:1", "metrics": "http://127.0.0.1:2/metrics"}
    raw: dict[str, Any] = {"replicas": [{**table, **replica}]}
    if routing is not None:
        raw["routing"] = routing
    return raw


def build(raw: dict[str, Any]) -> Any:
    return build_settings(raw, {}, Path("."))


def test_longest_prefix_is_the_default_policy() -> None:
    """A config without [routing] routes with longest_prefix."""
    assert build(config()).policy == "longest_prefix"


def test_a_policy_option_of_another_policy_is_refused_at_load() -> None:
    """affinity_blocks means nothing to longest_prefix: the config fails to load, saying so."""
    with pytest.raises(
        SettingsError,
        match=r"\[routing\]: unknown key\(s\) \['affinity_blocks'\] for policy 'longest_prefix'",
    ):
        build(config({"affinity_blocks": 1}))
    assert build(config({"policy": "prefix_affinity", "affinity_blocks": 2})).policy_options == {
        "affinity_blocks": 2
    }


def test_impossible_option_values_are_refused_at_load() -> None:
    """A load factor below 1 or an unknown policy name is a config error, not a crash later."""
    with pytest.raises(SettingsError, match="load_factor"):
        build(config({"load_factor": 0.5}))
    with pytest.raises(SettingsError, match=r"\[routing\] policy: expected one of .*got 'fastest'"):
        build(config({"policy": "fastest"}))


@pytest.mark.parametrize(
    ("replica", "pool"),
    [
        ({}, "production"),
        ({"reuse": False}, "eval"),
        ({"reuse": False, "production": True}, "production"),
        ({"reuse": True, "production": False}, "eval"),
    ],
)
def test_pool_defaults_to_reuse_and_production_overrides_it(
    replica: dict[str, Any], pool: str
) -> None:
    """Reuse-off replicas are eval-only unless production = true; any may be taken out."""
    assert build(config(**replica)).replicas[0].pool == pool


def test_production_must_be_a_boolean() -> None:
    """production = "no" is refused rather than read as true."""
    with pytest.raises(SettingsError, match="production: expected true or false, got 'no'"):
        build(config(production="no"))
