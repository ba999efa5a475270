"""tool_choice "auto" and reasoning_content through the real server and the
real `openai` client, with `--tool-call-parser hermes --reasoning-parser
qwen3`. The embedded model does not call tools or think on its own, so the
outputs that do are forced with a regex (SGLang's extension); the parsers
must then find the calls and the reasoning in text they did not constrain."""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_utils import DEFAULT_ARGS, ServerProcess
from test_server_tools import ASK, FAST, TOOLS, check_call

CALL_REGEX = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": '
              r'\{"city": "[A-Z][a-z]{2,8}", "unit": "celsius"\}\}\n</tool_call>')
TWO_CALLS = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris", '
             r'"unit": "celsius"\}\}\n</tool_call>\n<tool_call>\n\{"name": "get_time", '
             r'"arguments": \{"zone": "UTC"\}\}\n</tool_call>')
THINK_REGEX = r"<think>[a-z ]{4,40}</think>The answer is [A-Z][a-z]{2,8}\."
# Forced text costs more tokens than the model's own (it often spells it out).
LONG = {**FAST, "max_tokens": 160}


@pytest.fixture(scope="module")
def server() -> Any:
    # The template ignores tools, so their definitions join the prompt: a longer context.
    with ServerProcess([*DEFAULT_ARGS, "--context-length", "1024", "--tool-call-parser",
                        "hermes", "--reasoning-parser", "qwen3"]) as s:
        yield s


def collect(stream: Any) -> tuple[str, str, dict[int, dict[str, str]], str | None]:
    """(reasoning, content, calls by index, finish_reason) of a streamed choice 0."""
    reasoning = content = ""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id:
                    assert tc.index not in calls and tc.function.arguments == ""
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    calls[tc.index]["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


def test_auto_reads_a_call(server: ServerProcess) -> None:
    out = server.openai().chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice="auto", extra_body={"regex": CALL_REGEX},
        **LONG)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "Checking."
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])
    # Streamed: the same content, then the call's header and its argument pieces.
    stream = server.openai().chat.completions.create(
        messages=ASK, tools=TOOLS, extra_body={"regex": CALL_REGEX}, stream=True, **LONG)
    reasoning, content, calls, finish = collect(stream)
    assert (reasoning, content, finish) == ("", "Checking.", "tool_calls")
    assert [c["name"] for c in calls.values()] == ["get_weather"]
    assert calls[0]["arguments"] == choice.message.tool_calls[0].function.arguments


def test_auto_parallel_calls_streamed(server: ServerProcess) -> None:
    kw = {"messages": ASK, "tools": TOOLS, "extra_body": {"regex": TWO_CALLS},
          **LONG}
    whole = server.openai().chat.completions.create(**kw).choices[0]
    assert whole.message.content is None and whole.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in whole.message.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "UTC"})]
    _, content, calls, finish = collect(server.openai().chat.completions.create(
        stream=True, **kw))
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_auto_without_a_call_is_content(server: ServerProcess) -> None:
    client = server.openai()
    out = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="auto",
                                         **{**FAST, "max_tokens": 12})
    choice = out.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason in ("stop", "length")
    assert choice.message.content and "<tool_call>" not in choice.message.content
    _, content, calls, finish = collect(client.chat.completions.create(
        messages=ASK, tools=TOOLS, stream=True, **{**FAST, "max_tokens": 12}))
    assert (content, calls, finish) == (choice.message.content, {}, choice.finish_reason)


def test_broken_call_stays_content(server: ServerProcess) -> None:
    regex = r"<tool_call>\nnot json\n</tool_call>"
    out = server.openai().chat.completions.create(
        messages=ASK, tools=TOOLS, extra_body={"regex": regex}, **LONG)
    assert out.choices[0].message.content == "<tool_call>\nnot json\n</tool_call>"
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason == "stop"


def test_none_keeps_tools_out(server: ServerProcess) -> None:
    client = server.openai()
    out = client.chat.completions.create(messages=ASK, tools=TOOLS, tool_choice="none",
                                         extra_body={"regex": CALL_REGEX}, **LONG)
    assert "<tool_call>" in out.choices[0].message.content
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason == "stop"
    bare = client.chat.completions.create(messages=ASK, **{**FAST, "max_tokens": 1})
    assert out.usage.prompt_tokens == bare.usage.prompt_tokens  # no tools in the prompt


def test_reasoning_content(server: ServerProcess) -> None:
    client = server.openai()
    out = client.chat.completions.create(messages=ASK, extra_body={"regex": THINK_REGEX},
                                         **LONG)
    message = out.choices[0].message
    assert message.reasoning_content and "<think>" not in message.reasoning_content
    assert message.content.startswith("The answer is ")
    reasoning, content, calls, finish = collect(client.chat.completions.create(
        messages=ASK, extra_body={"regex": THINK_REGEX}, stream=True, **LONG))
    assert (reasoning, content, calls) == (message.reasoning_content, message.content, {})
    assert finish == "stop"
    plain = client.chat.completions.create(messages=ASK, **{**FAST, "max_tokens": 8})
    assert plain.choices[0].message.reasoning_content is None


class ThinkingTemplate:
    """A tokenizer whose template renders Qwen3's `enable_thinking` switch;
    `encode` hands the text back."""

    chat_template = "{{ enable_thinking }}"

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> str:
        think = kw.get("enable_thinking", True)
        return "<|im_start|>assistant\n" + ("" if think else "<think>\n\n</think>\n\n")

    def encode(self, text: str, add_special_tokens: bool = False) -> str:
        return text


def test_chat_template_kwargs_reach_the_template() -> None:
    from radixlm.server.openai_api import OpenAIServing
    from radixlm.server.openai_protocol import ChatCompletionRequest
    from radixlm.server.tool_calls import ToolPlan

    api = OpenAIServing(None, ThinkingTemplate(), "m", None)  # type: ignore[arg-type]
    off = ChatCompletionRequest(messages=ASK, chat_template_kwargs={"enable_thinking": False})
    assert api.render_chat(off, ToolPlan()).endswith("<think>\n\n</think>\n\n")
    assert "<think>" not in api.render_chat(ChatCompletionRequest(messages=ASK), ToolPlan())


def test_responses_api_auto_and_reasoning(server: ServerProcess) -> None:
    """The Responses API reads the same markup into function_call and reasoning items."""
    client = server.openai()
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r = client.responses.create(input="What is the weather in Paris?", tools=tools,
                                max_output_tokens=160, temperature=0,
                                extra_body={"regex": CALL_REGEX})
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output_text == "Checking." and r.output[1].name == "get_weather"
    events = list(client.responses.create(
        input="What is the weather in Paris?", tools=tools, max_output_tokens=160,
        temperature=0, stream=True, extra_body={"regex": CALL_REGEX}))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == r.output[1].arguments
    assert events[-1].type == "response.completed"
    thought = client.responses.create(input="Capital of France?", max_output_tokens=160,
                                      temperature=0, extra_body={"regex": THINK_REGEX})
    assert [o.type for o in thought.output] == ["reasoning", "message"]
    assert thought.output[0].content[0].text and thought.output_text.startswith("The answer")
    assert thought.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(input="Capital of France?", max_output_tokens=160,
                                          temperature=0, stream=True,
                                          extra_body={"regex": THINK_REGEX}))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == thought.output[0].content[0].text
