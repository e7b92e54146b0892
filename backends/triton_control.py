"""The management side of a Triton replica: readiness, model control, counters, engine digest.

Model control (unload, load), statistics and configs go over the replica's gRPC channel; the
metrics page (TensorRT-LLM's gauges) over HTTP. A readiness probe that finds the replica
unreachable (UNAVAILABLE) makes the next probe open a fresh channel: the old one would wait out
gRPC's reconnect backoff, seconds after a restarted replica is ready (``backends.triton_grpc``).
Counters and the reset use the *engine model* (``tensorrt_llm``), the one every path to the KV
cache goes through (see :mod:`backends.triton`).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from backends.base import BackendFailed, BackendUnavailable, EngineFacts, ReplicaCounters
from backends.engine_dir import EngineDir, max_input_len
from backends.engine_limits import engine_limits, tokens_per_block
from backends.triton_grpc import channel_options
from backends.triton_target import TritonTarget

_KV = "nv_trt_llm_kv_cache_block_metrics"
# The CPU stand-in's count of requests as TensorRT-LLM's C++ backend reports them to Triton's
# statistics (once per request, at its final response; stop requests not at all): a Python
# backend's own statistics count every execute (docs/stand-in.md). Read instead of Triton's
# statistics when the replica's metrics page has it.
SIM_REQUESTS = "kvledger_sim_backend_requests"


def _without_paths(config: Mapping[str, Any]) -> dict[str, Any]:
    """A model config without its path parameters (gpt_model_path, tokenizer_dir, ...): where
    files are does not change what they are, and identical replicas must share a digest."""
    params = config.get("parameters") or {}
    kept = {k: v for k, v in params.items() if not k.lower().endswith(("_path", "_dir"))}
    return {**config, "parameters": kept}


def _reuse(config: Mapping[str, Any]) -> bool:
    value = ((config.get("parameters") or {}).get("enable_kv_cache_reuse") or {}).get(
        "string_value", ""
    )
    return str(value).lower() in ("1", "true", "yes", "on")


def parse_metrics(page: str) -> dict[str, float]:
    """A Prometheus text page as ``{'family{labels}': value}``."""
    values: dict[str, float] = {}
    for line in page.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                values[key] = float(value)
            except ValueError:
                continue
    return values


def sample(values: dict[str, float], family: str, label: str) -> float:
    """Sum of a family's samples whose labels contain ``label``, e.g. ``general_type="x"``."""
    return found_sample(values, family, label) or 0.0


def found_sample(values: dict[str, float], family: str, label: str) -> float | None:
    """Like :func:`sample`, but None when the page has no such sample at all."""
    prefix = family + "{"
    found = [v for k, v in values.items() if k.startswith(prefix) and label in k]
    return sum(found) if found else None


class TritonControl:
    """Readiness, unload and load, statistics, metrics and the engine digest of one replica."""

    def __init__(
        self,
        target: TritonTarget,
        client: grpcaio.InferenceServerClient | None,
        http: aiohttp.ClientSession,
    ) -> None:
        """``client``: a caller's own, which it closes (None: this opens and closes its own)."""
        self.target = target
        self.replica_id = target.replica_id
        self._borrowed = client
        self._client = self._open() if client is None else client
        self._unreachable = False  # the last probe could not reach it: the next one renews
        self._renewed = False  # a fresh channel replaced a failed one (see take_renewed)
        self._http = http
        self._engine = EngineDir(target.replica_id)
        self._gpt_model_path: str | None = None  # as the engine model's config last said
        self._last_count: int | None = None
        self._sim_count = False  # the metrics page has SIM_REQUESTS: count with it

    def _open(self) -> grpcaio.InferenceServerClient:
        return grpcaio.InferenceServerClient(self.target.grpc, channel_args=channel_options())

    async def ready(self) -> bool:
        if self._unreachable:
            # Calls in flight on the old channel are to a server it could not reach.
            old, self._client = self._client, self._open()
            self._unreachable, self._renewed = False, True
            if old is not self._borrowed:
                await old.close()
        try:
            timeout = self.target.timeout_s
            live = await self._client.is_server_ready(client_timeout=timeout)
            model_ready = await self._client.is_model_ready(
                self.target.model, client_timeout=timeout
            )
        except InferenceServerException as exc:
            self._unreachable = "UNAVAILABLE" in (exc.status() or "")
            return False
        return bool(live and model_ready)

    def take_renewed(self) -> bool:
        """True once after the control channel was replaced (the replica was unreachable):
        the caller's own channels to it may be waiting out a backoff too."""
        renewed, self._renewed = self._renewed, False
        return renewed

    async def close(self) -> None:
        if self._client is not self._borrowed:
            await self._client.close()

    async def unload(self) -> None:
        await self._call(self._client.unload_model(self.target.model, unload_dependents=True))

    async def load(self, timeout_s: float) -> None:
        await self._call(self._client.load_model(self.target.model), timeout_s)

    async def reset(self, timeout_s: float) -> None:
        """Unload (returns at once), wait until the model and its engine model are gone and no
        model of the repository is still UNLOADING (a load issued while one is may keep it: the
        ensemble's ``preprocessing`` and ``postprocessing`` finish unloading up to 0.35 s after
        ``tensorrt_llm``), then load (blocks till ready), all within ``timeout_s``. A model that
        is not loaded (an earlier reset was interrupted) is only loaded."""
        deadline = time.monotonic() + timeout_s
        if await self.model_state() in ("READY", "UNLOADING", "LOADING"):
            await self.unload()
        self._engine.stale()
        names = (self.target.model, self.target.engine_model)
        while True:
            states = await self.model_states()
            held = {name: states.get(name) for name in names}
            held.update({name: state for name, state in states.items() if state == "UNLOADING"})
            if all(state not in ("READY", "UNLOADING") for state in held.values()):
                break
            if time.monotonic() > deadline:
                raise BackendFailed(
                    self.replica_id,
                    f"the model did not finish unloading in {timeout_s:g} s ({_states(held)})",
                )
            await asyncio.sleep(0.05)
        left = deadline - time.monotonic()
        try:
            await self.load(max(left, 1.0))
        except BackendUnavailable as exc:
            raise BackendUnavailable(self.replica_id, f"loading the model: {exc.detail}") from exc

    async def model_states(self) -> dict[str, str]:
        """Each model's state in the repository index: READY, UNLOADING, UNAVAILABLE, ..."""
        index = await self._call(self._client.get_model_repository_index(as_json=True))
        return {
            str(m.get("name")): str(m.get("state", "UNAVAILABLE")) for m in index.get("models", [])
        }

    async def model_state(self) -> str:
        """The served model's state in the repository index."""
        return (await self.model_states()).get(self.target.model, "UNAVAILABLE")

    async def engine_digest(self) -> str:
        """Server name and version; the configs of the served model and every model it is
        composed of (path parameters left out); the engine files' checksum; the reuse flag."""
        server = await self._call(self._client.get_server_metadata(as_json=True))
        configs = await self._model_configs()
        engine_config = configs.get(self.target.engine_model, {})
        material = {
            "server": {"name": server.get("name"), "version": server.get("version")},
            "model": self.target.model,
            "configs": {name: _without_paths(config) for name, config in configs.items()},
            "engine_files": await self._engine.checksum(self._engine_path(engine_config)),
            "kv_cache_reuse": _reuse(engine_config),
        }
        return hashlib.sha256(orjson.dumps(material, option=orjson.OPT_SORT_KEYS)).hexdigest()

    async def max_input_len(self) -> int | None:
        """The longest prompt the executor admits, or None when it cannot be read."""
        return (await self.engine_facts()).prompt_limit

    async def engine_facts(self) -> EngineFacts:
        """The runtime's limits as TensorRT-LLM computes them (:mod:`backends.engine_limits`)
        from the engine's config.json (cached until the engine is seen reloaded) and the engine
        model's parameters (``enable_chunked_context``); the built ``max_input_len`` when the
        config names no ``max_seq_len``."""
        engine_config = await self._model_config(self.target.engine_model)
        served = await self._model_config(self.target.model)
        inputs = tuple(
            (str(i.get("name")), str(i.get("data_type"))) for i in served.get("input") or ()
        )
        config = await self._engine.config(self._engine_path(engine_config))
        if config is None:
            return EngineFacts(model_inputs=inputs)
        found = engine_limits(config, engine_config.get("parameters") or {})
        block = tokens_per_block(config)
        if found is None:
            built = max_input_len(config)
            return EngineFacts(built, None, block, "max_input_len (as built)", inputs)
        return EngineFacts(found.max_input_len, found.max_seq_len, block, found.rule, inputs)

    def _engine_path(self, engine_config: Mapping[str, Any]) -> str:
        if self.target.engine_dir:
            return self.target.engine_dir
        param = (engine_config.get("parameters") or {}).get("gpt_model_path") or {}
        self._gpt_model_path = str(param.get("string_value", ""))
        return self._gpt_model_path

    async def _model_config(self, name: str) -> dict[str, Any]:
        config = await self._call(self._client.get_model_config(name, as_json=True))
        return dict(config.get("config", config))

    async def _model_configs(self) -> dict[str, dict[str, Any]]:
        """The served model's config and, through ensemble steps, its composing models'."""
        configs: dict[str, dict[str, Any]] = {}
        pending = [self.target.model, self.target.engine_model]
        while pending:
            name = pending.pop()
            if name in configs:
                continue
            configs[name] = await self._model_config(name)
            steps = (configs[name].get("ensemble_scheduling") or {}).get("step") or []
            pending.extend(str(step["model_name"]) for step in steps)
        return configs

    async def request_count(self) -> int:
        """The count of requests the engine model took since it was loaded, as the C++
        backend reports it (Triton's statistics; on the stand-in, its SIM_REQUESTS family)."""
        if self._sim_count:
            return int(sample(await self.scrape(), SIM_REQUESTS, "outcome="))
        stats = await self._call(
            self._client.get_inference_statistics(self.target.engine_model, as_json=True)
        )
        total = 0
        for model in stats.get("model_stats", []):
            inference = model.get("inference_stats", {})
            total += int(inference.get("success", {}).get("count", 0))
            total += int(inference.get("fail", {}).get("count", 0))
        return total

    async def counters(self) -> ReplicaCounters:
        if not await self.ready():
            self._last_count = None
            return ReplicaCounters(ready=False)
        page = await self.scrape()
        self._sim_count = self._sim_count or found_sample(page, SIM_REQUESTS, "") is not None
        if self._sim_count:
            count = int(sample(page, SIM_REQUESTS, "outcome="))
        else:
            count = await self.request_count()
        if self._last_count is None or count < self._last_count:
            # First sight, back from not ready, or reloaded: its engine files may be new.
            self._engine.stale()
        self._last_count = count
        return ReplicaCounters(
            ready=True,
            request_count=count,
            iteration_counter=sample(page, "nv_trt_llm_general_metrics", "iteration_counter"),
            reused_blocks=sample(page, _KV, 'kv_cache_block_type="reused"'),
            active=sample(page, "nv_trt_llm_request_metrics", 'request_type="active"'),
            scheduled=sample(page, "nv_trt_llm_request_metrics", 'request_type="scheduled"'),
            used_blocks=found_sample(page, _KV, 'kv_cache_block_type="used"'),
            metrics=page,
        )

    async def scrape(self) -> dict[str, float]:
        try:
            timeout = aiohttp.ClientTimeout(total=self.target.timeout_s)
            async with self._http.get(self.target.metrics, timeout=timeout) as response:
                return parse_metrics(await response.text())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendUnavailable(self.replica_id, f"metrics: {exc}") from exc

    async def _call(self, awaitable: Any, timeout_s: float | None = None) -> Any:
        """The call's result; BackendUnavailable when Triton refuses it or it takes longer than
        ``timeout_s`` (six health timeouts unless given)."""
        limit = self.target.timeout_s * 6 if timeout_s is None else timeout_s
        try:
            # Not asyncio.wait_for: in Python 3.11 it returns the call's result (or its error)
            # instead of the cancellation when both arrive together, and the monitor, cancelled
            # at shutdown, went on ticking forever (the proxy never exited on SIGTERM).
            async with asyncio.timeout(limit):
                return await awaitable
        except TimeoutError as exc:
            raise BackendUnavailable(self.replica_id, f"no answer within {limit:g} s") from exc
        except InferenceServerException as exc:
            raise BackendUnavailable(self.replica_id, str(exc)) from exc


def _states(states: Mapping[str, str | None]) -> str:
    return ", ".join(f"{name} {state or 'UNAVAILABLE'}" for name, state in states.items())
