"""Measure how often reruns of the agent workload diverge on the in-process stand-in engine.

For each configuration (float format, weight bits, weight seed) it runs the episodes once on a
fresh engine ("cold") and then compares, episode by episode, against:
- warm:  a rerun on the same engine, whose cache still holds the cold run's blocks;
- fresh: a rerun after `reset()` (must be identical: same state, same bytes);
- noreuse: with reuse off, a second run against a first (must be identical);
- small: with a cache too small to keep the first run's blocks, a second run against a first.

    python -m bench.calibrate_engine --seeds 0,1,2 --formats bf16,fp16,fp32 --bits 16,4
    python -m bench.calibrate_engine --modes warm --jobs 2   # quick: warm reruns only
    python -m bench.calibrate_engine --timings               # latency figures only

Divergence comes only from floating-point order, never from injected randomness.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import time
from dataclasses import dataclass, replace
from typing import Literal, cast

from backends.sim.engine import Engine, EngineConfig, SamplingParams
from bench.workload import DEFAULT_MAX_TOKENS, Episode, make_episodes, run_episode

MODES = ("warm", "fresh", "noreuse", "small")
SMALL_CAPACITY = 160  # blocks: about two episodes, far below the ~5,000-block working set


@dataclass(frozen=True)
class Job:
    config: EngineConfig
    modes: tuple[str, ...]
    episodes: int
    max_tokens: int


def run_all(engine: Engine, episodes: list[Episode], max_tokens: int) -> list[list[str]]:
    params = SamplingParams(max_tokens=max_tokens)
    return [run_episode(lambda p: engine.generate(p, params).text, ep) for ep in episodes]


def diverged(a: list[list[str]], b: list[list[str]]) -> int:
    return sum(x != y for x, y in zip(a, b, strict=True))


def _twice(config: EngineConfig, episodes: list[Episode], max_tokens: int) -> int:
    engine = Engine(config)
    first = run_all(engine, episodes, max_tokens)
    return diverged(first, run_all(engine, episodes, max_tokens))


def measure(job: Job) -> str:
    episodes = make_episodes(job.episodes)
    engine = Engine(job.config)
    started = time.perf_counter()
    cold = run_all(engine, episodes, job.max_tokens)
    cold_s = time.perf_counter() - started
    cells = {}
    if "warm" in job.modes:
        started = time.perf_counter()
        cells["warm"] = diverged(cold, run_all(engine, episodes, job.max_tokens))
        cells["warm_s"] = round(time.perf_counter() - started)
    if "fresh" in job.modes:
        engine.reset()
        cells["fresh"] = diverged(cold, run_all(engine, episodes, job.max_tokens))
    if "noreuse" in job.modes:
        cells["noreuse"] = _twice(replace(job.config, reuse=False), episodes, job.max_tokens)
    if "small" in job.modes:
        small = replace(job.config, capacity_blocks=SMALL_CAPACITY)
        cells["small"] = _twice(small, episodes, job.max_tokens)
    c = job.config
    label = f"{c.float_format:>4} w{c.weight_bits:<2} seed {c.weight_seed}"
    shown = "  ".join(f"{k}={v}" for k, v in cells.items())
    return f"{label}  n={job.episodes}  cold_s={cold_s:.0f}  {shown}"


def _text(rng: random.Random, n: int) -> str:
    return "".join(chr(rng.randrange(32, 127)) for _ in range(n))


def _timed(engine: Engine, prompt: str, params: SamplingParams) -> tuple[float, float, str]:
    """Wall and process-CPU milliseconds of one request, and its text."""
    wall, cpu = time.perf_counter(), time.process_time()
    text = engine.generate(prompt, params).text
    return 1e3 * (time.perf_counter() - wall), 1e3 * (time.process_time() - cpu), text


def timings() -> None:
    """Cold prefill latency, and a turn of 20 new prompt + 20 output tokens at 1,000 cached.

    CPU time is printed too: on a shared 2-core machine wall time mostly measures neighbours.
    """
    rng = random.Random(0)
    for n in (256, 1024, 2048):
        wall, cpu, _ = _timed(Engine(EngineConfig()), _text(rng, n), SamplingParams(max_tokens=1))
        print(f"cold prefill {n:>5} tokens: wall {wall:7.1f} ms  cpu {cpu:7.1f} ms")
    engine = Engine(EngineConfig())
    context = _text(rng, 1000)
    engine.generate(context, SamplingParams(max_tokens=0))
    # Forbidding the end token makes every turn produce exactly 20 tokens.
    params = SamplingParams(max_tokens=20, end_id=0, bad_words=("\x00",))
    walls, cpus = [], []
    for _ in range(10):
        context += _text(rng, 20)
        wall, cpu, text = _timed(engine, context, params)
        walls.append(wall)
        cpus.append(cpu)
        context += text
    print(
        f"turn (20 new + 20 output tokens, 1,000-1,400 cached): median wall "
        f"{statistics.median(walls):.1f} ms  cpu {statistics.median(cpus):.1f} ms"
    )


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--episodes", type=int, default=80)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--formats", default="bf16,fp16,fp32")
    parser.add_argument("--bits", default="16", help="weight bits to try, e.g. 16,4")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--timings", action="store_true", help="print latency figures only")
    args = parser.parse_args()
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}")
    return args


def _jobs(args: argparse.Namespace) -> list[Job]:
    return [
        Job(
            EngineConfig(
                float_format=cast(Literal["bf16", "fp16", "fp32"], fmt),
                weight_bits=cast(Literal[16, 4], int(bits)),
                weight_seed=int(seed),
            ),
            tuple(args.modes.split(",")),
            args.episodes,
            args.max_tokens,
        )
        for bits in args.bits.split(",")
        for fmt in args.formats.split(",")
        for seed in args.seeds.split(",")
    ]


def main() -> None:
    args = _parse()
    if args.timings:
        timings()
        return
    if args.jobs <= 1:
        for job in _jobs(args):
            print(measure(job), flush=True)
        return
    # One BLAS thread per worker: the workers already use the cores. Results do not depend
    # on it (float64 compute then rounding), only the timings do.
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for line in pool.imap(measure, _jobs(args)):
            print(line, flush=True)


if __name__ == "__main__":
    main()
