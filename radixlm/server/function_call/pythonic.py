"""The pythonic format (Llama 3.2 / 3.3 / 4 with a pythonic template): the
output is a Python list of calls with keyword arguments, optionally between
Llama 4's `<|python_start|>` and `<|python_end|>`:

    [get_weather(city="Paris", unit="celsius"), get_time(zone="UTC")]

The list is read with `ast` and each argument value with `ast.literal_eval`:
literals only, nothing is ever evaluated. A call's arguments are JSON made
from those literals, not the model's own text, so they cannot stream as
written; the calls are reported, complete, once the list closes.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from radixlm.server.function_call.base import Draft, ToolParser

_START = "<|python_start|>"
_END = "<|python_end|>"
_LEAD = re.compile(r"\s*\[\s*([A-Za-z_]\w*)?")


class PythonicParser(ToolParser):
    markers = (_START,)
    held = (_END,)

    @classmethod
    def tools_prompt(cls, tools: list[dict[str, Any]]) -> str:
        # Llama 3.2's pythonic templates: a list of calls with keyword arguments.
        listed = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=2)
        return ("You can call the functions described below (a JSON list). To call them, "
                "answer with only a Python list of calls with keyword arguments, "
                "[func_name1(param1=value1, param2=value2), func_name2(param=value)], and "
                "no other text.\n\n" + listed)

    @classmethod
    def calls_text(cls, calls: list[dict[str, Any]]) -> str:
        # repr() of the JSON values is Python literal syntax, as the format is.
        def call(c: dict[str, Any]) -> str:
            args = c["arguments"] if isinstance(c["arguments"], dict) else {}
            return f"{c['name']}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"

        return "[" + ", ".join(call(c) for c in calls) + "]"

    def section_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("["):
            return len(text) - len(stripped)
        return super().section_start(text)

    def parse_section(self, section: str, final: bool) -> list[str | Draft]:
        body = section.removeprefix(_START)
        if not self._may_be_calls(body):
            return [section]
        for i, c in enumerate(body):
            if c != "]":
                continue
            calls = self._calls(body[:i + 1])
            if calls is not None:
                return [*calls, body[i + 1:].lstrip().removeprefix(_END)]
        return [section] if final else []

    def _may_be_calls(self, body: str) -> bool:
        """Whether the list can still begin with a call of one of the tools: a plain
        answer that happens to begin with "[" streams as content at once."""
        m = _LEAD.match(body)
        if m is None:
            return not body.strip()
        name, after = m.group(1), body[m.end():]
        if name is None:
            return not after
        if not after:
            return any(n.startswith(name) for n in self.names)
        return name in self.names and (not after.strip() or after.lstrip().startswith("("))

    def _calls(self, source: str) -> list[Draft] | None:
        try:
            tree = ast.parse(source.strip(), mode="eval").body
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = [self._call(node) for node in tree.elts]
        return None if any(c is None for c in calls) else calls  # type: ignore[return-value]

    def _call(self, node: ast.expr) -> Draft | None:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in self.names and not node.args):
            return None
        try:
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            return None
        if None in args:  # **kwargs
            return None
        try:
            return Draft(node.func.id, json.dumps(args, ensure_ascii=False), True)
        except (TypeError, ValueError):  # a set, bytes or complex literal: no JSON for it
            return None
