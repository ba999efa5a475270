"""The scheduler: admits requests, builds prefill and decode batches, runs them,
and turns sampled tokens into per-request progress messages.

I/O-free by design: the offline Engine and the server's scheduler process call
`add_request` / `abort` / `step` and move the `TokenOut`s it returns.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from radixlm import distributed as tp
from radixlm.cache.base import PrefixCache
from radixlm.config import ServerArgs
from radixlm.constrained.manager import create_grammar_manager
from radixlm.forward_batch import (
    ForwardBatch,
    ForwardMode,
    SharedPrefixTracker,
    cascade_attention_wanted,
)
from radixlm.layers.sampler import Sampler, SamplingBatchInfo
from radixlm.protocol import GenerateReq, TokenOut
from radixlm.request_input import check_input
from radixlm.runtime.model_runner import ModelRunner
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.control import ControlMixin
from radixlm.scheduler.embedding import forward_hidden, pool_chunk
from radixlm.scheduler.kv_manager import KVManager
from radixlm.scheduler.policy import order_waiting
from radixlm.scheduler.req import Req
from radixlm.scheduler.session import SessionController, auto_bos_id
from radixlm.utils import to_device

logger = logging.getLogger(__name__)

# Decode reservation: each running request is assumed to still need
# `new_token_ratio` x its remaining tokens (clipped). The ratio decays while
# decoding goes well and jumps back after a retraction (SGLang's scheme).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CLIP = 4096
RETRACT_HEADROOM_STEPS = 8
# An otherwise idle loop blocks this long for a grammar compile (rather than spin).
GRAMMAR_WAIT_S = 0.05
# Two waiting requests whose uncached parts begin with this many equal tokens are
# not prefilled in the same batch: the second waits a round and reuses the first's KV.
IN_BATCH_PREFIX_TOKENS = 32


@dataclass
class InFlight:
    """A launched batch whose sampled tokens are on their way to the host."""

    reqs: list[Req]
    host: list[torch.Tensor]  # next ids [, logprobs [, top values, top ids]]
    event: torch.cuda.Event | None


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


@dataclass
class Stats:
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_generated_tokens: int = 0
    num_retractions: int = 0
    num_finished: int = 0


class Scheduler(ControlMixin):
    def __init__(self, args: ServerArgs, model_dir: str, config, tokenizer: Any,
                 gpu_id: int | None = None) -> None:
        if args.is_embedding:
            # Pooling needs the hidden state of every pooled position, and a prefix-cache
            # hit skips computing those (only K/V are cached): no sharing for embeddings.
            args = args.replace(disable_radix_cache=True)
        self.args = args
        self.tokenizer = tokenizer
        self.runner = ModelRunner(args, model_dir, config, gpu_id)
        # Tensor parallelism: ranks run this scheduler in lockstep (see TpSync).
        self.tp_sync = tp.get_tp_sync()
        self.device = self.runner.device
        self.vocab_size = self.runner.shape.vocab_size
        self.context_len = self.runner.shape.context_len
        self.max_total_tokens = self.runner.max_total_tokens
        self.max_running_requests = self.runner.max_running_requests
        self.cache = self._make_cache()
        self.kv = KVManager(self.runner.req_to_token_pool, self.runner.kv_pool, self.cache)
        self.sampler = Sampler()
        self.eos_token_ids = _eos_ids(config, tokenizer)
        self.rng = random.Random(args.random_seed)
        self.sessions = SessionController(args.random_seed, auto_bos_id(tokenizer))
        self.grammars = create_grammar_manager(args.grammar_backend, tokenizer, self.vocab_size,
                                               self.eos_token_ids, self.max_running_requests)

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.reqs: dict[str, Req] = {}
        self.pending_outputs: deque[TokenOut] = deque()
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness
        self.overlap = self.device.type == "cuda" and not args.disable_overlap_schedule
        self.in_flight: InFlight | None = None
        # future_ids[req_pool_idx]: the request's newest sampled token, on the device.
        self.future_ids = torch.zeros(self.runner.req_to_token_pool.size, dtype=torch.int64,
                                      device=self.device)
        self.stats = Stats()
        self.forward_ct = 0
        # Decode batches' shared prefixes, for backends with cascade attention.
        self.prefix_groups = SharedPrefixTracker() if cascade_attention_wanted(args) and \
            self.runner.attn_backend.supports_cascade_decode else None

    def _make_cache(self) -> PrefixCache:
        if self.args.disable_radix_cache:
            from radixlm.cache.no_prefix_cache import NoPrefixCache
            return NoPrefixCache()
        from radixlm.cache.radix_cache import RadixCache
        return RadixCache(self.runner.kv_pool)

    # ---- requests in -------------------------------------------------------------
    def add_request(self, msg: GenerateReq) -> None:
        """Queue a request; raises ValueError (with the parameter and allowed range)
        on bad input, leaving the scheduler untouched."""
        self.check_accepting()  # refused while memory is released (runtime_control.py)
        if msg.rid in self.reqs:
            raise ValueError(f"duplicate request id {msg.rid!r}")
        # An embedding server pools every request's prompt: no decoding, no sampling.
        params = SamplingParams(max_new_tokens=0) if self.args.is_embedding else \
            SamplingParams.from_wire(msg.sampling_params)
        params.validate(self.vocab_size)
        input_ids, session = list(msg.input_ids), None
        if msg.session_params is not None:  # the earlier request's context + these ids
            session = self.sessions.continuation(msg.rid, msg.session_params, input_ids)
            input_ids = session.input_ids
        self.validate_input(input_ids, params.max_new_tokens)
        self.grammars.check(params)
        seed = params.seed if params.seed is not None else self.rng.getrandbits(62)
        req = Req(rid=msg.rid, origin_input_ids=input_ids, sampling_params=params,
                  seed=seed, stream=msg.stream, return_logprob=msg.return_logprob,
                  top_logprobs_num=msg.top_logprobs_num,
                  logprob_start_len=msg.logprob_start_len if msg.return_logprob else -1,
                  eos_token_ids=self.eos_token_ids,
                  stop_str_max_len=max((len(s) for s in params.stop), default=0))
        self.reqs[req.rid] = req
        if session is not None:
            self.sessions.commit(session, req, self.abort)
        if not self.grammars.submit(req):  # else it waits for its grammar to compile
            self.waiting.append(req)

    def validate_input(self, input_ids: list[int], max_new_tokens: int) -> None:
        check_input(self, input_ids, max_new_tokens)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        targets = list(self.reqs.values()) if abort_all else (
            [self.reqs[rid]] if rid in self.reqs else [])
        for req in targets:
            req.abort()
            self._finish(req)

    # ---- the loop body -------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self.pending_outputs
                    or self.grammars.has_pending or self.in_flight)

    def step(self) -> list[TokenOut]:
        """Launch at most one batch and process the results of the previous one;
        return the progress messages that produced.

        Overlap mode (CUDA): batch N+1 is scheduled and launched before the
        sampled tokens of batch N are read back, so the host's bookkeeping runs
        while the GPU computes. Decode inputs come from `future_ids` on the
        device, written by the sampler, so N+1 needs nothing from the host about
        N. A request that N finishes still rides along in N+1; its extra token
        is dropped. Requests whose sampling needs N's tokens on the host first
        (grammar, penalties, min_new_tokens) make the step synchronous.
        """
        if self.grammars.has_pending:
            self._admit_compiled_grammars()
        if self.in_flight is not None and (not self.overlap or self._needs_sync()):
            self._process(self.in_flight)
            self.in_flight = None
        launched = None
        batch = self._schedule_prefill()
        if batch:
            launched = self._launch_prefill(batch)
        elif self.running:
            launched = self._launch_decode()
        if self.in_flight is not None:
            self._process(self.in_flight)
        self.in_flight = launched
        if self.in_flight is not None and not self.overlap:
            self._process(self.in_flight)
            self.in_flight = None
        if not self.reqs and self.in_flight is None:
            self.kv.check_invariants([])
        out = list(self.pending_outputs)
        self.pending_outputs.clear()
        self.profile_step()  # a num_steps profile stops by itself (runtime_control.py)
        return out

    def _needs_sync(self) -> bool:
        return any(r.needs_host_tokens for r in self.running)

    def _admit_compiled_grammars(self) -> None:
        idle = not (self.waiting or self.running or self.chunked_req)
        sync = self.tp_sync
        if sync is None or sync.is_leader:
            ready, failed = self.grammars.poll(GRAMMAR_WAIT_S if idle else 0.0)
        if sync is not None:  # compile times differ per rank: rank 0's poll decides
            rids = sync.broadcast_obj([r.rid for r in ready + failed] if sync.is_leader
                                      else None) or []
            if not sync.is_leader:
                ready, failed = self.grammars.poll_selected(rids)
        self.waiting += ready
        for req in failed:
            self._finish(req)

    # ---- prefill ---------------------------------------------------------------
    def _decode_reserve(self) -> int:
        return int(sum(min(r.remaining_new_tokens(), RESERVE_CLIP) for r in self.running)
                   * self.new_token_ratio)

    def _schedule_prefill(self) -> list[Req]:
        if not self.waiting and self.chunked_req is None:
            return []
        if self.chunked_req is None and len(self.running) >= self.max_running_requests:
            return []  # full: don't order (or, for lpm, match) the queue every decode step
        chunk_size = self.args.chunked_prefill_size
        chunk_left = chunk_size if chunk_size > 0 else 1 << 62
        token_budget = self.args.max_prefill_tokens
        mem_left = self.kv.available() - self._decode_reserve()
        batch: list[Req] = []
        batch_keys: set[tuple[int, ...]] = set()
        candidates = order_waiting(self.args.schedule_policy, self.waiting,
                                   self.kv.match, not self.args.disable_radix_cache)
        if self.chunked_req is not None:
            candidates.insert(0, self.chunked_req)
        for req in candidates:
            if len(self.running) + len(batch) >= self.max_running_requests:
                break
            if req is not self.chunked_req:
                self.kv.match(req)
                if self._shares_with_batch(req, batch_keys):
                    continue
            remaining = len(req.fill_ids) - req.kv_len if req.req_pool_idx is not None \
                else len(req.fill_ids) - len(req.prefix_indices)
            extend = min(remaining, chunk_left, token_budget)
            if extend <= 0:
                break
            need = extend + (0 if extend < remaining else
                             int(min(req.remaining_new_tokens(), RESERVE_CLIP)
                                 * self.new_token_ratio))
            if need > mem_left:
                if batch or self.running:
                    break
                # Nothing else runs: admit as much of this prompt as fits now.
                extend = min(extend, self.kv.available())
                if extend <= 0:
                    break
            slots = self.kv.admit(req, extend)
            if slots is None:
                break
            req.extend_input_len = extend
            req.is_chunked = extend < remaining
            if req.cached_tokens < 0:
                req.cached_tokens = len(req.prefix_indices)
                self.stats.num_cached_tokens += req.cached_tokens
            batch.append(req)
            mem_left -= need
            chunk_left -= extend
            token_budget -= extend
            if req.is_chunked:
                break  # one partly prefilled request at a time
        for req in batch:
            if req is self.chunked_req:
                self.chunked_req = None
            else:
                self.waiting.remove(req)
        return batch

    def _shares_with_batch(self, req: Req, keys: set[tuple[int, ...]]) -> bool:
        if self.args.disable_radix_cache:
            return False
        end = len(req.prefix_indices) + IN_BATCH_PREFIX_TOKENS
        if len(req.fill_ids) <= end:
            return False
        key = tuple(req.fill_ids[:end])
        if key in keys:
            return True
        keys.add(key)
        return False

    def _launch_prefill(self, batch: list[Req]) -> InFlight | None:
        input_ids, prefix_lens, extend_lens, rows, locs = [], [], [], [], []
        row_meta: list[tuple[Req, int, int]] = []  # (req, first row, first position)
        offset = 0
        for req in batch:
            start = req.kv_len - req.extend_input_len
            input_ids += req.fill_ids[start:req.kv_len]
            prefix_lens.append(start)
            extend_lens.append(req.extend_input_len)
            locs.append(self.kv.table_slots(req, start, req.kv_len))
            first = req.kv_len - 1
            if req.wants_input_logprobs:
                first = min(max(start, req.first_logprob_row), first)
            row_meta.append((req, len(rows), first))
            rows += [offset + p - start for p in range(first, req.kv_len)]
            offset += req.extend_input_len
        fb = ForwardBatch.build(
            ForwardMode.EXTEND, input_ids, [r.req_pool_idx for r in batch], prefix_lens,
            extend_lens, torch.cat(locs), self.runner.req_to_token_pool, self.runner.kv_pool,
            self.runner.attn_backend, self.device, logit_rows=rows)
        if self.args.is_embedding:
            return self._launch_embedding(batch, fb)
        logits = self.runner.forward(fb)
        self.forward_ct += 1
        self.stats.num_prompt_tokens += sum(extend_lens)

        sample_reqs, sample_rows = [], []
        for req, row0, first in row_meta:
            last_row = row0 + req.kv_len - first - 1
            if req.wants_input_logprobs:
                self._record_input_logprobs(req, logits[row0:last_row + 1], first)
            if req.is_chunked:
                continue
            if req.sampling_params.max_new_tokens == 0:  # prefill only (prompt logprobs,
                req.finished_reason = {"type": "length", "length": 0}  # prefix warm-up)
                continue
            sample_reqs.append(req)
            sample_rows.append(last_row)
        for req in batch:
            if req.is_chunked:
                self.chunked_req = req
            if not self.args.disable_radix_cache:
                # Share the prompt's KV at once with requests that arrive meanwhile.
                self.kv.cache_unfinished(req)
        for req in batch:
            if req.finished:
                self._finish(req)
        if not sample_reqs:
            return None
        self.running += sample_reqs
        return self._sample(sample_reqs, logits[sample_rows])

    def _launch_embedding(self, batch: list[Req], fb: ForwardBatch) -> None:
        """A prefill round of embedding requests: hidden states, pooled; no logits, no
        sampling. A request whose prompt is complete finishes with its embedding."""
        hidden = forward_hidden(self.runner, fb)
        self.forward_ct += 1
        self.stats.num_prompt_tokens += fb.num_tokens
        pool_chunk(hidden, batch, fb.extend_seq_lens_cpu, self.args.embedding_pooling)
        for req in batch:
            if req.is_chunked:
                self.chunked_req = req
            else:
                req.finished_reason = {"type": "length", "length": 0}
                self._finish(req)
        return None

    def _record_input_logprobs(self, req: Req, logits: torch.Tensor, first: int) -> None:
        """logits[j] (position first + j) predicts the prompt token at first + j + 1."""
        fill = req.fill_ids
        n_prompt = len(req.origin_input_ids)
        if req.logprob_start_len == 0 and not req.input_logprobs:
            req.input_logprobs.append([None, fill[0]])  # the first token has no context
            if req.top_logprobs_num:
                req.input_top_logprobs.append([])
        lo = max(first, req.first_logprob_row)
        hi = min(req.kv_len, n_prompt - 1)
        if not req.is_chunked:
            req.input_logprobs_done = True
        if hi <= lo:
            return
        logp = torch.log_softmax(logits[lo - first:hi - first], dim=-1)
        targets = torch.tensor(fill[lo + 1:hi + 1], device=logp.device)
        chosen = logp.gather(1, targets[:, None])[:, 0].tolist()
        req.input_logprobs += [[lp, t] for lp, t in zip(chosen, fill[lo + 1:hi + 1])]
        if req.top_logprobs_num:
            vals, ids = logp.topk(req.top_logprobs_num, dim=-1)
            req.input_top_logprobs += [[[v, i] for v, i in zip(vr, ir)]
                                       for vr, ir in zip(vals.tolist(), ids.tolist())]

    # ---- decode ------------------------------------------------------------------
    def _launch_decode(self) -> InFlight | None:
        self._ensure_decode_memory()
        if not self.running:
            return None
        batch = list(self.running)  # _finish() edits self.running while we process
        locs = self.kv.alloc(len(batch))
        assert locs is not None, "decode memory was checked"
        prefix_lens = [r.kv_len for r in batch]
        pool_idx = [r.req_pool_idx for r in batch]
        self.kv.extend_decode(batch, locs)
        fb = ForwardBatch.build(
            ForwardMode.DECODE, [0] * len(batch), pool_idx, prefix_lens,
            [1] * len(batch), locs, self.runner.req_to_token_pool, self.runner.kv_pool,
            self.runner.attn_backend, self.device)
        # Each request's newest token, wherever it was sampled, is on the device.
        fb.input_ids = self.future_ids[fb.req_pool_indices]
        if self.prefix_groups is not None:
            fb.prefix_groups = self.prefix_groups.find(batch)
        logits = self.runner.forward(fb)
        self.forward_ct += 1
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                   self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        return self._sample(batch, logits)

    def _ensure_decode_memory(self) -> None:
        """Retract requests (most remaining work first, then newest) until one decode
        step fits with some headroom; they are requeued and finish later."""
        def enough() -> bool:
            need = sum(min(r.remaining_new_tokens(), RETRACT_HEADROOM_STEPS)
                       for r in self.running)
            return self.kv.available() >= max(need, len(self.running))

        if enough():
            return
        order = sorted(self.running, key=lambda r: (r.remaining_new_tokens(),
                                                    -len(r.output_ids)))
        while len(self.running) > 1 and not enough():
            victim = order.pop()
            self.running.remove(victim)
            self.kv.release(victim)
            victim.num_retractions += 1
            self.stats.num_retractions += 1
            self.waiting.insert(0, victim)
        if self.kv.available() < len(self.running):
            raise RuntimeError("KV pool too small for a single request's decode step")
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)
        logger.info("retracted requests to free KV memory; %d running, %d waiting",
                    len(self.running), len(self.waiting))

    # ---- sampling and results ---------------------------------------------------
    def _sample(self, reqs: list[Req], logits: torch.Tensor) -> InFlight:
        """Sample one token per request on the device and start copying the results
        to the host; `_process` reads them."""
        info = SamplingBatchInfo.build(
            [r.sampling_params for r in reqs], [r.seed for r in reqs],
            [r.sampled_len for r in reqs], [r.origin_input_ids for r in reqs],
            [r.output_ids for r in reqs],
            [_min_tokens_ban(r) for r in reqs],
            self.vocab_size, self.device)
        want_lp = any(r.return_logprob for r in reqs)
        top_k = max((r.top_logprobs_num for r in reqs if r.return_logprob), default=0)
        logits = self.grammars.mask_logits(reqs, logits)
        out = self.sampler(logits, info, want_lp, top_k)
        if self.tp_sync is not None:  # every rank continues with rank 0's tokens
            tp.tensor_model_parallel_broadcast(out.next_token_ids)
        pool_idx = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        self.future_ids[to_device(pool_idx, self.device)] = out.next_token_ids
        for r in reqs:
            r.sampled_len += 1
        tensors = [out.next_token_ids]
        if want_lp and out.logprobs is not None:
            tensors.append(out.logprobs)
            if top_k and out.top_logprobs is not None:
                tensors += list(out.top_logprobs)
        return InFlight(reqs, [_to_host(t) for t in tensors], _record_event(self.device))

    def _process(self, batch: InFlight) -> None:
        """Read back a launched batch's tokens and advance its requests."""
        if batch.event is not None:
            batch.event.synchronize()  # the one wait on the device per step
        lists = [t.tolist() for t in batch.host]
        next_ids = lists[0]
        logprobs = lists[1] if len(lists) > 1 else None
        tops = (lists[2], lists[3]) if len(lists) > 3 else None
        for i, (req, tok) in enumerate(zip(batch.reqs, next_ids)):
            if req.finished:  # finished (or aborted) while this batch was in flight
                continue
            req.output_ids.append(tok)
            self.stats.num_generated_tokens += 1
            if req.return_logprob and logprobs is not None:
                req.output_logprobs.append([logprobs[i], tok])
                if req.top_logprobs_num and tops is not None:
                    k = req.top_logprobs_num
                    req.output_top_logprobs.append(
                        [[v, t] for v, t in zip(tops[0][i][:k], tops[1][i][:k])])
            self.grammars.advance(req, tok)
            req.check_finished(self.tokenizer)
            if req.finished:
                self._finish(req)
            elif req.stream and (req.sent_output_len == 0 or len(req.output_ids)
                                 - req.sent_output_len >= self.args.stream_interval):
                self._emit(req)  # the first token at once, then every stream_interval

    def _finish(self, req: Req) -> None:
        """Free the request's resources and report its last message. Idempotent."""
        if req.rid not in self.reqs:
            return
        del self.reqs[req.rid]
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        self.grammars.discard(req)
        self.kv.release(req)
        self.stats.num_finished += 1
        self._emit(req)

    def _emit(self, req: Req) -> None:
        new_ids = req.output_ids[req.sent_output_len:]
        req.sent_output_len = len(req.output_ids)
        msg = TokenOut(
            rid=req.rid, new_token_ids=new_ids, finish_reason=req.finished_reason,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=max(req.cached_tokens, 0),
            skip_special_tokens=req.sampling_params.skip_special_tokens,
            spaces_between_special_tokens=req.sampling_params.spaces_between_special_tokens,
            no_stop_trim=req.sampling_params.no_stop_trim, stop=req.sampling_params.stop,
            embedding=req.embedding)
        if req.return_logprob:
            msg.output_logprobs = req.output_logprobs[req.sent_logprob_len:]
            if req.top_logprobs_num:
                msg.output_top_logprobs = req.output_top_logprobs[req.sent_logprob_len:]
            req.sent_logprob_len = len(req.output_logprobs)
            if req.logprob_start_len >= 0 and not req.input_logprobs_sent:
                msg.input_logprobs = req.input_logprobs
                msg.input_top_logprobs = req.input_top_logprobs if req.top_logprobs_num \
                    else None
                req.input_logprobs_sent = True
        self.pending_outputs.append(msg)

    # ---- control -------------------------------------------------------------------
    def flush_cache(self) -> tuple[bool, str]:
        if self.reqs:
            return False, (f"cannot flush the cache while {len(self.reqs)} request(s) are "
                           f"running or queued")
        self.cache.reset()
        self.runner.kv_pool.clear()
        self.runner.req_to_token_pool.clear()
        self.kv.check_invariants([])
        return True, "cache flushed"

    def server_info(self) -> dict[str, Any]:
        live = list(self.reqs.values())
        in_use = sum(r.own_kv_len for r in live if r.req_pool_idx is not None) + \
            self.cache.protected_size()
        st = self.stats
        prompt = st.num_prompt_tokens + st.num_cached_tokens
        return {
            "kv_tokens_total": self.max_total_tokens,
            "kv_tokens_free": self.runner.kv_pool.available_size(),
            "kv_tokens_cached": self.cache.evictable_size(),
            "kv_tokens_in_use": in_use,
            "cache_hit_rate": st.num_cached_tokens / prompt if prompt else 0.0,
            "num_running_requests": len(self.running) + (1 if self.chunked_req else 0),
            "num_queued_requests": len(self.waiting),
            "max_running_requests": self.max_running_requests,
            "context_length": self.context_len,
            "num_retractions": st.num_retractions,
            "num_prompt_tokens": st.num_prompt_tokens,
            "num_cached_tokens": st.num_cached_tokens,
            "num_generated_tokens": st.num_generated_tokens,
        }

    def check_invariants(self) -> None:
        self.kv.check_invariants(list(self.reqs.values()))


def _min_tokens_ban(req: Req) -> set[int]:
    """Tokens that would stop the request, banned while it is below min_new_tokens."""
    p = req.sampling_params
    if len(req.output_ids) >= p.min_new_tokens:
        return set()
    stops = set(p.stop_token_ids)
    return stops if p.ignore_eos else stops | req.eos_token_ids


def _eos_ids(config, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(src)
    return frozenset(ids)

