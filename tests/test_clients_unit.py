"""What tests/test_clients.py shows through the server, piece by piece and
without one: the tool prompt for templates that do not render tools (probed
once per template, merged into the system message, each parser's own format),
earlier calls written in the parser's markup, which grammars go with a forced
call, the finish order of `Req.check_finished`, and the access-log middleware
with its switch."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.req import Req
from radixlm.server.chat_output import ChatParsers
from radixlm.server.errors import APIError
from radixlm.server.function_call import PARSERS, calls_text, make_parser, tools_prompt
from radixlm.server.http_server import AccessLogMiddleware
from radixlm.server.openai_api import CHAT_GRAMMARS, OpenAIServing, check_grammars
from radixlm.server.openai_protocol import ChatCompletionRequest, ChatTool
from radixlm.server.responses_api import RESPONSES_GRAMMARS
from radixlm.server.tool_calls import plan_tools
from radixlm.server.tool_prompt import ToolPrompt

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time"}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class Template:
    """apply_chat_template of a template that renders tools or ignores them; counts calls."""

    def __init__(self, renders: bool) -> None:
        self.renders = renders
        self.calls = 0

    def __call__(self, messages: list[dict[str, Any]], tokenize: bool = False,
                 add_generation_prompt: bool = True, tools: Any = None) -> str:
        self.calls += 1
        shown = f"tools={tools}|" if tools and self.renders else ""
        return shown + "|".join(f"{m['role']}:{m['content']}" for m in messages)


# ---- the tool prompt --------------------------------------------------------------------
def test_tools_go_into_a_new_system_message(caplog: pytest.LogCaptureFixture) -> None:
    prompt, render = ToolPrompt("hermes"), Template(renders=False)
    with caplog.at_level(logging.INFO, "radixlm.server"):
        out = prompt.messages(ASK, TOOLS, "tmpl-a", render)
        again = prompt.messages(ASK, TOOLS, "tmpl-a", render)
    assert out == again and out[1:] == ASK
    assert out[0] == {"role": "system", "content": tools_prompt("hermes", TOOLS)}
    assert render.calls == 2, "one probe (with and without tools) per template"
    assert sum("does not render tools" in r.message for r in caplog.records) == 1


def test_tools_join_an_existing_system_message() -> None:
    messages = [{"role": "developer", "content": "Be brief."}, *ASK]
    out = ToolPrompt("llama3").messages(messages, TOOLS, "tmpl", Template(renders=False))
    assert out[0]["role"] == "developer" and len(out) == 2
    assert out[0]["content"] == "Be brief.\n\n" + tools_prompt("llama3", TOOLS)
    assert messages[0]["content"] == "Be brief.", "the request's messages are not changed"


def test_no_change_when_the_template_renders_tools_or_there_is_no_parser() -> None:
    render = Template(renders=True)
    assert ToolPrompt("hermes").messages(ASK, TOOLS, "t", render) == ASK
    silent = Template(renders=False)
    assert ToolPrompt(None).messages(ASK, TOOLS, "t", silent) == ASK
    assert ToolPrompt("hermes").messages(ASK, [], "t", silent) == ASK
    assert silent.calls == 0, "no tools or no parser: nothing to probe"


def test_a_template_that_fails_the_probe_is_left_alone() -> None:
    def broken(*_: Any, **__: Any) -> str:
        raise ValueError("roles must alternate")

    assert ToolPrompt("hermes").messages(ASK, TOOLS, "t", broken) == ASK


# What each parser's prompt must teach: the markup its parser reads.
FORMATS = {"hermes": ("<tools>", "<tool_call>", "</tool_call>", '"arguments"'),
           "qwen25": ("<tools>", "<tool_call>", "</tool_call>", '"arguments"'),
           "llama3": ('"parameters"', '";"'),
           "mistral": ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]", '"arguments"'),
           "deepseekv3": ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>",
                          "```json", "<｜tool▁call▁end｜>"),
           "pythonic": ("[func_name1(param1=value1",)}
# A call written as each prompt asks, which its parser must read back.
ANSWERS = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                     '</tool_call>',
           "llama3": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
           "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
           "deepseekv3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>'
                         'get_weather\n```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>'
                         '<｜tool▁calls▁end｜>',
           "pythonic": '[get_weather(city="Paris")]'}
ANSWERS["qwen25"] = ANSWERS["hermes"]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_parser_has_its_own_tools_prompt(name: str) -> None:
    text = tools_prompt(name, TOOLS)
    assert "get_weather" in text and "get_time" in text and "Weather" in text
    for markup in FORMATS[name]:
        assert markup in text, (name, markup)
    (call,) = make_parser(name, TOOLS).parse(ANSWERS[name], final=True).calls
    assert (call.name, call.arguments, call.complete) == ("get_weather", '{"city": "Paris"}',
                                                          True)


EARLIER = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "metric": True}},
           {"name": "get_time", "arguments": {}}]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_earlier_calls_are_written_as_the_parser_reads_them(name: str) -> None:
    parsed = make_parser(name, TOOLS).parse(calls_text(name, EARLIER), final=True)
    assert parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        (c["name"], c["arguments"]) for c in EARLIER]


class DropsCalls:
    """A tokenizer whose template (like SmolLM2's) ignores tools and earlier calls."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> str:
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    def encode(self, text: str, add_special_tokens: bool = False) -> str:
        return text


def test_history_shows_earlier_calls_in_the_parsers_markup() -> None:
    api = OpenAIServing(None, DropsCalls(), "m", None, ChatParsers("hermes"))  # type: ignore
    req = ChatCompletionRequest(messages=[*ASK, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}], tools=TOOLS)
    text = api.render_chat(req, _plan("auto"))
    assert text.startswith("system:" + tools_prompt("hermes", TOOLS) + "|user:Weather")
    assert text.endswith('|assistant:<tool_call>\n{"name": "get_time", "arguments": {}}\n'
                         '</tool_call>|tool:noon')


# ---- grammars with a forced call ------------------------------------------------------------
def _plan(tool_choice: Any) -> Any:
    return plan_tools([ChatTool.model_validate(t) for t in TOOLS], tool_choice, None, True)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_time"}}])
def test_a_forced_call_takes_a_response_format(tool_choice: Any) -> None:
    req = ChatCompletionRequest(messages=ASK, response_format={"type": "json_object"})
    check_grammars(req, _plan(tool_choice), CHAT_GRAMMARS)
    check_grammars(req, _plan(tool_choice), RESPONSES_GRAMMARS)


@pytest.mark.parametrize("field,value", [("regex", "a+"), ("ebnf", 'root ::= "a"'),
                                         ("json_schema", {"type": "object"})])
def test_a_forced_call_refuses_raw_grammars(field: str, value: Any) -> None:
    req = ChatCompletionRequest(messages=ASK, **{field: value})
    with pytest.raises(APIError) as err:
        check_grammars(req, _plan("required"), CHAT_GRAMMARS)
    assert err.value.param == field and "forces a tool call" in err.value.message
    check_grammars(req, _plan("auto"), CHAT_GRAMMARS)  # nothing forced: one grammar is fine


def test_two_grammars_are_refused_by_the_endpoints_names() -> None:
    req = ChatCompletionRequest(messages=ASK, response_format={"type": "json_object"}, regex="a")
    with pytest.raises(APIError) as err:
        check_grammars(req, _plan("auto"), RESPONSES_GRAMMARS)
    assert err.value.param == "regex"
    assert err.value.message == ("only one of text.format, regex, ebnf may be set, got "
                                 "text.format and regex")


# ---- finish order -------------------------------------------------------------------------------
EOS = 2


def _finish(tokens: list[int], **params: Any) -> dict[str, Any] | None:
    req = Req("r", [1], SamplingParams.from_dict(params), seed=0, eos_token_ids=frozenset({EOS}))
    for t in tokens:
        req.output_ids.append(t)
        req.check_finished(None)
        if req.finished:
            break
    return req.finished_reason


def test_a_stop_on_the_last_allowed_token_is_a_stop() -> None:
    assert _finish([5, 6, EOS], max_new_tokens=3) == {"type": "stop", "matched": EOS}
    assert _finish([5, 6, 9], max_new_tokens=3, stop_token_ids=[9]) == {"type": "stop",
                                                                      "matched": 9}
    assert _finish([5, 6, 7], max_new_tokens=3) == {"type": "length", "length": 3}
    assert _finish([5, 6, EOS], max_new_tokens=3, ignore_eos=True) == {"type": "length",
                                                                       "length": 3}
    assert _finish([5, EOS, 7], max_new_tokens=3, min_new_tokens=2) == {"type": "length",
                                                                        "length": 3}


# ---- the access log ------------------------------------------------------------------------------
async def _app_get(enabled: bool, headers: dict[str, str]) -> httpx.Response:
    async def ok(_: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = AccessLogMiddleware(Starlette(routes=[Route("/ok", ok)]), enabled=enabled)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as client:
        return await client.get("/ok?a=1", headers=headers)


@pytest.mark.parametrize("enabled", [True, False])
def test_access_log_switch(caplog: pytest.LogCaptureFixture, enabled: bool) -> None:
    import asyncio

    with caplog.at_level(logging.INFO, "radixlm.access"):
        r = asyncio.run(_app_get(enabled, {"X-Request-Id": "abc-1"}))
        odd = asyncio.run(_app_get(enabled, {"X-Request-Id": "has spaces"}))
    assert r.headers["x-request-id"] == "abc-1"
    assert odd.headers["x-request-id"].startswith("req-"), "a client id must be plain"
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "radixlm.access"]
    if not enabled:
        assert lines == []
        return
    assert len(lines) == 2
    assert lines[0].startswith('127.0.0.1:123 - "GET /ok?a=1 HTTP/1.1" 200 OK ')
    assert lines[0].endswith(" ms abc-1")
