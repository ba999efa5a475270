"""The Responses API (`POST /v1/responses`) through the real server and the
real `openai` client's `responses.create`, streamed and not: string and
message-list input, instructions, max_output_tokens, sampling fields,
function tools, the documented stream events, and `store` semantics."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from server_utils import ServerProcess, default_server
from test_server_tools import SCHEMAS, WEATHER

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER}]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return default_server()


def test_string_input_matches_chat(server: ServerProcess) -> None:
    client = server.openai()
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12,
                                temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                          messages=[{"role": "user", "content": QUESTION}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                        else "completed")


def test_messages_and_instructions(server: ServerProcess) -> None:
    client = server.openai()
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi."}]},
             {"role": "assistant", "content": "Hello! How can I help?"},
             {"role": "user", "content": QUESTION}]
    r = client.responses.create(model=MODEL, input=items, instructions="Answer in one word.",
                                max_output_tokens=6, temperature=0.7, top_p=0.9)
    assert r.instructions == "Answer in one word." and r.temperature == 0.7 and r.top_p == 0.9
    # The instructions are the system message; input parts are joined into the text.
    chat = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Hi."}, *items[1:]])
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_max_output_tokens_is_incomplete(server: ServerProcess) -> None:
    r = server.openai().responses.create(model=MODEL, input="Tell me a long story.",
                                         max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_stream_events(server: ServerProcess) -> None:
    client = server.openai()
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", types[-1]]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == events[-4].text
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=12,
                                    temperature=0)
    assert whole.output_text == text


def test_function_tool_forced(server: ServerProcess) -> None:
    client = server.openai()
    r = client.responses.create(model=MODEL, input="What is the weather in Paris?",
                                tools=TOOLS, tool_choice="required", max_output_tokens=64,
                                temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_weather"])
    events = list(client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64,
        temperature=0, stream=True))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and json.loads(args)
    # The call's result goes back as a function_call_output item.
    follow = client.responses.create(model=MODEL, max_output_tokens=8, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id,
         "output": "18 degrees, sunny"}])
    assert follow.output[0].type == "message"


def test_store_semantics(server: ServerProcess) -> None:
    client = server.openai()
    kept = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=4)
    assert kept.store is True and client.responses.retrieve(kept.id).id == kept.id
    follow = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=kept.id, max_output_tokens=4)
    alone = client.responses.create(model=MODEL, input="What is my name?", max_output_tokens=4)
    assert follow.usage.input_tokens > alone.usage.input_tokens  # the history was sent
    gone = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input="Hi.", previous_response_id=gone.id)
    assert err.value.body["param"] == "previous_response_id"
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


BAD = [({"tools": [{"type": "web_search"}]}, "tools[0].type"),
       ({"background": True}, "background"),
       ({"reasoning": {"effort": "high"}}, "reasoning"),
       ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]"),
       ({"input": [{"type": "computer_call"}]}, "input[0].type"),
       ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
       ({"input": []}, "input")]


@pytest.mark.parametrize("body,param", BAD, ids=[b[1] for b in BAD])
def test_refused_fields(server: ServerProcess, body: dict[str, Any], param: str) -> None:
    with server.client() as c:
        r = c.post("/v1/responses", json={"model": MODEL, "input": "Hi.", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
