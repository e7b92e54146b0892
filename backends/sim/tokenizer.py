"""Byte-level tokenizer of the stand-in (one token per UTF-8 byte, plus EOS) and sampler.

Token ids 0..255 are bytes and 256 is EOS, a vocabulary of 257. Any string encodes, but the
engine only lets the model *generate* printable ASCII (32..126), newline (10) and the
request's end token (EOS unless the request sets another end_id): every other logit is
masked to -inf. The end token is never emitted, so generated text is always valid UTF-8 and
decodes token by token, which keeps streaming pieces and the final text consistent.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from backends.sim.numerics import F64

EOS_ID = 256
VOCAB_SIZE = 257


def encode(text: str) -> list[int]:
    """The UTF-8 bytes of `text` as token ids."""
    return list(text.encode("utf-8"))


def decode(tokens: list[int]) -> str:
    """Text of the byte tokens; ids >= 256 (EOS) carry no text, bad UTF-8 is replaced."""
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


def piece(token: int) -> str:
    """Text of one generated token (always ASCII or empty, see the module docstring)."""
    return chr(token) if 0 <= token < 128 else ""


def generation_mask() -> NDArray[np.bool_]:
    """True for the token ids the model may generate."""
    allowed = np.zeros(VOCAB_SIZE, dtype=np.bool_)
    allowed[32:127] = True
    allowed[10] = True
    allowed[EOS_ID] = True
    return allowed


class Sampler:
    """Greedy or seeded sampling over the generable tokens, with bad-word bans.

    Greedy when temperature <= 0 or top_k == 1; otherwise temperature, then top_k (0 = no
    limit), then top_p (1.0 = none), drawing from numpy's PCG64 seeded per request.
    """

    def __init__(
        self,
        temperature: float,
        top_k: int,
        top_p: float,
        seed: int,
        end_id: int,
        bad_words: tuple[str, ...],
    ) -> None:
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.greedy = temperature <= 0 or top_k == 1
        self.rng = np.random.Generator(np.random.PCG64(seed))
        # The model stops only by generating end_id, so that is the one non-text token allowed.
        self.allowed = generation_mask()
        self.allowed[EOS_ID] = False
        self.allowed[end_id] = True
        self.bad = [w.encode("utf-8") for w in bad_words]

    def pick(self, logits: F64, output: bytes) -> int:
        """The next token given the logits and the bytes generated so far."""
        z = np.where(self.allowed, logits, -np.inf)
        for word in self.bad:
            # Bad words are matched against the generated text only.
            if output.endswith(word[:-1]):
                z[word[-1]] = -np.inf
        if self.greedy:
            return int(np.argmax(z))
        order = np.argsort(-z, kind="stable")
        kept = order[np.isfinite(z[order])]
        if self.top_k > 0:
            kept = kept[: self.top_k]
        scaled = z[kept] / self.temperature
        probs = np.exp(scaled - scaled[0])
        probs /= probs.sum()
        if self.top_p < 1.0:
            # The smallest prefix (in descending probability) whose mass reaches top_p.
            keep = np.cumsum(probs) - probs < self.top_p
            kept, probs = kept[keep], probs[keep] / probs[keep].sum()
        cdf = np.cumsum(probs)
        index = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return int(kept[min(index, len(kept) - 1)])


# The stand-in's chat template, as tokenizer_config.json's ``chat_template`` (a Hugging Face
# template: the proxy renders it, as the engines' OpenAI servers do). ChatML-like, with a tools
# section and tool calls and results in the Hermes format (``<tool_call>``, ``<tool_response>``),
# after the templates Qwen 2.5 ships. The stand-in's model is random and was trained on nothing:
# this gives the proxy a real template to render, not the model any skill.
CHAT_TEMPLATE = """\
{%- if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}
# Tools

You may call one or more functions. Their signatures are within <tools></tools>:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

For each call, write a JSON object with the function's name and arguments within \
<tool_call></tool_call>:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'system' %}
{% if not loop.first %}{{ raise_exception('a system message must come first') }}{% endif %}
{% elif message.role == 'user' %}
<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}
<|im_start|>assistant
{% if message.content %}
{{ message.content }}
{% endif %}
{% for call in message.tool_calls or [] %}
<tool_call>
{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}
<|im_end|>
{% elif message.role == 'tool' %}
<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}
{{ raise_exception('unknown role: ' ~ message.role) }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
