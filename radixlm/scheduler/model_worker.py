"""The model worker: runs one scheduled batch and returns each request's new tokens
(seed 001's TpModelWorker: `forward_batch_generation` returns logits and next
token ids).

Between the scheduler (which requests, which KV slots) and the model runner
(the model, the attention backend, CUDA graphs). The worker loads the model,
has the memory plan size its KV pools (`runtime/memory_plan.py`) and hands
them to the runner; the scheduler reaches everything through the `Worker`
protocol below, never through the runner. `forward(batch)` builds the device
`ForwardBatch`, runs the model, computes the prompt logprobs asked for,
samples the rows that sample, and returns a `PendingResult` whose `wait()`
gives the `BatchResult`.

Results are lists of tokens per request (0..k): a prefill chunk yields none,
a decode step one, a verify step 1..k + 1: the drafts the target agrees with
(its own token at each position equals the draft's, sampled with that
position's seed, so the output is the target's whatever the drafter
proposed), then the target's own next token.

Overlap (CUDA): sampled ids stay on the device in a token table indexed by
(request slot, position) (`token_table.py`), where the next decode or verify
batch reads its input tokens, and their host copies travel asynchronously;
`wait()` is the one synchronization. The scheduler may therefore launch batch
N + 1 before it reads batch N's result, also when N gives a request several
tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from radixlm import distributed as tp
from radixlm.cache.memory_pool import KVPool, ReqToTokenPool
from radixlm.config import ServerArgs
from radixlm.forward_batch import (
    ForwardBatch,
    HiddenCapture,
    SharedPrefixTracker,
    cascade_attention_wanted,
)
from radixlm.layers.sampler import Sampler, SamplingBatchInfo
from radixlm.runtime.memory_plan import MemoryPlan
from radixlm.runtime.model_runner import ModelRunner
from radixlm.scheduler.req import Req
from radixlm.scheduler.schedule_batch import ScheduleBatch
from radixlm.scheduler.token_table import TokenTable
from radixlm.speculative import check_target, create_drafter, tree
from radixlm.speculative.model_drafter import ModelDrafter
from radixlm.speculative.rejection import token_logprobs, verify_sampled
from radixlm.utils import ints_to_device, to_device


@dataclass(frozen=True)
class WorkerLimits:
    """What the scheduler admits against (the same on every tensor-parallel rank)."""

    max_total_tokens: int  # KV slots
    max_running_requests: int
    context_len: int
    vocab_size: int
    hidden_size: int  # of `input_embeds` rows


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
    # With a `HiddenCapture` (ModelWorker's `capture`): on the device, one tensor per
    # captured state, [num_tokens, hidden], rows in the batch's flat token order.
    hidden_states: list[torch.Tensor] | None = None
    # A verify of draft trees: per request, the rows of its kept path (root first, as
    # many as its tokens; request-local rows, `speculative/tree.py`), else None.
    paths: list[list[int]] | None = None


class PendingResult:
    """A launched batch's result; `wait()` blocks until its tokens are on the host.
    Also made already complete (`PendingResult.done(result)`).

    `host`: sampled ids [rows] [, their logprobs [rows] [, top values, top ids
    [rows, k]]], rows in batch order, `batch.sample_rows(i)` per request; and
    `counts`: for a verify batch, how many of each sampling request's rows it keeps
    (a tree's rows come in the order of its kept path, `paths` [n, W] the rows)."""

    def __init__(self, batch: ScheduleBatch, host: list[torch.Tensor] | None = None,
                 event: torch.cuda.Event | None = None,
                 prompt: tuple[list[Any], list[Any]] | None = None,
                 done: BatchResult | None = None, counts: torch.Tensor | None = None,
                 hidden_states: list[torch.Tensor] | None = None,
                 paths: torch.Tensor | None = None) -> None:
        self.batch = batch
        self.hidden_states = hidden_states
        self._paths = paths
        self._host = host
        self._counts = counts
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
        counts = self._counts.tolist() if self._counts is not None else None
        batch = self.batch
        n = batch.batch_size
        tokens: list[list[int]] = [[] for _ in range(n)]
        logprobs = [[] for _ in range(n)] if len(lists) > 1 else None
        tops = [[] for _ in range(n)] if len(lists) > 3 else None
        row = j = 0
        for i in range(n):
            m = batch.sample_rows(i)
            if not m:
                continue
            keep = counts[j] if counts is not None else m
            tokens[i] = lists[0][row:row + keep]
            if logprobs is not None:
                logprobs[i] = lists[1][row:row + keep]
            if tops is not None:
                k = batch.reqs[i].top_logprobs_num
                tops[i] = [[[v, t] for v, t in zip(lists[2][r][:k], lists[3][r][:k])]
                           for r in range(row, row + keep)]
            row += m
            j += 1
        result = BatchResult(tokens, logprobs, tops, hidden_states=self.hidden_states)
        if self._paths is not None:
            paths, result.paths = self._paths.tolist(), [[] for _ in range(n)]
            sampling = [i for i in range(n) if batch.sample_rows(i)]
            for j, i in enumerate(sampling):
                result.paths[i] = paths[j][:len(tokens[i])]
        if self._prompt is not None:
            result.prompt_logprobs, result.prompt_top_logprobs = self._prompt
        return result


class Worker(Protocol):
    """What the scheduler needs of a model worker (`ModelWorker`; tests script one).

    - `limits`, `device`, `tp_sync` (None: one rank), `supports_overlap` (the
      scheduler may launch a batch before reading the previous one's result).
    - `req_to_token_pool`, `kv_pool`: the pools the worker computes over; the
      scheduler's KV manager hands out their slots.
    - `forward(batch)`: returns at once with a `PendingResult`; a sampling
      request gets 1..k tokens. `forward_embedding(batch)`: final-normed hidden
      rows per request (embedding servers).
    - `runtime_controls()`: the weight updater, memory occupation and profiler
      the control component drives (`scheduler/control.py`).
    - `drafter` (optional): the drafter --speculative-algorithm built, which the
      scheduler asks for drafts.
    """

    limits: WorkerLimits
    device: torch.device
    tp_sync: Any
    supports_overlap: bool
    req_to_token_pool: ReqToTokenPool
    kv_pool: KVPool

    def forward(self, batch: ScheduleBatch) -> PendingResult: ...

    def forward_embedding(self, batch: ScheduleBatch) -> PendingResult: ...

    def runtime_controls(self) -> Any: ...


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


def min_tokens_ban(req: Req, ahead: int = 0) -> set[int]:
    """Tokens that would stop the request, banned while it is below min_new_tokens
    (`ahead`: tokens it will have before this row, a verify row's drafts)."""
    p = req.sampling_params
    if len(req.output_ids) + ahead >= p.min_new_tokens:
        return set()
    stops = set(p.stop_token_ids)
    return stops if p.ignore_eos else stops | req.eos_token_ids


class ModelWorker:
    """Owns the model runner, the sampler and the token table of one (tensor-parallel) rank."""

    def __init__(self, args: ServerArgs, model_dir: str, config: Any,
                 gpu_id: int | None = None, capture: HiddenCapture | None = None) -> None:
        """`capture`: hidden states every forward also returns (`BatchResult.hidden_states`;
        fixed before the CUDA graphs are captured)."""
        self.args = args
        check_target(config)
        self.runner = ModelRunner(args, model_dir, config, gpu_id)
        r = self.runner
        self.drafter = create_drafter(args, r, model_dir, gpu_id)
        # A drafter with a model drafts inside the verify forward and sees every forward.
        self.model_drafter = self.drafter if isinstance(self.drafter, ModelDrafter) else None
        needs = self.model_drafter.capture if self.model_drafter is not None else None
        if capture is not None and needs is not None:
            raise ValueError("a hidden-state capture and an EAGLE drafter's at once")
        r.capture = capture or needs
        self.device = r.device
        requests = [r.kv_request()]
        if self.model_drafter is not None:
            requests += self.model_drafter.kv_requests()
        pools = MemoryPlan(args, self.device, r.context_len, requests).build()
        r.attach_pools(pools)
        if self.model_drafter is not None:
            self.model_drafter.attach_pools(pools)
        self.req_to_token_pool, self.kv_pool = pools.req_to_token_pool, pools.target
        self.limits = WorkerLimits(pools.max_total_tokens, pools.max_running_requests,
                                   r.context_len, r.vocab_size, config.hidden_size)
        self.supports_overlap = self.device.type == "cuda"
        self.sampler = Sampler()
        self.tp_sync = tp.get_tp_sync()
        self.tokens = TokenTable(pools.req_to_token_pool.size,
                                 pools.req_to_token_pool.max_context_len, self.device)
        # Decode batches' shared prefixes, for backends with cascade attention.
        self.prefix_groups = SharedPrefixTracker() if cascade_attention_wanted(args) and \
            r.attn_backend.supports_cascade_decode else None

    def runtime_controls(self) -> Any:
        from radixlm.scheduler.control import RuntimeControls
        return RuntimeControls.for_runner(self.runner, self.args.model_path)

    # ---- generation ------------------------------------------------------------------
    def forward(self, batch: ScheduleBatch) -> PendingResult:
        with self.runner.cpu_threads(batch.num_tokens):
            return self._forward(batch)

    def _forward(self, batch: ScheduleBatch) -> PendingResult:
        draft_probs = None
        if self.model_drafter is not None and batch.mode.is_verify():
            draft_probs = self.model_drafter.draft(batch)  # writes batch.drafts
        fb, last_rows = self._forward_batch(batch)
        logits = self.runner.forward(fb)
        if self.model_drafter is not None:
            self.model_drafter.observe(batch, fb)
        prompt = self._prompt_logprobs(batch, logits) if any(batch.prompt_logprobs) else None
        if not any(batch.sample):
            empty = BatchResult([[] for _ in batch.reqs], hidden_states=fb.captured or None)
            if prompt is not None:
                empty.prompt_logprobs, empty.prompt_top_logprobs = prompt
            return PendingResult.done(batch, empty)
        if not batch.mode.is_decode_like():  # else every row is sampled
            logits = logits[[row for row, s in zip(last_rows, batch.sample) if s]]
        return self._sample(batch, fb, logits, prompt, draft_probs)

    def _forward_batch(self, batch: ScheduleBatch) -> tuple[ForwardBatch, list[int]]:
        """The device batch, and each request's last row among the logit rows."""
        num_device = batch.batch_size - batch.num_extend  # rows whose input is on the device
        if batch.mode.is_decode():  # the hot path: one row per request
            rows = last_rows = list(range(batch.batch_size))
            input_ids = [0] * num_device
        elif batch.mode.is_verify():
            input_ids = [t for d in batch.drafts for t in [0, *d]]
            rows = list(range(len(input_ids)))
            last_rows = list(_last_rows(batch.extend_lens))
        else:
            input_ids, rows, last_rows = _host_rows(batch)
            input_ids += [0] * num_device
        fb = ForwardBatch.build(
            batch.mode, input_ids, [q.req_pool_idx for q in batch.reqs], batch.prefix_lens,
            batch.extend_lens, batch.out_cache_loc, self.req_to_token_pool, self.kv_pool,
            self.runner.attn_backend, self.device, logit_rows=rows, num_extend=batch.num_extend,
            tree=batch.draft_parents if batch.mode.is_verify() else None)
        fb.capture = self.runner.capture
        if num_device:
            self._device_inputs(batch, fb, num_device)
        if batch.mode.is_decode() and self.prefix_groups is not None:
            fb.prefix_groups = self.prefix_groups.find(batch.reqs)
        if any(r.input_embeds is not None for r in batch.reqs[:batch.num_extend]):
            fb.input_embeds = self._input_embeds(batch, fb)
        return fb, last_rows

    def _device_inputs(self, batch: ScheduleBatch, fb: ForwardBatch, num_device: int) -> None:
        """The newest token of each decoding (or verifying) request, from the token
        table, wherever it was sampled."""
        slots = fb.req_pool_indices[batch.num_extend:]
        newest = self.tokens.read(slots, fb.extend_prefix_lens[batch.num_extend:])
        if batch.mode.is_decode():
            fb.input_ids = newest
        elif batch.mode.is_verify():
            fb.input_ids[fb.extend_start_loc] = newest
        else:
            fb.input_ids[fb.num_tokens - num_device:] = newest

    def _input_embeds(self, batch: ScheduleBatch, fb: ForwardBatch) -> torch.Tensor:
        """Every row's token embedding, with the rows of prompt positions of requests
        that came with `input_embeds` replaced by theirs."""
        embeds = self.runner.embed(fb.input_ids)
        rows, given = [], []
        offset = 0
        for i, req in enumerate(batch.reqs[:batch.num_extend]):
            start, ext = batch.prefix_lens[i], batch.extend_lens[i]
            if req.input_embeds is not None:
                end = min(start + ext, len(req.input_embeds))
                if end > start:
                    rows += range(offset, offset + end - start)
                    given.append(req.input_embeds[start:end])
            offset += ext
        if rows:
            index = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
            embeds[index] = to_device(torch.cat(given), self.device, embeds.dtype)
        return embeds

    def _sample(self, batch: ScheduleBatch, fb: ForwardBatch, logits: torch.Tensor,
                prompt: tuple[list[Any], list[Any]] | None,
                draft_probs: list[torch.Tensor | None] | None = None) -> PendingResult:
        """Sample every sampling row on the device, keep a verify's agreed drafts,
        record the tokens in the token table and start copying them to the host.
        `draft_probs[i]`: the distribution request i's drafts were sampled from
        (speculative sampling, `speculative/rejection.py`; None: kept while they
        equal the target's own tokens)."""
        reqs = batch.sampling_reqs
        rows = _row_params(batch)
        info = SamplingBatchInfo.build(*rows, self.limits.vocab_size, self.device)
        want_lp = any(r.return_logprob for r in reqs)
        top_k = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        if batch.mask_logits is not None:
            logits = batch.mask_logits(reqs, logits, batch.drafts)
        out = self.sampler(logits, info, want_lp, top_k)
        if self.tp_sync is not None:  # every rank continues with rank 0's tokens
            tp.tensor_model_parallel_broadcast(out.next_token_ids)
        ids, kept, paths = out.next_token_ids, None, None
        if batch.mode.is_verify() and batch.draft_parents is not None:
            # A tree: the kept path's rows first, so the result reads as a chain's.
            assert draft_probs is None or all(q is None for q in draft_probs), \
                "tree drafts are verified by equality: no draft distributions"
            tokens, counts_t, paths = tree.accept_path(
                ids, batch.drafts, batch.draft_parents, self.device)
            kept = (tokens, counts_t)
            order = _path_order(batch, paths, self.device)
            ids = ids[order]
            if out.logprobs is not None:
                out.logprobs = out.logprobs[order]
            if out.top_logprobs is not None:
                out.top_logprobs = tuple(t[order] for t in out.top_logprobs)
        elif batch.mode.is_verify():
            kept = _accept_drafts(batch, ids, self.device)
            if draft_probs is not None and any(q is not None for q in draft_probs):
                kept, ids = self._verify_sampled(batch, logits, rows, ids, draft_probs, kept)
                if want_lp and out.logprobs is not None:
                    out.logprobs = token_logprobs(logits, info, ids)
        counts = self._record_tokens(batch, fb, ids, kept)
        tensors = [ids]
        if want_lp and out.logprobs is not None:
            tensors.append(out.logprobs)
            if top_k and out.top_logprobs is not None:
                tensors += list(out.top_logprobs)
        return PendingResult(batch, [_to_host(t) for t in tensors], _record_event(self.device),
                             prompt, counts=None if counts is None else _to_host(counts),
                             hidden_states=fb.captured or None,
                             paths=None if paths is None else _to_host(paths))

    def _verify_sampled(self, batch: ScheduleBatch, logits: torch.Tensor, rows: tuple[list, ...],
                        sampled: torch.Tensor, draft_probs: list[torch.Tensor | None],
                        kept: tuple[torch.Tensor, torch.Tensor]
                        ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """Speculative sampling for the requests whose drafts came with their q:
        their kept tokens and counts replace the equality test's, and each of their
        rows stands for the token it decided (returned, per row)."""
        offsets = [0, *itertools.accumulate(len(d) + 1 for d in batch.drafts)]
        which = [i for i, q in enumerate(draft_probs) if q is not None]
        flat = [r for i in which for r in range(offsets[i], offsets[i + 1])]
        local, at = [], 0
        for i in which:
            local.append(list(range(at, at + len(batch.drafts[i]) + 1)))
            at += len(batch.drafts[i]) + 1
        info = SamplingBatchInfo.build(*([col[r] for r in flat] for col in rows),
                                       self.limits.vocab_size, self.device)
        index = to_device(torch.tensor(flat, dtype=torch.int64), self.device)
        tokens, counts = verify_sampled(
            logits[index], info, local, [batch.drafts[i] for i in which],
            [draft_probs[i] for i in which], sampled[index],
            [batch.reqs[i].seed for i in which], [batch.first_out(i) for i in which])
        all_tokens, all_counts = (t.clone() for t in kept)
        req_index = to_device(torch.tensor(which, dtype=torch.int64), self.device)
        all_tokens[req_index] = 0
        all_tokens[req_index, :tokens.shape[1]] = tokens
        all_counts[req_index] = counts
        ids = sampled.clone()
        pick = [(a, j) for a, rows_a in enumerate(local) for j in range(len(rows_a))]
        src = to_device(torch.tensor(pick, dtype=torch.int64), self.device)
        ids[index] = tokens[src[:, 0], src[:, 1]]
        return (all_tokens, all_counts), ids

    def _record_tokens(self, batch: ScheduleBatch, fb: ForwardBatch, sampled: torch.Tensor,
                       kept: tuple[torch.Tensor, torch.Tensor] | None = None
                       ) -> torch.Tensor | None:
        """Write the sampled tokens into the token table; for a verify batch (`kept`:
        each request's tokens and how many it keeps) return the counts (on the device)."""
        idx = [i for i in range(batch.batch_size) if batch.sample[i]]
        # Every request samples in decode and verify steps: no index to copy over.
        sel = None if len(idx) == batch.batch_size else \
            to_device(torch.tensor(idx, dtype=torch.int64), self.device)

        def pick(t: torch.Tensor, lo: int = 0, hi: int | None = None) -> torch.Tensor:
            return t[lo:hi] if sel is None else t[sel[lo:hi]]

        slots = pick(fb.req_pool_indices)
        if kept is not None:
            tokens, counts = kept
            self.tokens.write_steps(slots, pick(fb.extend_prefix_lens), tokens, counts)
            return counts
        n_ext = sum(1 for i in idx if i < batch.num_extend)
        if n_ext:  # prefill rows: the token after each request's last input
            last = pick(fb.extend_prefix_lens + fb.extend_seq_lens, 0, n_ext)
            self.tokens.write_extend(slots[:n_ext], last, sampled[:n_ext])
        if n_ext < len(idx):  # decode rows
            self.tokens.write_steps(slots[n_ext:], pick(fb.extend_prefix_lens, n_ext),
                                    sampled[n_ext:, None])
        return None

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
        hidden = self.runner.forward_hidden(fb)
        rows = list(hidden.split(batch.extend_lens))
        return PendingResult.done(batch, BatchResult([[] for _ in batch.reqs], hidden=rows))


def _row_params(batch: ScheduleBatch) -> tuple[list[Any], ...]:
    """`SamplingBatchInfo.build`'s per-row lists, one row per sampled logit row: a
    verify request's row j is its output index first_out + j (the seed's step),
    after its drafts 0..j - 1 (the context of its penalties); in a tree, first_out
    + the row's depth, after the drafts on its path."""
    params, seeds, steps, prompts, outputs, bans = [], [], [], [], [], []
    for i, req in enumerate(batch.reqs):
        first = batch.first_out(i)
        m = batch.sample_rows(i)
        contexts = tree.row_contexts(batch.drafts[i], batch.draft_parents[i]) \
            if m and batch.draft_parents is not None else None
        for j in range(m):
            if contexts is not None:
                drafted = contexts[j]
            else:
                drafted = batch.drafts[i][:j] if j else []
            d = len(drafted)
            params.append(req.sampling_params)
            seeds.append(req.seed)
            steps.append(first + d)
            prompts.append(req.origin_input_ids)
            outputs.append(req.output_ids + drafted if drafted else req.output_ids)
            bans.append(min_tokens_ban(req, d))
    return params, seeds, steps, prompts, outputs, bans


def _last_rows(lens: list[int]) -> list[int]:
    """Each request's last row of a flat layout with these row counts."""
    out, acc = [], 0
    for n in lens:
        acc += n
        out.append(acc - 1)
    return out


def _path_order(batch: ScheduleBatch, paths: torch.Tensor, device: torch.device
                ) -> torch.Tensor:
    """Flat row index putting each verify request's kept path first (row j of the
    result is path row j; the rest after, in any order)."""
    lens = batch.extend_lens
    offsets = torch.tensor([0, *itertools.accumulate(lens)][:-1], dtype=torch.int64)
    width = paths.shape[1]
    cols = torch.arange(width)
    rows = to_device(offsets, device)[:, None] + paths  # [n, W]: flat rows of the path
    valid = to_device(cols[None, :] < torch.tensor(lens)[:, None], device)
    order = torch.arange(sum(lens), device=device)
    dst = to_device(offsets[:, None] + cols[None, :], device)
    order[dst[valid]] = rows[valid]
    return order


def _accept_drafts(batch: ScheduleBatch, sampled: torch.Tensor, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sampled tokens [n, K + 1] per verify request, padded; how many to keep [n]).
    Row j's token is the target's at the position after draft j; draft j + 1 is
    kept while it equals row j's token, then the target's own token ends the run."""
    lens = [len(d) for d in batch.drafts]
    width = max(lens) + 1
    index, padded, offset = [], [], 0
    for k, drafts in zip(lens, batch.drafts):
        index.append([offset + min(j, k) for j in range(width)])
        padded.append(drafts + [-1] * (width - 1 - k))  # -1 never matches
        offset += k + 1
    flat_index, flat_drafts = ints_to_device([[i for row in index for i in row],
                                              [t for row in padded for t in row]], device)
    index_t = flat_index.view(len(lens), width)
    drafts_t = flat_drafts.view(len(lens), width - 1)
    tokens = sampled[index_t]
    agree = (tokens[:, :-1] == drafts_t).cumprod(dim=1).sum(dim=1)  # bool cumprod: int64
    return tokens, agree + 1


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
