"""Settings: one frozen object, built at the edge from the TOML file and the environment.

Nothing below ``create_app`` reads ``os.environ`` or a file: it gets a :class:`Settings`.
The environment may override ``KVL_REDIS_URL`` (or ``REDIS_URL``) and ``KVL_LISTEN``
(``host:port``); the admin token is read from the variable the config names.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

PolicyName = Literal["round_robin", "least_loaded", "prefix_affinity"]
DEFAULT_MESSAGE_TEMPLATE = "<|{role}|>\n{content}\n"
DEFAULT_GENERATION_PROMPT = "<|assistant|>\n"


class SettingsError(ValueError):
    """The config file or environment is wrong; the message says where."""


@dataclass(frozen=True)
class ReplicaSettings:
    id: str
    grpc: str
    metrics: str
    http: str = ""
    model: str = "ensemble"
    reuse: bool = True
    tokens_per_block: int = 16
    seed_input: str = "seed"
    perf_input: str = "return_perf_metrics"
    token_counts: bool = True
    engine_model: str = "tensorrt_llm"  # the model every path to the KV cache goes through
    engine_dir: str = ""  # its engine directory as the proxy reads it ("" = gpt_model_path)


@dataclass(frozen=True)
class ChatTemplate:
    """How chat messages become ``text_input``: each message, then the generation prompt."""

    message: str = DEFAULT_MESSAGE_TEMPLATE
    generation_prompt: str = DEFAULT_GENERATION_PROMPT


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096
    request_timeout_s: float = 300.0
    backend_timeout_s: float = 10.0


@dataclass(frozen=True)
class LineageSettings:
    stream_maxlen: int = 1_000_000
    request_ttl_s: int = 7 * 24 * 3600
    buffer_size: int = 10_000
    spool_path: Path = Path("kvledger-spool.jsonl")


@dataclass(frozen=True)
class EvalSettings:
    """``[eval]``: leases, verified resets and the serial turn of eval runs."""

    min_production_replicas: int = 1  # per model, never leased to runs
    drain_timeout_s: float = 60.0  # a reset waits this long for in-flight requests
    turn_ttl_s: float = 30.0  # a crashed proxy's turn is given up after this
    queue_timeout_s: float = 300.0  # a request waits this long for its turn, then 503
    continuity_wait_s: float = 2.0  # for the replica's counter to show the request


@dataclass(frozen=True)
class Settings:
    replicas: tuple[ReplicaSettings, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    admin_token: str | None = None
    admin_token_env: str = "KVL_ADMIN_TOKEN"
    policy: PolicyName = "prefix_affinity"
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    allow_anonymous: bool = False
    monitor_interval_s: float = 2.0
    chat_templates: Mapping[str, ChatTemplate] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    lineage: LineageSettings = field(default_factory=LineageSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    log_level: str = "info"

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.model for r in self.replicas))

    def template(self, model: str) -> ChatTemplate:
        return self.chat_templates.get(model, ChatTemplate())


def _section(raw: Mapping[str, Any], name: str, cls: type[Any]) -> Any:
    table = raw.get(name, {})
    known = set(cls.__dataclass_fields__)
    unknown = set(table) - known
    if unknown:
        raise SettingsError(f"[{name}]: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return cls(**table)


def _replicas(raw: Mapping[str, Any]) -> tuple[ReplicaSettings, ...]:
    tables = raw.get("replicas", [])
    if not tables:
        raise SettingsError("the config names no [[replicas]]")
    replicas = []
    for i, table in enumerate(tables):
        missing = {"id", "grpc", "metrics"} - set(table)
        if missing:
            raise SettingsError(f"[[replicas]] #{i + 1}: missing {sorted(missing)}")
        try:
            replicas.append(ReplicaSettings(**table))
        except TypeError as exc:
            raise SettingsError(f"[[replicas]] #{i + 1}: {exc}") from exc
    ids = [r.id for r in replicas]
    if len(set(ids)) != len(ids):
        raise SettingsError(f"replica ids must be unique: {ids}")
    return tuple(replicas)


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise SettingsError(f"KVL_LISTEN must be host:port, not {value!r}")
    return host or "127.0.0.1", int(port)


def build_settings(raw: Mapping[str, Any], env: Mapping[str, str], base: Path) -> Settings:
    """Settings from a parsed TOML document and an environment (both injected for tests)."""
    server = dict(raw.get("server", {}))
    lineage = _section(raw, "lineage", LineageSettings)
    lineage = LineageSettings(**{**lineage.__dict__, "spool_path": base / lineage.spool_path})
    templates = {
        model: ChatTemplate(**table) for model, table in raw.get("chat_templates", {}).items()
    }
    host, port = server.pop("host", "127.0.0.1"), int(server.pop("port", 8000))
    if "KVL_LISTEN" in env:
        host, port = _listen(env["KVL_LISTEN"])
    redis_url = env.get("KVL_REDIS_URL") or env.get("REDIS_URL") or server.pop("redis_url", None)
    server.pop("redis_url", None)
    token_env = server.pop("admin_token_env", "KVL_ADMIN_TOKEN")
    routing = dict(raw.get("routing", {}))
    try:
        return Settings(
            replicas=_replicas(raw),
            host=host,
            port=port,
            redis_url=redis_url or Settings.redis_url,
            admin_token=env.get(token_env) or None,
            admin_token_env=token_env,
            policy=routing.pop("policy", "prefix_affinity"),
            policy_options=routing,
            chat_templates=templates,
            limits=_section(raw, "limits", Limits),
            lineage=lineage,
            eval=_section(raw, "eval", EvalSettings),
            **server,
        )
    except TypeError as exc:
        raise SettingsError(f"[server]: {exc}") from exc


def load_settings(path: Path, env: Mapping[str, str]) -> Settings:
    """Read the TOML config file at ``path``; relative paths in it are relative to the file."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SettingsError(f"cannot read config {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config {path} is not valid TOML: {exc}") from exc
    return build_settings(raw, env, path.resolve().parent)
