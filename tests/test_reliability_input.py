"""Bad input (issue 9, scenario 5): nothing a client sends gets a 5xx or
takes the server down.

- Property test: hypothesis builds request bodies from the pydantic request
  models themselves (every field, right types and wrong ones, edge numbers,
  NaN, nested junk, unknown keys) for /v1/completions, /v1/chat/completions
  and /generate. Every answer is a success or a 4xx in OpenAI's error shape;
  no traceback appears in the server's log; the server still serves.
- Hand-written cases the error tests (test_server_errors.py) do not cover
  yet, each followed by a normal request.

Generation lengths are drawn from a small set (never the default "fill the
context"), so the property tests stay cheap on two cores.
"""

from __future__ import annotations

import json
import math
import types
import typing
from collections import Counter
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from server_utils import ServerProcess, default_server

from radixlm.sampling_params import SamplingParams
from radixlm.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)

pytestmark = pytest.mark.timeout(900)

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Hi"}]
JSON_HEADER = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return default_server()


class LogWatch:
    """The part of the server log written since it was created."""

    def __init__(self, server: ServerProcess) -> None:
        self.server, self.start = server, len(server.log())

    def assert_clean(self) -> None:
        new = self.server.log()[self.start:]
        assert "Traceback" not in new and "Exception in ASGI" not in new, new[-4000:]


def assert_still_serving(server: ServerProcess) -> None:
    assert server.proc.poll() is None, "the server exited"
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1


def check_answer(r: httpx.Response, body: Any) -> None:
    """A success, or a 4xx in OpenAI's error shape with a message."""
    assert r.status_code < 500, (r.status_code, r.text[:500], body)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert err["code"] == r.status_code and err["message"], err
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-500:]


# ---- strategies from the request models ---------------------------------------------------
# A body is a valid, cheap request plus a few mutations, each setting one field
# of the model (every field, nested ones too) to a value of its type, an edge
# value, or junk. Random whole bodies almost always stop at the first field
# pydantic checks; mutations of a valid one reach every later check and the
# generation itself.
EDGE_INTS = [0, -1, 2 ** 31, 2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30, -(10 ** 30)]
EDGE_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -0.0, 5e-324]
JSON_LEAF = (st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from(EDGE_INTS)
             | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
JSON_ANY = st.recursive(
    JSON_LEAF, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
        st.text(max_size=6), kids, max_size=3), max_leaves=8)
# Generation lengths come from here: never unset (that fills the context).
LENGTHS = st.sampled_from([0, 1, 2, 3, -1, 10 ** 6, 10 ** 30, "2", 2.5])
SPECIAL = {
    "max_tokens": LENGTHS, "max_completion_tokens": LENGTHS, "max_new_tokens": LENGTHS,
    "n": st.sampled_from([1, 2, 3, 0, -1, 129, 10 ** 30, 2.0, "2"]),
    "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"])
    | st.text(max_size=8),
}
# Names of real chat-template arguments, so chat_template_kwargs hits something.
TEMPLATE_KWARGS = ["tokenize", "return_dict", "add_generation_prompt", "continue_final_message",
                   "tools", "documents", "messages", "conversation", "padding", "truncation",
                   "max_length", "return_tensors", "chat_template"]


def of_type(tp: Any) -> st.SearchStrategy[Any]:
    """Values of (roughly) the annotated type, edge values included."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([of_type(a) for a in args])
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(of_type(args[0]), max_size=3)
    if origin is dict:
        keys = st.text(max_size=6) | st.integers(0, 60000).map(str) | st.sampled_from(
            TEMPLATE_KWARGS)
        return st.dictionaries(keys, of_type(args[1]), max_size=3)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return mutated(tp, {})
    simple = {type(None): st.none(), bool: st.booleans(),
              int: st.integers(-3, 8) | st.sampled_from(EDGE_INTS),
              float: st.floats(-3, 3) | st.sampled_from(EDGE_FLOATS),
              str: st.text(max_size=12)}
    return simple.get(tp, JSON_ANY)


def field_values(name: str, tp: Any) -> st.SearchStrategy[Any]:
    if name in SPECIAL:
        return SPECIAL[name]
    typed = of_type(tp)
    return st.one_of(typed, typed, typed, JSON_ANY)  # mostly the right type


def mutated(schema: Any, base: dict[str, Any], keep: str | None = None, max_changes: int = 3
            ) -> st.SearchStrategy[dict[str, Any]]:
    """`base` with up to `max_changes` fields of `schema` (a pydantic model or a
    dataclass) set to drawn values, or removed (except `keep`: without it the
    default length applies, up to the whole context), maybe an unknown key."""
    hints = typing.get_type_hints(schema)
    names = sorted(schema.model_fields if isinstance(schema, type) and issubclass(
        schema, BaseModel) else schema.__dataclass_fields__)
    required = {n for n in names if issubclass(schema, BaseModel)
                and schema.model_fields[n].is_required()}
    names += ["frobnicate"]  # unknown to every model
    hints["frobnicate"] = Any
    change = st.sampled_from(names).flatmap(lambda n: st.tuples(
        st.just(n), st.just(DELETE) if n in required and n not in base else
        field_values(n, hints[n]) if n == keep else field_values(n, hints[n]) | st.just(DELETE)))

    def apply(changes: list[tuple[str, Any]]) -> dict[str, Any]:
        body = dict(base)
        for name, value in changes:
            if value is DELETE:
                body.pop(name, None)
            else:
                body[name] = value
        return body

    return st.lists(change, max_size=max_changes).map(apply)


DELETE = object()
NATIVE_SP = mutated(SamplingParams, {"max_new_tokens": 2}, keep="max_new_tokens")
SPECIAL["sampling_params"] = NATIVE_SP | st.lists(NATIVE_SP, max_size=2) | JSON_ANY.filter(
    lambda v: v not in (None, {}))  # those mean the default: 128 tokens
ENDPOINTS = {
    "/v1/completions": mutated(CompletionRequest, {"model": MODEL, "prompt": "Hi",
                                                   "max_tokens": 2}, keep="max_tokens"),
    "/v1/chat/completions": mutated(ChatCompletionRequest, {"messages": CHAT, "max_tokens": 2},
                                    keep="max_tokens"),
    "/generate": mutated(GenerateRequest, {"text": "Hi", "sampling_params": {
        "max_new_tokens": 2}}, keep="sampling_params"),
}
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_fuzzed_bodies_get_no_5xx(server: ServerProcess, path: str, capsys: Any) -> None:
    watch = LogWatch(server)
    statuses: Counter[int] = Counter()
    with server.client() as c:
        @FUZZ
        @given(body=ENDPOINTS[path])
        def one(body: dict[str, Any]) -> None:
            # json.dumps, not httpx's json=: NaN and Infinity go out as JSON's
            # common extension, which Python's parser (the server's) accepts.
            r = c.post(path, content=json.dumps(body).encode(), headers=JSON_HEADER)
            statuses[r.status_code] += 1
            check_answer(r, body)
            assert server.proc.poll() is None, "the server exited"

        one()
    with capsys.disabled():
        print(f"\n[fuzz] {path}: {sum(statuses.values())} bodies, {dict(statuses)} by status")
    watch.assert_clean()
    assert_still_serving(server)
    info = server.wait_idle()
    assert info["kv_tokens_in_use"] == 0


# ---- hand-written cases ---------------------------------------------------------------------
def raw(content: bytes) -> dict[str, Any]:
    return {"content": content, "headers": JSON_HEADER}


DEEP = b"[" * 100_000 + b"]" * 100_000
# (name, path, request kwargs, status, text the message must contain)
HAND_CASES = [
    ("empty body", "/v1/completions", raw(b""), 400, "empty"),
    ("JSON null", "/v1/chat/completions", raw(b"null"), 400, "JSON object"),
    ("no content type", "/v1/completions",
     {"content": b'{"prompt": "Hi", "max_tokens": 1}'}, 400, "Content-Type"),
    ("prompt is an object", "/v1/completions", {"json": {"prompt": {"a": 1}}}, 400, "prompt"),
    ("messages is a string", "/v1/chat/completions", {"json": {"messages": "Hi"}}, 400,
     "messages"),
    ("content is a number", "/v1/chat/completions",
     {"json": {"messages": [{"role": "user", "content": 5}]}}, 400, "content"),
    ("stream is a word", "/v1/completions", {"json": {"prompt": "Hi", "stream": "please"}}, 400,
     "stream"),
    ("stop is a number", "/v1/completions", {"json": {"prompt": "Hi", "stop": 7}}, 400, "stop"),
    ("n huge", "/v1/completions", {"json": {"prompt": "Hi", "n": 10 ** 30}}, 400, "n"),
    ("n huge, chat", "/v1/chat/completions", {"json": {"messages": CHAT, "n": 10 ** 30}}, 400,
     "n"),
    ("n just over", "/v1/chat/completions", {"json": {"messages": CHAT, "n": 129}}, 400, "128"),
    ("n huge, native", "/generate",
     {"json": {"text": "Hi", "sampling_params": {"n": 10 ** 30}}}, 400, "n must be"),
    ("max_tokens huge", "/v1/completions", {"json": {"prompt": "Hi", "max_tokens": 10 ** 30}},
     400, "max_new_tokens"),
    ("max_tokens huge, chat", "/v1/chat/completions",
     {"json": {"messages": CHAT, "max_tokens": 10 ** 12}}, 400, "limit"),
    ("max_new_tokens huge, native", "/generate",
     {"json": {"text": "Hi", "sampling_params": {"max_new_tokens": 10 ** 30}}}, 400, "limit"),
    ("logprobs negative", "/v1/completions",
     {"json": {"prompt": "Hi", "max_tokens": 1, "logprobs": -1}}, 400, "logprobs"),
    ("top_logprobs negative", "/v1/chat/completions",
     {"json": {"messages": CHAT, "logprobs": True, "top_logprobs": -1}}, 400, "top_logprobs"),
    ("top_logprobs_num negative, native", "/generate",
     {"json": {"text": "Hi", "return_logprob": True, "top_logprobs_num": -1}}, 400,
     "top_logprobs_num"),
    ("seed beyond 64 bits", "/v1/completions",
     {"json": {"prompt": "Hi", "max_tokens": 1, "seed": 10 ** 30}}, 400, "out of range"),
    ("top_k beyond 64 bits", "/v1/chat/completions",
     {"json": {"messages": CHAT, "max_tokens": 1, "top_k": 10 ** 30}}, 400, "out of range"),
    ("temperature NaN", "/v1/completions",
     raw(b'{"prompt": "Hi", "max_tokens": 1, "temperature": NaN}'), 400, "temperature"),
    ("logit_bias Infinity", "/v1/completions",
     raw(b'{"prompt": "Hi", "max_tokens": 1, "logit_bias": {"5": Infinity}}'), 400,
     "logit_bias"),
    ("invalid UTF-8", "/v1/completions", raw(b'{"prompt": "\xff\xfe", "max_tokens": 1}'), 400,
     "UTF-8"),
    ("invalid UTF-8, chat", "/v1/chat/completions",
     raw(b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}'), 400, "UTF-8"),
    ("deeply nested JSON", "/v1/completions", raw(b'{"prompt": "Hi", "x": ' + DEEP + b"}"), 400,
     "nested"),
    ("deeply nested JSON, native", "/generate", raw(b'{"text": "Hi", "sampling_params": '
                                                    + DEEP + b"}"), 400, "nested"),
    ("chat template kwargs clash", "/v1/chat/completions",
     {"json": {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}}, 400, "template"),
]


@pytest.mark.parametrize(("name", "path", "kwargs", "status", "needle"), HAND_CASES,
                         ids=[c[0] for c in HAND_CASES])
def test_bad_input_gets_a_useful_4xx(server: ServerProcess, name: str, path: str,
                                     kwargs: dict[str, Any], status: int, needle: str) -> None:
    watch = LogWatch(server)
    with server.client() as c:
        r = c.post(path, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and needle in err["message"] + str(err["param"]), err
    watch.assert_clean()
    assert_still_serving(server)


def test_ten_megabyte_body_without_length_is_413(server: ServerProcess) -> None:
    """test_server_errors covers a declared Content-Length; a chunked upload is
    cut off by counting, without buffering all of it."""
    def chunks() -> Any:
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"x" * (1 << 20)
        yield b'"}'

    with server.client() as c:
        r = c.post("/v1/completions", content=chunks(), headers=JSON_HEADER)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    assert_still_serving(server)


UNKNOWN_FIELDS = [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "frobnicate": {"a": [1, 2]},
                         "service_tier": "flex"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "x_note": 1}],
                              "max_tokens": 2, "parallel_tool_calls": False, "store": True}),
    ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2},
                   "lora_path": None, "x_priority": 3}),
]


@pytest.mark.parametrize(("path", "body"), UNKNOWN_FIELDS, ids=[p for p, _ in UNKNOWN_FIELDS])
def test_unknown_fields_are_ignored(server: ServerProcess, path: str,
                                    body: dict[str, Any]) -> None:
    """As vLLM does: clients written for newer API versions keep working."""
    with server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    tokens = out["usage"]["completion_tokens"] if "usage" in out else \
        out["meta_info"]["completion_tokens"]
    assert tokens <= 2
