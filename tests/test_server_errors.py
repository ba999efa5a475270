"""Every kind of bad input gets its status and OpenAI's error shape, and the
server keeps serving: each case is followed by a normal request."""

from __future__ import annotations

from typing import Any

import pytest
from server_utils import ServerProcess, default_server

pytestmark = pytest.mark.timeout(600)

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return default_server()


def assert_error(r: Any, status: int, *, param: str | None = None,
                 contains: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err
    return err


def assert_still_serving(server: ServerProcess) -> None:
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1


COMPLETION_CASES = [
    ({"prompt": "Hi", "temperature": -1}, 400, "temperature"),
    ({"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "Hi", "n": 0}, 400, "n"),
    ({"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": "Hi", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "Hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "Hi", "logit_bias": {"999999": 1.0}}, 400, None),
    ({"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "Hi", "suffix": "x"}, 400, "suffix"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [[1, 2], []]}, 400, "prompt"),
    ({"prompt": [10 ** 9]}, 400, None),  # outside the vocabulary
    ({}, 400, "prompt"),
    ({"prompt": "Hi", "model": "gpt-5"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), COMPLETION_CASES)
def test_completion_errors(server: ServerProcess, body: dict[str, Any], status: int,
                           param: str | None) -> None:
    with server.client() as c:
        assert_error(c.post("/v1/completions", json=body), status, param=param)
    assert_still_serving(server)


def test_prompt_longer_than_the_context(server: ServerProcess) -> None:
    context = server.server_info()["context_length"]
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": [100] * (context + 10), "max_tokens": 1})
        err = assert_error(r, 400)
    assert str(context + 10) in err["message"] and str(context - 1) in err["message"]
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": [100] * 10, "max_tokens": context})
        err = assert_error(r, 400)
    assert str(context) in err["message"] and "10" in err["message"]
    assert_still_serving(server)


CHAT_CASES = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, None),
    ({"messages": CHAT, "response_format": {"type": "yaml"}}, 400, "response_format"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),
    ({"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ({"messages": CHAT, "max_completion_tokens": -5}, 400, "max_tokens"),
    ({"messages": CHAT, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize(("body", "status", "param"), CHAT_CASES)
def test_chat_errors(server: ServerProcess, body: dict[str, Any], status: int,
                     param: str | None) -> None:
    with server.client() as c:
        assert_error(c.post("/v1/chat/completions", json=body), status, param=param)
    assert_still_serving(server)


NATIVE_CASES = [
    ({"text": "Hi", "input_ids": [1]}, 400),
    ({"sampling_params": {"max_new_tokens": 1}}, 400),
    ({"text": "Hi", "sampling_params": {"bogus": 1}}, 400),
    ({"text": "Hi", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}, 400),
    ({"text": ["a", "b"], "sampling_params": [{}]}, 400),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, 400),
    ({"input_ids": [[]]}, 400),
    ({"text": "Hi", "return_logprob": True, "top_logprobs_num": 1000}, 400),
]


@pytest.mark.parametrize(("body", "status"), NATIVE_CASES)
def test_native_errors(server: ServerProcess, body: dict[str, Any], status: int) -> None:
    with server.client() as c:
        assert_error(c.post("/generate", json=body), status)
    assert_still_serving(server)


def test_transport_level_errors(server: ServerProcess) -> None:
    with server.client() as c:
        json_header = {"content-type": "application/json"}
        assert_error(c.post("/v1/completions", content=b"{not json", headers=json_header),
                     400, contains="JSON")
        assert_error(c.post("/v1/completions", content=b"[1, 2]", headers=json_header), 400)
        big = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
        assert_error(c.post("/v1/completions", content=big, headers=json_header), 413)
        assert_error(c.get("/no/such/route"), 404)
        assert_error(c.get("/v1/models/nope"), 404, param="model")
        assert_error(c.post("/abort_request", json={"rid": "never-seen"}), 404)
        assert_error(c.post("/detokenize", json={"tokens": [-1]}), 400)
    assert_still_serving(server)


def test_streaming_error_comes_back_as_status(server: ServerProcess) -> None:
    """Validation runs before the stream starts: a bad streamed request is a 400."""
    body = {"prompt": "Hi", "stream": True, "temperature": -2}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        r.read()
        assert_error(r, 400, param="temperature")
    assert_still_serving(server)
