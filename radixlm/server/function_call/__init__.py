"""Tool-call parsers for `tool_choice: "auto"`, by SGLang's `--tool-call-parser`
names. `base.py` states what every parser promises."""

from __future__ import annotations

from typing import Any

from radixlm.server.function_call.base import Draft, Parsed, ToolParser
from radixlm.server.function_call.json_calls import Llama3Parser, MistralParser
from radixlm.server.function_call.pythonic import PythonicParser
from radixlm.server.function_call.tagged import DeepSeekV3Parser, HermesParser, Qwen25Parser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen25": Qwen25Parser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "deepseekv3": DeepSeekV3Parser,
    "pythonic": PythonicParser,
}

# What a chat template says when it teaches a format, and the parser for it;
# a template that matches more than one (or none) picks nothing.
_TEMPLATE_SIGNS: dict[str, tuple[str, ...]] = {
    "deepseekv3": ("tool▁calls▁begin",),
    "mistral": ("[TOOL_CALLS]",),
    "qwen25": ("<tool_call>", "<|im_start|>"),
    "hermes": ("<tool_call>",),
    "llama3": ("<|python_tag|>",),
    "pythonic": ("[func_name1(",),
}


def make_parser(name: str, tools: list[dict[str, Any]]) -> ToolParser:
    return PARSERS[name](tools)


def tools_prompt(name: str, tools: list[dict[str, Any]]) -> str:
    """The system-message text that shows `tools` in parser `name`'s format."""
    return PARSERS[name].tools_prompt(tools)


def calls_text(name: str, calls: list[dict[str, Any]]) -> str:
    """Earlier calls written in parser `name`'s markup."""
    return PARSERS[name].calls_text(calls)


def detect_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own markup asks for, when exactly one fits
    (Qwen2.5's ChatML template is Hermes' markup too: qwen25 wins there)."""
    if not chat_template:
        return None
    hits = [name for name, signs in _TEMPLATE_SIGNS.items()
            if all(s in chat_template for s in signs)]
    if "qwen25" in hits:
        hits.remove("hermes")
    if "pythonic" in hits and "llama3" in hits:
        hits.remove("llama3")  # a pythonic template keeps Llama 3's special tokens
    return hits[0] if len(hits) == 1 else None


__all__ = ["PARSERS", "Draft", "Parsed", "ToolParser", "calls_text", "detect_parser",
           "make_parser", "tools_prompt"]
