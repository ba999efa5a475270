"""Driving a model the way the model runner does, without the scheduler: one
req_to_token row per request, KV slots from the pool's allocator, a
hand-built ForwardBatch; and comparing its logits with HF's."""

from __future__ import annotations

import torch

from radixlm.cache.memory_pool import MHATokenToKVPool, PoolOptions, ReqToTokenPool
from radixlm.forward_batch import ForwardBatch, ForwardMode
from radixlm.layers.attention.base import AttentionBackend
from radixlm.layers.attention.torch_native import TorchNativeBackend

# Relative to the largest reference logit; fp32 on the same weights differs
# only by summation order (batched matmuls of other shapes).
RTOL = 1e-4


class KVRunner:
    """Runs a model over a real KV pool: extend (prefill after a cached prefix) and decode."""

    def __init__(self, model: torch.nn.Module, max_requests: int = 8,
                 max_context: int = 256, backend: AttentionBackend | None = None) -> None:
        self.model = model
        self.req_pool = ReqToTokenPool(max_requests, max_context, "cpu")
        self.kv_pool = MHATokenToKVPool.create(model.kv_spec().without_windows(), torch.float32,
                                               max_requests * max_context, torch.device("cpu"),
                                               PoolOptions())
        self.backend = backend or TorchNativeBackend()
        self.kv_len: dict[int, int] = {}

    def new_request(self) -> int:
        slot = self.req_pool.alloc()
        self.kv_len[slot] = 0
        return slot

    def run(self, mode: ForwardMode, reqs: list[tuple[int, list[int]]],
            all_rows: bool = False, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`reqs`: (request slot, its new tokens); returns the model's logits.
        `input_embeds`: the model's input instead of the tokens' embeddings."""
        ids, prefix_lens, extend_lens, locs = [], [], [], []
        for slot, new in reqs:
            loc = self.kv_pool.alloc(len(new))
            pre = self.kv_len[slot]
            self.req_pool.req_to_token[slot, pre:pre + len(new)] = loc.to(torch.int32)
            self.kv_len[slot] = pre + len(new)
            ids += new
            prefix_lens.append(pre)
            extend_lens.append(len(new))
            locs.append(loc)
        rows = list(range(len(ids))) if all_rows else None
        fb = ForwardBatch.build(mode, ids, [slot for slot, _ in reqs], prefix_lens, extend_lens,
                                torch.cat(locs), self.req_pool, self.kv_pool, self.backend,
                                torch.device("cpu"), logit_rows=rows)
        self.backend.begin_forward(fb)
        with torch.inference_mode():
            if input_embeds is None:
                return self.model(fb.input_ids, fb.positions, fb)
            return self.model(fb.input_ids, fb.positions, fb, input_embeds=input_embeds)

    def extend(self, reqs: list[tuple[int, list[int]]], all_rows: bool = False,
               input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        return self.run(ForwardMode.EXTEND, reqs, all_rows, input_embeds)

    def decode(self, reqs: list[tuple[int, int]]) -> torch.Tensor:
        return self.run(ForwardMode.DECODE, [(slot, [tok]) for slot, tok in reqs])


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def check_close(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= RTOL * ref.abs().max().item(), f"max |diff| {diff:.3g}"
    return diff


def load_fp32(path: str, **overrides: object) -> torch.nn.Module:
    """The checkpoint at `path` as our model in fp32 on the CPU, with config
    fields replaced by `overrides` (to check that a field matters)."""
    from radixlm.models.loader import load_config, load_model

    config = load_config(path)
    for k, v in overrides.items():
        setattr(config, k, v)
    return load_model(path, config, "safetensors", torch.float32, "cpu")


def logits_through_kv(runner: KVRunner, seqs: list[list[int]]
                      ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(prefill logits of all but each sequence's last 3 tokens; the first
    sequence's cached prefix extended by 2 of them; decode logits of the other
    sequences' last 3 tokens, step by step) on the runner's one KV pool."""
    slots = [runner.new_request() for _ in seqs]
    prefill = runner.extend([(s, ids[:-3]) for s, ids in zip(slots, seqs, strict=True)],
                            all_rows=True)
    extended = runner.extend([(slots[0], seqs[0][-3:-1])], all_rows=True)
    decodes = [runner.decode([(s, ids[k]) for s, ids in zip(slots[1:], seqs[1:], strict=True)])
               for k in (-3, -2, -1)]
    return prefill, extended, decodes


def check_through_kv(refs: list[torch.Tensor], got) -> None:
    """`logits_through_kv`'s result against each sequence's full reference logits."""
    prefill, extended, decodes = got
    check_close(prefill, torch.cat([r[:-3] for r in refs]))
    check_close(extended, refs[0][-3:-1])
    for k, logits in zip((-3, -2, -1), decodes, strict=True):
        check_close(logits, torch.stack([r[k] for r in refs[1:]]))


def greedy_through_kv(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int
                      ) -> list[list[int]]:
    """Greedy continuations of `prompts`, all in one batch: a prefill, then decode steps."""
    runner = KVRunner(model)
    slots = [runner.new_request() for _ in prompts]
    nxt = runner.extend(list(zip(slots, prompts, strict=True))).argmax(-1).tolist()
    out = [[t] for t in nxt]
    for _ in range(new_tokens - 1):
        nxt = runner.decode(list(zip(slots, nxt, strict=True))).argmax(-1).tolist()
        for seq, t in zip(out, nxt, strict=True):
            seq.append(t)
    return out


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of positions where two sets of continuations hold the same token."""
    return sum(x == y for s, t in zip(a, b, strict=True) for x, y in zip(s, t, strict=True)) \
        / sum(len(s) for s in a)
