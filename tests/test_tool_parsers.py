"""Tool-call and reasoning parsers on outputs written after each family's
published format: whole and partial calls, several calls, content before
them, broken markup and unknown functions (content, never an error), and
streaming: for any chunking, the deltas add up to the non-streamed parse."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from radixlm.server.chat_output import OutputParser, OutputStream
from radixlm.server.function_call import PARSERS, detect_parser, make_parser
from radixlm.server.function_call.json_prefix import JsonPrefix, json_value_end
from radixlm.server.reasoning import REASONING_PARSERS

TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "get_time")]
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
UTC = ("get_time", {"zone": "UTC"})

# parser -> [(output, expected content, expected calls)]
WELL_FORMED: dict[str, list[tuple[str, str, list[tuple[str, dict[str, Any]]]]]] = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}\n</tool_call>', "", [PARIS]),
        ('Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
         '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
         '{"zone": "UTC"}}\n</tool_call>', "Let me look.", [PARIS, UTC]),
        # another key order: read once the object is whole
        ('<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>', "", [UTC]),
    ],
    "qwen25": [
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}\n</tool_call>', "", [UTC, PARIS]),
    ],
    "llama3": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "",
         [PARIS]),
        ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": '
         '"get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [UTC, PARIS]),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
         '"celsius"}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]', "", [PARIS, UTC]),
        ('Sure.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]', "Sure.",
         [UTC]),
    ],
    "deepseekv3": [
        ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
         '```json\n{"city": "Paris", "unit": "celsius"}\n```<｜tool▁call▁end｜>\n'
         "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
         '{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "", [PARIS, UTC]),
        ("I will check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
         'get_time\n```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
         "I will check.", [UTC]),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="celsius"), get_time(zone="UTC")]', "", [PARIS, UTC]),
        ('<|python_start|>[get_time(zone="UTC")]<|python_end|>', "", [UTC]),
    ],
}
CASES = [(name, *case) for name, cases in WELL_FORMED.items() for case in cases]

# Output that holds no readable call: all of it is content.
NOT_CALLS = {
    "hermes": ["<tool_call>not json</tool_call>",
               '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
               "I use <tool_call> tags sometimes", "<tool_call>{\"name\": \"get_wea"],
    "qwen25": ['<tool_call>{"name": 5}</tool_call>'],
    "llama3": ['{"answer": 42}', "{not json at all", '{"name": "nope", "parameters": {}}'],
    "mistral": ["[TOOL_CALLS] oops", '[TOOL_CALLS] [{"name": "nope", "arguments": {}}]'],
    "deepseekv3": ["<｜tool▁call▁begin｜>function<｜tool▁sep｜>nope\n```json\n{}\n```"
                   "<｜tool▁call▁end｜>",
                   "<｜tool▁call▁begin｜>get_weather(Paris)<｜tool▁call▁end｜>"],
    "pythonic": ["[1, 2, 3] are numbers", '[get_weather(city=open("x"))]', "[rm(x=1)]",
                 "[get_weather(city="],
}
NOT_CALL_CASES = [(name, text) for name, texts in NOT_CALLS.items() for text in texts]


def parse(name: str, text: str) -> tuple[str, list[tuple[str, Any]]]:
    p = make_parser(name, TOOLS).parse(text, final=True)
    return p.content, [(c.name, json.loads(c.arguments)) for c in p.calls]


def stream(parser: OutputParser, text: str, sizes: list[int]) -> tuple[str, str, list[Any]]:
    """Reassemble (reasoning, content, [(name, arguments)]) from streamed deltas."""
    s, deltas, i = OutputStream(parser), [], 0
    for size in sizes:
        if i >= len(text):
            break
        deltas += s.feed(text[i:i + size])
        i += size
    deltas += s.feed(text[i:]) + s.finish()
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] not in calls and tc["function"]["arguments"] == ""
                assert tc["id"].startswith("call_")
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                calls[tc["index"]][1] += tc["function"]["arguments"]
    assert all(len(d) == 1 for d in deltas)
    return ("".join(d.get("reasoning_content", "") for d in deltas),
            "".join(d.get("content", "") for d in deltas), [tuple(c) for c in calls.values()])


def chunkings(text: str) -> list[list[int]]:
    rng = random.Random(len(text))
    return [[1] * len(text), [3] * len(text), [len(text)],
            *[[rng.randint(1, 9) for _ in text] for _ in range(5)]]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_well_formed(name: str, text: str, content: str, calls: list[Any]) -> None:
    assert parse(name, text) == (content, calls)


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_equals_whole(name: str, text: str, content: str, calls: list[Any]) -> None:
    whole = make_parser(name, TOOLS).parse(text, final=True)
    expected = ("", whole.content, [(c.name, c.arguments) for c in whole.calls])
    for sizes in chunkings(text):
        assert stream(OutputParser(make_parser(name, TOOLS)), text, sizes) == expected


@pytest.mark.parametrize("name,text", NOT_CALL_CASES)
def test_not_a_call_is_content(name: str, text: str) -> None:
    assert parse(name, text) == (text, [])
    for sizes in chunkings(text):
        assert stream(OutputParser(make_parser(name, TOOLS)), text, sizes) == ("", text, [])


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_every_prefix(name: str, text: str, content: str, calls: list[Any]) -> None:
    """Cut short anywhere (a token limit): never an error, arguments always a
    prefix of JSON, and each prefix's parse a prefix of the next one's."""
    parser = make_parser(name, TOOLS)
    last = parser.parse("", final=False)
    for i in range(1, len(text) + 1):
        now = parser.parse(text[:i], final=False)
        assert now.content.startswith(last.content)
        assert len(now.calls) >= len(last.calls)
        for a, b in zip(last.calls, now.calls):
            assert a.name == b.name and b.arguments.startswith(a.arguments)
        for c in now.calls:
            p = JsonPrefix()
            assert p.feed(c.arguments) == len(c.arguments) and not p.failed
            assert c.complete == p.done
        parser.parse(text[:i], final=True)  # a cut-short output parses too
        last = now


def test_broken_arguments_stop_where_json_stops() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": UTC}}</tool_call> bye'
    p = make_parser("hermes", TOOLS).parse(text, final=True)
    assert [(c.name, c.arguments, c.complete) for c in p.calls] == \
        [("get_time", '{"zone": ', False)]
    assert p.content == 'UTC}} bye'


def test_missing_closing_brace_still_a_call() -> None:
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}\n</tool_call>'
    assert parse("hermes", text) == ("", [UTC])


def test_arguments_as_a_json_string() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>'
    assert parse("hermes", text) == ("", [UTC])


def test_plain_text_untouched() -> None:
    text = "  The weather is nice.\n\n"
    for name in PARSERS:
        assert parse(name, text) == (text, [])
        assert stream(OutputParser(make_parser(name, TOOLS)), text, [1] * 40) == ("", text, [])


def test_pythonic_never_evaluates() -> None:
    for text in ['[get_weather(city=__import__("os").getcwd())]', "[get_weather(**{'a': 1})]",
                 "[get_weather(city={1, 2})]", "[get_weather('Paris')]"]:
        assert parse("pythonic", text) == (text, [])


@pytest.mark.parametrize("template,expected", [
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n<tool_call>{{ tools }}</tool_call>"
     "{% endfor %}", "qwen25"),
    ("<tool_call>\n{{ tool }}\n</tool_call>", "hermes"),
    ("{{ '<|python_tag|>' }}{{ '<|eot_id|>' }}", "llama3"),
    ("[TOOL_CALLS] {{ tool_calls|tojson }}", "mistral"),
    ("<｜tool▁calls▁begin｜>{{ x }}", "deepseekv3"),
    ("[func_name1(params_name1=params_value1)] <|python_tag|>", "pythonic"),
    ("{{ messages }}", None), (None, None),
    ("<tool_call> [TOOL_CALLS]", None),  # two formats: ambiguous, none chosen
])
def test_detect_from_template(template: str | None, expected: str | None) -> None:
    assert detect_parser(template) == expected


def test_json_prefix() -> None:
    doc = '{"a": [1, -2.5e3, true, null, "x\\u00e9\\""], "b": {}}'
    assert json_value_end(doc + " tail") == len(doc)
    for i in range(len(doc)):
        p = JsonPrefix()
        assert p.feed(doc[:i]) == i and not p.failed and not p.done
    for bad, valid in [("{a}", 1), ('{"a" 1}', 5), ("[1,]", 3), ('{"a":01}', 6), ("tru e", 3)]:
        p = JsonPrefix()
        assert p.feed(bad) == valid and p.failed


# ---- reasoning -------------------------------------------------------------------------
REASONING = [
    ("qwen3", "<think>\nLet me think.\n</think>\n\nParis.", "\nLet me think.\n", "Paris."),
    ("qwen3", "Paris.", "", "Paris."),  # enable_thinking off: no tags at all
    ("qwen3", "<think>cut short", "cut short", ""),
    ("deepseek-r1", "Let me think.</think>Paris.", "Let me think.", "Paris."),
    ("deepseek-r1", "<think>Hmm.</think>\n\nParis.", "Hmm.", "Paris."),
    ("deepseek-r1", "still thinking", "still thinking", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning(name: str, text: str, reasoning: str, content: str) -> None:
    parser = OutputParser(reasoning=REASONING_PARSERS[name])
    whole = parser.parse(text, final=True)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    for sizes in chunkings(text):
        assert stream(parser, text, sizes) == (reasoning, content, [])


def test_reasoning_then_tool_call() -> None:
    text = ('<think>The user wants the time.</think>\n<tool_call>\n{"name": "get_time", '
            '"arguments": {"zone": "UTC"}}\n</tool_call>')
    parser = OutputParser(make_parser("qwen25", TOOLS), REASONING_PARSERS["qwen3"])
    message = parser.message(text)
    assert message["reasoning_content"] == "The user wants the time."
    assert message["content"] is None
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    for sizes in chunkings(text):
        assert stream(parser, text, sizes) == ("The user wants the time.", "",
                                               [("get_time", '{"zone": "UTC"}')])
