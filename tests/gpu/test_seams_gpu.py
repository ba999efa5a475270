"""The wave-2 seams on CUDA: a verify forward's rows equal decode steps with CUDA
graphs (bf16 within tolerance, fp32 tokens exactly through the scheduler with
drafts), and multi-token steps with the overlap scheduler."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu

from gpu_models import save_random_llama  # noqa: E402

import radixlm  # noqa: E402
from radixlm.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from radixlm.protocol import GenerateReq  # noqa: E402
from radixlm.scheduler.drafter import Drafter  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("tiny-llama"))


def _forward(runner, mode: ForwardMode, reqs: list[tuple[int, list[int]]],
             kv_len: dict[int, int]) -> torch.Tensor:
    """One forward of `runner` (its pools, backend and CUDA graphs) over request rows."""
    ids, prefix, ext, locs = [], [], [], []
    for slot, new in reqs:
        loc = runner.kv_pool.alloc(len(new))
        pre = kv_len[slot]
        runner.req_to_token_pool.req_to_token[slot, pre:pre + len(new)] = loc.cuda().int()
        kv_len[slot] = pre + len(new)
        ids += new
        prefix.append(pre)
        ext.append(len(new))
        locs.append(loc)
    fb = ForwardBatch.build(mode, ids, [s for s, _ in reqs], prefix, ext, torch.cat(locs),
                            runner.req_to_token_pool, runner.kv_pool, runner.attn_backend,
                            runner.device)
    return runner.forward(fb).clone()


@pytest.mark.parametrize("k", [1, 3, 7])
def test_verify_rows_equal_decode_steps_in_graphs(model_dir, k):
    with radixlm.Engine(model_dir, dtype="bfloat16", skip_tokenizer_init=True,
                        max_total_tokens=8192) as e:
        runner = e.scheduler.worker.runner
        assert runner.graph_runner is not None and runner.graph_runner.use_graphs
        g = torch.Generator().manual_seed(k)
        prompt = torch.randint(10, 32000, (300,), generator=g).tolist()
        tokens = torch.randint(10, 32000, (k + 1,), generator=g).tolist()
        pool = runner.req_to_token_pool
        slots = [pool.alloc(), pool.alloc()]
        kv_len = dict.fromkeys(slots, 0)
        _forward(runner, ForwardMode.EXTEND, [(s, prompt) for s in slots], kv_len)
        steps = torch.cat([_forward(runner, ForwardMode.DECODE, [(slots[0], [t])], kv_len)
                           for t in tokens])
        rows = _forward(runner, ForwardMode.VERIFY, [(slots[1], tokens)], kv_len)
        err = (rows - steps).norm() / steps.norm()
        assert err < 2e-2, err.item()
        assert (rows.argmax(-1) == steps.argmax(-1)).float().mean() >= 0.75
        for s in slots:
            pool.free(s)


class Oracle(Drafter):
    def __init__(self, continuations, k, wrong=frozenset()):
        self.continuations, self.k, self.wrong = continuations, k, wrong

    def propose(self, reqs):
        out = {}
        for r in reqs:
            n = len(r.output_ids)
            ahead = self.continuations[r.rid][n:n + self.k]
            out[r.rid] = [(t + 1) % 1000 if n + j in self.wrong else t
                          for j, t in enumerate(ahead)]
        return out


def _serve(model_dir, prompts, drafter=None):
    with radixlm.Engine(model_dir, dtype="float32", skip_tokenizer_init=True,
                        max_total_tokens=8192) as e:
        sched = e.scheduler
        sched.drafter = drafter
        for i, ids in enumerate(prompts):
            sched.add_request(GenerateReq(rid=f"r{i}", input_ids=ids, sampling_params={
                "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}))
        out = {f"r{i}": [] for i in range(len(prompts))}
        while sched.has_work:
            for o in sched.step():
                out[o.rid] += o.new_token_ids
        sched.check_invariants()
        return out, sched.forward_ct, sched.stats


def test_drafts_change_forwards_not_tokens_on_cuda(model_dir):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 32000, (n,), generator=g).tolist() for n in (20, 77, 150)]
    plain, forwards, _ = _serve(model_dir, prompts)
    right, fewer, stats = _serve(model_dir, prompts, Oracle(plain, 3))
    assert right == plain and fewer < forwards and stats.num_accepted_drafts > 0
    partly, _, stats = _serve(model_dir, prompts, Oracle(plain, 4, wrong={1, 5, 6, 11}))
    assert partly == plain
    assert 0 < stats.num_accepted_drafts < stats.num_draft_tokens


def test_multi_token_steps_with_overlap_on_cuda(tmp_path):
    """The CPU test's scripted worker (0, 1 and 3 tokens a step, with and without
    overlap) with the pools on CUDA, on a tokenizer trained here (the embedded
    model does not travel to GPU machines)."""
    from gpu_models import save_tiny_bpe_tokenizer
    from test_scheduler_results import TEXT, test_multi_token_steps_match_one_token_steps

    tok = save_tiny_bpe_tokenizer(tmp_path, [TEXT, "Write something:", "1234 5678"])
    for overlap in (False, True):
        test_multi_token_steps_match_one_token_steps(tok, overlap, device="cuda")
