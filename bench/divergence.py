"""The problem kvledger exists for, measured on real Triton stand-in replicas.

For the 80-episode agent workload (bench/workload.py), run in the same order each time, it
prints the share of episodes whose outputs differ from a cold run when rerun
- on the warm cache the cold run left (no reset),
- after a reset (unload + load through Triton's repository API),
- on a replica with block reuse off (its own cold run vs its rerun),
at 16-bit (bf16) and 4-bit (int4) weights; then the time of one turn at 256, 1,000 and 2,000
tokens of context, cold and with the context cached, and the start-up time of three replicas.

    .venv/bin/python -m bench.divergence [--episodes 80] [--out bench/out/divergence.md]
"""

from __future__ import annotations

import argparse
import queue
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

from backends.sim.launcher import Replica, ReplicaSpec, launch
from backends.sim.repository import MODEL_NAME, ModelSettings, Precision
from bench.workload import DEFAULT_MAX_TOKENS, Episode, make_episodes, run_episode
from tests.triton_helpers import reset

Run = list[list[str]]


class Client:
    """One gRPC stream to a replica; one generation at a time, as an eval harness sends them."""

    def __init__(self, replica: Replica) -> None:
        self.results: queue.Queue[Any] = queue.Queue()
        self.client = grpcclient.InferenceServerClient(replica.grpc_url)
        self.client.start_stream(callback=lambda result, error: self.results.put(error or result))
        self.reused = 0

    def generate(self, prompt: str, max_tokens: int = DEFAULT_MAX_TOKENS) -> str:
        inputs = []
        for name, value, dtype, kind in (
            ("text_input", prompt.encode(), np.object_, "BYTES"),
            ("max_tokens", max_tokens, np.int32, "INT32"),
            ("exclude_input_in_output", True, np.bool_, "BOOL"),
            ("return_perf_metrics", True, np.bool_, "BOOL"),
        ):
            tensor = grpcclient.InferInput(name, [1, 1], kind)
            tensor.set_data_from_numpy(np.array([[value]], dtype=dtype))
            inputs.append(tensor)
        self.client.async_stream_infer(MODEL_NAME, inputs)
        item = self.results.get(timeout=120)
        if isinstance(item, Exception):
            raise item
        self.reused += int(item.as_numpy("kv_cache_reused_blocks").reshape(-1)[0])
        return str(item.as_numpy("text_output").reshape(-1)[0].decode())

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def play(replica: Replica, episodes: list[Episode], label: str) -> tuple[Run, float, int]:
    client = Client(replica)
    start = time.perf_counter()
    try:
        run = [run_episode(client.generate, e) for e in episodes]
    finally:
        client.close()
    elapsed = time.perf_counter() - start
    print(f"  {label}: {elapsed:.1f} s, {client.reused} reused blocks", flush=True)
    return run, elapsed, client.reused


def diverged(a: Run, b: Run) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def divergence_rows(precision: Precision, episodes: list[Episode]) -> list[str]:
    print(f"{precision}: starting a replica with reuse and one without", flush=True)
    specs = [
        ReplicaSpec("on", ModelSettings(precision=precision)),
        ReplicaSpec("off", ModelSettings(precision=precision, reuse=False)),
    ]
    with launch(specs) as (on, off):
        cold, t_cold, _ = play(on, episodes, "cold run")
        warm, t_warm, reused = play(on, episodes, "rerun on the warm cache")
        reset(on)
        fresh, t_fresh, _ = play(on, episodes, "rerun after a reset")
        off_a, t_off, _ = play(off, episodes, "reuse off, first run")
        off_b, _, off_reused = play(off, episodes, "reuse off, rerun")
    n = len(episodes)

    def row(setting: str, d: int, seconds: float, blocks: int | str) -> str:
        return (
            f"| {precision} | {setting} | {d}/{n} ({100 * d / n:.1f}%) | {blocks} | {seconds:.1f} |"
        )

    return [
        row("rerun on the warm cache", diverged(cold, warm), t_warm, reused),
        row("rerun after a reset", diverged(cold, fresh), t_fresh, "-"),
        row("reuse off, rerun", diverged(off_a, off_b), t_off, off_reused),
        f"| {precision} | (cold run) | - | - | {t_cold:.1f} |",
    ]


def turn_times(precision: Precision) -> list[str]:
    rows = []
    rng = random.Random(7)
    with launch([ReplicaSpec("t", ModelSettings(precision=precision))]) as (replica,):
        client = Client(replica)
        try:
            for context in (256, 1000, 2000):
                text = "".join(rng.choice("abcdefghij klmnop.") for _ in range(context))
                cold = _timed(client.generate, text)
                warm = _timed(client.generate, text + " and one more turn.")
                rows.append(f"| {context} | {cold * 1000:.0f} | {warm * 1000:.0f} |")
        finally:
            client.close()
    return rows


def _timed(call: Callable[[str], object], prompt: str) -> float:
    start = time.perf_counter()
    call(prompt)
    return time.perf_counter() - start


def startup_time() -> float:
    start = time.perf_counter()
    with launch([ReplicaSpec(f"s{i}") for i in range(3)]):
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=80)
    parser.add_argument("--out", type=Path, default=Path("bench/out/divergence.md"))
    args = parser.parse_args()
    episodes = make_episodes(args.episodes)
    lines = [
        f"Episodes whose outputs differ from the cold run ({args.episodes} episodes, "
        f"{sum(e.turns for e in episodes)} turns, {DEFAULT_MAX_TOKENS} tokens per turn)",
        "",
        "| weights | rerun | divergent episodes | reused blocks | wall s |",
        "|---|---|---|---|---|",
    ]
    for precision in ("bf16", "int4"):
        lines += divergence_rows(precision, episodes)
    lines += [
        "",
        "Time of one turn (20 output tokens), ms",
        "",
        "| context tokens | cold | context cached |",
        "|---|---|---|",
    ]
    lines += turn_times("bf16")
    lines += ["", f"Start-up of three replicas (to all ready): {startup_time():.1f} s"]
    report = "\n".join(lines)
    print("\n" + report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
