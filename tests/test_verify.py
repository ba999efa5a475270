"""The verify forward (speculative decoding's target step) and its path through the
real model worker and scheduler, on the embedded model in fp32 on the CPU.

- A verify row computes what a decode step over the same tokens computes: the
  logits of k + 1 verify rows equal k + 1 single decode steps.
- Through the scheduler with a drafter: greedy and seeded sampling give the same
  tokens with drafts as without (all right, partly wrong, all wrong), in fewer
  forwards when they are right, with rejected drafts' KV given back and the
  accounting invariant holding after every step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kv_runner import KVRunner
from verify_runs import BACKENDS, NEW_TOKENS, PROMPTS
from verify_runs import serve as _serve

from radixlm.forward_batch import ForwardMode
from radixlm.layers.attention.cpu_backend import CpuAttentionBackend
from radixlm.models.loader import load_config, load_model
from radixlm.scheduler.drafter import Drafter
from radixlm.scheduler.req import Req
from radixlm.tokenizer import get_tokenizer


@pytest.fixture(scope="module")
def smol(model_dir: str) -> torch.nn.Module:
    return load_model(model_dir, load_config(model_dir), "auto", torch.float32, "cpu")


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    return get_tokenizer(model_dir)




@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("k", [1, 4])
def test_verify_rows_equal_decode_steps(smol: torch.nn.Module, tokenizer: Any, backend: str,
                                        k: int) -> None:
    if backend == "cpu" and not CpuAttentionBackend.supports(smol.kv_spec().k_head_dim):
        pytest.skip("the CPU kernels need a C++ compiler")
    runner = KVRunner(smol, backend=BACKENDS[backend]())
    prompt = tokenizer.encode(PROMPTS[0])
    tokens = tokenizer.encode(" Paris, and the capital of Spain")[:k + 1]
    stepped, verified = runner.new_request(), runner.new_request()
    runner.extend([(stepped, prompt), (verified, prompt)])
    steps = torch.cat([runner.decode([(stepped, t)]) for t in tokens])
    rows = runner.run(ForwardMode.VERIFY, [(verified, tokens)])
    assert rows.shape == steps.shape == (k + 1, smol.spec.vocab_size)
    diff = (rows - steps).abs().max().item()
    assert diff <= 1e-5 * steps.abs().max().item(), diff


class ScriptDrafter(Drafter):
    """Proposes the next `k` tokens of a known continuation, with chosen draft
    positions (output indices) replaced by a wrong token."""

    def __init__(self, continuations: dict[str, list[int]], k: int,
                 wrong: set[int] = frozenset()) -> None:
        self.continuations, self.k, self.wrong = continuations, k, wrong

    def propose(self, reqs: list[Req]) -> dict[str, list[int]]:
        out = {}
        for r in reqs:
            n = len(r.output_ids)
            ahead = self.continuations[r.rid][n:n + self.k]
            out[r.rid] = [(t + 1) % 1000 if n + j in self.wrong else t
                          for j, t in enumerate(ahead)]
        return out


@pytest.mark.parametrize("params", [{"temperature": 0.0},
                                    {"temperature": 0.8, "top_p": 0.9, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_drafts_change_forwards_not_tokens(model_dir: str, tokenizer: Any,
                                           params: dict[str, Any]) -> None:
    plain, base = _serve(model_dir, tokenizer, params)
    assert all(len(v) == NEW_TOKENS for v in plain.values())
    right, sched = _serve(model_dir, tokenizer, params, ScriptDrafter(plain, k=3))
    assert right == plain
    assert sched.forward_ct < base.forward_ct  # drafts accepted: fewer forwards
    assert sched.stats.num_accepted_drafts == sched.stats.num_draft_tokens > 0
    partly, sched = _serve(model_dir, tokenizer, params,
                           ScriptDrafter(plain, k=4, wrong={2, 5, 6, 9}))
    assert partly == plain
    assert 0 < sched.stats.num_accepted_drafts < sched.stats.num_draft_tokens
    wrong, sched = _serve(model_dir, tokenizer, params,
                          ScriptDrafter(plain, k=2, wrong=set(range(NEW_TOKENS))))
    assert wrong == plain and sched.stats.num_accepted_drafts == 0
