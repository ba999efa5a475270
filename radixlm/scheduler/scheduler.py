"""The scheduler: the loop that ties admission, decoding, the model worker and
result processing together, and turns results into per-request messages.

    add_request ──▶ PrefillManager (waiting queue, chunked prefill, admission)
                         │ admitted                 ▲ retracted / preempted
                         ▼                          │
                    DecodeManager (running batch, decode reservation, retraction)
                         │ ScheduleBatch: prefill, decode, or both (--enable-mixed-chunk)
                         ▼
                    ModelWorker.forward ─▶ BatchResult (0..k tokens per request)
                         ▼
                    OutputProcessor (stops, stop strings, grammars, logprobs) ─▶ TokenOut

I/O-free by design: the offline Engine and the server's scheduler process call
`add_request` / `abort` / `step` / `control` and move the `TokenOut`s it returns.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch

from radixlm.cache.base import PrefixCache
from radixlm.config import ServerArgs
from radixlm.constrained.manager import create_grammar_manager
from radixlm.protocol import GenerateReq, TokenOut
from radixlm.request_input import check_input
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.control import SchedulerControl
from radixlm.scheduler.decode import DecodeManager
from radixlm.scheduler.drafter import Drafter
from radixlm.scheduler.kv_manager import KVManager
from radixlm.scheduler.model_worker import BatchResult, ModelWorker, PendingResult, Worker
from radixlm.scheduler.output import OutputProcessor
from radixlm.scheduler.prefill import PrefillManager
from radixlm.scheduler.req import Req
from radixlm.scheduler.schedule_batch import ScheduleBatch
from radixlm.scheduler.session import SessionController, auto_bos_id
from radixlm.scheduler.stats import Stats

logger = logging.getLogger(__name__)

# An otherwise idle loop blocks this long for a grammar compile (rather than spin).
GRAMMAR_WAIT_S = 0.05


class Scheduler:
    def __init__(self, args: ServerArgs, model_dir: str, config: Any, tokenizer: Any,
                 gpu_id: int | None = None, worker: Worker | None = None,
                 drafter: Drafter | None = None) -> None:
        """`worker`: a model worker to use instead of building one (tests drive the
        scheduler with scripted workers). `drafter`: proposes draft tokens that
        decode steps verify (speculative decoding; `scheduler/drafter.py`); default:
        the worker's, the one --speculative-algorithm asks for."""
        if args.is_embedding:
            # Pooling needs the hidden state of every pooled position, and a prefix-cache
            # hit skips computing those (only K/V are cached): no sharing for embeddings.
            args = args.replace(disable_radix_cache=True)
        self.args = args
        self.tokenizer = tokenizer
        self.worker: Worker = worker or ModelWorker(args, model_dir, config, gpu_id)
        self.tp_sync = self.worker.tp_sync  # ranks run this scheduler in lockstep
        self.device = self.worker.device
        limits = self.worker.limits
        self.vocab_size = limits.vocab_size
        self.hidden_size = limits.hidden_size
        self.context_len = limits.context_len
        self.max_total_tokens = limits.max_total_tokens
        self.max_running_requests = limits.max_running_requests
        self.cache = self._make_cache()
        self.kv = KVManager(self.worker.req_to_token_pool, self.worker.kv_pool, self.cache)
        self.stats = Stats()
        self.eos_token_ids = _eos_ids(config, tokenizer)
        self.rng = random.Random(args.random_seed)
        self.sessions = SessionController(args.random_seed, auto_bos_id(tokenizer))
        self.grammars = create_grammar_manager(args.grammar_backend, tokenizer, self.vocab_size,
                                               self.eos_token_ids, self.max_running_requests)
        self.prefill = PrefillManager(args, self.kv, self.stats, self.max_running_requests)
        self.decode = DecodeManager(args, self.kv, self.stats, self.prefill.requeue,
                                    self.context_len)
        self.drafter = drafter if drafter is not None else getattr(self.worker, "drafter", None)
        self.output = OutputProcessor(tokenizer, self.grammars, args.stream_interval,
                                      self.stats,
                                      args.embedding_pooling if args.is_embedding else None)
        self.controls = SchedulerControl(self)
        self.reqs: dict[str, Req] = {}
        self.overlap = self.worker.supports_overlap and not args.disable_overlap_schedule
        self.in_flight: PendingResult | None = None
        self.forward_ct = 0

    def _make_cache(self) -> PrefixCache:
        if self.args.disable_radix_cache:
            from radixlm.cache.no_prefix_cache import NoPrefixCache
            return NoPrefixCache()
        from radixlm.cache.radix_cache import RadixCache
        return RadixCache(self.worker.kv_pool)

    # The queues, as the managers hold them.
    @property
    def waiting(self) -> list[Req]:
        return self.prefill.waiting

    @property
    def running(self) -> list[Req]:
        return self.decode.running

    @property
    def chunked_req(self) -> Req | None:
        return self.prefill.chunked_req

    # ---- requests in -------------------------------------------------------------
    def add_request(self, msg: GenerateReq) -> None:
        """Queue a request; raises ValueError (naming the parameter) when it cannot be
        served, leaving the scheduler untouched.

        The front ends (radixlm/request_input.py) validated the request once on its
        way in: sampling parameters, the prompt against the limits, logprob
        arguments, the grammar's syntax. Checked here is what only the scheduler
        knows: memory released, a duplicate id, priority scheduling off, a
        session's full prompt, whether grammars can be served at all."""
        self.controls.check_accepting()  # refused while memory is released
        if msg.rid in self.reqs:
            raise ValueError(f"duplicate request id {msg.rid!r}")
        if msg.priority and not self.args.enable_priority_scheduling:
            raise ValueError(f"priority={msg.priority}: priority scheduling is off (start the "
                             "server with --enable-priority-scheduling)")
        # An embedding server pools every request's prompt: no decoding, no sampling.
        params = SamplingParams(max_new_tokens=0) if self.args.is_embedding else \
            SamplingParams.from_wire(msg.sampling_params)
        input_ids, session = list(msg.input_ids), None
        if msg.session_params is not None:  # the earlier request's context + these ids
            session = self.sessions.continuation(msg.rid, msg.session_params, input_ids)
            input_ids = session.input_ids
            self.validate_input(input_ids, params.max_new_tokens)
        self.grammars.check_servable(params)
        embeds = self._input_embeds(msg) if msg.input_embeds is not None else None
        seed = params.seed if params.seed is not None else self.rng.getrandbits(62)
        req = Req(rid=msg.rid, origin_input_ids=input_ids, sampling_params=params,
                  seed=seed, stream=msg.stream, return_logprob=msg.return_logprob,
                  top_logprobs_num=msg.top_logprobs_num,
                  logprob_start_len=msg.logprob_start_len if msg.return_logprob else -1,
                  eos_token_ids=self.eos_token_ids,
                  stop_str_max_len=max((len(s) for s in params.stop), default=0),
                  namespace=msg.namespace, priority=msg.priority, input_embeds=embeds)
        self.reqs[req.rid] = req
        if session is not None:
            self.sessions.commit(session, req, self.abort)
        if not self.grammars.submit(req):  # else it waits for its grammar to compile
            self.prefill.add(req)

    def _input_embeds(self, msg: GenerateReq) -> torch.Tensor:
        """The prompt's embeddings [positions, hidden] from the wire's float32 bytes."""
        if msg.session_params is not None:
            raise ValueError("input_embeds cannot continue a session (session_params)")
        rows = torch.frombuffer(bytearray(msg.input_embeds), dtype=torch.float32)
        if rows.numel() != len(msg.input_ids) * self.hidden_size:
            raise ValueError(f"input_embeds holds {rows.numel()} values for "
                             f"{len(msg.input_ids)} positions of hidden size {self.hidden_size}")
        return rows.view(len(msg.input_ids), self.hidden_size)

    def validate_input(self, input_ids: list[int], max_new_tokens: int) -> None:
        check_input(self, input_ids, max_new_tokens)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        targets = list(self.reqs.values()) if abort_all else (
            [self.reqs[rid]] if rid in self.reqs else [])
        for req in targets:
            req.abort()
            self._finish(req)

    def control(self, method: str, **args: Any) -> Any:
        """A control method by name (scheduler/control.py's allow-list)."""
        return self.controls.call(method, **args)

    # ---- the loop body -------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return bool(self.prefill.has_work or self.running or self.output.pending
                    or self.grammars.has_pending or self.in_flight)

    def step(self) -> list[TokenOut]:
        """Launch at most one batch and process the results of the previous one;
        return the progress messages that produced.

        Overlap mode (CUDA): batch N+1 is scheduled and launched before the
        sampled tokens of batch N are read back, so the host's bookkeeping runs
        while the GPU computes. Decode inputs come from the worker's `future_ids`
        on the device, so N+1 needs nothing from the host about N. A request that
        N finishes still rides along in N+1; its extra token is dropped. Requests
        whose sampling needs N's tokens on the host first (grammar, penalties,
        min_new_tokens) make the step synchronous.
        """
        if self.grammars.has_pending:
            self._admit_compiled_grammars()
        if self.in_flight is not None and (not self.overlap or self._needs_sync()):
            self._process(self.in_flight)
            self.in_flight = None
        launched = None
        batch = self._next_batch()
        if batch is not None:
            launched = self._launch(*batch)
        if self.in_flight is not None:
            self._process(self.in_flight, launched)
        self.in_flight = launched
        if self.in_flight is not None and not self.overlap:
            self._process(self.in_flight)
            self.in_flight = None
        self.controls.after_step()
        return self.output.drain()

    def _needs_sync(self) -> bool:
        if self.drafter is not None and self.drafter.needs_host_tokens and self.running:
            return True
        if self.drafter is not None and self.args.speculative_topk > 1 and self.running:
            return True  # a tree's kept path re-points its slots before the next step
        return any(r.needs_host_tokens for r in self.running)

    def _admit_compiled_grammars(self) -> None:
        idle = not (self.prefill.has_work or self.running)
        sync = self.tp_sync
        if sync is None or sync.is_leader:
            ready, failed = self.grammars.poll(GRAMMAR_WAIT_S if idle else 0.0)
        if sync is not None:  # compile times differ per rank: rank 0's poll decides
            rids = sync.broadcast_obj([r.rid for r in ready + failed] if sync.is_leader
                                      else None) or []
            if not sync.is_leader:
                ready, failed = self.grammars.poll_selected(rids)
        for req in ready:
            self.prefill.add(req)
        for req in failed:
            self._finish(req)

    # ---- batches ------------------------------------------------------------------
    def _next_batch(self) -> tuple[ScheduleBatch, list[Req]] | None:
        """The next forward and the requests it newly admits (seed: get_next_batch_to_run).
        A prefill round goes first; without mixed chunked prefill the running requests
        wait for it, with it (`--enable-mixed-chunk`) they decode in the same forward."""
        if self.args.enable_mixed_chunk and self.running:
            # Decode slots first: admission then sees what they leave.
            behind, decode = self.decode.schedule()
            admitted = self.prefill.schedule(self.decode)
            return self._compose(admitted + behind, decode), admitted
        admitted = self.prefill.schedule(self.decode)
        if admitted:
            return ScheduleBatch.prefill(admitted, self.kv), admitted
        if not self.running:
            return None
        drafts = self.drafter.propose(self.running) if self.drafter is not None else None
        behind, decode = self.decode.schedule(drafts)
        return self._compose(behind, decode), []

    def _compose(self, extend: list[Req], decode: ScheduleBatch | None) -> ScheduleBatch:
        if not extend:
            assert decode is not None
            return decode
        batch = ScheduleBatch.prefill(extend, self.kv)
        return batch.mix(decode) if decode is not None else batch

    def _launch(self, batch: ScheduleBatch, admitted: list[Req]) -> PendingResult:
        if self.args.is_embedding:
            pending = self.worker.forward_embedding(batch)
        else:
            if any(r.grammar is not None for r in batch.sampling_reqs):
                batch.mask_logits = self.grammars.mask_logits
            pending = self.worker.forward(batch)
        self.forward_ct += 1
        # The admitted requests lead the batch.
        for req, samples in zip(admitted, batch.sample):
            self.stats.num_prompt_tokens += req.extend_input_len
            if req.is_chunked:
                self.prefill.chunked_req = req
            elif samples:
                self.running.append(req)
        if not self.args.disable_radix_cache:
            # Share the prompt's KV at once with requests that arrive meanwhile.
            for req in admitted:
                self.kv.cache_unfinished(req)
        return pending

    def _process(self, pending: PendingResult, launched: PendingResult | None = None) -> None:
        """Read back a launched batch's result and advance its requests; `launched`:
        the batch launched after it, still in flight (overlap)."""
        batch, result = pending.batch, pending.wait()
        self.stats.num_stale_results += _drop_stale(batch, result)
        if batch.drafts is not None:
            self._count_drafts(batch, result)
        if result.paths is not None:  # a tree's kept path becomes the next positions
            for i, req in enumerate(batch.reqs):
                if result.tokens[i] and req.req_pool_idx is not None:
                    self.kv.keep_rows(req, batch.prefix_lens[i], result.paths[i],
                                      batch.extend_lens[i])
        self.output.process(batch, result, self._finish)
        ahead = _valid_rows_ahead(launched.batch) if launched is not None else {}
        for i, req in enumerate(batch.reqs):
            if batch.sample[i] and not req.finished:
                self._reconcile_kv(req, ahead.get(id(req), 0))

    def _count_drafts(self, batch: ScheduleBatch, result: BatchResult) -> None:
        for req, drafts, tokens in zip(batch.reqs, batch.drafts, result.tokens):
            if tokens and drafts:  # not stale
                accepted = len(tokens) - 1
                self.stats.num_spec_verifies += 1
                self.stats.num_draft_tokens += len(drafts)
                self.stats.num_accepted_drafts += accepted
                req.spec_verify_ct += 1
                req.spec_accepted_drafts += accepted

    def _reconcile_kv(self, req: Req, ahead: int) -> None:
        """After a step that gave a request fewer tokens than it had KV slots for (a
        verify keeping k' < k drafts): free the slots past its newest token (the
        rejected drafts', and those of a step launched meanwhile, which is then
        stale), but not the `ahead` slots of a launched step that is still valid.
        Tokens accepted without their KV get it computed in the next step."""
        excess = -req.kv_behind - ahead
        if excess > 0:
            self.kv.truncate(req, excess)

    def _finish(self, req: Req) -> None:
        """Free the request's resources and report its last message. Idempotent."""
        if req.rid not in self.reqs:
            return
        del self.reqs[req.rid]
        self.decode.remove(req)
        self.prefill.remove(req)
        self.grammars.discard(req)
        if self.drafter is not None:
            self.drafter.forget(req.rid)
        excess = req.kv_len - req.seq_len  # a verify's slots past a stop in its accepted run
        if req.req_pool_idx is not None and excess > 0:
            self.kv.truncate(req, excess)
        self.kv.release(req)
        self.stats.num_finished += 1
        self.output.emit(req)

    # ---- control -------------------------------------------------------------------
    def flush_cache(self) -> tuple[bool, str]:
        if self.reqs:
            return False, (f"cannot flush the cache while {len(self.reqs)} request(s) are "
                           f"running or queued")
        self.cache.reset()
        self.worker.kv_pool.clear()
        self.worker.req_to_token_pool.clear()
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
            "kv_tokens_free": self.worker.kv_pool.available_size(),
            "kv_tokens_cached": self.cache.evictable_size(),
            "kv_tokens_in_use": in_use,
            "cache_hit_rate": st.num_cached_tokens / prompt if prompt else 0.0,
            "num_running_requests": len(self.running) + (1 if self.chunked_req else 0),
            "num_queued_requests": len(self.waiting),
            "max_running_requests": self.max_running_requests,
            "context_length": self.context_len,
            "num_retractions": st.num_retractions,
            "num_preemptions": st.num_preemptions,
            "num_prompt_tokens": st.num_prompt_tokens,
            "num_cached_tokens": st.num_cached_tokens,
            "num_generated_tokens": st.num_generated_tokens,
            "num_spec_verifies": st.num_spec_verifies,
            "num_draft_tokens": st.num_draft_tokens,
            "num_accepted_drafts": st.num_accepted_drafts,
        }

    def check_invariants(self) -> None:
        self.kv.check_invariants(list(self.reqs.values()))


def _drop_stale(batch: ScheduleBatch, result: BatchResult) -> int:
    """Drop the tokens of requests this batch was launched too early for (an
    earlier step gave them another number of tokens than the batch's positions
    assumed, `ScheduleBatch.first_out`); returns how many."""
    dropped = 0
    for i, req in enumerate(batch.reqs):
        if result.tokens[i] and not req.finished and batch.first_out(i) != len(req.output_ids):
            result.tokens[i] = []
            dropped += 1
    return dropped


def _valid_rows_ahead(batch: ScheduleBatch) -> dict[int, int]:
    """{id(request): KV slots it holds in this in-flight batch}, for the requests
    the batch is not stale for (their token count now is what it was launched on)."""
    return {id(r): batch.extend_lens[i] for i, r in enumerate(batch.reqs)
            if batch.sample[i] and batch.first_out(i) == len(r.output_ids)}


def _eos_ids(config: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(src)
    return frozenset(ids)
