"""The model worker: runs one scheduled batch and returns each request's new tokens
(seed 001's TpModelWorker: `forward_batch_generation` returns logits and next
token ids).

Between the scheduler (which requests, which KV slots) and the model runner
(the model, the pools, the attention backend, CUDA graphs). `forward(batch)`
builds the device `ForwardBatch`, runs the model, computes the prompt
logprobs asked for, samples the requests that sample, and returns a
`PendingResult` whose `wait()` gives the `BatchResult`.

Results are lists of tokens per request (0..k): a prefill chunk yields none,
a decode step one, a speculative verify step (a later worker) up to k. The
scheduler applies them token by token, in order.

Overlap (CUDA): the sampled ids stay on the device in `future_ids` (indexed by
request slot), where the next decode batch reads its input tokens, and their
host copies travel asynchronously; `wait()` is the one synchronization. The
scheduler may therefore launch batch N+1 before it reads batch N's result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from radixlm import distributed as tp
from radixlm.config import ServerArgs
from radixlm.forward_batch import ForwardBatch, SharedPrefixTracker, cascade_attention_wanted
from radixlm.layers.sampler import Sampler, SamplingBatchInfo
from radixlm.runtime.model_runner import ModelRunner
from radixlm.scheduler.req import Req
from radixlm.scheduler.schedule_batch import ScheduleBatch
from radixlm.utils import to_device


@dataclass
class BatchResult:
    """What one forward produced, per request of its batch (batch order).

    A request that sampled (`ScheduleBatch.sample`) gets at least one token
    (a verify step's bonus token at the least), the others none."""

    tokens: list[list[int]]  # new tokens of each request: 0..k
    # Per new token when any request of the batch asked for logprobs, else None.
    logprobs: list[list[float]] | None = None
    # Per new token, that request's top_logprobs_num [logprob, token id] pairs.
    top_logprobs: list[list[list[list[Any]]]] | None = None
    # Prompt tokens' [logprob, token id] from this forward (None where not asked).
    prompt_logprobs: list[list[list[Any]] | None] | None = None
    prompt_top_logprobs: list[list[list[list[Any]]] | None] | None = None
    # Embedding batches: each request's new rows of final-normed hidden states.
    hidden: list[torch.Tensor] | None = None


class PendingResult:
    """A launched batch's result; `wait()` blocks until its tokens are on the host.
    Also made already complete (`PendingResult.done(result)`)."""

    def __init__(self, batch: ScheduleBatch, host: list[torch.Tensor] | None = None,
                 event: torch.cuda.Event | None = None,
                 prompt: tuple[list[Any], list[Any]] | None = None,
                 done: BatchResult | None = None) -> None:
        self.batch = batch
        self._host = host  # sampled ids [, logprobs [, top values, top ids]]
        self._event = event
        self._prompt = prompt
        self._result = done

    @classmethod
    def done(cls, batch: ScheduleBatch, result: BatchResult) -> PendingResult:
        return cls(batch, done=result)

    def wait(self) -> BatchResult:
        if self._result is None:
            self._result = self._resolve()
        return self._result

    def _resolve(self) -> BatchResult:
        if self._event is not None:
            self._event.synchronize()  # the one wait on the device per step
        lists = [t.tolist() for t in self._host or []]
        batch = self.batch
        n = batch.batch_size
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs = [[] for _ in range(n)] if len(lists) > 1 else None
        tops = [[] for _ in range(n)] if len(lists) > 3 else None
        rows = range(n) if all(batch.sample) else [i for i in range(n) if batch.sample[i]]
        for j, i in enumerate(rows):
            tokens[i].append(lists[0][j])
            if logprobs is not None:
                logprobs[i].append(lists[1][j])
            if tops is not None:
                k = batch.reqs[i].top_logprobs_num
                tops[i].append([[v, t] for v, t in zip(lists[2][j][:k], lists[3][j][:k])])
        result = BatchResult(tokens, logprobs, tops)
        if self._prompt is not None:
            result.prompt_logprobs, result.prompt_top_logprobs = self._prompt
        return result


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t
    # Pinned memory: the copy is truly asynchronous and queued behind the sampler.
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _record_event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def min_tokens_ban(req: Req) -> set[int]:
    """Tokens that would stop the request, banned while it is below min_new_tokens."""
    p = req.sampling_params
    if len(req.output_ids) >= p.min_new_tokens:
        return set()
    stops = set(p.stop_token_ids)
    return stops if p.ignore_eos else stops | req.eos_token_ids


class ModelWorker:
    """Owns the model runner and the sampler of one (tensor-parallel) rank."""

    def __init__(self, args: ServerArgs, model_dir: str, config: Any,
                 gpu_id: int | None = None) -> None:
        self.runner = ModelRunner(args, model_dir, config, gpu_id)
        self.device = self.runner.device
        self.vocab_size = self.runner.shape.vocab_size
        self.sampler = Sampler()
        self.tp_sync = tp.get_tp_sync()
        # future_ids[req_pool_idx]: the request's newest sampled token, on the device.
        self.future_ids = torch.zeros(self.runner.req_to_token_pool.size, dtype=torch.int64,
                                      device=self.device)
        # Decode batches' shared prefixes, for backends with cascade attention.
        self.prefix_groups = SharedPrefixTracker() if cascade_attention_wanted(args) and \
            self.runner.attn_backend.supports_cascade_decode else None

    # ---- generation ------------------------------------------------------------------
    def forward(self, batch: ScheduleBatch) -> PendingResult:
        fb, last_rows = self._forward_batch(batch)
        logits = self.runner.forward(fb)
        prompt = self._prompt_logprobs(batch, logits) if any(batch.prompt_logprobs) else None
        if not any(batch.sample):
            empty = BatchResult([[] for _ in batch.reqs])
            if prompt is not None:
                empty.prompt_logprobs, empty.prompt_top_logprobs = prompt
            return PendingResult.done(batch, empty)
        if not batch.mode.is_decode():  # decode: one row per request, all sampling
            logits = logits[[row for row, s in zip(last_rows, batch.sample) if s]]
        return self._sample(batch, logits, prompt)

    def _forward_batch(self, batch: ScheduleBatch) -> tuple[ForwardBatch, list[int]]:
        """The device batch, and each request's last row among the logit rows."""
        num_device = batch.batch_size - batch.num_extend  # rows whose input is on the device
        if batch.mode.is_decode():  # the hot path: one row per request
            rows = last_rows = list(range(batch.batch_size))
            input_ids = [0] * num_device
        else:
            input_ids, rows, last_rows = _host_rows(batch)
            input_ids += [0] * num_device
        r = self.runner
        fb = ForwardBatch.build(
            batch.mode, input_ids, [q.req_pool_idx for q in batch.reqs], batch.prefix_lens,
            batch.extend_lens, batch.out_cache_loc, r.req_to_token_pool, r.kv_pool,
            r.attn_backend, self.device, logit_rows=rows, num_extend=batch.num_extend)
        if num_device:
            # The newest token of each decoding request, wherever it was sampled.
            pool_idx = fb.req_pool_indices[batch.num_extend:]
            if batch.mode.is_decode():
                fb.input_ids = self.future_ids[pool_idx]
            else:
                fb.input_ids[fb.num_tokens - num_device:] = self.future_ids[pool_idx]
        if batch.mode.is_decode() and self.prefix_groups is not None:
            fb.prefix_groups = self.prefix_groups.find(batch.reqs)
        return fb, last_rows

    def _sample(self, batch: ScheduleBatch, logits: torch.Tensor,
                prompt: tuple[list[Any], list[Any]] | None) -> PendingResult:
        """Sample one token per sampling request on the device and start copying the
        results to the host."""
        reqs = batch.sampling_reqs
        info = SamplingBatchInfo.build(
            [r.sampling_params for r in reqs], [r.seed for r in reqs],
            [r.sampled_len for r in reqs], [r.origin_input_ids for r in reqs],
            [r.output_ids for r in reqs], [min_tokens_ban(r) for r in reqs],
            self.vocab_size, self.device)
        want_lp = any(r.return_logprob for r in reqs)
        top_k = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        if batch.mask_logits is not None:
            logits = batch.mask_logits(reqs, logits)
        out = self.sampler(logits, info, want_lp, top_k)
        if self.tp_sync is not None:  # every rank continues with rank 0's tokens
            tp.tensor_model_parallel_broadcast(out.next_token_ids)
        pool_idx = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        self.future_ids[to_device(pool_idx, self.device)] = out.next_token_ids
        tensors = [out.next_token_ids]
        if want_lp and out.logprobs is not None:
            tensors.append(out.logprobs)
            if top_k and out.top_logprobs is not None:
                tensors += list(out.top_logprobs)
        return PendingResult(batch, [_to_host(t) for t in tensors], _record_event(self.device),
                             prompt)

    def _prompt_logprobs(self, batch: ScheduleBatch, logits: torch.Tensor
                         ) -> tuple[list[Any], list[Any]]:
        """Per request, [logprob, token] of the prompt tokens its range asks for (and
        the top-k lists when it wants them). Logits row j of a request (position
        logit_starts + j) predicts the prompt token at that position + 1."""
        lps: list[Any] = []
        tops: list[Any] = []
        row0 = 0
        for i, req in enumerate(batch.reqs):
            first = batch.logit_starts[i]
            nrows = batch.prefix_lens[i] + batch.extend_lens[i] - first
            span = batch.prompt_logprobs[i]
            lp, top = None, None
            if span is not None:
                lp, top = _token_logprobs(req, logits[row0:row0 + nrows], first, *span)
            lps.append(lp)
            tops.append(top)
            row0 += nrows
        return lps, tops

    # ---- embeddings ------------------------------------------------------------------
    @torch.inference_mode()
    def forward_embedding(self, batch: ScheduleBatch) -> PendingResult:
        """A prefill round of embedding requests: final-normed hidden states, per
        request, for the scheduler to pool; no logits, no sampling."""
        fb, _ = self._forward_batch(batch)
        fb.attn_backend.begin_forward(fb)
        hidden = self.runner.model.forward_hidden(fb.input_ids, fb.positions, fb)
        rows = list(hidden.split(batch.extend_lens))
        return PendingResult.done(batch, BatchResult([[] for _ in batch.reqs], hidden=rows))


def _host_rows(batch: ScheduleBatch) -> tuple[list[int], list[int], list[int]]:
    """(input ids of the extend requests, logit rows of the flat token axis, each
    request's last row among them)."""
    input_ids: list[int] = []
    rows: list[int] = []
    last_rows: list[int] = []
    offset = 0
    for i, req in enumerate(batch.reqs):
        start, ext = batch.prefix_lens[i], batch.extend_lens[i]
        if i < batch.num_extend:
            input_ids += req.fill_ids[start:start + ext]
        rows += range(offset + batch.logit_starts[i] - start, offset + ext)
        last_rows.append(len(rows) - 1)
        offset += ext
    return input_ids, rows, last_rows


def _token_logprobs(req: Req, logits: torch.Tensor, first: int, lo: int,
                    hi: int) -> tuple[list[Any], list[Any] | None]:
    """[logprob, token] of prompt tokens lo + 1 .. hi from logits rows starting at
    position `first`."""
    if hi <= lo:
        return [], [] if req.top_logprobs_num else None
    fill = req.fill_ids
    logp = torch.log_softmax(logits[lo - first:hi - first].float(), dim=-1)
    targets = torch.tensor(fill[lo + 1:hi + 1], device=logp.device)
    chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
    lps = [[lp, t] for lp, t in zip(chosen, fill[lo + 1:hi + 1])]
    if not req.top_logprobs_num:
        return lps, None
    vals, ids = logp.topk(req.top_logprobs_num, dim=-1)
    return lps, [[[v, i] for v, i in zip(vr, ir)] for vr, ir in zip(vals.tolist(), ids.tolist())]
