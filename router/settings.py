"""Settings: one frozen object, built at the edge from the TOML file and the environment.

Nothing below ``create_app`` reads ``os.environ`` or a file: it gets a :class:`Settings`.
The environment may override ``KVL_REDIS_URL`` (or ``REDIS_URL``) and ``KVL_LISTEN``
(``host:port``); the admin token is read from the variable the config names.

Every value is checked here, at start: an unknown section or key, a value of the wrong type,
a negative number or a broken chat template is a :class:`SettingsError` naming the file, the
field and what was expected, so ``kvledger serve`` fails in one line instead of a request
failing later (the checks themselves are in ``router.settings_check``).
"""

from __future__ import annotations

import functools
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

from policies import DEFAULT_POLICY, PolicyName
from router.chat.parsers import PARSERS, ToolParser
from router.chat.templates import JinjaChat
from router.settings_check import (
    SettingsError,
    check_model_chat,
    check_table,
    check_template,
    routing_options,
)

Transport = Literal["http", "grpc"]
TRANSPORTS: tuple[Transport, ...] = ("http", "grpc")
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
DEFAULT_MESSAGE_TEMPLATE = "<|{role}|>\n{content}\n"
DEFAULT_GENERATION_PROMPT = "<|assistant|>\n"
# One spool per instance: two proxies started from one config file must not share it (the
# spool is locked), and they differ at least in machine or port. Placeholders may be used in
# an explicit spool_path too.
DEFAULT_SPOOL = "kvledger-spool-{hostname}-{port}.jsonl"

__all__ = ["SettingsError"]


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
    # The engine's max_input_len in tokens (0: not known here; the replica still enforces it),
    # and the most UTF-8 bytes one token of its tokenizer can stand for (0: not known). With
    # both, a prompt of more than max_input_len * max_token_bytes bytes has certainly more
    # tokens than the engine takes, and the proxy refuses it without asking the replica.
    max_input_len: int = 0
    max_token_bytes: int = 0
    # How generations reach the replica: Triton's HTTP generate_stream over keep-alive (needs
    # ``http``; a replica without it defaults to grpc), or gRPC stream_infer. Model control and
    # statistics use gRPC either way.
    transport: Transport = "http"
    # Takes production traffic; unset means "if it reuses KV blocks": a reuse-off replica
    # would serve every production request cold, so by default it serves cache=off arms only.
    production: bool | None = None

    @property
    def pool(self) -> Literal["production", "eval"]:
        """``production`` (production traffic and eval leases) or ``eval`` (leases only)."""
        serves = self.reuse if self.production is None else self.production
        return "production" if serves else "eval"


@dataclass(frozen=True)
class ChatTemplate:
    """How chat messages become ``text_input``: each message, then the generation prompt."""

    message: str = DEFAULT_MESSAGE_TEMPLATE
    generation_prompt: str = DEFAULT_GENERATION_PROMPT


@dataclass(frozen=True)
class ModelTable:
    """``[models.NAME]``: where a model's chat template and tool-call format come from
    (router.chat.templates says how the template is found)."""

    tokenizer: str = ""  # the model's tokenizer directory (tokenizer_config.json)
    chat_template: str = ""  # a .jinja file, or the name of one of the tokenizer's templates
    tool_call_parser: str = ""  # one of router.chat.parsers.PARSERS; "" = none


@dataclass(frozen=True)
class ModelChat:
    """How a model's chats are rendered and its tool calls parsed (resolved at start)."""

    jinja: JinjaChat | None  # the model's own template; None: the format-string fallback
    fallback: ChatTemplate
    parser: ToolParser | None


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096
    request_timeout_s: float = 300.0
    backend_timeout_s: float = 10.0  # no progress (a chunk) for this long: cancel, 504
    unhealthy_after_timeouts: int = 3  # in a row on one replica: routed around until it recovers


@dataclass(frozen=True)
class LineageSettings:
    stream_maxlen: int = 1_000_000
    request_ttl_s: int = 7 * 24 * 3600
    buffer_size: int = 10_000
    spool_path: Path = Path(DEFAULT_SPOOL)
    # WAIT 1 <ms> after a production request's chain step (when its master has a replica):
    # 0, the default, sends none (the request path keeps its one round trip).
    production_wait_ms: int = 0


@dataclass(frozen=True)
class EvalSettings:
    """``[eval]``: leases, verified resets and the serial turn of eval runs."""

    min_production_replicas: int = 1  # per model, never leased to runs
    drain_timeout_s: float = 60.0  # a reset waits this long for in-flight requests
    reload_timeout_s: float = 300.0  # a reset's unload and load take at most this long
    turn_ttl_s: float = 30.0  # a crashed proxy's turn is given up after this
    queue_timeout_s: float = 300.0  # a request waits this long for its turn, then 503
    continuity_wait_s: float = 2.0  # for the replica's counter to show the request
    # Resets and run begins renew their claim this often; a claim 3 heartbeats old is dead.
    heartbeat_s: float = 1.0
    # WAIT 1 <ms> after an eval request's chain step, before its response leaves, when its
    # Redis master has a replica (else no WAIT, and the record has no ``durable`` field).
    # A record no replica acknowledged in time says ``durable: false``, and so does its run.
    durable_wait_ms: int = 1000
    break_on_not_durable: bool = False  # true: such a record breaks its run


@dataclass(frozen=True)
class Settings:
    replicas: tuple[ReplicaSettings, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = "redis://127.0.0.1:6379/0"
    # A Redis Cluster at redis_url (or a redis+cluster://host:port,host:port URL): see
    # router.ledger.connect. The URL is then kept in its redis+cluster:// form.
    redis_cluster: bool = False
    admin_token: str | None = None
    admin_token_env: str = "KVL_ADMIN_TOKEN"
    policy: PolicyName = DEFAULT_POLICY
    policy_options: Mapping[str, Any] = field(default_factory=dict)
    allow_anonymous: bool = False
    monitor_interval_s: float = 2.0
    health_timeout_s: float = 3.0  # a replica's health check that takes longer fails
    chat_templates: Mapping[str, ChatTemplate] = field(default_factory=dict)
    chat_models: Mapping[str, ModelChat] = field(default_factory=dict)  # [models.NAME]
    limits: Limits = field(default_factory=Limits)
    lineage: LineageSettings = field(default_factory=LineageSettings)
    eval: EvalSettings = field(default_factory=EvalSettings)
    log_level: LogLevel = "info"

    @functools.cached_property
    def models(self) -> tuple[str, ...]:
        # Cached: every request checks its model against it, and the replicas never change.
        return tuple(dict.fromkeys(r.model for r in self.replicas))

    def template(self, model: str) -> ChatTemplate:
        return self.chat_templates.get(model, ChatTemplate())

    @functools.cached_property
    def _chats(self) -> dict[str, ModelChat]:
        chats = {m: ModelChat(None, self.template(m), None) for m in self.models}
        chats.update(self.chat_models)
        return chats

    def chat(self, model: str) -> ModelChat:
        """How chats for ``model`` are rendered (its template, else the fallback)."""
        found = self._chats.get(model)
        return found if found is not None else ModelChat(None, self.template(model), None)


_SECTIONS = (
    "server",
    "routing",
    "limits",
    "lineage",
    "eval",
    "chat_templates",
    "models",
    "replicas",
)
# Settings fields that are not keys of [server]: the other sections, and the admin token itself
# (only the name of the variable holding it is configured).
_NOT_SERVER = frozenset(
    ("replicas", "admin_token", "policy", "policy_options", "chat_templates", "chat_models")
    + ("limits", "lineage", "eval")
)


def _replicas(raw: Mapping[str, Any], source: str) -> tuple[ReplicaSettings, ...]:
    tables = raw.get("replicas", [])
    if not isinstance(tables, list) or not tables:
        raise SettingsError(f"{source}: the config names no [[replicas]]")
    replicas = []
    for i, table in enumerate(tables):
        where = f"{source}: [[replicas]] #{i + 1}"
        values = check_table(table, ReplicaSettings, where)
        missing = {"id", "grpc", "metrics"} - set(values)
        if missing:
            raise SettingsError(f"{where}: missing {sorted(missing)}")
        if "transport" not in values and not values.get("http"):
            values["transport"] = "grpc"  # the default needs an http URL; none given
        replicas.append(ReplicaSettings(**values))
        _check_transport(replicas[-1], where)
    ids = [r.id for r in replicas]
    if len(set(ids)) != len(ids):
        raise SettingsError(f"{source}: [[replicas]]: ids must be unique, got {ids}")
    return tuple(replicas)


def _templates(raw: Mapping[str, Any], source: str) -> dict[str, ChatTemplate]:
    tables = raw.get("chat_templates", {})
    if not isinstance(tables, dict):
        raise SettingsError(f"{source}: [chat_templates]: expected [chat_templates.MODEL] tables")
    templates = {}
    for model, table in tables.items():
        where = f"{source}: [chat_templates.{model}]"
        template = ChatTemplate(**check_table(table, ChatTemplate, where))
        check_template(template.message, where + " message")
        templates[model] = template
    return templates


def _chat_models(
    raw: Mapping[str, Any], templates: Mapping[str, ChatTemplate], base: Path, source: str
) -> dict[str, ModelChat]:
    tables = raw.get("models", {})
    if not isinstance(tables, dict):
        raise SettingsError(f"{source}: [models]: expected [models.NAME] tables")
    chats = {}
    for model, table in tables.items():
        where = f"{source}: [models.{model}]"
        values = ModelTable(**check_table(table, ModelTable, where))
        jinja = check_model_chat(
            values.tokenizer, values.chat_template, values.tool_call_parser, base, where
        )
        parser = PARSERS.get(values.tool_call_parser)
        chats[model] = ModelChat(jinja, templates.get(model, ChatTemplate()), parser)
    return chats


def _check_transport(replica: ReplicaSettings, where: str) -> None:
    if replica.transport not in TRANSPORTS:
        raise SettingsError(
            f"{where} transport: expected one of {list(TRANSPORTS)}, got {replica.transport!r}"
        )
    if replica.transport == "http" and not replica.http:
        raise SettingsError(
            f'{where} ({replica.id}): transport "http" needs the replica\'s "http" URL'
            ' (or transport = "grpc")'
        )


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or int(port) > 65535:
        raise SettingsError(f"environment variable KVL_LISTEN must be host:port, not {value!r}")
    return host or "127.0.0.1", int(port)


def _spool(lineage: Mapping[str, Any], base: Path, host: str, port: int, hostname: str) -> Path:
    pattern = str(lineage.get("spool_path", DEFAULT_SPOOL))
    name = pattern.replace("{hostname}", hostname).replace("{host}", host)
    return base / name.replace("{port}", str(port))


def build_settings(
    raw: Mapping[str, Any],
    env: Mapping[str, str],
    base: Path,
    *,
    source: str = "config",
    hostname: str | None = None,
) -> Settings:
    """Settings from a parsed TOML document and an environment (both injected for tests)."""
    unknown = sorted(set(raw) - set(_SECTIONS))
    if unknown:
        raise SettingsError(f"{source}: unknown section(s) {unknown}; known: {list(_SECTIONS)}")
    server = check_table(raw.get("server", {}), Settings, f"{source}: [server]", _NOT_SERVER)
    host, port = server.pop("host", "127.0.0.1"), server.pop("port", 8000)
    if "KVL_LISTEN" in env:
        host, port = _listen(env["KVL_LISTEN"])
    redis_url = env.get("KVL_REDIS_URL") or env.get("REDIS_URL") or server.pop("redis_url", None)
    server.pop("redis_url", None)
    token_env = server.pop("admin_token_env", "KVL_ADMIN_TOKEN")
    lineage = check_table(raw.get("lineage", {}), LineageSettings, f"{source}: [lineage]")
    spool = _spool(lineage, base, host, port, hostname or socket.gethostname())
    policy, options = routing_options(raw.get("routing", {}), f"{source}: [routing]")
    templates = _templates(raw, source)
    return Settings(
        replicas=_replicas(raw, source),
        host=host,
        port=port,
        redis_url=_redis_url(redis_url or Settings.redis_url, server, source),
        admin_token=env.get(token_env) or None,
        admin_token_env=token_env,
        policy=cast(PolicyName, policy),  # checked against the policies' names
        policy_options=options,
        chat_templates=templates,
        chat_models=_chat_models(raw, templates, base, source),
        limits=Limits(**check_table(raw.get("limits", {}), Limits, f"{source}: [limits]")),
        lineage=LineageSettings(**{**lineage, "spool_path": spool}),
        eval=EvalSettings(**check_table(raw.get("eval", {}), EvalSettings, f"{source}: [eval]")),
        **server,
    )


def _redis_url(url: str, server: dict[str, Any], source: str) -> str:
    """``url``, in its ``redis+cluster://`` form when ``[server] redis_cluster`` is true (the
    one setting every consumer of the URL then follows)."""
    if not server.get("redis_cluster"):
        return url
    from router.ledger.connect import cluster_url

    try:
        return cluster_url(url)
    except ValueError as exc:
        raise SettingsError(f"{source}: [server] redis_cluster: {exc}") from None


def load_settings(path: Path, env: Mapping[str, str]) -> Settings:
    """Read the TOML config file at ``path``; relative paths in it are relative to the file."""
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise SettingsError(f"cannot read config {path}: {exc.strerror}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(f"config {path} is not valid TOML: {exc}") from exc
    return build_settings(raw, env, path.resolve().parent, source=str(path))
