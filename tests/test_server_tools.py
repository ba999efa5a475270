"""OpenAI tool calling through the real server and the real `openai` client:
forced calls (a named function, "required", parallel), streamed deltas, n > 1,
tool messages in the history, "auto" refused without a tool-call parser (see
test_server_parsers.py for "auto" with one), and 400s naming the field. The
reader that turns output text into tool calls is also tested on its own."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from server_utils import ServerProcess, default_server

from radixlm.server.openai_protocol import ChatTool
from radixlm.server.tool_calls import ToolCallReader, plan_tools, read_calls

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "description": "The time in a time zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
FAST = {"model": MODEL, "max_tokens": 64, "temperature": 0}


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return default_server()


def check_call(call: Any, names: tuple[str, ...] = ("get_weather",)) -> None:
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def reassemble(stream: Any) -> tuple[dict[int, dict[int, dict[str, Any]]], dict[int, str],
                                     list[Any]]:
    """choice index -> tool call index -> {id, name, arguments}; the finish_reason
    of each choice; the chunks."""
    calls: dict[int, dict[int, dict[str, Any]]] = {}
    finish: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(choice.index, {}).setdefault(
                    tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert call["id"] is None, "the header comes once"
                    assert tc.function.arguments == "", "arguments follow the header"
                    call["id"], call["name"] = tc.id, tc.function.name
                else:
                    assert call["id"] is not None, "arguments before the header"
                    call["arguments"] += tc.function.arguments
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    return calls, finish, chunks


# ---- through the server ------------------------------------------------------------------
def test_named_function(server: ServerProcess) -> None:
    out = server.openai().chat.completions.create(messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                  logprobs=True, top_logprobs=2, **FAST)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])
    assert out.usage.completion_tokens == len(choice.logprobs.content) > 0
    assert all(len(lp.top_logprobs) == 2 for lp in choice.logprobs.content)


def test_required_picks_one_of_two_tools(server: ServerProcess) -> None:
    ask = [{"role": "user", "content": "What time is it in Tokyo?"}]
    out = server.openai().chat.completions.create(messages=ask, tools=TOOLS,
                                                  tool_choice="required", **FAST)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0], tuple(SCHEMAS))


def test_required_parallel_is_an_array(server: ServerProcess) -> None:
    out = server.openai().chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=True,
        **{**FAST, "max_tokens": 128})
    choice = out.choices[0]
    calls = choice.message.tool_calls
    assert calls and len({c.id for c in calls}) == len(calls)
    # A small model may keep adding calls until the limit; every complete one is valid.
    complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    assert choice.finish_reason in ("tool_calls", "length")
    for call in complete:
        check_call(call, tuple(SCHEMAS))


def test_n2_non_streamed(server: ServerProcess) -> None:
    out = server.openai().chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice="required", n=2, seed=7,
        **{**FAST, "temperature": 0.8})
    assert [c.index for c in out.choices] == [0, 1]
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0], tuple(SCHEMAS))


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_streamed_n2(server: ServerProcess, tool_choice: Any) -> None:
    stream = server.openai().chat.completions.create(
        messages=ASK, tools=TOOLS, tool_choice=tool_choice, n=2, stream=True,
        stream_options={"include_usage": True}, **FAST)
    calls, finish, chunks = reassemble(stream)
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert sorted(calls) == [0, 1]
    for per_choice in calls.values():
        assert list(per_choice) == [0]
        call = per_choice[0]
        assert call["id"].startswith("call_") and call["name"] in SCHEMAS
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        if tool_choice == NAMED:
            assert call["name"] == "get_weather"
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices
    # Greedy: the streamed call is the non-streamed one.
    whole = server.openai().chat.completions.create(messages=ASK, tools=TOOLS,
                                                    tool_choice=tool_choice, **FAST)
    assert whole.choices[0].message.tool_calls[0].function.arguments == calls[0][0]["arguments"]


def test_tool_messages_in_history(server: ServerProcess) -> None:
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    client = server.openai()
    out = client.chat.completions.create(messages=history, tools=TOOLS, tool_choice="none",
                                         **{**FAST, "max_tokens": 8})
    assert isinstance(out.choices[0].message.content, str)
    assert not out.choices[0].message.tool_calls
    assert out.usage.prompt_tokens > 40  # the call and its result were rendered
    # Without tools at all, and forcing another call after the result.
    out = client.chat.completions.create(messages=history, **{**FAST, "max_tokens": 4})
    assert out.choices[0].message.content is not None
    out = client.chat.completions.create(messages=history, tools=TOOLS,
                                         tool_choice="required", **FAST)
    check_call(out.choices[0].message.tool_calls[0], tuple(SCHEMAS))


def test_truncated_call_reports_length(server: ServerProcess) -> None:
    out = server.openai().chat.completions.create(messages=ASK, tools=TOOLS,
                                                  tool_choice=NAMED, **{**FAST, "max_tokens": 3})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.tool_calls[0].function.arguments.startswith("{")


@pytest.mark.parametrize("tool_choice,param", [("auto", "tool_choice"), (None, "tools")])
def test_auto_is_refused(server: ServerProcess, tool_choice: str | None, param: str) -> None:
    extra = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError) as err:
        server.openai().chat.completions.create(messages=ASK, tools=TOOLS, **extra, **FAST)
    body = err.value.body
    assert "needs a parser for tool calls" in body["message"] and "required" in body["message"]
    assert "--tool-call-parser" in body["message"]
    assert body["param"] == param and err.value.status_code == 400


BAD = [
    ({"tools": [{"type": "function", "function": {"parameters": WEATHER}}],
      "tool_choice": "required"}, "tools.0.function.name", "Field required"),
    ({"tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"},
     "tools.0.function.name", "must not be empty"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools.2.function.name",
     "used twice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not among the tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be one of"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
    ({"tool_choice": NAMED}, "tool_choice", "only allowed when tools are given"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "strin"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools.0.function.parameters", "json_schema is invalid"),
    ({"tools": TOOLS[:1] + [{"type": "function", "function": {
        "name": "g", "parameters": {"type": "strin"}}}], "tool_choice": "required"},
     "tools", "json_schema is invalid"),
    ({"tools": TOOLS, "tool_choice": NAMED, "regex": "a+"}, "regex", "cannot be combined"),
    ({"tools": TOOLS, "tool_choice": "required", "json_schema": {"type": "object"}},
     "json_schema", "cannot be combined"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}], "tool_choice": "required"},
     "tools.0.type", "function"),
]


@pytest.mark.parametrize("body,param,message", BAD, ids=[b[1] + ":" + b[2] for b in BAD])
def test_validation_errors(server: ServerProcess, body: dict[str, Any], param: str,
                           message: str) -> None:
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": ASK, **FAST, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    assert err["type"] == "BadRequestError" and err["code"] == 400


def test_bad_schema_streamed_is_400(server: ServerProcess) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]
    with pytest.raises(openai.BadRequestError) as err:
        server.openai().chat.completions.create(
            messages=ASK, tools=tools, stream=True, n=2,
            tool_choice={"type": "function", "function": {"name": "f"}}, **FAST)
    assert err.value.body["param"] == "tools.0.function.parameters"


# ---- the reader alone -----------------------------------------------------------------------
def plan(tool_choice: Any, parallel: bool | None = None) -> Any:
    tools = [ChatTool.model_validate(t) for t in TOOLS]
    tools.append(ChatTool.model_validate({"function": {"name": 'odd"name',
                                                       "parameters": {"type": "integer"}}}))
    return plan_tools(tools, tool_choice, parallel)


ARRAY = ('[{"name": "get_weather", "parameters": {"city": "P}a\\"ris", "unit": "celsius"}}, '
         '{"name": "odd\\"name", "parameters": 42}, {"name": "get_time", "parameters": {}}]')


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(ARRAY)])
def test_reader_pieces_match_whole(size: int) -> None:
    p = plan("required", parallel=True)
    reader, deltas = ToolCallReader(p), []
    for i in range(0, len(ARRAY), size):
        deltas += reader.feed(ARRAY[i:i + size])
    reader.finish()
    whole = read_calls(p, ARRAY)
    assert [(c.name, c.arguments) for c in reader.calls] == \
        [(c.name, c.arguments) for c in whole.calls] == [
            ("get_weather", '{"city": "P}a\\"ris", "unit": "celsius"}'),
            ('odd"name', "42"), ("get_time", "{}")]
    headers = [d for d in deltas if "id" in d]
    assert [d["index"] for d in headers] == [0, 1, 2]
    for i, call in enumerate(reader.calls):
        assert "".join(d["function"]["arguments"] for d in deltas
                       if d["index"] == i and "id" not in d) == call.arguments


def test_reader_cut_short() -> None:
    p = plan("required")
    partial = read_calls(p, '{"name": "get_time", "parameters": {"zo')
    assert [(c.name, c.arguments) for c in partial.calls] == [("get_time", '{"zo')]
    assert partial.content is None
    nameless = read_calls(p, '{"name": "get_ti')
    assert nameless.calls == [] and nameless.content == '{"name": "get_ti'
    named = read_calls(plan(NAMED), '{"city": "Rome"')
    assert [(c.name, c.arguments) for c in named.calls] == [("get_weather", '{"city": "Rome"')]


def test_required_schema_shape() -> None:
    schema = plan("required").schema()
    assert [alt["properties"]["name"] for alt in schema["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}, {"const": 'odd"name'}]
    assert all(alt["required"] == ["name", "parameters"] for alt in schema["anyOf"])
    array = plan("required", parallel=True).schema()
    assert array["type"] == "array" and array["minItems"] == 1
    assert plan(NAMED).schema() == WEATHER


class RefusesTools:
    """A tokenizer whose chat template knows no tools and refuses the "tool" role
    (as strict-alternation templates do); `encode` hands the text back."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> str:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("roles must alternate user/assistant")
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    def encode(self, text: str, add_special_tokens: bool = False) -> str:
        return text


def test_history_falls_back_to_text() -> None:
    from radixlm.server.openai_api import OpenAIServing
    from radixlm.server.openai_protocol import ChatCompletionRequest

    api = OpenAIServing(None, RefusesTools(), MODEL, None)  # type: ignore[arg-type]
    req = ChatCompletionRequest(messages=ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    text = api.render_chat(req, plan("none"))
    assert text == ('user:What is the weather in Paris?|assistant:[{"name": "get_weather", '
                    '"arguments": {"city": "P"}}]|user:Tool result (call call_1): sunny')
