"""Server pieces that need no model: error mapping, the HTTP guard, the
scheduler process loop (with a stand-in scheduler), output accumulation and
OpenAI logprob formatting."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
import zmq
from fastapi import FastAPI

from radixlm.config import ServerArgs
from radixlm.protocol import (
    AbortReq,
    ControlReq,
    GenerateReq,
    StrOut,
    TokenOut,
    decode_to_detokenizer,
    decode_to_tokenizer,
    encode,
)
from radixlm.scheduler.control import RuntimeControls, SchedulerControl
from radixlm.server.errors import APIError, from_value_error
from radixlm.server.http_server import GuardMiddleware
from radixlm.server.io import SeqOutput, sse
from radixlm.server.ipc import IpcPaths, pull_socket, push_socket
from radixlm.server.launch import served_model_name
from radixlm.server.openai_api import OpenAIServing, finish_reason, stop_reason
from radixlm.server.scheduler_process import SchedulerLoop
from radixlm.server.tokenizer_manager import SAMPLING_NAMES


# ---- errors --------------------------------------------------------------------------
def test_value_error_names_the_openai_parameter() -> None:
    err = from_value_error(ValueError("max_new_tokens must be >= 0, got -1"), SAMPLING_NAMES)
    assert err.status == 400 and err.param == "max_tokens"
    assert err.message.startswith("max_tokens must be")
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["code"] == 400


def test_unrelated_first_word_is_no_param() -> None:
    err = from_value_error(ValueError("the prompt is empty"), SAMPLING_NAMES)
    assert err.param is None and err.message == "the prompt is empty"


# ---- the guard -----------------------------------------------------------------------
def _guarded_app(api_key: str | None, max_body: int = 100) -> httpx.AsyncClient:
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: dict[str, Any]) -> dict[str, Any]:
        return body

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"ok": "yes"}

    guarded = GuardMiddleware(app, api_key, max_body)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://t")


def test_guard_checks_the_api_key() -> None:
    async def run() -> None:
        async with _guarded_app("s3cret") as c:
            assert (await c.get("/health")).status_code == 200  # open without the key
            r = await c.post("/echo", json={"a": 1})
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
            r = await c.post("/echo", json={"a": 1}, headers={"Authorization": "Bearer nope"})
            assert r.status_code == 401
            r = await c.post("/echo", json={"a": 1}, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200 and r.json() == {"a": 1}

    asyncio.run(run())


def test_guard_limits_the_body_size() -> None:
    async def chunks() -> Any:
        for _ in range(10):
            yield b"x" * 20

    async def run() -> None:
        async with _guarded_app(None, max_body=100) as c:
            assert (await c.post("/echo", json={"a": "b" * 200})).status_code == 413
            r = await c.post("/echo", content=chunks())  # no content-length: counted
            assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
            assert (await c.post("/echo", json={"a": 1})).status_code == 200

    asyncio.run(run())


# ---- the scheduler process loop ------------------------------------------------------
class FakeScheduler:
    """Stands in for Scheduler: refuses prompts containing token 0. Its control
    calls go through the real control component (the allow-list)."""

    max_running_requests = 0  # everything queues

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.pending: list[TokenOut] = []
        self.invariant_checks = 0
        self.args = ServerArgs()
        runner = SimpleNamespace(model=torch.nn.Linear(1, 1), config=None,
                                 device=torch.device("cpu"))
        self.worker = SimpleNamespace(
            runtime_controls=lambda: RuntimeControls.for_runner(runner, None))
        self.controls = SchedulerControl(self)

    def control(self, method: str, **args: Any) -> Any:
        return self.controls.call(method, **args)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.pending)

    def add_request(self, msg: GenerateReq) -> None:
        if 0 in msg.input_ids:
            raise ValueError("input token id 0 is not allowed here")
        self.waiting.append(msg.rid)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        for r in list(self.waiting):
            if abort_all or r == rid:
                self.waiting.remove(r)
                self.pending.append(TokenOut(r, [], {"type": "abort"}, 1, 0, 0))

    def step(self) -> list[TokenOut]:
        out = self.pending
        self.pending = []
        return out

    def server_info(self) -> dict[str, Any]:
        return {"num_queued_requests": len(self.waiting)}

    def flush_cache(self) -> tuple[bool, str]:
        return (not self.waiting), "flushed" if not self.waiting else "busy"

    def check_invariants(self) -> None:
        self.invariant_checks += 1


@pytest.fixture()
def loop_and_peers() -> Any:
    paths = IpcPaths.create()
    ctx = zmq.Context()
    detok = pull_socket(ctx, paths.detokenizer)
    tok = pull_socket(ctx, paths.tokenizer)
    fake = FakeScheduler()
    loop = SchedulerLoop(fake, ServerArgs(max_queued_requests=2, stats_interval=0), paths, 0)
    send = push_socket(ctx, paths.scheduler)
    yield loop, fake, send, detok, tok
    loop.ctx.destroy(linger=0)
    ctx.destroy(linger=0)
    paths.cleanup()


def _pump(loop: SchedulerLoop, sock: zmq.Socket) -> Any:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        loop.run_once()
        if sock.poll(50):
            return sock.recv()
    raise TimeoutError("no message")


def test_loop_replies_400_for_a_refused_request(loop_and_peers: Any) -> None:
    loop, fake, send, detok, _ = loop_and_peers
    send.send(encode(GenerateReq("bad", [5, 0], {})))
    out = decode_to_detokenizer(_pump(loop, detok)).outputs[0]
    assert out.rid == "bad" and out.finish_reason["status_code"] == 400
    assert "token id 0" in out.finish_reason["message"]
    send.send(encode(GenerateReq("good", [5], {})))  # the loop is still serving
    _pump_until(loop, lambda: fake.waiting == ["good"])


def _pump_until(loop: SchedulerLoop, cond: Any) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline
        loop.run_once()


def test_loop_refuses_beyond_the_queue_limit(loop_and_peers: Any) -> None:
    loop, fake, send, detok, _ = loop_and_peers
    for i in range(3):
        send.send(encode(GenerateReq(f"r{i}", [5], {})))
    out = decode_to_detokenizer(_pump(loop, detok)).outputs[0]
    assert out.rid == "r2" and out.finish_reason["status_code"] == 503
    send.send(encode(AbortReq(abort_all=True)))
    outs = decode_to_detokenizer(_pump(loop, detok)).outputs
    assert {o.rid for o in outs} == {"r0", "r1"}
    assert fake.invariant_checks == 0  # not in the way of the outputs
    _pump_until(loop, lambda: fake.invariant_checks >= 1)  # checked once idle a while


def test_the_idle_check_waits_for_a_quiet_moment(loop_and_peers: Any) -> None:
    loop, fake, send, detok, _ = loop_and_peers
    send.send(encode(GenerateReq("a", [5], {})))
    _pump_until(loop, lambda: fake.waiting == ["a"])
    send.send(encode(AbortReq(abort_all=True)))
    _pump(loop, detok)  # idle now: the check is due
    send.send(encode(GenerateReq("b", [5], {})))  # ... but a request comes first
    _pump_until(loop, lambda: fake.waiting == ["b"])
    assert fake.invariant_checks == 0
    send.send(encode(AbortReq(abort_all=True)))
    _pump(loop, detok)
    _pump_until(loop, lambda: fake.invariant_checks == 1)


def test_loop_control_allow_list(loop_and_peers: Any) -> None:
    loop, _, send, _, tok = loop_and_peers
    send.send(encode(ControlReq(1, "get_server_info")))
    reply = decode_to_tokenizer(_pump(loop, tok))
    assert reply.success and reply.result == {"num_queued_requests": 0}
    send.send(encode(ControlReq(2, "__init__")))
    reply = decode_to_tokenizer(_pump(loop, tok))
    assert not reply.success and "unknown control method" in reply.message
    send.send(encode(ControlReq(3, "flush_cache")))
    assert decode_to_tokenizer(_pump(loop, tok)).result == {"success": True,
                                                            "message": "flushed"}


def test_loop_survives_garbage(loop_and_peers: Any) -> None:
    loop, fake, send, _, _ = loop_and_peers
    send.send(b"\x93not msgpack of ours")
    send.send(encode(GenerateReq("ok", [5], {})))
    _pump_until(loop, lambda: fake.waiting == ["ok"])


# ---- outputs -------------------------------------------------------------------------
def _out(rid: str, ids: list[int], text: str, finish: dict[str, Any] | None = None,
         lps: list[list[Any]] | None = None) -> StrOut:
    return StrOut(TokenOut(rid, ids, finish, 3, 0, 0, output_logprobs=lps), text)


def test_seq_output_accumulates() -> None:
    seq = SeqOutput("r", 2, return_logprob=True)
    seq.update(_out("r", [7], "a", lps=[[-0.5, 7]]))
    seq.update(_out("r", [8], "b", {"type": "length", "length": 2}, lps=[[float("-inf"), 8]]))
    d = seq.native()
    assert d["text"] == "ab" and d["output_ids"] == [7, 8] and d["index"] == 2
    assert d["meta_info"]["completion_tokens"] == 0  # taken from the messages as sent
    assert d["meta_info"]["output_token_logprobs"] == [[-0.5, 7], [-9999.0, 8]]
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'


def test_finish_reason_mapping() -> None:
    assert finish_reason(None) is None
    assert finish_reason({"type": "stop", "matched": 2}) == "stop"
    assert finish_reason({"type": "length", "length": 4}) == "length"
    assert finish_reason({"type": "abort", "message": "x"}) == "abort"
    assert stop_reason({"type": "stop", "matched": "\n"}) == "\n"
    assert stop_reason({"type": "stop", "matched": 2}) is None


class _Tok:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_completion_logprobs_list_the_sampled_token() -> None:
    api = OpenAIServing(tm=None, tokenizer=_Tok(), served_name="m", model_path=None)  # type: ignore[arg-type]
    lp, end = api.completion_logprobs([[None, 1], [-1.0, 2]], [[], [[-0.1, 3]]], 1, 0)
    assert lp["tokens"] == ["<1>", "<2>"] and lp["token_logprobs"] == [None, -1.0]
    assert lp["top_logprobs"] == [None, {"<3>": -0.1, "<2>": -1.0}]
    assert lp["text_offset"] == [0, 3] and end == 6


def test_served_model_name() -> None:
    assert served_model_name(ServerArgs()) == "SmolLM2-135M-Instruct"
    assert served_model_name(ServerArgs(model_path="/m/Llama-3-8B/")) == "Llama-3-8B"
    assert served_model_name(ServerArgs(model_path="/m/x.Q4.gguf")) == "x.Q4"
    assert served_model_name(ServerArgs(served_model_name="n")) == "n"


def test_tokenize_runs_off_the_event_loop() -> None:
    """Prompt encoding runs on the TokenizerManager's one tokenizer thread, so the
    event loop keeps streaming while a long prompt is encoded; errors come back."""
    import threading

    from radixlm.server.tokenizer_manager import TokenizerManager

    async def main() -> None:
        paths = IpcPaths.create()
        tm = TokenizerManager(ServerArgs(), tokenizer=None, paths=paths)
        try:
            loop_thread = threading.current_thread().name
            ticks = 0

            async def ticker() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.005)

            def slow_encode(n: int) -> tuple[str, int]:
                time.sleep(0.2)  # a long prompt: the loop must keep running meanwhile
                return threading.current_thread().name, n

            task = asyncio.get_running_loop().create_task(ticker())
            name, n = await tm.tokenize(slow_encode, 7)
            task.cancel()
            assert n == 7 and name != loop_thread and name.startswith("radixlm-tokenize")
            assert ticks >= 10

            def bad() -> None:
                raise APIError(400, "prompt is empty", "prompt")

            with pytest.raises(APIError, match="prompt is empty"):
                await tm.tokenize(bad)
        finally:
            tm.close()
            paths.cleanup()

    asyncio.run(main())


def test_sse_backlog_goes_out_in_one_write() -> None:
    """A stream that fell behind writes its queued chunks together; one that keeps
    up writes each as it comes. Either way the client reads the same events."""
    from radixlm.server.io import SSE_DONE
    from radixlm.server.openai_api import _sse_body

    def render(idx: int, out: StrOut) -> list[dict[str, Any]]:
        return [{"i": idx, "t": out.new_text}]

    async def body(backlog: bool) -> list[bytes]:
        queue: asyncio.Queue[tuple[int, StrOut]] = asyncio.Queue()
        for text in "bcd":
            queue.put_nowait((0, _out("r", [1], text)))

        async def events() -> Any:
            while not queue.empty():
                yield await queue.get()

        # A stream keeping up sees an empty queue after every message.
        caught_up = queue.empty if backlog else (lambda: True)
        gen = _sse_body(events(), (0, _out("r", [1], "a")), render,
                        lambda: [{"end": 1}], caught_up)
        return [w async for w in gen]

    events = b"".join(sse({"i": 0, "t": t}) for t in "abcd") + sse({"end": 1}) + SSE_DONE
    behind = asyncio.run(body(backlog=True))
    assert b"".join(behind) == events and len(behind) == 2  # the first at once, then the rest
    keeping_up = asyncio.run(body(backlog=False))
    assert b"".join(keeping_up) == events and len(keeping_up) == 5
