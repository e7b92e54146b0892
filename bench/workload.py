"""Deterministic multi-turn "agent" episodes for cache-state experiments.

Every episode shares one system prompt, has its own task line and runs 6 to 10 turns. A turn
sends the whole history and appends the model's output plus a toy tool's result to it, so the
next prompt extends the previous one byte for byte (a KV cache can reuse it) and a single
flipped token changes everything that follows: the tool's result is a hash of the output.

`run_episode` drives an episode through any `generate(prompt) -> text` function, so the same
workload runs against the in-process engine, a Triton server or the proxy. The generate
function owns its sampling parameters (`DEFAULT_MAX_TOKENS` output tokens per turn is what
the calibration uses).

Rendered prompt of turn t (outputs o_i, tool results r_i):

    <system>\\nTask: <task>\\nA: o_1\\nT: r_1\\nA: o_2\\nT: r_2\\n ... A: <- turn t continues here
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

DEFAULT_MAX_TOKENS = 20

SYSTEM_PROMPT = (
    "You are a careful software agent working inside a sandboxed repository. "
    "Each turn, reply with one short command or note; the tool runs it and answers on the "
    "line that starts with T:. Prefer reading files before editing them, keep answers "
    "brief, never invent tool output, and stop when the task is done. Available tools: "
    "ls, cat, grep, sed, pytest, git. Paths are relative to the repository root. "
    "Report failures plainly and try a different approach after two failed attempts."
)

_VERBS = ("fix", "find", "rename", "document", "test", "remove", "update", "explain")
_OBJECTS = ("the parser", "a flaky test", "the config loader", "the retry logic", "the CLI")
_PLACES = ("in src/core", "under tools/", "in the api module", "near main.py", "in lib/io")
_TOOLS = ("ls", "cat", "grep", "sed", "pytest", "git log")
_STATUSES = ("ok", "not found", "1 match", "3 matches", "error 2", "passed", "failed", "empty")


@dataclass(frozen=True)
class Episode:
    """One multi-turn task: the shared system prompt, a task line and a turn count."""

    id: int
    system: str
    task: str
    turns: int

    def header(self) -> str:
        return f"{self.system}\nTask: {self.task}\n"

    def render(self, outputs: Sequence[str]) -> str:
        """The prompt of the turn that follows `outputs` (the model's earlier replies)."""
        parts = [self.header()]
        for turn, output in enumerate(outputs):
            parts.append(f"A: {output}\nT: {tool_result(output, turn)}\n")
        parts.append("A: ")
        return "".join(parts)


def tool_result(output: str, turn: int) -> str:
    """A toy deterministic tool: the result is chosen by a hash of the model's output."""
    digest = hashlib.blake2b(f"{turn}|{output}".encode(), digest_size=8).digest()
    tool = _TOOLS[digest[0] % len(_TOOLS)]
    status = _STATUSES[digest[1] % len(_STATUSES)]
    echo = "".join(c for c in output if c.isalnum())[:6] or "-"
    return f"{tool} {echo}: {status} ({digest[2] % 50})"


def make_episodes(n: int = 80, seed: int = 0) -> list[Episode]:
    """`n` episodes, the same for the same seed on any machine."""
    rng = random.Random(seed)
    episodes: list[Episode] = []
    for i in range(n):
        task = (
            f"#{rng.randrange(1000, 10000)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
            f"{rng.choice(_PLACES)}"
        )
        episodes.append(Episode(id=i, system=SYSTEM_PROMPT, task=task, turns=rng.randint(6, 10)))
    return episodes


def run_episode(generate: Callable[[str], str], episode: Episode) -> list[str]:
    """Play `episode` turn by turn with `generate`; returns the model's outputs."""
    outputs: list[str] = []
    for _ in range(episode.turns):
        outputs.append(generate(episode.render(outputs)))
    return outputs
