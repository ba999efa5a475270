"""The real server (subprocess, ZMQ, three processes) through the `openai`
client and raw HTTP: OpenAI and native APIs, streaming contracts, aborts,
disconnects, observability. One server is shared by the whole module.

Token counts stay small: the test machine has two cores."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import openai
import pytest
from hf_reference import EXACT
from server_utils import ServerProcess, default_server

pytestmark = pytest.mark.timeout(600)

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return default_server()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai()


def sse_events(lines: Any) -> list[Any]:
    """Parsed `data:` payloads; the literal [DONE] stays a string."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def token_count(server: ServerProcess, text: str) -> int:
    with server.client() as c:
        return c.post("/tokenize", json={"text": text}).json()["count"]


# ---- models and info -----------------------------------------------------------------
def test_models_and_model_info(server: ServerProcess, client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert client.models.retrieve("SmolLM2-135M-Instruct").id == "SmolLM2-135M-Instruct"
    with server.client() as c:
        info = c.get("/get_model_info").json()
        assert info["is_generation"] and info["context_length"] > 0
        assert c.get("/health").status_code == 200
        assert c.get("/health_generate").status_code == 200


def test_server_info_reports_kv_state(server: ServerProcess) -> None:
    info = server.wait_idle()
    for key in ("kv_tokens_total", "kv_tokens_free", "kv_tokens_cached", "kv_tokens_in_use",
                "num_running_requests", "num_queued_requests"):
        assert isinstance(info[key], int), key
    assert info["kv_tokens_in_use"] == 0
    assert info["kv_tokens_free"] + info["kv_tokens_cached"] == info["kv_tokens_total"]
    assert 0.0 <= info["cache_hit_rate"] <= 1.0
    assert info["server_args"]["max_total_tokens"] == 8192


# ---- completions ---------------------------------------------------------------------
def test_completion_usage_is_exact(server: ServerProcess, client: openai.OpenAI) -> None:
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6,
                                  extra_body={"ignore_eos": True}, **GREEDY)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.prompt_tokens == token_count(server, PROMPT)
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=6, **GREEDY)
    chunks = list(client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_prompt_forms_and_n(server: ServerProcess, client: openai.OpenAI) -> None:
    ids = server.client().post("/tokenize", json={"text": PROMPT}).json()["tokens"]
    by_text = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                        max_tokens=3, **GREEDY)
    by_ids = client.completions.create(model="SmolLM2-135M-Instruct", prompt=[ids, ids],
                                       max_tokens=2, n=2, **GREEDY)
    assert [c.index for c in by_ids.choices] == [0, 1, 2, 3]
    assert all(by_text.choices[0].text.startswith(c.text) for c in by_ids.choices)
    assert by_ids.usage.prompt_tokens == 2 * len(ids)  # each prompt once, not per sample
    assert by_ids.usage.completion_tokens == 2 * 4


def test_completion_logprobs_and_echo(server: ServerProcess, client: openai.OpenAI) -> None:
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=3,
                                  logprobs=2, echo=True, **GREEDY)
    c = r.choices[0]
    assert c.text.startswith(PROMPT)
    lp = c.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    # Greedy: each generated token is the most likely one.
    for tok, top in zip(lp.tokens[n_prompt:], lp.top_logprobs[n_prompt:], strict=True):
        assert max(top, key=top.get) == tok
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                            max_tokens=3, logprobs=2, echo=True, stream=True,
                                            **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert [t for ch in chunks for t in ch.choices[0].logprobs.tokens] == lp.tokens
    assert [o for ch in chunks for o in ch.choices[0].logprobs.text_offset] == lp.text_offset


def test_stop_strings(client: openai.OpenAI) -> None:
    base = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                     max_tokens=8, extra_body={"ignore_eos": True}, **GREEDY)
    text = base.choices[0].text
    words = text.split()
    assert len(words) >= 2, text
    stop = words[1]
    expected = text[:text.index(stop)]
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8,
                                  stop=[stop], **GREEDY)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert getattr(r.choices[0], "stop_reason", None) == stop  # a vLLM extension
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                            max_tokens=8, stop=[stop], stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == expected


# ---- chat ----------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]


def test_chat_non_stream(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES,
                                       max_tokens=5, logprobs=True, top_logprobs=2, user="u1",
                                       extra_body={"a_field_from_the_future": 1}, **GREEDY)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.choices[0].finish_reason in ("stop", "length")
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_chat_stream_contract(server: ServerProcess) -> None:
    body = {"messages": MESSAGES, "max_completion_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, **GREEDY}
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    finals = [ch for ch in chunks[:-1] if ch["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0] is chunks[-2]
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)


def test_default_max_tokens_fill_the_context(server: ServerProcess,
                                             client: openai.OpenAI) -> None:
    context = server.server_info()["context_length"]
    prompt = [100 + i % 1000 for i in range(context - 4)]
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                  max_tokens=None, extra_body={"ignore_eos": True}, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


# ---- n > 1 streaming (seed 000) ------------------------------------------------------
def test_n3_stream_each_index_finishes_once(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=4, n=3, stream=True,
        temperature=1.0, seed=7))
    indexes = {c.choices[0].index for c in chunks}
    assert indexes == {0, 1, 2}
    for i in range(3):
        mine = [c.choices[0] for c in chunks if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert sum(1 for ch in mine if ch.finish_reason) == 1 and mine[-1].finish_reason


def test_native_n3_stream_last_chunk_carries_finish(server: ServerProcess) -> None:
    body = {"text": PROMPT, "stream": True,
            "sampling_params": {"max_new_tokens": 4, "n": 3, "temperature": 1.0, "seed": 3}}
    with server.client() as c, c.stream("POST", "/generate", json=body) as r:
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    last: dict[int, dict[str, Any]] = {}
    for ev in events[:-1]:
        prev = last.get(ev["index"])
        assert prev is None or prev["meta_info"]["finish_reason"] is None
        if prev is not None:  # cumulative: each chunk extends the previous one
            assert ev["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]
        last[ev["index"]] = ev
    assert set(last) == {0, 1, 2}
    assert all(ev["meta_info"]["finish_reason"]["type"] == "length" for ev in last.values())
    assert all(len(ev["output_ids"]) == 4 for ev in last.values())


# ---- native API ----------------------------------------------------------------------
def test_native_generate_shapes(server: ServerProcess) -> None:
    with server.client() as c:
        one = c.post("/generate", json={"text": PROMPT, "rid": "native-1",
                                        "sampling_params": {"max_new_tokens": 3, **GREEDY}})
        assert one.status_code == 200
        one = one.json()
        assert one["meta_info"]["id"] == "native-1" and len(one["output_ids"]) == 3
        ids = c.post("/tokenize", json={"text": PROMPT}).json()["tokens"]
        batch = c.post("/generate", json={
            "input_ids": [ids, ids[:3]], "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 2, **GREEDY}}).json()
        assert isinstance(batch, list) and [b["index"] for b in batch] == [0, 1]
        assert batch[0]["output_ids"] == one["output_ids"][:2]
        meta = batch[0]["meta_info"]
        assert len(meta["output_token_logprobs"]) == 2
        assert len(meta["input_token_logprobs"]) == len(ids)
        assert meta["input_token_logprobs"][0][0] is None
        text = c.post("/detokenize", json={"tokens": one["output_ids"]}).json()["text"]
        assert text == one["text"]


def test_greedy_matches_offline_engine(server: ServerProcess, client: openai.OpenAI) -> None:
    import radixlm

    prompts = [PROMPT, "def fibonacci(n):"]
    served = [client.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=10,
                                        **GREEDY).choices[0].text for p in prompts]
    engine = radixlm.Engine(**EXACT, max_total_tokens=4096, num_threads=1)  # as the server's
    try:
        offline = [engine.generate(p, {"max_new_tokens": 10, "temperature": 0.0})["text"]
                   for p in prompts]
    finally:
        engine.shutdown()
    assert served == offline


# ---- load ----------------------------------------------------------------------------
def test_32_concurrent_requests_complete(server: ServerProcess) -> None:
    async def run() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0,
                                    timeout=300)
        reqs = [client.completions.create(model="SmolLM2-135M-Instruct",
                                          prompt=f"Item {i}:", max_tokens=3,
                                          extra_body={"ignore_eos": True}, **GREEDY)
                for i in range(32)]
        try:
            return await asyncio.gather(*reqs)
        finally:
            await client.close()

    results = asyncio.run(run())
    assert all(r.usage.completion_tokens == 3 for r in results)
    assert server.wait_idle()["kv_tokens_in_use"] == 0


def test_bench_serving_over_two_client_processes(server: ServerProcess, tmp_path: Any) -> None:
    """The serving benchmark with its requests dealt over two client processes:
    every request is accounted for, in order, with the server's exact usage."""
    from radixlm.bench import serving

    out = tmp_path / "serving.json"
    rc = serving.main(["--base-url", server.url, "--num-prompts", "6", "--random-input-len",
                       "8", "--random-output-len", "3", "--vocab-size", "1000",
                       "--client-processes", "2", "--warmup-requests", "0",
                       "--output-json", str(out)])
    got = json.loads(out.read_text())["results"][0]
    assert rc == 0 and got["completed"] == 6 and got["failed"] == 0
    assert got["total_input_tokens"] == 48 and got["total_output_tokens"] == 18
    assert 0 < got["duration_s"] < 120
    assert got["client_busy"] > 0  # the busiest client process's CPU share of the run
    assert server.wait_idle()["kv_tokens_in_use"] == 0


# ---- aborts and disconnects ----------------------------------------------------------
LONG = {"max_new_tokens": 200, "ignore_eos": True}  # within the 256-token context


def _wait_running(server: ServerProcess, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while server.server_info()["num_running_requests"] < n:
        assert time.monotonic() < deadline, "the requests never started"
        time.sleep(0.1)


def test_abort_by_id(server: ServerProcess) -> None:
    result: dict[str, Any] = {}

    def run() -> None:
        with server.client() as c:
            result["r"] = c.post("/generate", json={"text": PROMPT, "rid": "to-abort",
                                                    "sampling_params": LONG}).json()

    t = threading.Thread(target=run)
    t.start()
    _wait_running(server, 1)
    with server.client() as c:
        assert c.post("/abort_request", json={"rid": "to-abort"}).json()["success"]
    t.join(60)
    meta = result["r"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort"
    assert meta["completion_tokens"] < LONG["max_new_tokens"]
    info = server.wait_idle()
    assert info["kv_tokens_in_use"] == 0 and info["num_running_requests"] == 0


def test_abort_all_ends_every_stream_with_abort(server: ServerProcess) -> None:
    finals: list[Any] = []

    def stream(i: int) -> None:
        body = {"prompt": f"Story {i}:", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            events = sse_events(r.iter_lines())
        finals.append((events[-1], events[-2]["choices"][0]["finish_reason"]))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    _wait_running(server, 2)
    with server.client() as c:
        c.post("/abort_request", json={"abort_all": True}).raise_for_status()
    for t in threads:
        t.join(60)
    assert finals == [("[DONE]", "abort")] * 2
    assert server.wait_idle()["kv_tokens_in_use"] == 0


def test_flush_cache_refused_while_running(server: ServerProcess) -> None:
    t = threading.Thread(target=lambda: server.client().post(
        "/generate", json={"text": PROMPT, "rid": "busy", "sampling_params": LONG}))
    t.start()
    _wait_running(server, 1)
    with server.client() as c:
        r = c.post("/flush_cache")
        assert r.status_code == 400 and "running" in r.json()["error"]["message"]
        c.post("/abort_request", json={"rid": "busy"})
    t.join(60)
    server.wait_idle()
    with server.client() as c:
        assert c.post("/flush_cache").status_code == 200
        assert c.get("/get_server_info").json()["kv_tokens_cached"] == 0


def test_client_disconnect_mid_stream_frees_kv(server: ServerProcess) -> None:
    body = {"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 4:
                break  # leaving the block closes the connection mid-stream
    info = server.wait_idle()
    assert info["kv_tokens_in_use"] == 0 and info["num_running_requests"] == 0


def test_client_disconnect_mid_request_frees_kv(server: ServerProcess) -> None:
    import httpx

    with server.client() as c, pytest.raises(httpx.ReadTimeout):
        c.post("/generate", json={"text": PROMPT, "sampling_params": LONG}, timeout=3.0)
    info = server.wait_idle()
    assert info["kv_tokens_in_use"] == 0 and info["num_running_requests"] == 0


# ---- observability -------------------------------------------------------------------
def test_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=3,
                                   stream=True, **GREEDY))
    with server.client() as c:
        text = c.get("/metrics").text
    for name in ("radixlm:num_running_reqs", "radixlm:num_queue_reqs", "radixlm:token_usage",
                 "radixlm:cache_hit_rate", "radixlm:prompt_tokens_total",
                 "radixlm:generation_tokens_total", "radixlm:time_to_first_token_seconds_count",
                 "radixlm:inter_token_latency_seconds_count",
                 "radixlm:e2e_request_latency_seconds_count"):
        assert name in text, name
    ttft = [line for line in text.splitlines()
            if line.startswith("radixlm:time_to_first_token_seconds_count")]
    assert float(ttft[0].split()[-1]) >= 1
    assert "gen throughput" in server.log()  # the periodic stats line
