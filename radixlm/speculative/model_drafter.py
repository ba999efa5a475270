"""Drafting with a model on the worker's device: the draft runner, its KV, its steps.

A `ModelDrafter` owns a second `ModelRunner` (a small model, or an EAGLE head)
whose KV pool the memory plan sizes beside the target's, with the same slots: a
token's draft KV lives at the slot the scheduler gave the token. The worker
calls three hooks:

- `draft(batch)`, before a verify forward, after the decode manager took the
  verify's slots: runs the draft model's steps into those slots and writes the
  draft tokens into `batch.drafts` (one host copy for the whole batch). The
  first step is a short verify-mode forward over each request's rows whose
  draft KV is missing ("catch-up": its newest token, and tokens the last
  verify accepted); the others are single decode steps. Both kinds replay the
  draft runner's CUDA graphs. Sampling requests draw their drafts from the
  draft distribution q (returned, per request, for `rejection.verify_sampled`);
  greedy ones take the argmax.
- `observe(batch, fb)`, after every target forward: computes the draft KV of
  prefill rows (so a cached prefix carries it too), and keeps what a draft head
  reads of the target (its hidden states at the new positions).
- `kv_requests` / `attach_pools` at start-up.

Per request the drafter tracks which leading positions hold valid draft KV:
catch-up rows end the gap, and a draft step's KV stays valid where the token
it read is the one kept there (the verify accepted it). Rejected drafts' slots
are freed by the scheduler and their draft KV is overwritten when the slots come
back. A cached prefix is taken to hold the draft KV of the tokens that made it
(stale only for the last positions of a request that stopped mid-draft: worse
drafts, never other tokens).

Subclasses say what a draft row reads: STANDALONE its own token at the
position (`shift` 0), EAGLE the token after it and the target's hidden state
at it (`shift` 1, `row_features`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from radixlm.config import ServerArgs
from radixlm.forward_batch import ForwardBatch, ForwardMode, HiddenCapture
from radixlm.runtime.memory_plan import KVPools, KVRequest
from radixlm.runtime.model_runner import ModelRunner
from radixlm.scheduler.drafter import Drafter, drafts_within
from radixlm.scheduler.req import Req
from radixlm.scheduler.schedule_batch import ScheduleBatch
from radixlm.speculative import tree as tree_mod
from radixlm.speculative.rejection import draft_info, sample_drafts
from radixlm.utils import to_device

logger = logging.getLogger(__name__)

# Most catch-up rows per request: after a long pause of speculation (a large
# batch) older positions keep stale draft KV rather than stall one step.
MAX_CATCH_UP = 32


@dataclass
class DraftState:
    """One request's draft KV: positions [0, valid) hold it; `pending` (position,
    token) are draft-step KV that holds if that token is kept there."""

    pool_idx: int
    valid: int
    pending: list[tuple[int, int]] = field(default_factory=list)
    # Draft heads: the target's features of positions feats_start.. (one row each).
    feats_start: int = 0
    feats: torch.Tensor | None = None
    # Draft heads after a tree verify: (its first position, the target's states of
    # its rows, its drafts, their parents) until the kept path is known.
    tree: tuple[int, torch.Tensor, list[int], list[int]] | None = None

    def put_features(self, start: int, rows: torch.Tensor) -> None:
        """Record the target's features of positions start..; what the state had
        from `start` on (rejected drafts' rows) is replaced."""
        if self.feats is None or start < self.feats_start or \
                start > self.feats_start + self.feats.shape[0]:
            self.feats_start, self.feats = start, rows
            return
        keep = self.feats[:start - self.feats_start]
        self.feats = torch.cat([keep, rows])[-MAX_CATCH_UP:]
        self.feats_start = start + rows.shape[0] - self.feats.shape[0]


@dataclass
class _Rows:
    """The draft rows of one forward, per request: first position and count."""

    reqs: list[Req]
    starts: list[int]
    lens: list[int]
    ids: list[int]
    slots: list[int]
    src: list[int] = field(default_factory=list)  # prefill rows: their rows in the target's


class ModelDrafter(Drafter):
    drafts_on_device = True
    # The catch-up rows depend on how many drafts the last verify kept.
    needs_host_tokens = True
    shift = 0
    capture: HiddenCapture | None = None

    def __init__(self, args: ServerArgs, target: ModelRunner, runner: ModelRunner,
                 max_verify_tokens: int) -> None:
        self.args = args
        self.target = target
        self.runner = runner
        self.device = runner.device
        self.num_drafts = args.speculative_num_drafts
        # Trees (topk > 1): `num_drafts` draft steps along the best chain, each
        # step's next best tokens as leaves beside it, `tree_nodes` nodes in all.
        self.topk = args.speculative_topk
        self.tree_nodes = args.speculative_tree_nodes if self.topk > 1 else self.num_drafts
        self.max_verify_tokens = max_verify_tokens
        self.states: dict[str, DraftState] = {}
        self.req_to_token_pool: Any = None

    # ---- start-up ------------------------------------------------------------------
    def kv_requests(self) -> list[KVRequest]:
        return [self.runner.kv_request("draft")]

    def attach_pools(self, pools: KVPools) -> None:
        self.req_to_token_pool = pools.req_to_token_pool
        self.runner.attach_pools(pools, "draft")

    # ---- the scheduler's side ----------------------------------------------------------
    def forget(self, rid: str) -> None:
        self.states.pop(rid, None)

    def propose(self, reqs: list[Req]) -> dict[str, list[int]]:
        live = {r.rid for r in reqs}
        for rid in [rid for rid in self.states if rid not in live]:
            del self.states[rid]
        k = drafts_within(len(reqs), self.tree_nodes, self.max_verify_tokens)
        if k == 0:
            return {}
        # Placeholders: `draft` writes the tokens (and a tree's parents) once the
        # verify's slots exist. A request with a grammar drafts a chain.
        chain = min(k, self.num_drafts)
        return {r.rid: [0] * (chain if r.grammar is not None else k) for r in reqs
                if r.rid in self.states}

    # ---- drafting, inside the worker's verify ----------------------------------------------
    @torch.inference_mode()
    def draft(self, batch: ScheduleBatch) -> list[torch.Tensor | None]:
        """Fill `batch.drafts` with draft tokens; returns per request the draft
        distributions q [k, V] its drafts were sampled from (None: chosen greedily,
        or none)."""
        assert batch.drafts is not None
        active = [i for i, d in enumerate(batch.drafts) if d]
        probs: list[torch.Tensor | None] = [None] * batch.batch_size
        if not active:
            return probs
        if self.topk > 1:
            self._draft_trees(batch, active)
            return probs
        reqs = [batch.reqs[i] for i in active]
        ks = [len(batch.drafts[i]) for i in active]
        newest = [batch.prefix_lens[i] for i in active]  # each newest token's position
        firsts = [batch.first_out(i) for i in active]
        rows = self._catch_up_rows(reqs, newest)
        logits, feats = self._run(ForwardMode.VERIFY, rows, self._catch_up_features(rows))
        last = to_device(torch.tensor(_last_rows(rows.lens), dtype=torch.int64), self.device)
        qrows: dict[int, list[torch.Tensor]] = {}
        token = self._choose(logits[last], reqs, firsts, list(range(len(reqs))), qrows)
        tokens = [token]
        feats = feats[last] if feats is not None else None
        for j in range(1, max(ks)):
            sel = [a for a in range(len(reqs)) if ks[a] > j]
            token, feats = self._step(j, sel, reqs, newest, firsts, tokens[-1], feats, qrows)
            tokens.append(token)
        host = torch.stack(tokens, dim=1).tolist()  # the one sync
        for a, i in enumerate(active):
            batch.drafts[i] = host[a][:ks[a]]
            self._after_draft(reqs[a], newest[a], batch.drafts[i])
            if a in qrows:
                probs[i] = torch.stack(qrows[a])
        return probs

    def _draft_trees(self, batch: ScheduleBatch, active: list[int]) -> None:
        """Trees (topk > 1) for the requests `active`, every draft chosen without
        sampling (kept by equality, which keeps a sampling request's seeded tokens
        too): the draft model's steps follow its argmax chain, as many as the
        request's nodes allow up to `num_drafts`; the remaining nodes are the next
        best tokens of those steps, highest cumulative draft probability first
        (EAGLE-2's score), each under the chain node its step read. Requests with a
        grammar get the chain alone (their masks follow one path). Rows: the
        chain first (row d at depth d, the slots its draft KV went to), then the
        leaves by depth."""
        reqs = [batch.reqs[i] for i in active]
        nodes = [len(batch.drafts[i]) for i in active]
        ks = [min(n, self.num_drafts) for n in nodes]
        newest = [batch.prefix_lens[i] for i in active]
        rows = self._catch_up_rows(reqs, newest)
        logits, feats = self._run(ForwardMode.VERIFY, rows, self._catch_up_features(rows))
        last = to_device(torch.tensor(_last_rows(rows.lens), dtype=torch.int64), self.device)
        steps_logits = logits[last]
        tops_lp, tops_id = [], []

        def top(step_logits: torch.Tensor) -> torch.Tensor:
            lp, ids = torch.log_softmax(step_logits.float(), dim=-1).topk(self.topk, dim=-1)
            tops_lp.append(lp)
            tops_id.append(self._to_target(ids))
            return self._to_target(ids[:, 0])

        token = top(steps_logits)
        tokens = [token]
        feats = feats[last] if feats is not None else None
        for j in range(1, max(ks)):
            sel = [a for a in range(len(reqs)) if ks[a] > j]
            step_logits, out = self._step_logits(j, sel, reqs, newest, tokens[-1], feats)
            full = torch.zeros_like(tops_lp[0])
            full_ids = torch.zeros_like(tops_id[0])
            index = to_device(torch.tensor(sel, dtype=torch.int64), self.device)
            lp, ids = torch.log_softmax(step_logits.float(), dim=-1).topk(self.topk, dim=-1)
            full[index], full_ids[index] = lp, self._to_target(ids)
            tops_lp.append(full)
            tops_id.append(full_ids)
            token = tokens[-1].clone()
            token[index] = full_ids[index, 0]
            tokens.append(token)
            if out is not None and feats is not None:
                feats = feats.clone()
                feats[index] = out
        lp_host = torch.stack(tops_lp, dim=1).tolist()  # [n, steps, topk]; the one sync
        id_host = torch.stack(tops_id, dim=1).tolist()
        parents_all = batch.draft_parents or [tree_mod.chain_parents(len(d))
                                              for d in batch.drafts]
        for a, i in enumerate(active):
            k, n = ks[a], nodes[a]
            chain = [id_host[a][d][0] for d in range(k)]
            toks, parents = list(chain), tree_mod.chain_parents(k)
            if batch.reqs[i].grammar is None and n > k:
                cum, leaves = 0.0, []
                for d in range(k):  # step d's alternatives hang under chain row d
                    leaves += [(cum + lp_host[a][d][c], d, id_host[a][d][c])
                               for c in range(1, self.topk)]
                    cum += lp_host[a][d][0]
                best = sorted(leaves, key=lambda x: -x[0])[:n - k]
                for _, d, t in sorted(best, key=lambda x: x[1]):
                    toks.append(t)
                    parents.append(d)
            assert len(toks) == n, "a tree fills the verify's slots"
            batch.drafts[i] = toks
            parents_all[i] = parents
            self._after_draft(reqs[a], newest[a], chain)
        if any(not tree_mod.is_chain(p) for p in parents_all):
            batch.draft_parents = parents_all

    def _step_logits(self, j: int, sel: list[int], reqs: list[Req], newest: list[int],
                     prev: torch.Tensor, feats: torch.Tensor | None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft step j's logits (and head features) of the requests `sel`, their
        input the previous step's token."""
        sub = [reqs[a] for a in sel]
        pos = [newest[a] - self.shift + j for a in sel]
        rows = _Rows(sub, pos, [1] * len(sel), [0] * len(sel),
                     [r.slots[p] for r, p in zip(sub, pos)])
        index = to_device(torch.tensor(sel, dtype=torch.int64), self.device)
        return self._run(ForwardMode.DECODE, rows,
                         None if feats is None else feats[index], input_ids=prev[index])

    def _catch_up_rows(self, reqs: list[Req], newest: list[int]) -> _Rows:
        """Each request's rows from its first position without draft KV to the last
        one whose input is known (the newest token, or the one before it)."""
        starts, lens, ids, slots = [], [], [], []
        for req, pos in zip(reqs, newest):
            st = self.states[req.rid]
            _validate(st, req, pos)
            end = pos - self.shift  # inclusive
            start = min(max(st.valid, end + 1 - MAX_CATCH_UP, self._first_row(st)), end)
            fill = req.fill_ids
            starts.append(start)
            lens.append(end + 1 - start)
            ids += fill[start + self.shift:end + 1 + self.shift]
            slots += req.slots[start:end + 1]
        return _Rows(reqs, starts, lens, ids, slots)

    def _first_row(self, st: DraftState) -> int:
        """The earliest position a catch-up row may start at (draft heads: the first
        one whose target features were kept)."""
        return 0

    def _catch_up_features(self, rows: _Rows) -> torch.Tensor | None:
        return None

    def _step(self, j: int, sel: list[int], reqs: list[Req], newest: list[int],
              firsts: list[int], prev: torch.Tensor, feats: torch.Tensor | None,
              qrows: dict[int, list[torch.Tensor]]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft step j (j >= 1) of the requests `sel`: one decode row each, its input
        the previous step's draft. Returns every request's latest draft token (the
        others' unchanged) and features."""
        sub = [reqs[a] for a in sel]
        pos = [newest[a] - self.shift + j for a in sel]
        rows = _Rows(sub, pos, [1] * len(sel), [0] * len(sel),
                     [r.slots[p] for r, p in zip(sub, pos)])
        index = to_device(torch.tensor(sel, dtype=torch.int64), self.device)
        whole = len(sel) == prev.shape[0]
        logits, out = self._run(ForwardMode.DECODE, rows,
                                None if feats is None else feats if whole else feats[index],
                                input_ids=prev if whole else prev[index])
        token = self._choose(logits, sub, [firsts[a] + j for a in sel], sel, qrows)
        if whole:
            return token, out
        full = prev.clone()
        full[index] = token
        if out is not None and feats is not None:
            feats = feats.clone()
            feats[index] = out
        return full, feats

    def _run(self, mode: ForwardMode, rows: _Rows, feats: torch.Tensor | None,
             input_ids: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft forward over `rows`: (logits of every row, the head's output
        features per row, or None)."""
        r = self.runner
        fb = ForwardBatch.build(mode, rows.ids, [q.req_pool_idx for q in rows.reqs],
                                rows.starts, rows.lens, torch.tensor(rows.slots,
                                                                     dtype=torch.int64),
                                r.req_to_token_pool, r.kv_pool, r.attn_backend, self.device)
        if input_ids is not None:
            fb.input_ids = input_ids
        if feats is not None:
            r.model.bind_features(feats)
        logits = r.forward(fb)
        out = fb.captured[0] if fb.captured else None
        return logits, out

    def _choose(self, logits: torch.Tensor, reqs: list[Req], steps: list[int],
                which: list[int], qrows: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        """A draft token per row: greedy requests take the argmax, the others draw
        from q, whose row is appended to `qrows[which[row]]`."""
        tokens = logits.argmax(dim=-1)
        sampled = [a for a, r in enumerate(reqs) if not r.sampling_params.is_greedy]
        if sampled:
            index = to_device(torch.tensor(sampled, dtype=torch.int64), self.device)
            info = draft_info([reqs[a].sampling_params for a in sampled],
                              [reqs[a].seed for a in sampled], [steps[a] for a in sampled],
                              logits.shape[1], self.device)
            drawn, q = sample_drafts(logits[index], info)
            tokens[index] = drawn
            q = self._q_to_target(q)
            for row, a in enumerate(sampled):
                qrows.setdefault(which[a], []).append(q[row])
        return self._to_target(tokens)

    def _to_target(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens

    def _q_to_target(self, q: torch.Tensor) -> torch.Tensor:
        width = min(q.shape[1], self.target.vocab_size)
        out = q.new_zeros((q.shape[0], self.target.vocab_size))
        out[:, :width] = q[:, :width]
        return out

    def _after_draft(self, req: Req, pos: int, drafts: list[int]) -> None:
        """Positions through the newest now hold draft KV; the draft steps' rows
        hold until the verify says otherwise."""
        st = self.states[req.rid]
        st.valid = pos + 1
        st.pending = [(pos + j, t) for j, t in enumerate(drafts[:-1], start=1)]

    # ---- after every target forward ---------------------------------------------------
    @torch.inference_mode()
    def observe(self, batch: ScheduleBatch, fb: ForwardBatch) -> None:
        """The draft KV of the batch's prefill rows; a head's features (subclasses)."""
        rows = self._extend_rows(batch)
        if rows is not None:
            self._run(ForwardMode.EXTEND, rows, self._extend_features(batch, fb, rows))

    def _extend_rows(self, batch: ScheduleBatch) -> _Rows | None:
        """Every prefill row whose input is known (a head: the next token's too)."""
        reqs, starts, lens, ids, slots, src = [], [], [], [], [], []
        flat = batch.out_cache_loc.tolist()
        offset = 0
        for i in range(batch.num_extend):
            req, start, ext = batch.reqs[i], batch.prefix_lens[i], batch.extend_lens[i]
            fill = req.fill_ids
            n = min(ext, len(fill) - self.shift - start)
            if req.input_embeds is None and req.req_pool_idx is not None:
                self.states[req.rid] = DraftState(req.req_pool_idx, start + max(n, 0))
                if n > 0:
                    reqs.append(req)
                    starts.append(start)
                    lens.append(n)
                    ids += fill[start + self.shift:start + n + self.shift]
                    slots += flat[offset:offset + n]
                    src += range(offset, offset + n)
            offset += ext
        return _Rows(reqs, starts, lens, ids, slots, src) if reqs else None

    def _extend_features(self, batch: ScheduleBatch, fb: ForwardBatch,
                         rows: _Rows) -> torch.Tensor | None:
        return None


def _validate(st: DraftState, req: Req, pos: int) -> None:
    """Advance `valid` over pending draft-step KV whose token was kept: positions
    before the newest (`pos`: they have target KV, their slots are final)."""
    fill = req.fill_ids
    if st.pool_idx != req.req_pool_idx:
        st.valid, st.pending = 0, []
    for p, token in st.pending:
        if p != st.valid or p >= pos or fill[p] != token:
            break
        st.valid += 1
    st.pending = []


def _last_rows(lens: list[int]) -> list[int]:
    out, acc = [], 0
    for n in lens:
        acc += n
        out.append(acc - 1)
    return out
