"""Checking a key profile before it is stored: the one place the admin API and the CLI share.

``validate_profile`` checks the fields; ``check_fleet`` checks an eval profile against the
replicas the proxies registered in Redis and the snapshots there (is a reuse-off replica
configured for ``cache=off``, does the pinned replica exist and suit the cache mode, does the
snapshot exist), so both ways of creating a key refuse the same profiles.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, get_args

from router.ledger.keys import Mode, Profile

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


def check_fleet(
    profile: Profile, registry: Mapping[str, Mapping[str, Any]], snapshot_exists: bool
) -> None:
    """ProfileError when the fleet cannot serve this eval profile (see the module docstring)."""
    if profile.mode != "eval" or profile.cache is None:
        return
    reuse = profile.cache != "off"
    known = sorted(registry)
    matching = [rid for rid in known if bool(registry[rid].get("reuse", True)) == reuse]
    if profile.cache == "off" and not matching:
        raise ProfileError(
            "cache 'off' needs a replica with KV-cache block reuse disabled (reuse = false in"
            f" the proxy config); the registered replicas {known} all reuse blocks"
            if known
            else "cache 'off' needs a replica with block reuse disabled, and no proxy has"
            " registered its replicas in this Redis yet: start the proxy first",
            "cache",
        )
    if profile.replica is not None and known:
        if profile.replica not in registry:
            raise ProfileError(f"no replica '{profile.replica}'; known: {known}", "replica")
        if profile.replica not in matching:
            state = "on" if not reuse else "off"
            raise ProfileError(
                f"replica '{profile.replica}' has block reuse {state}, which cache"
                f" '{profile.cache}' cannot use; suitable: {matching}",
                "replica",
            )
    if profile.cache.startswith(REPLAY) and not snapshot_exists:
        name = profile.cache[len(REPLAY) :]
        raise ProfileError(
            f"snapshot '{name}' does not exist; save it first"
            f" (kvledger snapshots save {name} --from-run RUN)",
            "cache",
        )
