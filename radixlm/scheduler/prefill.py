"""Admission: the waiting queue, and which of its requests prefill next.

`PrefillManager.schedule` orders the queue (`policy.order_waiting`: by
priority first under priority scheduling), matches each candidate's prefix
in the cache and admits requests while the round's budgets last: the token
budget (`--max-prefill-tokens`), the chunk size (`--chunked-prefill-size`;
a prompt longer than what is left is admitted in part and becomes the one
`chunked_req`, continued first next round), the running-request limit, and
KV memory after the decode reservation. With `--priority-preemption` a
request that does not fit may retract lower-priority running requests
(`DecodeManager.preempt_for`); they are requeued and resume later.
"""

from __future__ import annotations

from radixlm.config import ServerArgs
from radixlm.scheduler.decode import RESERVE_CLIP, DecodeManager
from radixlm.scheduler.kv_manager import KVManager
from radixlm.scheduler.policy import order_waiting
from radixlm.scheduler.req import Req
from radixlm.scheduler.stats import Stats

# Two waiting requests whose uncached parts begin with this many equal tokens are
# not prefilled in the same batch: the second waits a round and reuses the first's KV.
IN_BATCH_PREFIX_TOKENS = 32


class PrefillManager:
    def __init__(self, args: ServerArgs, kv: KVManager, stats: Stats,
                 max_running_requests: int) -> None:
        self.args = args
        self.kv = kv
        self.stats = stats
        self.max_running_requests = max_running_requests
        self.radix = not args.disable_radix_cache
        self.waiting: list[Req] = []
        self.chunked_req: Req | None = None  # admitted in part, continued first

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.chunked_req)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def requeue(self, req: Req) -> None:
        """A retracted request: back at the front, to resume first."""
        self.waiting.insert(0, req)

    def remove(self, req: Req) -> None:
        if req is self.chunked_req:
            self.chunked_req = None
        elif req in self.waiting:
            self.waiting.remove(req)

    def schedule(self, decode: DecodeManager) -> list[Req]:
        """Admit the next prefill round: requests with KV for their next
        `extend_input_len` tokens allocated, removed from the queue."""
        if not self.waiting and self.chunked_req is None:
            return []
        if self.chunked_req is None and len(decode.running) >= self.max_running_requests \
                and not self._may_preempt(decode):
            return []  # full: don't order (or, for lpm, match) the queue every decode step
        budget = _Budget(self.args, self.kv.available() - decode.reserve())
        batch: list[Req] = []
        batch_keys: set[tuple[int, ...]] = set()
        candidates = order_waiting(self.args.schedule_policy, self.waiting, self.kv.match,
                                   self.radix, self.args.enable_priority_scheduling)
        if self.chunked_req is not None:
            candidates.insert(0, self.chunked_req)
        for req in candidates:
            if req is not self.chunked_req:
                self.kv.match(req)
                if self._shares_with_batch(req, batch_keys):
                    continue
            if not self._admit(req, batch, budget, decode):
                break
            if req.is_chunked:
                break  # one partly prefilled request at a time
        for req in batch:
            self.remove(req)
        return batch

    def _admit(self, req: Req, batch: list[Req], budget: _Budget,
               decode: DecodeManager) -> bool:
        """Admit `req` (or the part of it that fits) into `batch`; False: stop the round."""
        while len(decode.running) + len(batch) >= self.max_running_requests:
            if not self._preempt(req, decode, budget):
                return False
        remaining = len(req.fill_ids) - (req.kv_len if req.req_pool_idx is not None
                                         else len(req.prefix_indices))
        extend = min(remaining, budget.chunk_left, budget.tokens_left)
        if extend <= 0:
            return False
        need = extend + (0 if extend < remaining else
                         int(min(req.remaining_new_tokens(), RESERVE_CLIP)
                             * decode.new_token_ratio))
        while need > budget.mem_left and self._preempt(req, decode, budget):
            pass
        if need > budget.mem_left:
            if batch or decode.running:
                return False
            # Nothing else runs: admit as much of this prompt as fits now.
            extend = min(extend, self.kv.available())
            if extend <= 0:
                return False
        if self.kv.admit(req, extend) is None:
            return False
        req.extend_input_len = extend
        req.is_chunked = extend < remaining
        if req.cached_tokens < 0:
            req.cached_tokens = len(req.prefix_indices)
            self.stats.num_cached_tokens += req.cached_tokens
        batch.append(req)
        budget.take(extend, need)
        return True

    def _may_preempt(self, decode: DecodeManager) -> bool:
        if not (self.args.priority_preemption and self.waiting):
            return False
        top = max(r.priority for r in self.waiting)
        return any(r.priority < top for r in decode.running)

    def _preempt(self, req: Req, decode: DecodeManager, budget: _Budget) -> bool:
        """Retract one running request of lower priority than `req` (it is requeued
        and resumes later); True if one was."""
        if not self.args.priority_preemption:
            return False
        before = self.kv.available() - decode.reserve()
        if decode.preempt_for(req) is None:
            return False
        budget.mem_left += self.kv.available() - decode.reserve() - before
        return True

    def _shares_with_batch(self, req: Req, keys: set[tuple[int, ...]]) -> bool:
        if not self.radix:
            return False
        end = len(req.prefix_indices) + IN_BATCH_PREFIX_TOKENS
        if len(req.fill_ids) <= end:
            return False
        key = (req.namespace, *req.fill_ids[:end])
        if key in keys:
            return True
        keys.add(key)
        return False


class _Budget:
    """What is left of one prefill round."""

    def __init__(self, args: ServerArgs, mem_left: int) -> None:
        size = args.chunked_prefill_size
        self.chunk_left = size if size > 0 else 1 << 62
        self.tokens_left = args.max_prefill_tokens
        self.mem_left = mem_left

    def take(self, tokens: int, memory: int) -> None:
        self.chunk_left -= tokens
        self.tokens_left -= tokens
        self.mem_left -= memory
