"""End-to-end engine behaviour on the embedded SmolLM2 model (CPU, fp32)."""

from __future__ import annotations

import hf_reference
import pytest
import torch
from hf_reference import EXACT

import radixlm

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "Explain why the sky is blue in one sentence.",
    "The quick brown fox",
    "In 1969, Neil Armstrong",
    "Translate to French: good morning, my friend. ->",
]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def prompt_ids(engine_default) -> list[list[int]]:
    tok = engine_default.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True) for p in PROMPTS[:4]]
    return [tok.encode(p) for p in PROMPTS[4:] + chats]


@pytest.fixture(scope="module")
def hf_greedy(hf_model, prompt_ids) -> list[list[int]]:
    return hf_reference.hf_greedy(hf_model, prompt_ids, NEW_TOKENS)


@pytest.fixture(scope="module")
def engine_default():
    with radixlm.Engine(**EXACT, max_total_tokens=8192) as e:
        yield e


def _ours(engine, prompt_ids, together: bool) -> list[list[int]]:
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}
    if together:
        return [o["output_ids"] for o in engine.generate(input_ids=prompt_ids, sampling_params=sp)]
    return [engine.generate(input_ids=ids, sampling_params=sp)["output_ids"] for ids in prompt_ids]


@pytest.mark.parametrize("together", [True, False])
def test_greedy_matches_hf(engine_default, prompt_ids, hf_greedy, together):
    ours = _ours(engine_default, prompt_ids, together)
    for o, h in zip(ours, hf_greedy):
        assert o == h[:len(o)]  # we stop at EOS where HF pads: compare up to our length
    engine_default.scheduler.check_invariants()


@pytest.mark.parametrize("kwargs,modes", [
    ({"disable_radix_cache": True}, (True, False)),
    ({"chunked_prefill_size": 16}, (True, False)),
    ({"chunked_prefill_size": 16, "disable_radix_cache": True}, (True, False)),
    ({"schedule_policy": "fcfs", "max_prefill_tokens": 64}, (True,)),
    ({"schedule_policy": "dfs-weight"}, (True,)),
])
def test_greedy_matches_hf_configs(prompt_ids, hf_greedy, kwargs, modes):
    with radixlm.Engine(**EXACT, max_total_tokens=8192, **kwargs) as e:
        for together in modes:
            ours = _ours(e, prompt_ids, together)
            for o, h in zip(ours, hf_greedy):
                assert o == h[:len(o)]
            e.scheduler.check_invariants()


def test_radix_cache_reports_cached_tokens(engine_default):
    prefix = "You are a careful assistant. " * 20
    sp = {"max_new_tokens": 8, "temperature": 0}
    first = engine_default.generate(prefix + "Question one?", sp)
    second = engine_default.generate(prefix + "Question one?", sp)
    assert second["meta_info"]["cached_tokens"] > 0.9 * first["meta_info"]["prompt_tokens"]
    assert second["output_ids"] == first["output_ids"]
    third = engine_default.generate(prefix + "Another question entirely?", sp)
    assert third["meta_info"]["cached_tokens"] >= 100
    engine_default.scheduler.check_invariants()


def test_retraction_completes_with_same_outputs(prompt_ids, hf_greedy):
    # 8 requests that need ~8 x 90 tokens in a pool of 400: decode runs out of
    # memory and must retract and resume requests.
    with radixlm.Engine(**EXACT, max_total_tokens=400, chunked_prefill_size=64) as e:
        ours = _ours(e, prompt_ids, together=True)
        assert e.scheduler.stats.num_retractions > 0
        for o, h in zip(ours, hf_greedy):
            assert o == h[:len(o)]
        e.scheduler.check_invariants()
        assert e.scheduler.kv.kv_pool.available_size() + e.scheduler.cache.total_size() == 400


def test_seeded_sampling_reproducible_across_batches(engine_default):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 1234}
    alone = engine_default.generate("Write a poem about the sea.", sp)["output_ids"]
    batch = engine_default.generate(
        ["Hello there", "Write a poem about the sea.", "Count to ten:"],
        [{"max_new_tokens": 16, "temperature": 0.7}, sp, {"max_new_tokens": 5}])
    assert batch[1]["output_ids"] == alone
    other = engine_default.generate("Write a poem about the sea.", {**sp, "seed": 99})
    assert other["output_ids"] != alone


def test_n_samples_share_prefill(engine_default):
    out = engine_default.generate("Name a fruit:", {"max_new_tokens": 8, "temperature": 1.0,
                                                    "n": 4, "seed": 7})
    assert [o["index"] for o in out] == [0, 1, 2, 3]
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in out)
    assert len({tuple(o["output_ids"]) for o in out}) > 1


def test_stop_strings_and_tokens(engine_default):
    base = engine_default.generate("1, 2, 3, 4, 5,", {"max_new_tokens": 20, "temperature": 0})
    text = base["text"]
    assert "7" in text
    out = engine_default.generate("1, 2, 3, 4, 5,", {"max_new_tokens": 20, "temperature": 0,
                                                     "stop": "7"})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "7"}
    assert out["text"] == text[:text.index("7")]
    kept = engine_default.generate("1, 2, 3, 4, 5,", {"max_new_tokens": 20, "temperature": 0,
                                                      "stop": "7", "no_stop_trim": True})
    assert kept["text"].endswith("7")
    tid = base["output_ids"][3]
    out = engine_default.generate("1, 2, 3, 4, 5,", {"max_new_tokens": 20, "temperature": 0,
                                                     "stop_token_ids": [tid]})
    assert out["output_ids"][-1] == tid and out["meta_info"]["finish_reason"]["matched"] == tid


def test_streaming_equals_non_streaming(engine_default):
    sp = {"max_new_tokens": 24, "temperature": 0}
    full = engine_default.generate("Tell me about Paris.", sp)
    chunks = list(engine_default.generate("Tell me about Paris.", sp, stream=True))
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] is not None


def test_stream_interval_batches_streamed_tokens():
    """--stream-interval 5: the first token at once, then five at a time, the rest
    with the finish; the same tokens and text as without streaming."""
    sp = {"max_new_tokens": 23, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(**EXACT, max_total_tokens=4096, stream_interval=5) as e:
        full = e.generate("Tell me about Paris.", sp)
        chunks = list(e.generate("Tell me about Paris.", sp, stream=True))
    assert [len(c["output_ids"]) for c in chunks] == [1, 5, 5, 5, 5, 2]
    assert sum((c["output_ids"] for c in chunks), []) == full["output_ids"]
    assert "".join(c["text"] for c in chunks) == full["text"]
    with pytest.raises(ValueError, match="stream_interval"):
        radixlm.Engine(stream_interval=0)


def test_full_batch_skips_ordering_the_queue(monkeypatch):
    """With max_running_requests running, decode steps must not order (for lpm:
    radix-match) the waiting queue: that work scaled with the queue every step."""
    import radixlm.scheduler.prefill as prefill

    calls = []
    real = prefill.order_waiting
    monkeypatch.setattr(prefill, "order_waiting", lambda *a: calls.append(1) or real(*a))
    sp = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with radixlm.Engine(**EXACT, max_total_tokens=4096, max_running_requests=2,
                        schedule_policy="lpm") as e:
        outs = e.generate([f"Count to {i}:" for i in range(6)], sp)
    assert all(len(o["output_ids"]) == 8 for o in outs)
    # Three waves of two: about one ordering per wave, not one per decode step (~24).
    assert len(calls) <= 6, len(calls)


def test_stream_abandoned_frees_kv(engine_default):
    gen = engine_default.generate("Tell me a long story.", {"max_new_tokens": 64}, stream=True)
    next(gen)
    gen.close()
    engine_default.scheduler.check_invariants()
    assert not engine_default.scheduler.reqs


def test_logprobs(engine_default, hf_model):
    ids = engine_default.tokenizer.encode("The capital of France is")
    out = engine_default.generate(input_ids=ids, sampling_params={"max_new_tokens": 4,
                                                                 "temperature": 0},
                                  return_logprob=True, top_logprobs_num=3, logprob_start_len=0)
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4
    assert len(meta["input_token_logprobs"]) == len(ids)
    assert meta["input_token_logprobs"][0][0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids + out["output_ids"]])).logits[0], -1)
    for pos, (lp, tok) in enumerate(meta["input_token_logprobs"][1:], start=1):
        assert tok == ids[pos]
        assert abs(lp - ref[pos - 1, tok].item()) < 1e-3
    for k, (lp, tok) in enumerate(meta["output_token_logprobs"]):
        assert abs(lp - ref[len(ids) - 1 + k, tok].item()) < 1e-3
        top = meta["output_top_logprobs"][k]
        assert top[0][1] == tok  # greedy: the chosen token is the top one


def test_bf16_engine_tracks_hf(prompt_ids, hf_model):
    """The CPU bf16 path (C++ kernels, prepacked weights, scores from raw bf16 keys)
    against HF in fp32: prompt logprobs within bf16 error, and each greedy token
    HF's top choice or within a near-tie of it (bf16 may flip those)."""
    with radixlm.Engine(dtype="bfloat16", quantization="none", max_total_tokens=8192) as e:
        outs = e.generate(input_ids=prompt_ids, return_logprob=True, logprob_start_len=0,
                          sampling_params={"max_new_tokens": 12, "temperature": 0})
        e.scheduler.check_invariants()
    for ids, out in zip(prompt_ids, outs, strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([ids + out["output_ids"]])).logits[0],
                                    -1)
        got = torch.tensor([lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]])
        diff = (got - ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]).abs()
        assert diff.mean() < 0.15 and diff.max() < 0.6, (diff.mean(), diff.max())
        for k, tok in enumerate(out["output_ids"]):
            row = ref[len(ids) - 1 + k]
            assert row.max() - row[tok] < 0.25, (k, tok)


def test_abort_frees_kv(engine_default):
    s = engine_default.scheduler
    from radixlm.protocol import GenerateReq
    s.add_request(GenerateReq(rid="to-abort", input_ids=[1, 2, 3, 4],
                              sampling_params={**_sp(), "max_new_tokens": 100}))
    s.step()
    s.step()
    s.abort("to-abort")
    outs = s.step()
    assert not s.reqs
    s.check_invariants()
    final = [o for o in outs if o.rid == "to-abort"]
    assert final and final[-1].finish_reason["type"] == "abort"


def _sp() -> dict:
    from radixlm.sampling_params import SamplingParams
    return SamplingParams().to_dict()


@pytest.mark.parametrize("bad,match", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"n": 0}, "n"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"bogus": 1}, "bogus"),
])
def test_bad_sampling_params(engine_default, bad, match):
    with pytest.raises(ValueError, match=match):
        engine_default.generate("hi", bad)
    assert engine_default.generate("hi", {"max_new_tokens": 2})["output_ids"]


@pytest.mark.parametrize("bad", [True, 1.5, "2", [0, 0]])
def test_priority_must_be_an_integer(engine_default, bad):
    with pytest.raises(ValueError, match="priority"):
        engine_default.generate("hi", {"max_new_tokens": 1}, priority=bad)


def test_priority_travels_to_the_scheduler(monkeypatch):
    with radixlm.Engine(**EXACT, enable_priority_scheduling=True) as engine:
        sent = []
        add = engine.scheduler.add_request
        monkeypatch.setattr(engine.scheduler, "add_request",
                            lambda msg: (sent.append((msg.rid, msg.priority)), add(msg))[1])
        outs = engine.generate(["a", "b"], {"max_new_tokens": 1}, rid=["pa", "pb"],
                               priority=[3, -2])
        assert [o["index"] for o in outs] == [0, 1]
        assert sent == [("pa", 3), ("pb", -2)]
        sent.clear()
        engine.generate("a", {"max_new_tokens": 1, "n": 2}, rid="pn", priority=7)
        assert [p for _, p in sent] == [7, 7, 7]  # the n > 1 warm-up keeps it too


def test_priority_needs_priority_scheduling(engine_default):
    with pytest.raises(ValueError, match="enable-priority-scheduling"):
        engine_default.generate("a", {"max_new_tokens": 1}, priority=3)
    assert not engine_default.scheduler.reqs


def test_bad_inputs(engine_default):
    with pytest.raises(ValueError, match="empty"):
        engine_default.generate(input_ids=[])
    with pytest.raises(ValueError, match="vocabulary"):
        engine_default.generate(input_ids=[1, 10**7])
    with pytest.raises(ValueError, match="input tokens|limit"):
        engine_default.generate(input_ids=[5] * 9000)
    assert engine_default.generate("hi", {"max_new_tokens": 2})["output_ids"]
    engine_default.scheduler.check_invariants()
