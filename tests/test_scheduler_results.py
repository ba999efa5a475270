"""Result processing takes any number of tokens per request and step.

A scripted model worker returns each request's predetermined tokens, either one
per step (as a plain decode does) or alternately 1 and 3 (as a speculative
verify step may), while a long prompt prefills in chunks beside them (0 tokens):
one step carries 0, 1 and 3 tokens for different requests. Stop strings (one
split across the three tokens of a step, one that ends inside a step),
max_new_tokens, EOS, a grammar, logprobs (output, top-k and prompt) and
streaming must come out exactly the same, text included, and the KV accounting
must hold throughout.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixlm.cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixlm.config import ServerArgs
from radixlm.protocol import GenerateReq, TokenOut
from radixlm.runtime.detokenize import Detokenizer
from radixlm.scheduler.control import RuntimeControls
from radixlm.scheduler.model_worker import BatchResult, PendingResult, WorkerLimits
from radixlm.scheduler.schedule_batch import ScheduleBatch
from radixlm.scheduler.scheduler import Scheduler
from radixlm.tokenizer import get_tokenizer

TEXT = " The quick brown fox jumps over the lazy dog and runs far away into the woods."


class ScriptedWorker:
    """Stands in for ModelWorker (the `Worker` protocol): request `rid` produces
    `scripts[rid]`, `sizes` tokens at a time (cycling, counted per request from its
    first sampling step), from the output index the batch was launched for
    (`ScheduleBatch.first_out`), as the device's token table would."""

    def __init__(self, scripts: dict[str, list[int]], sizes: list[int], vocab_size: int,
                 overlap: bool = False, device: str = "cpu") -> None:
        self.scripts = scripts
        self.sizes = sizes
        self.steps: dict[str, int] = {}
        self.device = torch.device(device)
        self.tp_sync = None
        self.supports_overlap = overlap
        self.req_to_token_pool = ReqToTokenPool(8, 256, device)
        self.kv_pool = MHATokenToKVPool(1024, torch.float32, 1, 1, 1, device)
        self.limits = WorkerLimits(max_total_tokens=1024, max_running_requests=8,
                                   context_len=256, vocab_size=vocab_size, hidden_size=1)
        self.vocab_size = vocab_size
        self.step_sizes: list[set[int]] = []  # per forward: the token counts it returned
        self.stale_results = 0  # the scheduler's count, after a run

    def runtime_controls(self) -> RuntimeControls:
        runner = SimpleNamespace(model=torch.nn.Linear(1, 1), config=None, device=self.device)
        return RuntimeControls.for_runner(runner, None)

    def forward(self, batch: ScheduleBatch) -> PendingResult:
        tokens, lps, tops, prompt, prompt_top = [], [], [], [], []
        for i, req in enumerate(batch.reqs):
            new: list[int] = []
            if batch.sample[i]:
                step = self.steps.get(req.rid, 0)
                self.steps[req.rid] = step + 1
                k = self.sizes[step % len(self.sizes)]
                pos = batch.first_out(i)
                new = self.scripts[req.rid][pos:pos + k]
                assert new, "a sampling request gets at least one token"
            tokens.append(new)
            first = batch.first_out(i)
            lps.append([-0.01 * (first + j + 1) for j in range(len(new))])
            tops.append([[[-0.01 * (first + j + 1), t], [-5.0, (t + 1) % self.vocab_size]]
                         [:req.top_logprobs_num] for j, t in enumerate(new)])
            span = batch.prompt_logprobs[i]
            if span is None:
                prompt.append(None)
                prompt_top.append(None)
            else:
                lo, hi = span
                fill = req.fill_ids
                prompt.append([[-0.1 * (p + 1), fill[p + 1]] for p in range(lo, hi)])
                prompt_top.append([[[-0.1 * (p + 1), fill[p + 1]]] for p in range(lo, hi)])
        self.step_sizes.append({len(t) for t in tokens})
        return PendingResult.done(batch, BatchResult(tokens, lps, tops, prompt, prompt_top))


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    return get_tokenizer(model_dir)


def _requests(tok: Any) -> tuple[list[GenerateReq], dict[str, list[int]]]:
    text = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode([t]) for t in text]
    # With sizes [1, 3] the 3-token steps carry output positions 1-3, 5-7, 9-11.
    split3 = pieces[5][1:] + pieces[6] + pieces[7][:2]  # begins in 5, ends in 7
    ends_in_6 = pieces[5][-2:] + pieces[6][:2]  # ends inside the step: 7 is dropped
    digits = tok.encode("1234", add_special_tokens=False)
    eos = tok.eos_token_id
    prompt = tok.encode("Write something:", add_special_tokens=False)
    specs = {
        "stop3": ({"max_new_tokens": 30, "stop": [split3]}, text),
        "stop2": ({"max_new_tokens": 30, "stop": [ends_in_6]}, text),
        "maxlen": ({"max_new_tokens": 6}, text),
        "eos": ({"max_new_tokens": 30}, text[:8] + [eos] + text[8:]),
        "grammar": ({"max_new_tokens": 12, "regex": "[0-9]{4}"}, digits + [eos] + text),
        "logprobs": ({"max_new_tokens": 10}, text),
        "long": ({"max_new_tokens": 10}, text),  # a long prompt, prefilled in chunks
    }
    long_prompt = tok.encode(TEXT * 3, add_special_tokens=False)
    reqs = []
    for rid, (params, _) in specs.items():
        lp = rid == "logprobs"
        reqs.append(GenerateReq(rid=rid, input_ids=long_prompt if rid == "long" else prompt,
                                sampling_params=params, stream=True,
                                return_logprob=lp, top_logprobs_num=2 if lp else 0,
                                logprob_start_len=0 if lp else -1))
    return reqs, {rid: script for rid, (_, script) in specs.items()}


def _run(tok: Any, sizes: list[int], overlap: bool = False, device: str = "cpu"
         ) -> tuple[dict[str, list[TokenOut]], ScriptedWorker]:
    reqs, scripts = _requests(tok)
    worker = ScriptedWorker(scripts, sizes, len(tok), overlap, device)
    args = ServerArgs(device=device, enable_mixed_chunk=True, chunked_prefill_size=8)
    sched = Scheduler(args, "", SimpleNamespace(eos_token_id=tok.eos_token_id), tok,
                      worker=worker)
    outs: dict[str, list[TokenOut]] = {r.rid: [] for r in reqs}
    sched.add_request(reqs[0])
    outs[reqs[0].rid] += sched.step()  # decoding before the others arrive: they mix in
    for r in reqs[1:]:
        sched.add_request(r)
    deadline = time.monotonic() + 120  # the grammar compiles on a thread meanwhile
    while sched.has_work:
        assert time.monotonic() < deadline
        for out in sched.step():
            outs[out.rid].append(out)
        sched.check_invariants()
    assert not sched.has_work and not sched.reqs
    sched.check_invariants()
    assert worker.kv_pool.available_size() + sched.cache.total_size() == 1024
    worker.stale_results = sched.stats.num_stale_results
    return outs, worker


def _summary(tok: Any, msgs: list[TokenOut]) -> dict[str, Any]:
    detok = Detokenizer(tok)
    text = "".join(s.new_text for s in detok.process(msgs))
    return {
        "ids": [t for m in msgs for t in m.new_token_ids],
        "text": text,
        "finish": msgs[-1].finish_reason,
        "logprobs": [x for m in msgs for x in (m.output_logprobs or [])],
        "top": [x for m in msgs for x in (m.output_top_logprobs or [])],
        "prompt": next((m.input_logprobs for m in msgs if m.input_logprobs), None),
        "prompt_top": next((m.input_top_logprobs for m in msgs if m.input_top_logprobs), None),
        "finished_once": sum(m.finish_reason is not None for m in msgs) == 1,
    }


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_multi_token_steps_match_one_token_steps(tokenizer: Any, overlap: bool,
                                                 device: str = "cpu") -> None:
    """With overlap the scheduler launches each step before it reads the previous
    one, so a step after a 3-token step was launched for one token: its result is
    stale and dropped, and the outputs must still be the same. (tests/gpu runs it
    with the pools on CUDA.)"""
    single, _ = _run(tokenizer, [1], device=device)
    multi, worker = _run(tokenizer, [1, 3], overlap, device)
    assert {0, 1, 3} in worker.step_sizes  # one step: a chunk, a decode, a 3-token step
    # Overlap launched steps on state a 3-token step then outdated (their tokens dropped).
    assert (worker.stale_results > 0) == overlap
    for rid in single:
        a, b = _summary(tokenizer, single[rid]), _summary(tokenizer, multi[rid])
        assert a == b, rid
        assert a["finished_once"]
    s = {rid: _summary(tokenizer, single[rid]) for rid in single}
    assert s["stop3"]["finish"]["type"] == "stop" and len(s["stop3"]["ids"]) == 8
    assert s["stop2"]["finish"]["type"] == "stop" and len(s["stop2"]["ids"]) == 7
    assert s["maxlen"]["finish"] == {"type": "length", "length": 6}
    assert len(s["eos"]["ids"]) == 9 and s["eos"]["finish"]["type"] == "stop"
    assert s["grammar"]["text"] == "1234"
    assert len(s["logprobs"]["logprobs"]) == 10 and len(s["logprobs"]["top"][0]) == 2
    assert s["logprobs"]["prompt"][0][0] is None  # the first prompt token has no context
    # Streaming: the multi-token run sends several tokens in one message.
    assert any(len(m.new_token_ids) > 1 for msgs in multi.values() for m in msgs)
