"""What the verify tests share: a CPU fp32 scheduler serving three prompts, step by
step, with the pool invariant checked after every step."""

from __future__ import annotations

from typing import Any

from radixlm.config import ServerArgs
from radixlm.layers.attention.cpu_backend import CpuAttentionBackend
from radixlm.layers.attention.torch_native import TorchNativeBackend
from radixlm.models.loader import load_config
from radixlm.protocol import GenerateReq
from radixlm.scheduler.scheduler import Scheduler

PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time"]
NEW_TOKENS = 12
BACKENDS = {"torch_native": TorchNativeBackend, "cpu": CpuAttentionBackend}


def serve(model_dir: str, tokenizer: Any, params: dict[str, Any], drafter: Any = None,
          backend: str = "auto") -> tuple[dict[str, list[int]], Scheduler]:
    """(each request's tokens, the scheduler) for PROMPTS under `params`, with `drafter`,
    on the attention `backend`."""
    args = ServerArgs(device="cpu", dtype="float32", quantization="none",
                      max_total_tokens=2048, chunked_prefill_size=64, attention_backend=backend)
    sched = Scheduler(args, model_dir, load_config(model_dir), tokenizer, drafter=drafter)
    for i, text in enumerate(PROMPTS):
        sched.add_request(GenerateReq(rid=f"r{i}", input_ids=tokenizer.encode(text),
                                      sampling_params={**params, "max_new_tokens": NEW_TOKENS}))
    ids: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while sched.has_work:
        for out in sched.step():
            ids[out.rid] += out.new_token_ids
        sched.check_invariants()
    assert sched.worker.kv_pool.available_size() + sched.cache.total_size() == 2048
    return ids, sched
