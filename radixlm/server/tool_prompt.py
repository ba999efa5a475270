"""Tools for a chat template that never shows them to the model.

Many templates render a request's `tools` (Qwen's, Llama 3.1's, Mistral's);
others ignore the argument (SmolLM2's), so the model never learns what it
could call, and `tool_choice: "auto"` only ever gets plain text. Whether a
template renders tools is found out once per distinct template, by rendering a
probe conversation with and without a probe tool and comparing; for one that
does not, the tool definitions go into the system message in the configured
tool-call parser's own format (`ToolParser.tools_prompt`), so what the model is
asked to write is what the parser reads. Without a parser there is no format
to ask for: nothing is added (forced calls need none; "auto" is refused then).
An assistant's earlier calls, which such templates drop too, are written into
its content in the same markup (`ToolParser.calls_text`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from radixlm.server.function_call import calls_text, tools_prompt
from radixlm.server.tool_calls import json_calls

logger = logging.getLogger("radixlm.server")

_PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "radixlm_probe_tool", "description": "A tool that only a template that renders "
    "tools shows", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# Roles whose message a template puts first as the system prompt.
_SYSTEM_ROLES = ("system", "developer")

Render = Callable[..., str]  # apply_chat_template(messages, tokenize=False, ...)


class ToolPrompt:
    """Shows a request's tools to the model when its template will not.

    `messages(...)` returns the messages to render: unchanged when there are no
    tools, no parser, or the template renders tools itself; otherwise with the
    parser's tool text at the end of the first system message (a new one first
    when there is none). The probe runs on the caller's thread (the
    TokenizerManager's one tokenizer thread), so the cache needs no lock."""

    def __init__(self, parser: str | None) -> None:
        self.parser = parser
        self._renders: dict[str, bool] = {}  # template text -> it renders tools

    def renders_tools(self, template: Any, render: Render) -> bool:
        key = str(template)
        known = self._renders.get(key)
        if known is None:
            known = self._renders[key] = _probe(render)
            if not known and self.parser:
                logger.info("the chat template does not render tools: a request's tool "
                            "definitions go into its system message, in the %s tool-call "
                            "parser's format", self.parser)
        return known

    def messages(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                 template: Any, render: Render) -> list[dict[str, Any]]:
        if not tools or self.parser is None or self.renders_tools(template, render):
            return messages
        text = tools_prompt(self.parser, tools)
        if messages and messages[0]["role"] in _SYSTEM_ROLES:
            first = messages[0]
            content = f"{first['content']}\n\n{text}" if first["content"] else text
            return [{**first, "content": content}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]


    def calls_text(self, calls: list[dict[str, Any]]) -> str:
        """An assistant's earlier calls as text, for a template that drops
        `tool_calls`: in the parser's markup (what the model is asked to write and
        what is read back), else a JSON list."""
        return calls_text(self.parser, calls) if self.parser else json_calls(calls)


def _probe(render: Render) -> bool:
    """Whether the template's output changes when tools are given. A template that
    fails on the probe is taken to render them (it is left to do as it does)."""
    try:
        plain = render(_PROBE_MESSAGES, tokenize=False, add_generation_prompt=True)
        with_tools = render(_PROBE_MESSAGES, tokenize=False, add_generation_prompt=True,
                            tools=_PROBE_TOOLS)
    except Exception as e:  # jinja2 errors, raise_exception() in templates
        logger.debug("the tools probe failed on the chat template: %s", e)
        return True
    return plain != with_tools
