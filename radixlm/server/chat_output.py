"""A chat choice's free-form output read into OpenAI's message fields:
`reasoning_content` (a reasoning parser), `content`, and `tool_calls` (a
tool-call parser, for `tool_choice: "auto"`). Both parsers are pure
functions of the text so far whose parts only grow (function_call/base.py),
so `OutputStream` sends the growth as deltas and the non-streamed message
is the same parse of the whole text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from radixlm.server.function_call import Draft, ToolParser, detect_parser, make_parser
from radixlm.server.reasoning import REASONING_PARSERS, ReasoningParser
from radixlm.server.tool_calls import ToolPlan, new_call_id

logger = logging.getLogger("radixlm.server")


@dataclass
class ChatParsed:
    reasoning: str = ""
    content: str = ""
    calls: list[Draft] = field(default_factory=list)


@dataclass(frozen=True)
class OutputParser:
    """What reads one choice's output; either part may be absent."""

    tools: ToolParser | None = None
    reasoning: ReasoningParser | None = None

    def parse(self, text: str, final: bool) -> ChatParsed:
        reasoning, answer = self.reasoning.parse(text, final) if self.reasoning else ("", text)
        if self.tools is None:
            return ChatParsed(reasoning, answer)
        parsed = self.tools.parse(answer, final)
        return ChatParsed(reasoning, parsed.content, parsed.calls)

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed message's fields. Content that is only whitespace
        around calls is null, as OpenAI sends it."""
        p = self.parse(text, final=True)
        content: str | None = p.content
        if p.calls and not p.content.strip():
            content = None
        out: dict[str, Any] = {"content": content,
                               "tool_calls": [_call_dict(new_call_id(), c) for c in p.calls]}
        if self.reasoning is not None:
            out["reasoning_content"] = p.reasoning or None
        return out


def _call_dict(call_id: str, c: Draft) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": c.name, "arguments": c.arguments}}


class OutputStream:
    """One streamed choice: `feed` the new text, then `finish`; each returns
    OpenAI's deltas in order (`reasoning_content`, `content`, a `tool_calls`
    entry: a call's header with empty arguments, then argument pieces)."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ChatParsed()
        self.ids: list[str] = []

    @property
    def made_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        return self._diff(self.parser.parse(self.text, final=False), final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._diff(self.parser.parse(self.text, final=True), final=True)

    def _diff(self, now: ChatParsed, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        sent = self.sent
        if len(now.reasoning) > len(sent.reasoning):
            deltas.append({"reasoning_content": now.reasoning[len(sent.reasoning):]})
            sent.reasoning = now.reasoning
        # Whitespace-only content waits: before a call it is dropped.
        if len(now.content) > len(sent.content) and (
                now.content.strip() or (final and not now.calls)):
            deltas.append({"content": now.content[len(sent.content):]})
            sent.content = now.content
        for i, call in enumerate(now.calls):
            if i == len(self.ids):
                self.ids.append(new_call_id())
                sent.calls.append(Draft(call.name))
                deltas.append({"tool_calls": [{"index": i, **_call_dict(self.ids[i], Draft(
                    call.name))}]})
            done = sent.calls[i]
            if len(call.arguments) > len(done.arguments):
                deltas.append({"tool_calls": [{"index": i, "function": {
                    "arguments": call.arguments[len(done.arguments):]}}]})
                done.arguments = call.arguments
        return deltas


@dataclass(frozen=True)
class ChatParsers:
    """The server's parsers, chosen once at start-up (`--tool-call-parser`, else
    the one the chat template names; `--reasoning-parser`)."""

    tool_parser: str | None = None
    reasoning: ReasoningParser | None = None

    @classmethod
    def from_args(cls, tool_call_parser: str | None, reasoning_parser: str | None,
                  tokenizer: Any) -> ChatParsers:
        name = tool_call_parser or detect_parser(getattr(tokenizer, "chat_template", None))
        return cls(name, REASONING_PARSERS[reasoning_parser] if reasoning_parser else None)

    def for_plan(self, plan: ToolPlan) -> OutputParser | None:
        """The parser of a request's output; None where the text is the content as
        it is (no parser applies, or a forced call, which tool_calls.py reads)."""
        if plan.forcing:
            return None
        tools = make_parser(self.tool_parser, plan.tools) \
            if plan.mode == "auto" and self.tool_parser else None
        if tools is None and self.reasoning is None:
            return None
        return OutputParser(tools, self.reasoning)


def chat_parsers(args: Any, tokenizer: Any) -> ChatParsers:
    parsers = ChatParsers.from_args(args.tool_call_parser, args.reasoning_parser, tokenizer)
    if parsers.tool_parser and not args.tool_call_parser:
        logger.info("tool calls: the %s parser, as the chat template's markup says",
                    parsers.tool_parser)
    return parsers
