"""Turning a forward's result into request progress and progress messages.

`OutputProcessor.process(batch, result)` walks each request's new tokens in
order, one at a time, exactly as if they had come in separate steps: append,
record the token's logprobs, advance the grammar, check stop tokens, stop
strings and max_new_tokens; the first token that finishes the request ends
its walk (the rest are dropped). A request that goes on gets a `TokenOut`
when it streams (its first token at once, then every `stream_interval`
tokens), one that finishes gets its last one from the scheduler's `finish`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from radixlm.constrained.manager import GrammarManager
from radixlm.protocol import TokenOut
from radixlm.scheduler.embedding import pool_chunk
from radixlm.scheduler.model_worker import BatchResult
from radixlm.scheduler.req import Req
from radixlm.scheduler.schedule_batch import ScheduleBatch
from radixlm.scheduler.stats import Stats


class OutputProcessor:
    def __init__(self, tokenizer: Any, grammars: GrammarManager, stream_interval: int,
                 stats: Stats, embedding_pooling: str | None = None) -> None:
        """`embedding_pooling` None: a generation server; else how embeddings pool."""
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.stream_interval = stream_interval
        self.stats = stats
        self.embedding_pooling = embedding_pooling
        self.pending: deque[TokenOut] = deque()

    def process(self, batch: ScheduleBatch, result: BatchResult,
                finish: Callable[[Req], None]) -> None:
        if result.hidden is not None:
            assert self.embedding_pooling is not None
            pool_chunk(result.hidden, batch.reqs, batch.finish_after, self.embedding_pooling)
        for i, req in enumerate(batch.reqs):
            if req.finished:  # finished (or aborted) while this batch was in flight
                continue
            if result.prompt_logprobs is not None and batch.prompt_logprobs[i] is not None:
                self._record_prompt_logprobs(req, result, i)
            new = result.tokens[i]
            for j, token in enumerate(new):
                self._append(req, token, result, i, j)
                if req.finished:
                    break
            if batch.finish_after[i] and not req.finished:  # prefill only (prompt logprobs,
                req.finished_reason = {"type": "length", "length": 0}  # warm-ups, embeddings)
            if req.finished:
                finish(req)
            elif new and req.stream and (req.sent_output_len == 0 or len(req.output_ids)
                                         - req.sent_output_len >= self.stream_interval):
                self.emit(req)  # the first token at once, then every stream_interval

    def _append(self, req: Req, token: int, result: BatchResult, i: int, j: int) -> None:
        req.output_ids.append(token)
        self.stats.num_generated_tokens += 1
        if req.return_logprob and result.logprobs is not None:
            req.output_logprobs.append([result.logprobs[i][j], token])
            if req.top_logprobs_num and result.top_logprobs is not None:
                req.output_top_logprobs.append(result.top_logprobs[i][j])
        self.grammars.advance(req, token)
        req.check_finished(self.tokenizer)

    @staticmethod
    def _record_prompt_logprobs(req: Req, result: BatchResult, i: int) -> None:
        assert result.prompt_logprobs is not None
        if req.logprob_start_len == 0 and not req.input_logprobs:
            req.input_logprobs.append([None, req.origin_input_ids[0]])  # it has no context
            if req.top_logprobs_num:
                req.input_top_logprobs.append([])
        req.input_logprobs += result.prompt_logprobs[i] or []
        if req.top_logprobs_num and result.prompt_top_logprobs is not None:
            req.input_top_logprobs += result.prompt_top_logprobs[i] or []

    def emit(self, req: Req) -> None:
        """Queue a message with the request's progress since its last one."""
        new_ids = req.output_ids[req.sent_output_len:]
        req.sent_output_len = len(req.output_ids)
        params = req.sampling_params
        msg = TokenOut(
            rid=req.rid, new_token_ids=new_ids, finish_reason=req.finished_reason,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=max(req.cached_tokens, 0),
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            no_stop_trim=params.no_stop_trim, stop=params.stop, embedding=req.embedding,
            spec_verify_ct=req.spec_verify_ct, spec_accepted_drafts=req.spec_accepted_drafts)
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
        self.pending.append(msg)

    def drain(self) -> list[TokenOut]:
        out = list(self.pending)
        self.pending.clear()
        return out
