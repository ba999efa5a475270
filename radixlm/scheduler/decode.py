"""The running batch: requests whose prompt is in the KV pool, one token a step.

`DecodeManager` owns the running requests, the decode memory reservation that
admission respects (`reserve`: each running request is assumed to still need
`new_token_ratio` x its remaining tokens, clipped; the ratio decays while
decoding goes well and jumps back after a retraction, SGLang's scheme), and
retraction when one more decode step would not fit: requests with the most
work left (then the newest) go back to the waiting queue with their output
so far, and resume later by prefilling prompt + output again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from radixlm.config import ServerArgs
from radixlm.scheduler.kv_manager import KVManager
from radixlm.scheduler.req import Req
from radixlm.scheduler.schedule_batch import ScheduleBatch
from radixlm.scheduler.stats import Stats
from radixlm.speculative import tree
from radixlm.speculative.tree import DraftTree

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RESERVE_CLIP = 4096  # a request's reservation counts at most this many future tokens
RETRACT_HEADROOM_STEPS = 8


class DecodeManager:
    def __init__(self, args: ServerArgs, kv: KVManager, stats: Stats,
                 requeue: Callable[[Req], None], context_len: int) -> None:
        """`requeue(req)` takes a retracted request back into the waiting queue."""
        self.kv = kv
        self.stats = stats
        self.requeue = requeue
        self.running: list[Req] = []
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness
        self.context_len = context_len

    def reserve(self) -> int:
        """KV slots admission must leave for the running requests' future tokens."""
        return int(sum(min(r.remaining_new_tokens(), RESERVE_CLIP) for r in self.running)
                   * self.new_token_ratio)

    def remove(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)

    # ---- one decode step ------------------------------------------------------------
    def schedule(self, drafts: dict[str, list[int] | DraftTree] | None = None
                 ) -> tuple[list[Req], ScheduleBatch | None]:
        """KV for the next step of every running request: (requests that must first
        catch up on tokens without KV, admitted as extends; the decode batch of the
        rest). Retracts first if the step would not fit. `drafts` (by rid, from a
        drafter): those requests verify them, which takes a KV slot per draft too,
        and the batch is a verify batch (the others verify no draft). A `DraftTree`
        verifies a tree: a slot per node, the same verify batch."""
        behind = [r for r in self.running if r.kv_behind > 0]
        # Catch-up extends and a verify do not share a forward: no drafts this step.
        drafts = {} if behind or not drafts else drafts
        self._ensure_memory(drafts)
        behind = [r for r in self.running if r.kv_behind > 0]  # retraction may drop some
        batch = [r for r in self.running if r.kv_behind <= 0] if behind else list(self.running)
        for req in behind:  # a step accepted several tokens without their KV
            req.extend_input_len = req.kv_behind + 1
            slots = self.kv.admit(req, req.extend_input_len)
            assert slots is not None, "decode memory was checked"
        if not batch:
            return behind, None
        fitted = [self._fit(r, drafts.get(r.rid, ())) for r in batch]
        proposed = [d for d, _ in fitted]
        parents = [p for _, p in fitted]
        counts = [len(d) + 1 for d in proposed]
        locs = self.kv.alloc(sum(counts))
        assert locs is not None, "decode memory was checked"
        prefix_lens = [r.kv_len for r in batch]
        self.kv.extend_decode(batch, locs, counts)
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                   self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        if any(proposed):
            trees = None if all(tree.is_chain(p) for p in parents) else parents
            return behind, ScheduleBatch.verify(batch, prefix_lens, proposed, locs, trees)
        return behind, ScheduleBatch.decode(batch, prefix_lens, locs)

    def _fit(self, req: Req, drafts: Sequence[int] | DraftTree
             ) -> tuple[list[int], list[int]]:
        """The drafts worth verifying and their parents: no deeper than the request
        may still generate after the target's own token, no more than its context
        has positions for. A request with a grammar verifies a tree's first branch
        (its masks follow one path of drafts)."""
        depth = max(min(req.remaining_new_tokens() - 1, self.context_len - req.kv_len - 1), 0)
        if not isinstance(drafts, DraftTree):
            kept = list(drafts[:depth])
            return kept, tree.chain_parents(len(kept))
        if req.grammar is not None:
            kept = tree.first_branch(drafts.tokens, drafts.parents)[:depth]
            return kept, tree.chain_parents(len(kept))
        return tree.fit(drafts.tokens, drafts.parents, depth,
                        max(self.context_len - req.kv_len - 1, 0))

    def _ensure_memory(self, drafts: dict[str, list[int] | DraftTree]) -> None:
        """Retract requests until one decode step fits with some headroom."""
        def need() -> int:
            steps = sum(min(r.remaining_new_tokens(), RETRACT_HEADROOM_STEPS)
                        for r in self.running)
            return max(steps, sum(max(r.kv_behind, 0) + 1 + len(drafts.get(r.rid, ()))
                                  for r in self.running))

        if self.kv.available() >= need():
            return
        order = sorted(self.running, key=lambda r: (r.remaining_new_tokens(),
                                                    -len(r.output_ids)))
        while len(self.running) > 1 and self.kv.available() < need():
            self.retract(order.pop())
        if self.kv.available() < len(self.running):
            raise RuntimeError("KV pool too small for a single request's decode step")
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.3)
        logger.info("retracted requests to free KV memory; %d running", len(self.running))

    def retract(self, req: Req) -> None:
        """Take the request out of the running batch, free its KV (the computed part
        goes to the prefix cache) and requeue it; its output so far is kept."""
        self.running.remove(req)
        self.kv.release(req)
        req.num_retractions += 1
        self.stats.num_retractions += 1
        self.requeue(req)

    def preempt_for(self, req: Req) -> Req | None:
        """Retract the running request of the lowest priority below `req`'s (the one
        with the most work left among those); None if there is none."""
        lower = [r for r in self.running if r.priority < req.priority]
        if not lower:
            return None
        victim = min(lower, key=lambda r: (r.priority, -r.remaining_new_tokens(),
                                           -len(r.output_ids)))
        self.retract(victim)
        self.stats.num_preemptions += 1
        logger.info("preempted request %s (priority %d) for %s (priority %d)", victim.rid,
                    victim.priority, req.rid, req.priority)
        return victim
