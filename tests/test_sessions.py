"""Sessions (SGLang's open_session / session_params / close_session): a request
continues an earlier one's context without the client re-sending it, reusing
its KV through the radix cache. Offline Engine, the scheduler directly, and
the real server over HTTP."""

from __future__ import annotations

from typing import Any

import pytest
from hf_reference import EXACT
from server_utils import ServerProcess, default_server

import radixlm
from radixlm.protocol import GenerateReq

pytestmark = pytest.mark.timeout(900)

GREEDY = {"max_new_tokens": 10, "temperature": 0.0}
QUESTIONS = ["What is the capital of France?", "And of Germany?", "Which one is larger?"]


@pytest.fixture(scope="module")
def engine():
    with radixlm.Engine(**EXACT, max_total_tokens=4096, num_threads=1) as e:
        yield e


def turn_ids(tok: Any, question: str, first: bool) -> list[int]:
    """A chat turn's new tokens: the whole template for the first, else what
    follows the previous assistant answer (which ends at <|im_end|>)."""
    if first:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": question}],
                                                  add_generation_prompt=True, tokenize=False))
    return tok.encode(f"<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
                      f"<|im_start|>assistant\n")


def run_turns(e: radixlm.Engine, sid: str) -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Three session turns; returns the results and each turn's full context."""
    outs, contexts, context, prev = [], [], [], None
    for i, q in enumerate(QUESTIONS):
        ids = turn_ids(e.tokenizer, q, i == 0)
        sp = {"id": sid} if prev is None else {"id": sid, "rid": prev["meta_info"]["id"]}
        out = e.generate(input_ids=ids, sampling_params=GREEDY, session_params=sp)
        context = context + ids
        contexts.append(context)
        context = context + out["output_ids"]
        outs.append(out)
        prev = out
    return outs, contexts


def test_three_turns_equal_full_context_and_reuse_kv(engine):
    sid = engine.open_session(capacity_of_str_len=1000)
    outs, contexts = run_turns(engine, sid)
    for out, ctx in zip(outs, contexts, strict=True):
        assert out["meta_info"]["prompt_tokens"] == len(ctx)
    assert outs[0]["meta_info"]["cached_tokens"] == 0
    for i in (1, 2):  # everything the previous turn computed is reused
        prev = outs[i - 1]["meta_info"]
        assert outs[i]["meta_info"]["cached_tokens"] >= \
            prev["prompt_tokens"] + prev["completion_tokens"] - 1
    engine.close_session(sid)
    engine.scheduler.check_invariants()
    for out, ctx in zip(outs, contexts, strict=True):  # the same contexts, sent whole
        assert engine.flush_cache()[0]
        full = engine.generate(input_ids=ctx, sampling_params=GREEDY)
        assert full["meta_info"]["cached_tokens"] == 0
        assert full["output_ids"] == out["output_ids"]
    engine.scheduler.check_invariants()


def test_continuation_without_radix_cache_recomputes(engine):
    sid = engine.open_session(0)
    cached, _ = run_turns(engine, sid)
    with radixlm.Engine(**EXACT, max_total_tokens=2048, num_threads=1,
                        disable_radix_cache=True) as e:
        sid2 = e.open_session(0, session_id="mine")
        assert sid2 == "mine"
        plain, _ = run_turns(e, sid2)
        assert [o["output_ids"] for o in plain] == [o["output_ids"] for o in cached]
        assert all(o["meta_info"]["cached_tokens"] == 0 for o in plain)
        e.scheduler.check_invariants()
    engine.close_session(sid)


def test_offset_drop_and_replace(engine):
    tok = engine.tokenizer
    sid = engine.open_session(0)
    a_ids = turn_ids(tok, QUESTIONS[0], True)
    a = engine.generate(input_ids=a_ids, sampling_params=GREEDY, session_params={"id": sid})
    new = tok.encode("Hello")
    cut = engine.generate(input_ids=new, sampling_params=GREEDY,
                          session_params={"id": sid, "rid": a["meta_info"]["id"], "offset": 3})
    assert cut["meta_info"]["prompt_tokens"] == 3 + len(new)
    dropped = engine.generate(input_ids=new, sampling_params=GREEDY, session_params={
        "id": sid, "rid": a["meta_info"]["id"], "drop_previous_output": True})
    assert dropped["meta_info"]["prompt_tokens"] == len(a_ids) + len(new)
    # b continues a, c continues b; then b2 replaces everything below a.
    b = engine.generate(input_ids=new, sampling_params=GREEDY,
                        session_params={"id": sid, "rid": a["meta_info"]["id"]})
    c = engine.generate(input_ids=new, sampling_params=GREEDY,
                        session_params={"id": sid, "rid": b["meta_info"]["id"]})
    b2 = engine.generate(input_ids=new, sampling_params=GREEDY, session_params={
        "id": sid, "rid": a["meta_info"]["id"], "replace": True})
    assert b2["output_ids"] == b["output_ids"]
    for gone in (b, c, cut):
        with pytest.raises(ValueError, match="is not part of session"):
            engine.generate(input_ids=new, sampling_params=GREEDY,
                            session_params={"id": sid, "rid": gone["meta_info"]["id"]})
    engine.generate(input_ids=new, sampling_params=GREEDY,
                    session_params={"id": sid, "rid": b2["meta_info"]["id"]})
    # replace without rid: the whole history goes.
    engine.generate(input_ids=a_ids, sampling_params=GREEDY,
                    session_params={"id": sid, "replace": True})
    with pytest.raises(ValueError, match="is not part of session"):
        engine.generate(input_ids=new, sampling_params=GREEDY,
                        session_params={"id": sid, "rid": a["meta_info"]["id"]})
    engine.close_session(sid)
    engine.scheduler.check_invariants()


def drain(scheduler) -> dict[str, Any]:
    """Step until idle; the finish message of every request that ended."""
    finished = {}
    while scheduler.has_work:
        for out in scheduler.step():
            if out.finish_reason is not None:
                finished[out.rid] = out
    return finished


def test_unfinished_request_is_refused_or_replaced(engine):
    s = engine.scheduler
    sid = engine.open_session(0)
    ids = turn_ids(engine.tokenizer, QUESTIONS[0], True)
    long = {**GREEDY, "max_new_tokens": 30, "ignore_eos": True}
    s.add_request(GenerateReq(rid="live", input_ids=ids, sampling_params=_wire(long),
                              session_params={"id": sid}))
    s.step()
    s.step()  # "live" is decoding
    cont = GenerateReq(rid="next", input_ids=[28], sampling_params=_wire(GREEDY),
                       session_params={"id": sid, "rid": "live"})
    with pytest.raises(ValueError, match="has not finished"):
        s.add_request(cont)
    cont.session_params = {"id": sid, "rid": "live", "replace": True}
    s.add_request(cont)
    done = drain(s)
    assert done["live"].finish_reason["type"] == "abort"
    assert 0 < done["live"].completion_tokens < 30
    # "next" ran on live's prompt + the output it had when it was replaced.
    assert done["next"].prompt_tokens == len(ids) + done["live"].completion_tokens + 1
    s.check_invariants()
    engine.close_session(sid)


def _wire(sp: dict[str, Any]) -> dict[str, Any]:
    from radixlm.sampling_params import SamplingParams

    return SamplingParams.from_dict(sp).to_dict()


@pytest.mark.parametrize("params,match", [
    ({"id": "nope"}, "is not open"),
    ({"id": "SID", "rid": "unknown-rid"}, "is not part of session"),
    ({"id": "SID", "rid": "FIRST", "offset": 10_000}, "offset"),
    ({"id": "SID", "rid": "FIRST", "offset": "x"}, "offset must be an integer"),
    ({"id": "SID", "rid": 5}, "rid must be"),
    ({"id": 7}, "session_params.id"),
    ({"id": "SID", "rid": "FIRST", "replace": "yes"}, "replace must be a boolean"),
])
def test_bad_session_requests_are_refused(engine, params, match):
    sid = engine.open_session(0)
    first = engine.generate("Hi", GREEDY, session_params={"id": sid})
    subst = {"SID": sid, "FIRST": first["meta_info"]["id"]}
    params = {k: subst.get(v, v) if isinstance(v, str) else v for k, v in params.items()}
    with pytest.raises(ValueError, match=match):
        engine.generate("again", GREEDY, session_params=params)
    assert not engine.scheduler.reqs
    engine.scheduler.check_invariants()
    engine.close_session(sid)


def test_capacity_close_and_open_errors(engine):
    sid = engine.open_session(capacity_of_str_len=40)
    first = engine.generate("Hi", GREEDY, session_params={"id": sid})
    with pytest.raises(ValueError, match="capacity_of_str_len of 40"):
        engine.generate(input_ids=[28] * 39, sampling_params=GREEDY,
                        session_params={"id": sid, "rid": first["meta_info"]["id"]})
    with pytest.raises(ValueError, match="already open"):
        engine.open_session(10, session_id=sid)
    with pytest.raises(ValueError, match="capacity_of_str_len must be"):
        engine.open_session(-1)
    engine.close_session(sid)
    with pytest.raises(ValueError, match="is not open"):
        engine.close_session(sid)
    with pytest.raises(ValueError, match="is not open"):  # closed
        engine.generate("again", GREEDY,
                        session_params={"id": sid, "rid": first["meta_info"]["id"]})
    # A batch with one refused request fails whole and leaves nothing running.
    sid = engine.open_session(0)
    with pytest.raises(ValueError, match="is not open"):
        engine.generate(["a", "b"], GREEDY, session_params=[{"id": sid}, {"id": "closed"}])
    assert not engine.scheduler.reqs
    assert engine.generate("Hi", GREEDY)["meta_info"]["finish_reason"] is not None
    engine.scheduler.check_invariants()
    engine.close_session(sid)


def test_closing_a_session_with_a_running_request(engine):
    s = engine.scheduler
    sid = engine.open_session(0)
    s.add_request(GenerateReq(rid="running", input_ids=[28, 29, 30],
                              sampling_params=_wire({**GREEDY, "ignore_eos": True}),
                              session_params={"id": sid}))
    s.step()
    engine.close_session(sid)  # the request runs on; its KV is released as usual
    done = drain(s)
    assert done["running"].finish_reason["type"] == "length"
    s.check_invariants()
    assert s.worker.kv_pool.available_size() + s.cache.total_size() == s.max_total_tokens


# ---- over HTTP ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> ServerProcess:
    return default_server()


def test_http_sessions(server: ServerProcess):
    with server.client() as c:
        sid = c.post("/open_session", json={"capacity_of_str_len": 100}).json()
        assert isinstance(sid, str) and sid
        first = c.post("/generate", json={"text": "The capital of France is",
                                          "sampling_params": GREEDY,
                                          "session_params": {"id": sid}}).json()
        second = c.post("/generate", json={
            "text": " The capital of Italy is", "sampling_params": GREEDY,
            "session_params": {"id": sid, "rid": first["meta_info"]["id"]}}).json()
        meta = second["meta_info"]
        assert meta["cached_tokens"] >= first["meta_info"]["prompt_tokens"]
        context = c.post("/tokenize", json={"text": "The capital of France is"}).json()["tokens"]
        context += first["output_ids"]
        context += c.post("/tokenize", json={"text": " The capital of Italy is"}).json()["tokens"]
        assert meta["prompt_tokens"] == len(context)
        full = c.post("/generate", json={"input_ids": context, "sampling_params": GREEDY})
        assert full.json()["output_ids"] == second["output_ids"]

        def refused(body: dict[str, Any], path: str = "/generate") -> str:
            r = c.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "BadRequestError" and err["code"] == 400
            return err["message"]

        again = {"text": "x", "sampling_params": GREEDY}
        assert "is not open" in refused({**again, "session_params": {"id": "unknown"}})
        assert "is not part of session" in refused(
            {**again, "session_params": {"id": sid, "rid": "unknown"}})
        assert "capacity" in refused({"input_ids": [28] * 150, "sampling_params": GREEDY,
                                      "session_params": {"id": sid,
                                                         "rid": first["meta_info"]["id"]}})
        assert "already open" in refused({"capacity_of_str_len": 5, "session_id": sid},
                                         "/open_session")
        assert c.post("/close_session", json={"session_id": sid}).status_code == 200
        assert "is not open" in refused({"session_id": sid}, "/close_session")
        assert "is not open" in refused(
            {**again, "session_params": {"id": sid, "rid": first["meta_info"]["id"]}})
        stream = c.post("/generate", json={**again, "stream": True,
                                           "session_params": {"id": sid}})
        assert stream.status_code == 400
        r = c.post("/open_session", json={"capacity_of_str_len": "many"})
        assert r.status_code == 400
    assert server.wait_idle()["kv_tokens_in_use"] == 0
