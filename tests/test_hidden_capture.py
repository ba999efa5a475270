"""The model worker returns the hidden states of chosen layers when asked (what an
EAGLE drafter reads), for every token of a prefill and of each decode step, equal
to HF's on CPU fp32."""

from __future__ import annotations

from typing import Any

import torch

from radixlm.config import ServerArgs
from radixlm.forward_batch import HiddenCapture
from radixlm.models.loader import load_config
from radixlm.protocol import GenerateReq
from radixlm.scheduler.model_worker import ModelWorker
from radixlm.scheduler.scheduler import Scheduler
from radixlm.tokenizer import get_tokenizer

LAYERS = (0, 14)


def test_captured_hidden_states_match_hf(model_dir: str, hf_model: Any) -> None:
    args = ServerArgs(device="cpu", dtype="float32", quantization="none",
                      max_total_tokens=1024)
    config = load_config(model_dir)
    worker = ModelWorker(args, model_dir, config, capture=HiddenCapture(LAYERS, final=True))
    results = []
    forward = worker.forward

    def recording(batch: Any) -> Any:
        pending = forward(batch)
        results.append(pending)
        return pending

    worker.forward = recording
    tok = get_tokenizer(model_dir)
    sched = Scheduler(args, model_dir, config, tok, worker=worker)
    ids = tok.encode("The capital of France is")
    sched.add_request(GenerateReq(rid="a", input_ids=ids,
                                  sampling_params={"max_new_tokens": 3, "temperature": 0}))
    out: list[int] = []
    while sched.has_work:
        out += [t for o in sched.step() for t in o.new_token_ids]
    states = [torch.cat(s) for s in zip(*(p.wait().hidden_states for p in results))]
    full = ids + out[:-1]  # the last token was sampled, never fed back
    assert [len(s) for s in states] == [len(full)] * (len(LAYERS) + 1)
    with torch.no_grad():
        hf = hf_model(torch.tensor([full]), output_hidden_states=True)
        final = hf_model.model(torch.tensor([full])).last_hidden_state[0]
    for layer, ours in zip(LAYERS, states):
        torch.testing.assert_close(ours, hf.hidden_states[layer + 1][0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(states[-1], final, atol=2e-4, rtol=1e-4)
