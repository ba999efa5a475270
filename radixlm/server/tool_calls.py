"""OpenAI tool calling for /v1/chat/completions: checking `tools` and
`tool_choice`, the JSON schema that forces a call, and reading forced calls
back out of the generated text (whole, or piece by piece for a stream).

A call that the request forces is constrained (xgrammar), so that it can be
read without guessing:

- a named `tool_choice`: the output is exactly the function's arguments, a JSON
  value for its `parameters` schema;
- `tool_choice: "required"`: the output is `{"name": <name>, "parameters":
  <arguments>}` for one of the tools (`anyOf` over them, as vLLM does), or,
  when the request sets `parallel_tool_calls: true`, a JSON array of such
  objects with at least one item. Without that explicit `true` it is a single
  call: a single call is always a valid answer, and small models given an
  open-ended array tend to repeat calls until the token limit.

`tool_choice: "auto"` (OpenAI's default when tools are given) leaves the
output free and reads the model family's own call markup out of it with a
tool-call parser (function_call/, chat_output.py); a server without one
refuses it with a 400 that says how to get one. `"none"` is an ordinary chat
in which neither the template nor a parser sees the tools.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.server.errors import APIError
from radixlm.server.openai_protocol import ChatTool

CHOICES = ("none", "auto", "required")
# The parameters of a function declared without any: it takes an empty object.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
AUTO_UNSUPPORTED = (
    'tool_choice "auto" needs a parser for tool calls in free-form model output, and this '
    "server has none (this model's chat template names no known format): start it with "
    "--tool-call-parser (hermes, qwen25, llama3, mistral, deepseekv3 or pythonic), force a "
    'call with tool_choice "required" (the model picks one of the tools) or {"type": '
    '"function", "function": {"name": "<tool name>"}}, or send tool_choice "none"')


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


# ---- the request side ----------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of its tools. `mode` is "none" (an ordinary
    chat), "auto" (the model may call tools in its own markup, read by a
    tool-call parser), "named" (call `name`) or "required" (call one of the
    tools; several when `array`); the last two force a call."""

    mode: str = "none"
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's shape, for templates
    name: str | None = None
    array: bool = False

    @property
    def forcing(self) -> bool:
        return self.mode in ("named", "required")

    def parameters(self, name: str) -> dict[str, Any]:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or NO_PARAMETERS

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema that constrains the output, or None (not forcing)."""
        if self.mode == "named":
            assert self.name is not None
            return self.parameters(self.name)
        if self.mode == "required":
            return required_schema(self.tools, self.array)
        return None

    def schema_param(self) -> str:
        """The request field to blame when the schema does not compile."""
        if self.mode == "named":
            i = next(i for i, t in enumerate(self.tools) if t["function"]["name"] == self.name)
            return f"tools.{i}.function.parameters"
        return "tools"


def required_schema(tools: list[dict[str, Any]], array: bool) -> dict[str, Any]:
    """`{"name": <const>, "parameters": <schema>}` for any one of the tools; xgrammar
    keeps the property order, so the name is generated (and known) first."""
    one = {"anyOf": [{"type": "object",
                      "properties": {"name": {"const": t["function"]["name"]},
                                     "parameters": t["function"].get("parameters")
                                     or NO_PARAMETERS},
                      "required": ["name", "parameters"]} for t in tools]}
    return {"type": "array", "items": one, "minItems": 1} if array else one


def plan_tools(tools: list[ChatTool] | None, tool_choice: Any,
               parallel_tool_calls: bool | None, can_parse: bool = False) -> ToolPlan:
    """Check `tools` and `tool_choice` (400s name the field) and say what to do.
    `can_parse`: the server has a tool-call parser, so "auto" is possible."""
    tools = tools or []
    dicts = [t.model_dump(exclude_none=True) for t in tools]
    _check_names(tools)
    if not tools:
        if tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice is only allowed when tools are given",
                           "tool_choice")
        return ToolPlan()
    if tool_choice is None or tool_choice == "auto":  # OpenAI's default with tools is "auto"
        if not can_parse:
            raise APIError(400, AUTO_UNSUPPORTED, "tools" if tool_choice is None
                           else "tool_choice")
        return ToolPlan("auto", dicts)
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise APIError(400, f"tool_choice must be one of {', '.join(CHOICES)} or "
                                f"a named function, got {tool_choice!r}", "tool_choice")
        if tool_choice == "none":
            return ToolPlan()
        return ToolPlan("required", dicts, array=parallel_tool_calls is True)
    return ToolPlan("named", dicts, name=_named_choice(tool_choice, dicts))


def _check_names(tools: list[ChatTool]) -> None:
    seen: set[str] = set()
    for i, t in enumerate(tools):
        name = t.function.name
        if not name:
            raise APIError(400, f"tools[{i}].function.name must not be empty",
                           f"tools.{i}.function.name")
        if name in seen:
            raise APIError(400, f"tools[{i}]: the function name {name!r} is used twice",
                           f"tools.{i}.function.name")
        seen.add(name)


def _named_choice(choice: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise APIError(400, 'tool_choice must be "none", "required" or {"type": "function", '
                            '"function": {"name": ...}}', "tool_choice")
    names = [t["function"]["name"] for t in tools]
    if name not in names:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among "
                            f"the tools ({', '.join(names)})", "tool_choice")
    return name


def schema_error(e: APIError, plan: ToolPlan) -> APIError:
    """A json_schema error for a forced call (the schema did not compile, or the
    server has no grammar backend), reworded to point at the request fields it
    came from: the client never sent a json_schema."""
    if not plan.forcing or e.status != 400 or not e.message.startswith("json_schema "):
        return e
    param = plan.schema_param() if e.message.startswith("json_schema is invalid") \
        else "tool_choice"
    return APIError(400, f"forcing a tool call constrains the output to the tools' "
                         f"parameters schema, which failed: {e.message}", param)


# ---- the history: earlier calls and their results -----------------------------------
def history_message(m: Any, content: str) -> dict[str, Any]:
    """A request message as the chat template takes it. Earlier calls keep their
    arguments as objects, which is what templates (and transformers) expect."""
    out: dict[str, Any] = {"role": m.role, "content": content}
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _arguments(args: str | dict[str, Any]) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


CallsWriter = Callable[[list[dict[str, Any]]], str]


def json_calls(calls: list[dict[str, Any]]) -> str:
    return json.dumps(calls, ensure_ascii=False)


def calls_as_text(messages: list[dict[str, Any]], results_too: bool,
                  write: CallsWriter = json_calls) -> list[dict[str, Any]]:
    """The text fallback for templates that know nothing of tools: an assistant's
    calls (`{"name", "arguments"}` each) become text in its content, written by
    `write` (a tool-call parser's own markup, else a JSON list), since templates
    that ignore `tool_calls` would otherwise drop them silently; with
    `results_too` (for templates that refuse the "tool" role), tool results
    become user messages that say so."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = write([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                          for c in calls])
            m["content"] = f"{m['content']}\n{text}" if m["content"] else text
        if results_too and m["role"] == "tool":
            call_id = m.pop("tool_call_id", None)
            where = f" (call {call_id})" if call_id else ""
            m = {"role": "user", "content": f"Tool result{where}: {m['content']}"}
        out.append(m)
    return out


def has_tool_messages(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


# ---- the response side ----------------------------------------------------------------
@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


# In "required" mode, what precedes a call's arguments: the previous call's
# closing brace and an array's "[" or ",", then the call object up to its
# "parameters" key. The name is complete once this matches.
_HEADER = re.compile(r'[\s\[\],}]*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,'
                     r'\s*"parameters"\s*:')


class _ValueEnd:
    """Where one JSON value ends, in text fed piece by piece (the grammar
    guarantees the JSON is valid, so counting brackets outside strings will do)."""

    def __init__(self) -> None:
        self.started = self.scalar = self.in_str = self.esc = False
        self.depth = 0

    def feed(self, piece: str) -> tuple[str, str | None]:
        """(the part of `piece` that belongs to the value, the text after the value
        or None while it goes on). Whitespace before the value is dropped."""
        begin = 0
        for i, c in enumerate(piece):
            if not self.started:
                if c.isspace():
                    begin = i + 1
                    continue
                self.started = True
                self.scalar = c not in '{["'
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
                    if self.depth == 0:
                        return piece[begin:i + 1], piece[i + 1:]
            elif self.scalar:
                if c in ",}] \t\r\n":
                    return piece[begin:i], piece[i:]
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return piece[begin:i + 1], piece[i + 1:]
        return piece[begin:], None


class ToolCallReader:
    """Reads one choice's tool calls out of its (constrained) output, fed as it
    streams. `feed` and `finish` return OpenAI's `delta.tool_calls` entries: a
    call's header (`id`, `type`, `name`, empty `arguments`) once its name is
    known, then pieces of its arguments. Reading the whole text at once gives
    the non-streamed answer, with the same argument text."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[ToolCall] = []
        self.rest = ""  # "required" mode: text not yet attributed to a call
        self.value: _ValueEnd | None = None  # the arguments being read, if any
        self.content: str | None = None  # output that held no call, set by finish()

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.plan.mode == "named":
            deltas = [] if self.calls else [self._start(self.plan.name or "")]
            return deltas + self._arguments(text)
        self.rest += text
        deltas: list[dict[str, Any]] = []
        while self.rest:
            if self.value is None:
                m = _HEADER.match(self.rest)
                if m is None:
                    break  # the name is not complete yet (or nothing more comes)
                self.rest = self.rest[m.end():]
                self.value = _ValueEnd()
                deltas.append(self._start(_unescape(m.group(1))))
                continue
            piece, after = self.value.feed(self.rest)
            deltas += self._arguments(piece)
            self.rest = after or ""
            if after is None:
                break
            self.value = None
        return deltas

    def finish(self) -> None:
        """The output ended. Output from which no call could be read (possible
        only when it was cut short) is kept as `content`, never dropped."""
        if not self.calls and self.plan.mode == "required":
            self.content = self.rest

    def _start(self, name: str) -> dict[str, Any]:
        self.calls.append(ToolCall(new_call_id(), name))
        return {"index": len(self.calls) - 1, **self.calls[-1].to_dict()}

    def _arguments(self, piece: str) -> list[dict[str, Any]]:
        if not piece:
            return []
        self.calls[-1].arguments += piece
        return [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]


def _unescape(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


def read_calls(plan: ToolPlan, text: str) -> ToolCallReader:
    """The calls of a whole (non-streamed) output."""
    reader = ToolCallReader(plan)
    reader.feed(text)
    reader.finish()
    return reader
