"""The overhead benchmark's tables: per round, then the ranges over rounds against the direct
call and against the bare pass-through (the floor of our stack)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from bench.overhead_client import Phase


@dataclass
class Cell:
    """One target in one round: its three phases."""

    c1: Phase
    c32: Phase
    stream: Phase

    @property
    def failures(self) -> list[str]:
        return self.c1.failures + self.c32.failures + self.stream.failures


@dataclass
class Results:
    names: list[str]
    rounds: list[dict[str, Cell]] = field(default_factory=list)
    executed: dict[str, Counter[str]] = field(default_factory=dict)  # commandstats delta
    served: Counter[str] = field(default_factory=Counter)  # requests in those windows
    sent: dict[str, Counter[str]] = field(default_factory=dict)  # MONITOR sample
    in_lua: dict[str, Counter[str]] = field(default_factory=dict)
    sampled: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)


def _span(values: Sequence[float], fmt: str) -> str:
    low, high = min(values), max(values)
    if f"{low:{fmt}}" == f"{high:{fmt}}":
        return f"{low:{fmt}}"
    return f"{low:{fmt}} to {high:{fmt}}"


def round_table(cells: dict[str, Cell], names: list[str]) -> list[str]:
    lines = [
        "| target | p50 c=1 | p99 c=1 | req/s c=32 | CPU/req c=32 | CPU/req c=1 "
        "| first chunk p50 | failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        cell = cells[name]
        lines.append(
            f"| {name} | {cell.c1.p(0.5):.2f} ms | {cell.c1.p(0.99):.2f} ms "
            f"| {cell.c32.rps:,.0f} | {cell.c32.cpu_per_request_us:,.0f} µs "
            f"| {cell.c1.cpu_per_request_us:,.0f} µs | {cell.stream.p(0.5):.2f} ms "
            f"| {len(cell.failures)} |"
        )
    return lines


def summary_table(results: Results, direct: str, floor: str) -> list[str]:
    """Added latency and throughput against the direct call, and the ratios to the floor."""
    lines = [
        "| target | added p50, c=1 | added first chunk | CPU per request (c=32) "
        f"| throughput vs direct (c=32) | vs {floor}: CPU, added p50, throughput, first chunk |",
        "|---|---|---|---|---|---|",
    ]
    for name in results.names:
        if name == direct:
            continue
        rounds = [r[name] for r in results.rounds]
        bases = [r[direct] for r in results.rounds]
        added = [c.c1.p(0.5) - b.c1.p(0.5) for c, b in zip(rounds, bases, strict=True)]
        ttfc = [c.stream.p(0.5) - b.stream.p(0.5) for c, b in zip(rounds, bases, strict=True)]
        tput = [c.c32.rps / b.c32.rps for c, b in zip(rounds, bases, strict=True)]
        cpu = [c.c32.cpu_per_request_us for c in rounds]
        versus = "n/a"
        if name != floor:
            pairs = list(zip(rounds, [r[floor] for r in results.rounds], strict=True))
            cpu_x = [c.c32.cpu_per_request_us / f.c32.cpu_per_request_us for c, f in pairs]
            p50_d = [c.c1.p(0.5) - f.c1.p(0.5) for c, f in pairs]
            tput_x = [c.c32.rps / f.c32.rps for c, f in pairs]
            ttfc_d = [c.stream.p(0.5) - f.stream.p(0.5) for c, f in pairs]
            versus = (
                f"{_span(cpu_x, '.2f')}×, {_span(p50_d, '+.2f')} ms, "
                f"{_span(tput_x, '.2f')}×, {_span(ttfc_d, '+.2f')} ms"
            )
        lines.append(
            f"| {name} | {_span(added, '+.2f')} ms | {_span(ttfc, '+.2f')} ms "
            f"| {_span(cpu, ',.0f')} µs | {_span(tput, '.2f')} | {versus} |"
        )
    return lines


def target_lines(results: Results, floor: str, kvledger: list[str]) -> list[str]:
    """Issue 12's targets, per kvledger target: met in how many rounds, and the figures."""
    lines = [
        "| target | CPU ≤ 1.5× floor | added p50 ≤ floor's + 0.3 ms | throughput ≥ 0.8× floor "
        "| first chunk ≤ floor's + 0.3 ms | ≤ 3 Redis commands sent |",
        "|---|---|---|---|---|---|",
    ]
    n = len(results.rounds)
    for name in kvledger:
        pairs = [(r[name], r[floor]) for r in results.rounds]
        checks = [
            [c.c32.cpu_per_request_us / f.c32.cpu_per_request_us for c, f in pairs],
            [c.c1.p(0.5) - f.c1.p(0.5) for c, f in pairs],
            [c.c32.rps / f.c32.rps for c, f in pairs],
            [c.stream.p(0.5) - f.stream.p(0.5) for c, f in pairs],
        ]
        limits = ((1.5, "≤", "×"), (0.3, "≤", " ms"), (0.8, "≥", "×"), (0.3, "≤", " ms"))
        cells = []
        for values, (limit, sense, unit) in zip(checks, limits, strict=True):
            met = sum((v <= limit) if sense == "≤" else (v >= limit) for v in values)
            cells.append(f"{met}/{n} ({_span(values, '.2f')}{unit})")
        sampled = results.sampled[name]
        sent = sum(results.sent.get(name, Counter()).values()) / sampled if sampled else 0.0
        cells.append(f"{'yes' if sampled and sent <= 3 else 'no'} ({sent:.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def redis_lines(results: Results) -> list[str]:
    lines = []
    for name, executed in results.executed.items():
        served = results.served[name]
        if not served:
            continue
        per = ", ".join(
            f"{cmd} {count / served:.2f}" for cmd, count in executed.most_common() if count
        )
        total = sum(executed.values()) / served
        lines.append(f"- {name}: {total:.2f} commands executed per request ({per})")
        sampled = results.sampled[name]
        if sampled:
            sent, lua = results.sent[name], results.in_lua[name]
            sent_per = ", ".join(f"{c} {n / sampled:.2f}" for c, n in sent.most_common())
            lua_per = ", ".join(f"{c} {n / sampled:.2f}" for c, n in lua.most_common())
            lines.append(
                f"  - MONITOR sample of {sampled} requests: {sum(sent.values()) / sampled:.2f} "
                f"sent per request ({sent_per}); {sum(lua.values()) / sampled:.2f} inside Lua "
                f"({lua_per or 'none'})"
            )
    return lines


def failure_lines(results: Results) -> list[str]:
    lines = []
    for index, cells in enumerate(results.rounds, 1):
        for name, cell in cells.items():
            if cell.failures:
                lines.append(
                    f"- round {index}, {name}: {len(cell.failures)} failed, e.g. {cell.failures[0]}"
                )
    return lines or ["- none: every response was checked and passed"]


def render(results: Results, direct: str, floor: str, header: list[str]) -> str:
    """``direct``: the direct call's target; ``floor``: the bare pass-through's."""
    out = [*header, "", "## Summary over rounds (ranges: lowest to highest round)", ""]
    out += summary_table(results, direct, floor)
    kvledger = [name for name in results.names if name in results.executed]
    if kvledger:
        out += ["", f"## Against issue 12's targets, floor: {floor} (rounds that met each)", ""]
        out += target_lines(results, floor, kvledger)
    out += ["", "## Redis, per kvledger request", ""]
    out += redis_lines(results) or ["- no kvledger target ran"]
    out += ["", "## Failures (not counted as latency)", ""]
    out += failure_lines(results)
    for index, cells in enumerate(results.rounds, 1):
        out += ["", f"## Round {index}", ""]
        out += round_table(cells, results.names)
    if results.notes:
        out += ["", "## Notes", ""] + [f"- {note}" for note in results.notes]
    return "\n".join(out) + "\n"
