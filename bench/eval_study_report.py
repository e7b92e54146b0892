"""The eval study's results (bench/eval_study.py) as a Markdown report and a PNG chart."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)

ARMS = ("off", "shared", "reset", "replay")
CAUSES = ("reuse", "state", "unexplained", "unknown")
ARM_LABELS = {
    "off": "cache off",
    "shared": "caching on, no control (`shared` key)",
    "reset": "`reset` key",
    "replay": "`replay:` key",
}
PRECISION_LABELS = {"bf16": "16-bit (bf16)", "fp16": "16-bit (fp16)", "int4": "4-bit (int4)"}


@dataclass
class ArmResult:
    """One arm at one precision: every rerun compared with the arm's first run."""

    precision: str
    arm: str
    episodes: int
    reruns: int
    diverged: int = 0
    causes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    proven: int = 0  # divergences proved caused by cache state, by replay
    tried: int = 0  # divergences replayed
    reused_blocks: int = 0
    total_blocks: int = 0
    wall_s: list[float] = field(default_factory=list)

    @property
    def compared(self) -> int:
        return self.episodes * self.reruns

    @property
    def divergence_pct(self) -> float:
        return 100 * self.diverged / self.compared if self.compared else 0.0

    def row(self) -> str:
        reuse = 100 * self.reused_blocks / self.total_blocks if self.total_blocks else 0.0
        c = self.causes
        causes = " / ".join(str(c[k]) for k in CAUSES) if self.diverged else "–"
        proofs = f"{self.proven} / {self.tried}" if self.tried else "–"
        wall = statistics.fmean(self.wall_s) if self.wall_s else 0.0
        cells = [
            PRECISION_LABELS.get(self.precision, self.precision),
            ARM_LABELS.get(self.arm, self.arm),
            f"{self.diverged} / {self.compared}",
            f"{self.divergence_pct:.1f}%",
            f"{reuse:.1f}%",
            f"{wall:.1f} s",
            causes,
            proofs,
        ]
        return "| " + " | ".join(cells) + " |"


def markdown(results: Sequence[ArmResult], command: str, when: str) -> str:
    first = results[0]
    lines = [
        "# Eval study: divergence between reruns, through the proxy",
        "",
        f"Command: `{command}`  ",
        f"Date: {when}  ",
        f"Workload: {first.episodes} episodes (bench/workload.py), {first.reruns + 1} runs per"
        " arm; each later run is compared with the arm's first run.  ",
        "Machine: 2 shared CPU cores; stand-in replicas (backends/sim), timings side by side.",
        "",
        "Wall time is per run, including the run's begin (verified reset, snapshot replay).",
        "Causes (`kvledger runs diff`, router/eval/diff.py), of each diverged episode's first",
        "differing request: the engine reused a different number of blocks / equal reuse but",
        "different cache states / same input, state and reuse (unexplained) / a state the ledger",
        "cannot know. Proven (`kvledger runs explain`, router/eval/explain.py): of a sample of",
        "divergences per rerun, those whose two outputs each reproduced, replayed on a reset",
        "replica under their own run's cache state.",
        "",
        "| weights | arm | divergent episodes | % | block reuse | wall time per run"
        " | causes: reuse / state / unexplained / unknown | proven caused by cache state |",
        "|---|---|---|---|---|---|---|---|",
        *(r.row() for r in results),
    ]
    return "\n".join(lines) + "\n"


def chart(results: Sequence[ArmResult], path: Path) -> None:
    """Grouped bars: divergence % per arm, one group per precision, each bar labelled."""
    precisions = list(dict.fromkeys(r.precision for r in results))
    arms = [a for a in ARMS if any(r.arm == a for r in results)]
    width = 0.8 / max(len(arms), 1)
    figure, axes = plt.subplots(figsize=(8, 5))
    for i, arm in enumerate(arms):
        values = [_pct(results, p, arm) for p in precisions]
        xs = [g + (i - (len(arms) - 1) / 2) * width for g in range(len(precisions))]
        bars = axes.bar(xs, values, width, label=ARM_LABELS[arm].replace("`", ""))
        axes.bar_label(bars, labels=[f"{v:.1f}%" for v in values], fontsize=8, padding=2)
    axes.set_xticks(range(len(precisions)))
    axes.set_xticklabels([PRECISION_LABELS.get(p, p) for p in precisions])
    axes.set_ylabel("episodes diverged between reruns (%)")
    axes.set_ylim(0, max([r.divergence_pct for r in results] + [10]) * 1.2)
    axes.set_title("Rerun divergence by cache control (through the proxy)")
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _pct(results: Sequence[ArmResult], precision: str, arm: str) -> float:
    return next(
        (r.divergence_pct for r in results if (r.precision, r.arm) == (precision, arm)), 0.0
    )
