"""The contract of a tool-call parser, and what the JSON formats share.

A parser reads the tool calls out of a model's free-form output (OpenAI's
`tool_choice: "auto"`). `parse(text, final)` is a pure function of the text
so far, and it only ever grows: for any text t and continuation u, the
content of `parse(t)` is a prefix of the content of `parse(t + u)`, and its
calls are the first calls of the longer text's, with the same names and
arguments that are prefixes of the longer ones. Streaming sends the
difference between two parses and never has to take anything back; the
non-streamed answer is `parse(text, final=True)`, so both agree by
construction.

What a parser promises about the output it reads:
- a call is only reported once its function name is complete and names one
  of the request's tools; its arguments are always a prefix of a JSON
  document (complete when the call is), never text that JSON could not
  continue;
- output that holds no readable call (broken markup, an unknown function,
  text that is not JSON) stays content, verbatim; nothing is dropped except
  a format's section markers and whitespace next to a call.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from radixlm.server.function_call.json_prefix import JsonPrefix


@dataclass
class Draft:
    """One call as far as it is written: `complete` once its arguments are."""

    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class Parsed:
    content: str = ""
    calls: list[Draft] = field(default_factory=list)


def tool_names(tools: list[dict[str, Any]]) -> frozenset[str]:
    return frozenset(t["function"]["name"] for t in tools)


class ToolParser(ABC):
    """One model family's tool-call format. `markers` open its tool-call section
    (text before the first one is content); subclasses read the section."""

    markers: tuple[str, ...] = ()
    held: tuple[str, ...] = ()  # more markup that a stream holds back while it may be coming

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.names = tool_names(tools)

    def parse(self, text: str, final: bool) -> Parsed:
        start = self.section_start(text)
        pieces = [text] if start is None else [text[:start], *self.parse_section(
            text[start:], final)]
        return assemble(pieces, final, self.markers + self.held)

    def section_start(self, text: str) -> int | None:
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held_back(self, text: str) -> int:
        return max((partial_suffix(text, m) for m in self.markers), default=0)

    @classmethod
    @abstractmethod
    def tools_prompt(cls, tools: list[dict[str, Any]]) -> str:
        """The text that shows `tools` (OpenAI's shape) to a model whose chat template
        does not render them, and asks for calls in this format, markup included,
        so that `parse` can read them; the server puts it into the system message."""

    @classmethod
    @abstractmethod
    def calls_text(cls, calls: list[dict[str, Any]]) -> str:
        """Earlier calls (`{"name", "arguments"}` each, arguments a JSON value) as
        this format writes them, for templates that drop an assistant's
        `tool_calls`: `parse` reads the calls back, so the model sees its own
        earlier calls in the markup it is asked to write."""

    @abstractmethod
    def parse_section(self, section: str, final: bool) -> list[str | Draft]:
        """Read `section`, which starts at a marker, into its calls and the text
        between them that holds none (verbatim), in order. Text whose fate is
        not decided yet (a call still being written) is left out."""


def tool_lines(tools: list[dict[str, Any]]) -> str:
    """The tool definitions as prompts show them: one JSON object per line."""
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


def assemble(pieces: list[str | Draft], final: bool, markers: tuple[str, ...]) -> Parsed:
    """Content and calls from a parse's pieces. Whitespace next to a call is
    markup, and text on either side of a call is one line apart; while the
    output goes on, the end is held back if it may still become a marker or
    is whitespace (dropped if a call follows)."""
    calls = [p for p in pieces if isinstance(p, Draft)]
    texts: list[str] = []  # runs of text between calls
    run = ""
    for i, p in enumerate(pieces):
        if isinstance(p, Draft):
            texts.append(run.rstrip())
            run = ""
        elif i > 0 and isinstance(pieces[i - 1], Draft):
            run = p.lstrip()
        else:
            run += p
    if not final:
        run = run[:len(run) - max((partial_suffix(run, m) for m in markers), default=0)]
        run = run.rstrip()
    texts.append(run)
    return Parsed("\n".join(t for t in texts if t), calls)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# ---- a JSON call object: {"name": ..., "arguments": ...} ---------------------------------
# The name comes first in every family's published format, so a call can be
# announced (and its arguments streamed) as soon as the name is complete.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"'
                     r'\s*:')
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ObjectRead:
    """`state`: "pending" (not decided yet), "call" or "invalid" (not a call: its
    text is content). `end`: where the object's text ends, once known."""

    state: str
    draft: Draft | None = None
    end: int | None = None


def read_call_object(text: str, names: frozenset[str], final: bool) -> ObjectRead:
    """One call object at the start of `text` (leading whitespace allowed)."""
    m = _HEADER.match(text)
    if m is not None and _unescape(m.group(1)) in names:
        first = text[m.end():].lstrip()[:1]
        # Announced once the arguments have begun, and not for a JSON string
        # (streaming its quoted text would not be the arguments' text).
        if first and first != '"':
            return _streamed_object(text, m, final)
    return _whole_object(text, names, final)


def _streamed_object(text: str, m: re.Match[str], final: bool) -> ObjectRead:
    """Header first: the arguments stream as written."""
    rest = text[m.end():]
    args = JsonPrefix()
    n = args.feed(rest)
    if final:
        args.finish()
    draft = Draft(_unescape(m.group(1)), rest[:n].lstrip(), args.done)
    if args.failed:  # the arguments broke off: what follows is not part of the call
        return ObjectRead("call", draft, m.end() + n)
    if not args.done:
        return ObjectRead("call", draft)
    whole = JsonPrefix()
    k = whole.feed(text)
    # A small model may forget the object's closing brace: the call still ends
    # with its arguments, and the text after them is read on as usual.
    end = k if whole.done else (m.end() + n if whole.failed or final else None)
    return ObjectRead("call", draft, end)


def _whole_object(text: str, names: frozenset[str], final: bool) -> ObjectRead:
    """Any other key order (or arguments sent as a JSON string): a call once the
    whole object is there."""
    whole = JsonPrefix()
    k = whole.feed(text)
    if not whole.done:
        if whole.failed or final:
            return ObjectRead("invalid", end=k if whole.failed else len(text))
        return ObjectRead("pending")
    draft = call_from_object(json.loads(text[:k]), names)
    return ObjectRead("call", draft, k) if draft else ObjectRead("invalid", end=k)


def call_from_object(obj: Any, names: frozenset[str]) -> Draft | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    key = next((k for k in ARGUMENT_KEYS if k in obj), None)
    args = obj.get(key, {}) if key else {}
    if isinstance(args, str):  # arguments as a JSON string, as OpenAI itself sends them
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Draft(obj["name"], json.dumps(args, ensure_ascii=False), True)


def _unescape(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw
