"""Formats whose calls are bare JSON objects after a marker.

mistral (Mistral-7B-Instruct-v0.3, Mistral-Nemo; `[TOOL_CALLS]` is a special
token of their tokenizer, so it is only seen with skip_special_tokens off or
in a template that spells it):

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]

llama3 (Llama 3.1 / 3.2 / 3.3 JSON tool calling: the output is the call, a
`<|python_tag|>` in front is optional, several calls are separated by ";"):

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}
"""

from __future__ import annotations

import json
from typing import Any

from radixlm.server.function_call.base import Draft, ToolParser, read_call_object, tool_lines


def read_objects(text: str, names: frozenset[str], final: bool, separator: str,
                 end: str | None) -> list[str | Draft]:
    """Call objects one after another, `separator` between them, up to `end` (or
    the end of the text), as parse pieces. An object that is no call is
    content, and so is everything after it."""
    pieces: list[str | Draft] = []
    pos = 0
    while True:
        read = read_call_object(text[pos:], names, final)
        if read.state == "pending":
            return pieces
        if read.state == "invalid":
            return [*pieces, text[pos:]]
        assert read.draft is not None
        pieces.append(read.draft)
        if read.end is None:
            return pieces
        pos += read.end
        rest = text[pos:].lstrip()
        if rest.startswith(separator):
            pos = len(text) - len(rest) + len(separator)
            continue
        if end is not None and rest.startswith(end):
            rest = rest[len(end):]
        elif not rest and not final:
            return pieces
        return [*pieces, rest]


class MistralParser(ToolParser):
    markers = ("[TOOL_CALLS]",)

    @classmethod
    def tools_prompt(cls, tools: list[dict[str, Any]]) -> str:
        # Mistral's templates list the tools between [AVAILABLE_TOOLS] markers.
        return ("[AVAILABLE_TOOLS] [" + ", ".join(tool_lines(tools).splitlines())
                + "][/AVAILABLE_TOOLS]\nYou may call the functions above. To call them, "
                "write [TOOL_CALLS] followed by a JSON list of calls: [TOOL_CALLS] "
                "[{\"name\": <function-name>, \"arguments\": <args-json-object>}]")

    @classmethod
    def calls_text(cls, calls: list[dict[str, Any]]) -> str:
        return "[TOOL_CALLS] " + json.dumps(calls, ensure_ascii=False)

    def parse_section(self, section: str, final: bool) -> list[str | Draft]:
        body = section[len(self.markers[0]):].lstrip()
        if not body.startswith("["):
            return [section] if body or final else []
        pieces = read_objects(body[1:], self.names, final, ",", "]")
        # Nothing read yet and the list did not hold a call: it stays as written.
        if pieces and not any(isinstance(p, Draft) for p in pieces):
            return [section]
        return pieces


class Llama3Parser(ToolParser):
    markers = ("<|python_tag|>",)

    @classmethod
    def tools_prompt(cls, tools: list[dict[str, Any]]) -> str:
        # Llama 3.1's JSON tool calling: the answer is the call, with "parameters".
        return ("You have access to the functions below. To call one, answer with only a "
                "JSON object of the form {\"name\": <function-name>, \"parameters\": "
                "<a dictionary of argument names and their values>}, nothing else; to call "
                "several, separate the objects with \";\". Do not use variables.\n\n"
                + tool_lines(tools))

    @classmethod
    def calls_text(cls, calls: list[dict[str, Any]]) -> str:
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]},
                                    ensure_ascii=False) for c in calls)

    def section_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("{"):  # the output itself is the call
            return len(text) - len(stripped)
        return super().section_start(text)

    def parse_section(self, section: str, final: bool) -> list[str | Draft]:
        body = section.removeprefix(self.markers[0])
        pieces = read_objects(body, self.names, final, ";", None)
        if pieces and not any(isinstance(p, Draft) for p in pieces):
            return [section]
        return pieces
