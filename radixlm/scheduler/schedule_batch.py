"""One forward as the scheduler decided it (SGLang's ScheduleBatch).

The scheduler picks the requests and gives them KV slots; a `ScheduleBatch`
records that decision in host terms (request objects, positions, slots), and
the model worker turns it into a device `ForwardBatch`, runs it and samples.
Nothing here touches the device.

Per request i: `extend_lens[i]` tokens after `prefix_lens[i]` already in the
KV pool get their K/V computed now, into `out_cache_loc` (flat, batch order).
Logits are produced for positions `logit_starts[i]` .. last new token; the
last one's logits sample the next token when `sample[i]`; positions
`prompt_logprobs[i] = (lo, hi)` (when not None) report the logprobs of the
prompt tokens lo + 1 .. hi. `finish_after[i]`: the request is complete once this
forward is (the last chunk of a prefill-only request), decided here because
in overlap mode the result is read after the next round was scheduled.

Per-request extras: in a verify batch `drafts[i]` are the k draft tokens the
request's newest token is followed by; its k + 1 rows are all sampled
(`sample_rows`) and the worker keeps the drafts the target agrees with, plus
one token of its own. `draft_parents[i]` (None: every request verifies a
chain) makes them a tree: draft j hangs under row `draft_parents[i][j]`
(`speculative/tree.py`), and what is kept is the agreeing path from the root.

`first_out(i)`: the output index request i's first sampled token will have,
from the positions the batch was scheduled at (which count every token the
steps before it may give: a verify's KV slots are allocated for all its
rows). When the result is read, a request with fewer tokens than that is
stale (an earlier step kept fewer drafts than this one was launched after):
its tokens are dropped, as the device's token table drops them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixlm.forward_batch import ForwardMode
from radixlm.scheduler.req import Req

if TYPE_CHECKING:
    from radixlm.scheduler.kv_manager import KVManager

# (requests of the sampled rows, their logits, a verify's drafts or None) -> the logits
# with grammar masks applied (a verify's rows masked per draft position).
MaskLogits = Callable[[list[Req], torch.Tensor, "list[list[int]] | None"], torch.Tensor]


@dataclass
class ScheduleBatch:
    mode: ForwardMode
    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor  # int64, CPU
    # Mixed: requests [0, num_extend) extend and the rest decode. In every mode,
    # requests from num_extend on take their input token from the device (the
    # token the previous forward sampled), the others from `fill_ids`.
    num_extend: int
    sample: list[bool]
    logit_starts: list[int]
    prompt_logprobs: list[tuple[int, int] | None]
    finish_after: list[bool]
    mask_logits: MaskLogits | None = None
    drafts: list[list[int]] | None = None  # verify mode: each request's draft tokens
    draft_parents: list[list[int]] | None = None  # verify mode: trees (None: chains)

    def sample_rows(self, i: int) -> int:
        """How many of request i's last logit rows are sampled: 0, 1, or k + 1 (verify)."""
        if not self.sample[i]:
            return 0
        return len(self.drafts[i]) + 1 if self.drafts is not None else 1

    def first_out(self, i: int) -> int:
        """Output index of request i's first sampled token (the position after the
        input of its first sampled row, less its prompt)."""
        last_input = self.prefix_lens[i] + (self.extend_lens[i] - 1 if i < self.num_extend
                                            else 0)
        return last_input + 1 - len(self.reqs[i].origin_input_ids)

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def sampling_reqs(self) -> list[Req]:
        return [r for r, s in zip(self.reqs, self.sample) if s]

    # ---- builders ------------------------------------------------------------------
    @classmethod
    def prefill(cls, reqs: list[Req], kv: KVManager) -> ScheduleBatch:
        """A prefill round of admitted requests (`Req.extend_input_len` set, its KV
        already allocated by `KVManager.admit`)."""
        prefix_lens, extend_lens, locs, sample, starts, prompt = [], [], [], [], [], []
        finish = []
        for req in reqs:
            start = req.kv_len - req.extend_input_len
            prefix_lens.append(start)
            extend_lens.append(req.extend_input_len)
            locs.append(kv.table_slots(req, start, req.kv_len))
            # The last new token's logits give the next token.
            first = req.kv_len - 1
            lp_range = None
            if req.wants_input_logprobs:
                first = min(max(start, req.first_logprob_row), first)
                lo = max(first, req.first_logprob_row)
                lp_range = (lo, min(req.kv_len, len(req.origin_input_ids) - 1))
                # Recorded once: a retracted request does not ask again.
                req.input_logprobs_done = not req.is_chunked
            starts.append(first)
            prompt.append(lp_range)
            generates = req.sampling_params.max_new_tokens > 0
            sample.append(not req.is_chunked and generates)
            finish.append(not req.is_chunked and not generates)
        return cls(ForwardMode.EXTEND, list(reqs), prefix_lens, extend_lens, torch.cat(locs),
                   len(reqs), sample, starts, prompt, finish)

    @classmethod
    def decode(cls, reqs: list[Req], prefix_lens: list[int],
               out_cache_loc: torch.Tensor) -> ScheduleBatch:
        """One new token per request at position `prefix_lens[i]`, its input the
        token the request sampled last (on the device)."""
        n = len(reqs)
        return cls(ForwardMode.DECODE, list(reqs), list(prefix_lens), [1] * n, out_cache_loc,
                   0, [True] * n, list(prefix_lens), [None] * n, [False] * n)

    @classmethod
    def verify(cls, reqs: list[Req], prefix_lens: list[int], drafts: list[list[int]],
               out_cache_loc: torch.Tensor, parents: list[list[int]] | None = None
               ) -> ScheduleBatch:
        """Each request's newest token (at position `prefix_lens[i]`, its input on the
        device) and its drafts after it, every row sampled; `out_cache_loc` holds
        k + 1 new slots per request. `parents`: each request's draft parents when
        some verify a tree (None: all chains)."""
        n = len(reqs)
        return cls(ForwardMode.VERIFY, list(reqs), list(prefix_lens),
                   [len(d) + 1 for d in drafts], out_cache_loc, 0, [True] * n,
                   list(prefix_lens), [None] * n, [False] * n, drafts=[list(d) for d in drafts],
                   draft_parents=None if parents is None else [list(p) for p in parents])

    def mix(self, decode: ScheduleBatch) -> ScheduleBatch:
        """This prefill batch and a decode batch in one forward (mixed chunked prefill)."""
        assert self.mode is ForwardMode.EXTEND and decode.mode is ForwardMode.DECODE
        return ScheduleBatch(
            ForwardMode.MIXED, self.reqs + decode.reqs, self.prefix_lens + decode.prefix_lens,
            self.extend_lens + decode.extend_lens,
            torch.cat([self.out_cache_loc, decode.out_cache_loc]), self.batch_size,
            self.sample + decode.sample, self.logit_starts + decode.logit_starts,
            self.prompt_logprobs + decode.prompt_logprobs,
            self.finish_after + decode.finish_after)
