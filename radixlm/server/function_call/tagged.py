"""Formats whose calls are blocks between an opening and a closing tag.

hermes and qwen25 (NousResearch Hermes 2 Pro, Qwen2.5 and Qwen3; the same
markup):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

deepseekv3 (DeepSeek-V3's chat template; the bars and spaces are the
full-width U+FF5C and U+2581 of its special tokens):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import json
import re
from typing import Any

from radixlm.server.function_call.base import (
    Draft,
    ObjectRead,
    ToolParser,
    read_call_object,
    tool_lines,
)
from radixlm.server.function_call.json_prefix import JsonPrefix


class TaggedParser(ToolParser):
    """Blocks `open_tag` ... `close_tag`, any number of them; `frame` tags (a
    section's own begin/end markers) are dropped; text between blocks is content."""

    open_tag = ""
    close_tag = ""
    frame: tuple[str, ...] = ()

    def read_body(self, body: str, final: bool) -> ObjectRead:
        return read_call_object(body, self.names, final)

    def parse_section(self, section: str, final: bool) -> list[str | Draft]:
        for tag in self.frame:
            section = section.replace(tag, "")
        pieces: list[str | Draft] = []
        pos = 0
        while True:
            i = section.find(self.open_tag, pos)
            if i < 0:
                pieces.append(section[pos:])
                return pieces
            pieces.append(section[pos:i])
            body_start = i + len(self.open_tag)
            j = section.find(self.close_tag, body_start)
            closed = j >= 0
            body = section[body_start:j if closed else len(section)]
            read = self.read_body(body, final or closed)
            if read.state == "call":
                assert read.draft is not None
                pieces.append(read.draft)
                if (closed or final) and read.end is not None:
                    pieces.append(body[read.end:])  # text inside the block, after the call
            elif read.state == "invalid" and (closed or final):
                pieces.append(section[i:j + len(self.close_tag) if closed else len(section)])
            if not closed:
                return pieces
            pos = j + len(self.close_tag)


class HermesParser(TaggedParser):
    markers = ("<tool_call>",)
    held = ("</tool_call>",)
    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    @classmethod
    def tools_prompt(cls, tools: list[dict[str, Any]]) -> str:
        # The <tools> block and the <tool_call> instruction that Hermes 2 Pro,
        # Qwen2.5 / Qwen3 and SmolLM2 were trained on.
        return ("# Tools\n\nYou may call one or more functions to answer the user. The "
                "functions you can call are described, one JSON object per line, between "
                "<tools> and </tools>:\n<tools>\n" + tool_lines(tools) + "\n</tools>\n\n"
                "To call a function, write a JSON object with its name and its arguments "
                "between <tool_call> and </tool_call> tags, one block per call:\n"
                "<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")

    @classmethod
    def calls_text(cls, calls: list[dict[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>"
                         for c in calls)


class Qwen25Parser(HermesParser):
    """Qwen2.5's template asks for Hermes' markup, word for word."""


_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_CALLS_END = "<｜tool▁calls▁end｜>"
_CALL_BEGIN = "<｜tool▁call▁begin｜>"
_CALL_END = "<｜tool▁call▁end｜>"
_SEP = "<｜tool▁sep｜>"
# The type ("function") and the name, then the arguments in a json code fence.
_DEEPSEEK_HEADER = re.compile(r"\s*(?:function)?" + _SEP + r"([^\n]+)\n```(?:json)?\s*\n")


class DeepSeekV3Parser(TaggedParser):
    markers = (_CALLS_BEGIN, _CALL_BEGIN)
    open_tag = _CALL_BEGIN
    close_tag = _CALL_END
    frame = (_CALLS_BEGIN, _CALLS_END)
    held = (_CALLS_END,)

    @classmethod
    def tools_prompt(cls, tools: list[dict[str, Any]]) -> str:
        # DeepSeek-V3's template lists each function with its parameters in a json fence.
        listed = "\n".join(f"- `{t['function']['name']}`: {t['function'].get('description', '')}"
                           f"\n```json\n{json.dumps(t['function'].get('parameters') or {})}"
                           f"\n```" for t in tools)
        return ("## Tools\n\n### Function\n\nYou have the following functions available:\n\n"
                + listed + "\n\nTo call functions, write them one after another between "
                + _CALLS_BEGIN + " and " + _CALLS_END + ", each as " + _CALL_BEGIN
                + "function" + _SEP + "<function-name>\n```json\n<args-json-object>\n```"
                + _CALL_END)

    @classmethod
    def calls_text(cls, calls: list[dict[str, Any]]) -> str:
        return _CALLS_BEGIN + "".join(
            f"{_CALL_BEGIN}function{_SEP}{c['name']}\n```json\n"
            f"{json.dumps(c['arguments'], ensure_ascii=False)}\n```{_CALL_END}"
            for c in calls) + _CALLS_END

    def read_body(self, body: str, final: bool) -> ObjectRead:
        m = _DEEPSEEK_HEADER.match(body)
        if m is None or m.group(1).strip() not in self.names:
            # Not decided while the header may still be coming.
            done = final or m is not None or "\n```" in body
            return ObjectRead("invalid", end=len(body)) if done else ObjectRead("pending")
        rest = body[m.end():]
        args = JsonPrefix()
        n = args.feed(rest)
        draft = Draft(m.group(1).strip(), rest[:n].lstrip(), args.done)
        if not rest.strip():
            return ObjectRead("invalid", end=len(body)) if final else ObjectRead("pending")
        # The closing code fence after the arguments is markup, not content.
        end = m.end() + n
        if args.done and rest[n:].lstrip().startswith("```"):
            end = len(body)
        return ObjectRead("call", draft, end if args.done or args.failed else None)
