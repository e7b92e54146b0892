"""Checking a key profile before it is stored: the one place the admin API and the CLI share.

Checks that need the fleet (is a reuse-off replica configured for ``cache=off``, does the pinned
replica exist, does the snapshot exist) belong here too once they exist, so both ways of
creating a key refuse the same profiles.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, get_args

from router.ledger_keys import Mode, Profile

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
MODES: tuple[str, ...] = get_args(Mode)
CACHE_MODES = ("reset", "off", "shared")
REPLAY = "replay:"
EVAL_FIELDS = ("cache", "replica", "idle_timeout_s")
FIELDS = ("name", "mode", *EVAL_FIELDS)


class ProfileError(ValueError):
    """The profile is not acceptable; ``param`` names the offending field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def validate_profile(fields: Mapping[str, Any], *, created_at: str) -> Profile:
    """The profile described by ``fields`` (a JSON body or CLI options), or ProfileError."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ProfileError(f"unknown field(s) {unknown}; known: {list(FIELDS)}", unknown[0])
    name = _name(fields.get("name"), "name", "a key name")
    mode = fields.get("mode")
    if mode not in MODES:
        raise ProfileError(f"mode must be one of {list(MODES)}, not {mode!r}", "mode")
    if mode == "production":
        # Refused rather than ignored: a user who sets them expects them to act.
        for param in EVAL_FIELDS:
            if fields.get(param) is not None:
                raise ProfileError(f"{param} applies only to eval keys (mode 'eval')", param)
        return Profile(name=name, mode=mode, created_at=created_at)
    replica = fields.get("replica")
    profile = Profile(
        name=name,
        mode=mode,
        cache=_cache(fields.get("cache")),
        replica=None if replica is None else _name(replica, "replica", "a replica id"),
        created_at=created_at,
    )
    timeout = fields.get("idle_timeout_s")
    return profile if timeout is None else replace(profile, idle_timeout_s=_idle_timeout(timeout))


def _name(value: Any, param: str, what: str) -> str:
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ProfileError(
            f"{param} must be {what} of 1 to 64 characters from A-Z a-z 0-9 _ . -, not {value!r}",
            param,
        )
    return value


def _cache(value: Any) -> str:
    if isinstance(value, str) and value.startswith(REPLAY):
        if not NAME.fullmatch(value[len(REPLAY) :]):
            raise ProfileError(
                f"replay:SNAPSHOT needs a snapshot name of A-Z a-z 0-9 _ . -, not {value!r}",
                "cache",
            )
        return value
    if value not in CACHE_MODES:
        choices = [*CACHE_MODES, REPLAY + "SNAPSHOT"]
        raise ProfileError(f"an eval key needs cache, one of {choices}; got {value!r}", "cache")
    cache: str = value
    return cache


def _idle_timeout(value: Any) -> float:
    # bool is an int to Python, but "idle_timeout_s": true is a mistake, not one second.
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not number or not 0 < value < math.inf:
        raise ProfileError(
            f"idle_timeout_s must be a positive number of seconds, not {value!r}", "idle_timeout_s"
        )
    return float(value)
