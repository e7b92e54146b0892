"""The routing note: docs/results/routing.md and its plot, from the figures in routing.json.

The simulation and the real run are measured by separate commands; each stores its figures
under its own key of ``routing.json``, and the note is rebuilt from both, so rerunning one
part keeps the other's figures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

POLICIES = ("round_robin", "least_loaded", "prefix_affinity", "longest_prefix")
TWO_PROXIES = ("prefix_affinity", "longest_prefix")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def simulation_lines(sim: Mapping[str, Any]) -> list[str]:
    """The simulation's section: what was simulated, and one row per replica count and policy."""
    shape = sim["shape"]
    lines = [
        "## Simulation: the policies alone",
        "",
        f"Command: `{sim['command']}` ({sim['seconds']:.0f} s on one core)  ",
        f"Date: {sim['date']}",
        "",
        f"Workload per replica: {shape['conversations_per_replica']} conversations arriving"
        f" as a Poisson process at {shape['rate_per_replica']:g}/s, {shape['turns'][0]} to"
        f" {shape['turns'][1]} turns each, think time {shape['think_mean_s']:g} s (mean,"
        f" exponential) after each reply; {shape['systems']} shared system prompts of"
        f" {shape['system_blocks'][0] * 16} to {shape['system_blocks'][1] * 16} tokens with Zipf"
        f" popularity (s = {shape['zipf_s']:g}); user messages {shape['user_blocks'][0] * 16} to"
        f" {shape['user_blocks'][1] * 16} tokens, replies {shape['reply_blocks'][0] * 16} to"
        f" {shape['reply_blocks'][1] * 16} tokens. Each replica: an LRU cache of"
        f" {sim['capacity']} blocks ({sim['capacity'] * 16:,} tokens). Seed {sim['seed']}.",
        "",
        "Reuse: reused prompt tokens / prompt tokens. Oracle: one LRU cache of the fleet's"
        " whole capacity seeing every request. Load: each replica's busy time (the integral of"
        " its in-flight count), max over mean. Two proxies: every turn goes to one of two"
        " independent policy instances at random, each seeing only its own in-flight counts.",
        "",
        "| replicas | requests | in flight per replica | policy | reuse | share of oracle"
        " | max/mean load | two proxies: share of oracle | two proxies: max/mean |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for size in sim["sizes"]:
        oracle = size["oracle"]["reuse"]
        head = f"| {size['replicas']} | {size['requests']:,} |"
        lines.append(f"{head} | oracle | {_pct(oracle)} | 100% | | | |")
        for name in POLICIES:
            one, two = size["policies"][name], size["two_proxies"].get(name)
            pair = f"{_pct(two['reuse'] / oracle)} | {two['max_over_mean']:.2f}" if two else "– | –"
            lines.append(
                f"| {size['replicas']} | | {one['in_flight']:.1f} | `{name}` | {_pct(one['reuse'])}"
                f" | {_pct(one['reuse'] / oracle)} | {one['max_over_mean']:.2f} | {pair} |"
            )
    return lines


def summary_lines(sim: Mapping[str, Any], first: int = 8) -> list[str]:
    """One line per policy: its range of share of oracle and worst load from ``first`` up."""
    sizes = [s for s in sim["sizes"] if s["replicas"] >= first] or sim["sizes"]
    span = f"{sizes[0]['replicas']} to {sizes[-1]['replicas']} replicas"
    lines = [f"At {span}:", ""]
    for name in reversed(POLICIES):
        shares = [s["policies"][name]["reuse"] / s["oracle"]["reuse"] for s in sizes]
        load = max(s["policies"][name]["max_over_mean"] for s in sizes)
        line = (
            f"- `{name}`: {_pct(min(shares))} to {_pct(max(shares))} of the oracle's reuse,"
            f" max/mean load at most {load:.2f}"
        )
        if name in TWO_PROXIES:
            pair = [s["two_proxies"][name]["reuse"] / s["oracle"]["reuse"] for s in sizes]
            line += f"; with two proxies {_pct(min(pair))} to {_pct(max(pair))}"
        lines.append(line + ".")
    return lines


READING = [
    "How to read it. Most prompt tokens are the shared system prompts, which every policy"
    " ends up caching on every replica, so even `round_robin` reuses most tokens; the policies"
    " differ in the conversations' own turns. `prefix_affinity` (first block) sends every"
    " conversation of a system prompt to one home: under bounded load the popular ones spill,"
    " their follow-ups land on replicas that never saw them, and the homes run hot."
    " `longest_prefix` loses against the oracle mostly because each replica holds its own copy"
    " of every system prompt (less room for conversations than in one big cache), and much"
    " less because a follow-up over its bound is recomputed elsewhere. With two proxies it"
    " loses more: a new conversation that one proxy spilled away from its rendezvous home (the"
    " load bound at work) is sent home by the other proxy, which does not know about the"
    " spill; without the bound the two would agree on every conversation, at the price of"
    " load.",
]


def real_lines(real: Mapping[str, Any]) -> list[str]:
    """The real run's section: cached share of prompt tokens per policy, through the proxy."""
    lines = [
        "## Real run: through `kvledger serve` and three stand-in replicas",
        "",
        f"Command: `{real['command']}`  ",
        f"Date: {real['date']}",
        "",
        f"{real['conversations']} chat conversations through the openai SDK"
        f" ({real['requests']} requests), {real['systems']} shared system prompts with Zipf"
        " popularity, Poisson arrivals and think times, the same for every policy; before each"
        " policy every replica gets a verified reset (`POST /admin/replicas/ID/reset`). Cached"
        " share: the records' `cached_tokens` summed over their `prompt_tokens`. Load: requests"
        " per replica, max over mean.",
        "",
        "| policy | cached share of prompt tokens | requests per replica | max/mean | wall time |",
        "|---|---|---|---|---|",
    ]
    for row in real["policies"]:
        counts = ", ".join(f"{rid} {n}" for rid, n in sorted(row["per_replica"].items()))
        lines.append(
            f"| `{row['policy']}` | {_pct(row['cached_share'])} | {counts}"
            f" | {row['max_over_mean']:.2f} | {row['seconds']:.0f} s |"
        )
    return lines


def markdown(results: Mapping[str, Any], plot_name: str) -> str:
    lines = [
        "# Routing: reuse against a single-cache oracle, and load",
        "",
        "What each production policy (`[routing] policy`) leaves for the engines' KV-cache block"
        " reuse, measured two ways: a simulation of the policies themselves at 4 to 64"
        " replicas, and a real run through the proxy (`python -m bench.routing`, see"
        " `bench/routing.py`).",
        "",
    ]
    if "simulation" in results:
        sim = results["simulation"]
        lines += [f"![reuse and load per policy]({plot_name})", ""]
        lines += simulation_lines(sim) + [""] + summary_lines(sim) + [""] + READING + [""]
    if "real" in results:
        lines += real_lines(results["real"]) + [""]
    return "\n".join(lines)


def chart(sim: Mapping[str, Any], path: Path) -> None:
    """Share of oracle and max/mean load against replica count, one line per policy."""
    sizes: Sequence[Mapping[str, Any]] = sim["sizes"]
    xs = [s["replicas"] for s in sizes]
    figure, (reuse, load) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name in POLICIES:
        share = [s["policies"][name]["reuse"] / s["oracle"]["reuse"] * 100 for s in sizes]
        line = reuse.plot(xs, share, marker="o", label=name)[0]
        loads = [s["policies"][name]["max_over_mean"] for s in sizes]
        load.plot(xs, loads, marker="o", color=line.get_color(), label=name)
        if name in TWO_PROXIES:
            pair = [s["two_proxies"][name]["reuse"] / s["oracle"]["reuse"] * 100 for s in sizes]
            reuse.plot(xs, pair, "--", color=line.get_color(), label=f"{name}, two proxies")
    reuse.axhline(90, color="grey", linewidth=0.8, linestyle=":")
    load.axhline(1.2, color="grey", linewidth=0.8, linestyle=":")
    for axes in (reuse, load):
        axes.set_xscale("log", base=2)
        axes.set_xticks(xs, [str(x) for x in xs])
        axes.set_xlabel("replicas")
    reuse.set_ylabel("reuse, % of the single-cache oracle")
    load.set_ylabel("max / mean busy time per replica")
    reuse.legend(fontsize=8)
    load.legend(fontsize=8)
    figure.suptitle("Prefix-cache reuse and load by routing policy (simulation)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
