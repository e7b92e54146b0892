"""What rendering a chat costs the proxy per request: the model's Jinja template (the stand-in
tokenizer's, ChatML-like with tools) against the format-string fallback, in one run.

Renders an agent conversation (system, user, then assistant tool calls and tool results; 10
turns) through the chat front's own path (``router.http.chat_request.render_chat``: checks and
render), many times per round, and reports the best round's CPU time per render (process time,
so other work on a shared machine adds less), and the ratios:

- fallback: the same messages, tool calls written as text (the fallback takes no tools);
- template: those same messages through the Jinja template;
- template + tools: the agent conversation with ``tools`` and ``tool_calls``, as a harness sends.

    .venv/bin/python -m bench.chat_render [--turns 10] [--renders 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from backends.sim.tokenizer import CHAT_TEMPLATE
from router.chat.templates import JinjaChat
from router.http.chat_request import render_chat
from router.settings import ChatTemplate, ModelChat

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the documents",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
]


def agent(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a research agent. Use the tools."},
        {"role": "user", "content": "Find what the ledger records for each request."},
    ]
    for i in range(turns):
        args = json.dumps({"query": f"lineage record field {i}", "top_k": 3})
        call = {
            "id": f"c{i}",
            "type": "function",
            "function": {"name": "search", "arguments": args},
        }
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": "result " * 40})
    return messages


def plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation without tool_calls: each call written as the assistant's text."""
    out = []
    for m in messages:
        if "tool_calls" in m:
            out.append({"role": "assistant", "content": json.dumps(m["tool_calls"])})
        else:
            out.append(m)
    return out


def per_render(render: Callable[[], str], renders: int, rounds: int) -> float:
    """Best round's CPU seconds per render."""
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(renders):
            render()
        best = min(best, (time.process_time() - start) / renders)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--renders", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    fallback = ModelChat(None, ChatTemplate(), None)
    jinja = ModelChat(JinjaChat("stand-in", CHAT_TEMPLATE), ChatTemplate(), None)
    messages = agent(args.turns)
    flat = plain(messages)
    cases: dict[str, Callable[[], str]] = {
        "fallback": lambda: render_chat(flat, fallback),
        "template": lambda: render_chat(flat, jinja),
        "template + tools": lambda: render_chat(messages, jinja, TOOLS),
    }
    floor = 0.0
    print(f"{len(messages)} messages, best of {args.rounds} rounds of {args.renders} renders")
    for name, render in cases.items():
        seconds = per_render(render, args.renders, args.rounds)
        floor = floor or seconds
        size = len(render())
        print(f"  {name:17s} {seconds * 1e6:8.1f} us/render  x{seconds / floor:5.2f}  {size} chars")


if __name__ == "__main__":
    main()
