"""``kvledger replicas check``: does a live replica behave as the ledger assumes?

Every figure kvledger records is proven on the CPU stand-in; this command proves a deployment
(a GPU replica running TensorRT-LLM's Triton backend) against the same list before anyone trusts
its ledger. It talks to the replica as the proxy does (Triton's gRPC and HTTP APIs, the metrics
page, the engine's files) and prints one line per behaviour: PASS or FAIL, what it saw, and for a
FAIL the setting to change. It exits 0 only when every line passes. What each line relies on is
in docs/stand-in.md (the real backend's file that defines it, and where the stand-in imitates
it); docs/deploy.md says when to run it.

The command's options are in :mod:`router.cli.replicas`. It sends a handful of short
requests (and one refused prompt one token over the limit), so run it on a replica that serves
nobody else: the request-counter lines need the counter to move for the check's own requests
only. ``--reset`` adds the line that needs an unload and a load.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import numpy as np
import orjson
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from backends.base import BackendError, GenerationRequest
from backends.engine_limits import is_prompt_refusal, plain_params
from backends.triton_control import TritonControl, found_sample
from backends.triton_grpc import StreamChannel, infer_request, tensor
from backends.triton_http import request_body
from backends.triton_target import TritonTarget

STATS = ("kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks")
COUNTS = ("num_input_tokens", "num_output_tokens")
KV = "nv_trt_llm_kv_cache_block_metrics"
GAUGES = (
    (KV, "kv_cache_block_type", ("max", "free", "used", "tokens_per")),
    ("nv_trt_llm_request_metrics", "request_type", ("active", "scheduled")),
    ("nv_trt_llm_general_metrics", "general_type", ("iteration_counter",)),
)
METRICS_FIX = "metrics = Triton's metrics page (tritonserver --allow-metrics, --metrics-port)"


@dataclass
class Line:
    """One behaviour: whether it holds, what the check saw, and what to change if not."""

    name: str
    ok: bool
    saw: str
    fix: str = ""

    def render(self) -> str:
        text = f"{'PASS' if self.ok else 'FAIL'}  {self.name:<16} {self.saw}"
        return text + (f"\n      change: {self.fix}" if not self.ok and self.fix else "")


@dataclass(frozen=True)
class Expect:
    """What the proxy's config says of the replica (the defaults when checked by URL)."""

    reuse: bool = True
    tokens_per_block: int = 0  # 0: take the engine's


class Checker:
    """The checks of one replica, in order; later ones use what earlier ones found."""

    def __init__(
        self, target: TritonTarget, http_url: str, session: aiohttp.ClientSession, expect: Expect
    ) -> None:
        self.target, self.http_url, self.session, self.expect = target, http_url, session, expect
        self.client = grpcaio.InferenceServerClient(target.grpc)
        self.control = TritonControl(target, self.client, session)
        self.streams = StreamChannel(target.grpc)
        self.lines: list[Line] = []
        self.limit: int | None = None
        self.tokens_per_block = expect.tokens_per_block or 16
        self.served: dict[str, Any] = {}
        self.engine_params: dict[str, Any] = {}
        self.repeated = ""

    def add(self, name: str, ok: bool, saw: str, fix: str = "") -> bool:
        self.lines.append(Line(name, ok, saw, fix))
        return ok

    async def run(self, reset: bool) -> list[Line]:
        steps: list[Callable[[], Awaitable[bool]]] = [
            self.ready,
            self.topology,
            self.inputs,
            self.outputs,
            self.reuse_flag,
            self.engine_files,
            self.generation,
            self.streamed,
            self.metrics,
            self.counter,
            self.prompt_limit,
            self.block_reuse,
        ]
        if reset:
            steps.append(self.reset_empties)
        try:
            for step in steps:
                try:
                    if not await step() and step in (self.ready, self.topology):
                        break  # nothing further can be asked of it
                except (BackendError, InferenceServerException, aiohttp.ClientError) as exc:
                    self.add(step.__name__, False, f"could not be checked: {exc}")
        finally:
            await self.streams.close()
            await self.client.close()
        return self.lines

    async def ready(self) -> bool:
        ok = await self.control.ready()
        saw = f"server live, model '{self.target.model}' ready" if ok else "not ready"
        return self.add(
            "ready", ok, saw, f"grpc = the replica's gRPC address; model = {self.target.model!r}?"
        )

    async def config(self, name: str) -> dict[str, Any]:
        found = await self.client.get_model_config(name, as_json=True)
        return dict(found.get("config", found))

    async def topology(self) -> bool:
        served = await self.config(self.target.model)
        try:
            engine = await self.config(self.target.engine_model)
        except InferenceServerException:
            return self.add(
                "topology",
                False,
                f"no model '{self.target.engine_model}' on the replica",
                "engine_model = the TensorRT-LLM model every request goes through",
            )
        steps = [
            s.get("model_name") for s in (served.get("ensemble_scheduling") or {}).get("step", [])
        ]
        if served.get("platform") == "ensemble" and self.target.engine_model not in steps:
            return self.add(
                "topology",
                False,
                f"ensemble steps {steps} do not include '{self.target.engine_model}'",
                "engine_model = the ensemble's TensorRT-LLM step",
            )
        shape = " -> ".join(map(str, steps)) if steps else f"{served.get('backend')} model"
        self.served, self.engine_params = served, engine.get("parameters") or {}
        return self.add("topology", True, f"{self.target.model}: {shape}")

    async def reuse_flag(self) -> bool:
        flag = plain_params(self.engine_params).get("enable_kv_cache_reuse", "")
        reuse = flag.lower() in ("1", "true", "yes", "on")
        fix = (
            'enable_kv_cache_reuse: "true" in tensorrt_llm/config.pbtxt, or reuse = false'
            if self.expect.reuse
            else "reuse = true in kvledger's config (the engine reuses blocks)"
        )
        return self.add(
            "reuse flag",
            reuse == self.expect.reuse,
            f"enable_kv_cache_reuse {'on' if reuse else 'off'}, kvledger expects"
            f" {'on' if self.expect.reuse else 'off'}",
            fix,
        )

    async def inputs(self) -> bool:
        names = {str(i.get("name")) for i in self.served.get("input", [])}
        target, missing, fixes = self.target, [], []
        for name in ("text_input", "max_tokens", "stream", "exclude_input_in_output"):
            if name not in names:
                missing.append(name)
        for setting, wanted, other in (
            ("seed_input", target.seed_input, {"seed": "random_seed", "random_seed": "seed"}),
            (
                "perf_input",
                target.perf_input,
                {
                    "return_perf_metrics": "return_kv_cache_reuse_stats",
                    "return_kv_cache_reuse_stats": "return_perf_metrics",
                },
            ),
        ):
            if wanted not in names:
                missing.append(wanted)
                alternative = other.get(wanted)
                if alternative in names:
                    fixes.append(f'{setting} = "{alternative}"')
        if (
            target.token_counts
            and not {"return_num_input_tokens", "return_num_output_tokens"} <= names
        ):
            missing.append("return_num_input_tokens/return_num_output_tokens")
            fixes.append("token_counts = false")
        saw = f"declares {', '.join(sorted(names & _WANTED))}"
        if missing:
            saw = f"lacks {', '.join(missing)}"
        return self.add(
            "inputs", not missing, saw, "; ".join(fixes) or "use TensorRT-LLM 0.16+'s ensemble"
        )

    async def outputs(self) -> bool:
        names = {str(o.get("name")) for o in self.served.get("output", [])}
        wanted = STATS + (COUNTS if self.target.token_counts else ())
        missing = [n for n in wanted if n not in names]
        saw = f"lacks {', '.join(missing)}" if missing else f"returns {', '.join(wanted)}"
        fix = (
            "map tensorrt_llm's kv_cache_* and num_*_tokens outputs in ensemble/config.pbtxt"
            " (TensorRT-LLM 0.16+)"
        )
        return self.add("stats outputs", not missing, saw, fix)

    async def engine_files(self) -> bool:
        facts = await self.control.engine_facts()
        if facts.prompt_limit is None:
            return self.add(
                "engine files",
                False,
                "no readable config.json in the engine directory",
                "engine_dir = the engine directory as this machine sees it (a read-only mount)",
            )
        self.limit = facts.prompt_limit
        block = facts.tokens_per_block
        self.tokens_per_block = block or self.tokens_per_block
        saw = f"prompt limit {facts.prompt_limit} ({facts.rule}), {block} tokens per block"
        wrong = self.expect.tokens_per_block and block and block != self.expect.tokens_per_block
        return self.add("engine files", not wrong, saw, f"tokens_per_block = {block}")

    async def generate(
        self, prompt: str, stream: bool, max_tokens: int = 4
    ) -> list[dict[str, Any]]:
        request = GenerationRequest(uuid.uuid4().hex, prompt, max_tokens, stream, seed=1)
        path = f"/v2/models/{self.target.model}/generate" + ("_stream" if stream else "")
        body = request_body(self.target, request)
        async with self.session.post(self.http_url + path, data=body) as response:
            raw = await response.read()
        if not stream:
            return [orjson.loads(raw)]
        return [orjson.loads(line[5:]) for line in raw.splitlines() if line.startswith(b"data:")]

    async def generation(self) -> bool:
        (answer,) = await self.generate("kvledger check " + uuid.uuid4().hex, stream=False)
        if "error" in answer:
            return self.add(
                "generation", False, f"error: {answer['error']}", "see the replica's log"
            )
        missing = [n for n in STATS + COUNTS if n not in answer]
        saw = "the answer carries " + (
            "every statistic" if not missing else f"no {', '.join(missing)}"
        )
        return self.add("generation", not missing, saw, "the stats outputs and inputs above")

    async def streamed(self) -> bool:
        events = await self.generate(
            "kvledger stream " + uuid.uuid4().hex, stream=True, max_tokens=6
        )
        errors = [e["error"] for e in events if "error" in e]
        with_stats = [e for e in events if "kv_cache_reused_blocks" in e]
        tokens = sum(int(e.get("num_output_tokens", 0)) for e in events)
        if errors or not with_stats:
            saw = f"error: {errors[0]}" if errors else "no event carries the reuse statistics"
            return self.add("stream stats", False, saw, "the stats inputs and outputs above")
        where = (
            "every event"
            if len(with_stats) == len(events)
            else f"{len(with_stats)} of {len(events)} events"
        )
        saw = f"statistics on {where}; num_output_tokens sums to {tokens} over the stream"
        return self.add("stream stats", tokens > 0, saw, "return_num_output_tokens in the ensemble")

    async def metrics(self) -> bool:
        await self.control.counters()  # as the proxy's monitor: picks the request counter
        page = await self.control.scrape()
        missing = []
        for family, label, values in GAUGES:
            for value in values:
                if found_sample(page, family, f'{label}="{value}"') is None:
                    missing.append(f'{family}{{{label}="{value}"}}')
        labelled = any(k.startswith(KV + "{") and 'model="' in k and 'version="' in k for k in page)
        if not labelled:
            missing.append(f"{KV} with model and version labels")
        saw = (
            f"lacks {', '.join(missing)}"
            if missing
            else "block, request and iteration gauges with their labels"
        )
        return self.add("metrics", not missing, saw, METRICS_FIX)

    async def settled_count(self) -> int:
        count = await self.control.request_count()
        for _ in range(40):
            await asyncio.sleep(0.05)
            again = await self.control.request_count()
            if again == count:
                return count
            count = again
        return count

    async def engine_call(self, inputs: list[Any], request_id: str) -> str | None:
        """One request straight to the engine model; its error message, or None."""
        done = asyncio.Event()
        call = self.streams.open(infer_request(self.target.engine_model, inputs, request_id), done)
        try:
            async with asyncio.timeout(self.target.timeout_s * 6):
                async for result in call:
                    if result.get_response().parameters["triton_final_response"].bool_param:
                        return None
        except InferenceServerException as exc:
            return exc.message() or str(exc)
        except grpc.RpcError as exc:
            return str(exc)
        finally:
            done.set()
        return "the stream ended without a final response"

    async def counter(self) -> bool:
        before = await self.settled_count()
        await self.generate("kvledger count " + uuid.uuid4().hex, stream=False, max_tokens=2)
        one = await self.settled_count()
        stop = [
            tensor("input_ids", 0, np.int32, "INT32"),
            tensor("input_lengths", 1, np.int32, "INT32"),
            tensor("request_output_len", 1, np.int32, "INT32"),
            tensor("stop", True, np.bool_, "BOOL"),
        ]
        error = await self.engine_call(stop, "kvledger-check-" + uuid.uuid4().hex)
        two = await self.settled_count()
        kind = {0: "not counted (C++ backend)", 1: "counted (Python backend)"}.get(two - one)
        saw = f"a request +{one - before}; a stop request {kind or f'+{two - one}'}"
        if error:
            saw += f"; the stop was answered with an error: {error}"
        ok = one - before == 1 and kind is not None and not error
        return self.add("request counter", ok, saw, "run the check on a replica nobody else uses")

    async def prompt_limit(self) -> bool:
        if self.limit is None:
            return self.add("prompt limit", False, "unknown (no engine config)", "engine_dir = ...")
        over = self.limit + 1
        inputs = [
            tensor("input_ids", [1] * over, np.int32, "INT32"),
            tensor("input_lengths", over, np.int32, "INT32"),
            tensor("request_output_len", 1, np.int32, "INT32"),
        ]
        error = await self.engine_call(inputs, "kvledger-check-" + uuid.uuid4().hex)
        if error is None:
            saw = (
                f"a prompt of {over} tokens was admitted: the engine's limit is above {self.limit}"
            )
            fix = "engine_dir = the engine this replica loaded; enable_chunked_context as deployed"
            return self.add("prompt limit", False, saw, fix)
        if not is_prompt_refusal(error):
            return self.add(
                "prompt limit", False, f"{over} tokens: {error[:200]}", "see the replica's log"
            )
        named = f"({self.limit})" in error
        saw = f"{over} tokens refused: {error[error.find('Prompt length') :][:90]}"
        return self.add("prompt limit", named, saw, "the refusal names another limit: engine_dir")

    def reuse_prompt(self) -> str:
        words = " ".join(f"w{i}" for i in range(self.tokens_per_block * 6))
        return f"kvledger reuse {uuid.uuid4().hex} {words}"

    async def reused(self, prompt: str) -> int:
        (answer,) = await self.generate(prompt, stream=False, max_tokens=2)
        return int(answer.get("kv_cache_reused_blocks", -1))

    async def block_reuse(self) -> bool:
        prompt = self.reuse_prompt()
        first, second = await self.reused(prompt), await self.reused(prompt)
        self.repeated = prompt
        saw = f"a repeated prompt reused {second} block(s) (first time {first})"
        if not self.expect.reuse:
            return self.add("block reuse", second == 0, saw, "reuse = true in kvledger's config")
        fix = 'enable_kv_cache_reuse: "true"; a KV cache large enough to keep the prompt'
        return self.add("block reuse", second > 0, saw, fix)

    async def reset_empties(self) -> bool:
        started = time.monotonic()
        await self.control.reset(300.0)
        count = await self.settled_count()
        again = await self.reused(self.repeated)
        saw = (
            f"unload + load took {time.monotonic() - started:.1f} s; request counter then {count};"
            f" the repeated prompt then reused {again} block(s)"
        )
        fix = "tritonserver --model-control-mode=explicit; a load that rebuilds the executor"
        return self.add("reset", count == 0 and again == 0, saw, fix)


_WANTED = {
    "text_input",
    "max_tokens",
    "stream",
    "seed",
    "random_seed",
    "return_perf_metrics",
    "return_kv_cache_reuse_stats",
    "return_num_input_tokens",
    "return_num_output_tokens",
}


async def check(target: TritonTarget, http_url: str, expect: Expect, reset: bool) -> list[Line]:
    async with aiohttp.ClientSession() as session:
        return await Checker(target, http_url, session, expect).run(reset)
