"""The client libraries people point at an OpenAI-compatible server, driven
against the real server (`--tool-call-parser hermes`, the embedded model):
openai-agents (an agent with an `output_type` and a tool under
`tool_choice="required"`, on the chat-completions and on the Responses model),
instructor (TOOLS, JSON_SCHEMA, RESPONSES_TOOLS) and langchain-openai
(`bind_tools` with "auto", `with_structured_output`). The tiny model's answers
are poor: each test asserts the call completes and its result is well-formed,
not that it is wise. A library that is not installed skips its test.

Also, on the same server: a forced tool call with a response format on both
endpoints (and the combinations still refused, by each endpoint's own names),
tool definitions reaching the prompt of a template that does not render them,
`finish_reason` when EOS is the last allowed token, and the access log.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from pydantic import BaseModel, Field
from server_utils import DEFAULT_ARGS, ServerProcess

MODEL = "SmolLM2-135M-Instruct"
# A context long enough for the tool definitions and an agent's instructions.
ARGS = [*DEFAULT_ARGS, "--context-length", "2048", "--tool-call-parser", "hermes"]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}
ANSWER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                 "required": ["city"]}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
INJECTED_LOG = "the chat template does not render tools"


class Weather(BaseModel):
    """What the structured-output clients ask for (small, so that it fits a few tokens)."""

    city: str = Field(max_length=12)
    celsius: int = Field(ge=-60, le=60)


@pytest.fixture(scope="module")
def server() -> Any:
    with ServerProcess(ARGS) as s:
        yield s


def wait_for_log(server: ServerProcess, pattern: str, timeout: float = 10.0) -> list[str]:
    """The server log's lines matching `pattern` (a line is written just after the
    response it is about, so it may arrive a moment after the client returns)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in server.log().splitlines() if re.search(pattern, line)]
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


# ---- openai-agents -------------------------------------------------------------------------
@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_output_type_with_required_tool(server: ServerProcess, api: str) -> None:
    """An agent with an output_type and a tool under tool_choice="required": the
    first turn is a forced call sent with a json_schema response format."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # traces would go to OpenAI's servers
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 21 degrees in {city}."

    client = AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)
    model_cls = agents.OpenAIChatCompletionsModel if api == "chat_completions" \
        else agents.OpenAIResponsesModel
    agent = agents.Agent(
        name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
        output_type=Weather, model=model_cls(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=48,
                                            temperature=0))
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert isinstance(result.final_output, Weather)
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"], kinds
    assert len(calls) == 1 and isinstance(calls[0], str)


# ---- instructor ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "RESPONSES_TOOLS"])
def test_instructor_modes(server: ServerProcess, mode: str) -> None:
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(server.openai(), mode=getattr(instructor.Mode, mode))
    out = client.chat.completions.create(
        model=MODEL, response_model=Weather, max_retries=0, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "Paris: 21 degrees and sunny."}])
    assert isinstance(out, Weather) and out.city


# ---- langchain-openai --------------------------------------------------------------------------
def _chat_model(server: ServerProcess, max_tokens: int) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=server.base_url, api_key="none", model=MODEL,
                                       temperature=0, max_tokens=max_tokens, max_retries=0)


def test_langchain_bind_tools_auto(server: ServerProcess) -> None:
    """bind_tools sends tool_choice "auto" (by leaving it out): the template
    ignores tools, so the server shows them in the system message."""
    llm = _chat_model(server, 40)
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    with_tools = llm.bind_tools([get_weather]).invoke("What is the weather in Paris?")
    plain = llm.invoke("What is the weather in Paris?")
    assert with_tools.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert isinstance(with_tools.content, str) and isinstance(with_tools.tool_calls, list)
    for call in with_tools.tool_calls:
        assert call["name"] == "get_weather" and isinstance(call["args"], dict)
    assert with_tools.usage_metadata["input_tokens"] > plain.usage_metadata["input_tokens"]


def test_langchain_with_structured_output(server: ServerProcess) -> None:
    llm = _chat_model(server, 48)
    out = llm.with_structured_output(Weather).invoke("Paris: 21 degrees and sunny.")
    assert isinstance(out, Weather) and out.city


# ---- a forced call with a response format ----------------------------------------------------
def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> Any:
    with server.client() as c:
        return c.post(path, json={"model": MODEL, "temperature": 0, **body})


JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("tool_choice,response_format", [
    ("required", JSON_FORMAT), (NAMED, {"type": "json_object"})], ids=["required", "named"])
def test_chat_forced_call_with_response_format(server: ServerProcess, tool_choice: Any,
                                               response_format: dict[str, Any]) -> None:
    r = _post(server, "/v1/chat/completions", {
        "messages": ASK, "tools": [WEATHER_TOOL], "tool_choice": tool_choice,
        "response_format": response_format, "max_tokens": 40})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    assert choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"])["city"], str)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])
def test_responses_forced_call_with_text_format(server: ServerProcess, tool_choice: Any) -> None:
    r = _post(server, "/v1/responses", {
        "input": "What is the weather in Paris?", "tools": [RESPONSES_TOOL],
        "tool_choice": tool_choice, "max_output_tokens": 40,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA}}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "completed", body
    (item,) = body["output"]
    assert item["type"] == "function_call" and item["name"] == "get_weather"
    assert isinstance(json.loads(item["arguments"])["city"], str)


TOOLS_REQUIRED = {"tools": [WEATHER_TOOL], "tool_choice": "required"}
RESPONSES_REQUIRED = {"tools": [RESPONSES_TOOL], "tool_choice": "required"}
TEXT_JSON = {"text": {"format": {"type": "json_object"}}}
STILL_REFUSED = [
    ("/v1/chat/completions", {**TOOLS_REQUIRED, "regex": "a+"}, "regex", "forces a tool call"),
    ("/v1/chat/completions", {**TOOLS_REQUIRED, "json_schema": ANSWER_SCHEMA}, "json_schema",
     "forces a tool call"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "ebnf": 'root ::= "a"'},
     "ebnf", "only one of response_format, json_schema, regex, ebnf"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format", "response_format.json_schema.schema must be a JSON schema"),
    ("/v1/responses", {**RESPONSES_REQUIRED, "ebnf": 'root ::= "a"'}, "ebnf",
     "forces a tool call"),
    ("/v1/responses", {**TEXT_JSON, "regex": "a+"}, "regex", "only one of text.format, regex"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "text.format.schema must be a JSON schema"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "x",
                                           "schema": {"type": "strin"}}}}, "text.format",
     "text.format is invalid"),
]


@pytest.mark.parametrize("path,body,param,message", STILL_REFUSED,
                         ids=[f"{p.split('/')[-1]}:{b[2]}" for p, *b in STILL_REFUSED])
def test_contradictions_still_refused(server: ServerProcess, path: str, body: dict[str, Any],
                                      param: str, message: str) -> None:
    key = "messages" if path == "/v1/chat/completions" else "input"
    r = _post(server, path, {key: ASK if key == "messages" else "Hi", "max_tokens": 8, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err
    if path == "/v1/responses":  # that endpoint has no such parameter
        assert "response_format" not in err["message"] and "json_schema" not in err["message"]


# ---- tools the template never renders ------------------------------------------------------
def test_tools_reach_a_template_without_tool_support(server: ServerProcess) -> None:
    """SmolLM2's template ignores `tools`: the server puts them into the system
    message in the hermes format, and says so once. How often the model then
    calls the tool is printed (the model's ability, not a pass condition)."""
    questions = ["What is the weather in Paris?", "Is it raining in London?",
                 "Tell me the weather in Tokyo.", "How warm is it in Rome today?",
                 "Weather in Berlin, please."]

    def ask(question: str, tools: bool) -> dict[str, Any]:
        extra = {"tools": [WEATHER_TOOL], "tool_choice": "auto"} if tools else {}
        r = _post(server, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": question}], "max_tokens": 40, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(len(questions) + 1) as pool:  # one batch in the scheduler
        with_tools = list(pool.map(lambda q: ask(q, True), questions))
        plain = ask(questions[0], False)
    grown = with_tools[0]["usage"]["prompt_tokens"] - plain["usage"]["prompt_tokens"]
    assert grown > 40, (with_tools[0]["usage"], plain["usage"])
    called = 0
    for out in with_tools:
        choice = out["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert all(c["function"]["name"] == "get_weather" for c in calls)
        called += bool(calls)
    print(f"\n[report] tool_choice auto, tools in the system message (hermes): the embedded "
          f"model called the tool in {called} of {len(questions)} requests; the prompt grew "
          f"by {grown} tokens")
    responses = _post(server, "/v1/responses", {
        "input": questions[0], "tools": [RESPONSES_TOOL], "max_output_tokens": 4}).json()
    assert responses["usage"]["input_tokens"] == with_tools[0]["usage"]["prompt_tokens"]
    assert len(wait_for_log(server, INJECTED_LOG)) == 1, "logged once per template"


# ---- finish_reason at the exact limit ----------------------------------------------------------
QUESTION = "What is the capital of France? Answer with one word."
# The same conversation as the completions endpoints see it (SmolLM2's template).
PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
          f"Face<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")


def _chat(server: ServerProcess, limit: int) -> tuple[str, int]:
    out = _post(server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": QUESTION}], "max_tokens": limit}).json()
    return out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]


def _completion(server: ServerProcess, limit: int) -> tuple[str, int]:
    out = _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": limit}).json()
    return out["choices"][0]["finish_reason"], out["usage"]["completion_tokens"]


def _responses(server: ServerProcess, limit: int) -> tuple[str, int]:
    out = _post(server, "/v1/responses", {"input": QUESTION, "max_output_tokens": limit}).json()
    return out["status"], out["usage"]["output_tokens"]


def _native(server: ServerProcess, limit: int) -> tuple[str, int]:
    with server.client() as c:
        out = c.post("/generate", json={"text": PROMPT, "sampling_params": {
            "max_new_tokens": limit, "temperature": 0}}).json()
    return out["meta_info"]["finish_reason"]["type"], out["meta_info"]["completion_tokens"]


@pytest.mark.parametrize("ask,done,cut", [(_chat, "stop", "length"),
                                          (_completion, "stop", "length"),
                                          (_responses, "completed", "incomplete"),
                                          (_native, "stop", "length")],
                         ids=["chat", "completions", "responses", "native"])
def test_finish_reason_when_eos_is_the_last_allowed_token(server: ServerProcess, ask: Any,
                                                          done: str, cut: str) -> None:
    """The greedy answer ends with EOS at token n: max_tokens n and n + 1 both
    finished (the model stopped), n - 1 was cut at the limit."""
    reason, n = ask(server, 32)
    assert reason == done and 2 <= n < 32, (reason, n)
    assert ask(server, n) == (done, n)
    assert ask(server, n + 1) == (done, n)
    assert ask(server, n - 1) == (cut, n - 1)


# ---- the access log ---------------------------------------------------------------------
def test_access_log_lines(server: ServerProcess) -> None:
    """One line per request: client, method and path, status, latency, request id;
    a refusal's reason is logged with the same id."""
    with server.client() as c:
        ok = c.get("/v1/models", headers={"X-Request-Id": "clients-ok-1"})
        bad = c.post("/v1/chat/completions", json={"messages": []},
                     headers={"X-Request-Id": "clients-bad-1"})
        missing = c.get("/no/such/route?x=1", headers={"X-Request-Id": "clients-404-1"})
        fresh = c.get("/health")
    assert (ok.status_code, bad.status_code, missing.status_code) == (200, 400, 404)
    assert ok.headers["x-request-id"] == "clients-ok-1"
    assert re.fullmatch(r"req-[0-9a-f]{24}", fresh.headers["x-request-id"])
    line = r'127\.0\.0\.1:\d+ - "{} {} HTTP/1\.1" {} \d+\.\d ms {}$'
    assert wait_for_log(server, line.format("GET", "/v1/models", "200 OK", "clients-ok-1"))
    assert wait_for_log(server, line.format("POST", "/v1/chat/completions", "400 Bad Request",
                                            "clients-bad-1"))
    assert wait_for_log(server, line.format("GET", r"/no/such/route\?x=1", "404 Not Found",
                                            "clients-404-1"))
    (reason,) = wait_for_log(server, r"request clients-bad-1 refused with 400")
    assert "(param messages)" in reason
    assert wait_for_log(server, r"request clients-404-1 refused with 404: Not Found")
