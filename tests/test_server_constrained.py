"""Constrained decoding through the real server: the native API's grammar
sampling params, OpenAI's response_format, SGLang's regex/ebnf/json_schema
extension fields, and 400s for bad grammars or a server without a backend."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from server_utils import ServerProcess, default_server

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"]}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return default_server()


def test_native_generate_with_each_grammar(server):
    with server.client() as c:
        outs = c.post("/generate", json={"text": ["A code:", "A person:", "Greet:"],
                                         "sampling_params": [
                                             {"regex": r"[A-Z]{2}-\d{3}", "max_new_tokens": 16},
                                             {"json_schema": PERSON, "max_new_tokens": 48,
                                              "temperature": 0},
                                             {"ebnf": 'root ::= "hi" | "hello"',
                                              "max_new_tokens": 8}]}).json()
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", outs[0]["text"])
    jsonschema.validate(json.loads(outs[1]["text"]), PERSON)
    assert outs[2]["text"] in ("hi", "hello")
    assert all(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)


def test_chat_response_format_json_schema(server):
    out = server.openai().chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=48, temperature=0, n=2,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}})
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        assert choice.finish_reason == "stop"


def test_chat_response_format_json_object_streamed(server):
    # Any object is allowed, so the length is the model's choice: ask for a small one.
    ask = [{"role": "user", "content": 'Reply with the JSON object {"ok": true} only.'}]
    stream = server.openai().chat.completions.create(
        model=MODEL, messages=ask, max_tokens=100, temperature=0, stream=True,
        response_format={"type": "json_object"})
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text), dict)


def test_completions_regex_extension(server):
    out = server.openai().completions.create(
        model=MODEL, prompt="The date today is", max_tokens=16,
        extra_body={"regex": r" \d{4}-\d{2}-\d{2}"})
    assert re.fullmatch(r" \d{4}-\d{2}-\d{2}", out.choices[0].text)


@pytest.mark.parametrize("extra,message", [
    ({"regex": "(a"}, "regex is invalid: Regex parsing error"),
    ({"json_schema": '{"type": "strin"}'}, 'json_schema is invalid: Unsupported type'),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "only one of response_format, json_schema, regex, "
                                              "ebnf"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "only one of"),
])
def test_bad_grammars_are_400(server, extra, message):
    with pytest.raises(openai.BadRequestError) as err:
        server.openai().chat.completions.create(model=MODEL, messages=ASK, max_tokens=8,
                                                extra_body=extra)
    assert message in err.value.body["message"]
    # The server keeps serving.
    ok = server.openai().chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
    assert ok.choices[0].message.content is not None


def test_grammar_backend_none_refuses_with_400():
    with ServerProcess(["--grammar-backend", "none", "--max-total-tokens", "2048",
                        "--context-length", "256"]) as srv, srv.client() as c:
        r = c.post("/generate", json={"text": "Hi", "sampling_params": {"regex": "a+"}})
        assert r.status_code == 400
        body = r.json()["error"]
        assert "--grammar-backend none" in body["message"] and body["param"] == "regex"
        r = c.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200
