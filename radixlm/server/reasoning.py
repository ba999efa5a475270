"""Reasoning parsers (`--reasoning-parser`, SGLang's names): the model's
`<think>...</think>` goes to `reasoning_content`, the rest is the answer.

- deepseek-r1: DeepSeek-R1's template ends the prompt inside the reasoning,
  so the output starts with it (an opening `<think>`, which older versions
  still write, is dropped) and everything is reasoning until `</think>`.
- qwen3: Qwen3 writes `<think>` itself when it thinks; an output that does not
  begin with it (`chat_template_kwargs: {"enable_thinking": false}`) is all
  answer.

Like the tool-call parsers, `parse(text, final)` is a pure function of the
output so far whose parts only grow, so a stream sends differences.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.server.function_call.base import partial_suffix

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_in_reasoning: bool  # the prompt opened the reasoning

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, answer) of the output so far."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            body = stripped[len(THINK_START):]
        elif not final and THINK_START.startswith(stripped):
            return "", ""  # may still become "<think>"
        elif self.starts_in_reasoning:
            body = text
        else:
            return "", text
        end = body.find(THINK_END)
        if end < 0:
            held = 0 if final else partial_suffix(body, THINK_END)
            return body[:len(body) - held], ""
        return body[:end], body[end + len(THINK_END):].lstrip()


REASONING_PARSERS = {"deepseek-r1": ReasoningParser("deepseek-r1", True),
                     "qwen3": ReasoningParser("qwen3", False)}
