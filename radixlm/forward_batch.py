"""What one model forward needs: token ids (or embeddings), positions and where
their KV lives."""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

import torch

from radixlm.utils import ints_to_device, to_device

if TYPE_CHECKING:
    from radixlm.cache.memory_pool import KVPool, ReqToTokenPool
    from radixlm.layers.attention.base import AttentionBackend


class ForwardMode(Enum):
    EXTEND = auto()  # prefill: new tokens of each request after a cached prefix
    DECODE = auto()  # exactly one new token per request
    # Mixed chunked prefill: extend requests first, then decode requests (one
    # token each) in the same forward; see `ForwardBatch.mixed_parts`.
    MIXED = auto()
    # Speculative verify: each request's newest token and k draft tokens after it
    # (k + 1 rows, every row's logits wanted); row j attends to the request's KV
    # and rows 0..j, exactly as the j-th of k + 1 decode steps would
    # (`ForwardBatch.verify_decode_view`).
    VERIFY = auto()

    def is_decode(self) -> bool:
        return self is ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self is ForwardMode.MIXED

    def is_verify(self) -> bool:
        return self is ForwardMode.VERIFY

    def is_decode_like(self) -> bool:
        """Every row is one decode step (decode, verify): one logit row per token."""
        return self in (ForwardMode.DECODE, ForwardMode.VERIFY)


@dataclass(frozen=True)
class HiddenCapture:
    """Hidden states a forward returns beside its logits (what an EAGLE drafter
    reads): the residual stream after each layer in `layers` (HF's
    `hidden_states[i + 1]`) and, with `final`, the final-normed state the LM
    head reads; every token's row, in the order of `layers`, then the final one."""

    layers: tuple[int, ...] = ()
    final: bool = False

    @property
    def count(self) -> int:
        return len(self.layers) + int(self.final)


@dataclass
class ForwardBatch:
    """Flat (ragged) layout: the new tokens of all requests back to back.

    For request i: `extend_seq_lens[i]` new tokens follow `extend_prefix_lens[i]`
    tokens already in the KV pool; `seq_lens[i]` = prefix + new. The KV slots of
    all its tokens are `req_to_token[req_pool_indices[i], :seq_lens[i]]`, and the
    new ones are also given flat in `out_cache_loc` (the backend writes K/V there).
    In decode mode every extend length is 1. In mixed mode the first
    `num_extend` requests extend and the rest decode (one token each, last in
    the flat token axis). In verify mode each request's rows are its newest
    token and its draft tokens.

    `input_embeds` [num_tokens, hidden], when set, is the model's input instead
    of the embeddings of `input_ids` (rows of requests that came with
    embeddings; the other rows hold their tokens' embeddings).
    """

    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    extend_seq_lens: torch.Tensor  # [bs] int64
    extend_prefix_lens: torch.Tensor  # [bs] int64
    extend_start_loc: torch.Tensor  # [bs] int64, exclusive cumsum of extend_seq_lens
    # Host copies, so Python-side loops never sync with the device.
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: KVPool
    attn_backend: AttentionBackend
    # Rows of the flat token axis whose logits are wanted, [num_logit_rows] int64.
    # Default: the last new token of each request.
    logit_rows: torch.Tensor | None = None
    # Decode only: requests sharing their first KV slots (cascade attention); None:
    # no sharing, or not looked for. Backends without cascade attention ignore it.
    prefix_groups: PrefixGroups | None = None
    num_extend: int = 0  # mixed mode: how many requests (from the first) extend
    input_embeds: torch.Tensor | None = None
    # Verify mode: per request, the parent row of each draft (`speculative/tree.py`)
    # when some request verifies a tree; None: chains, each row sees the rows
    # before it. A backend with `supports_tree_mask` attends a tree through
    # `verify_decode_view`'s per-row slot table.
    tree: list[list[int]] | None = None
    # What hidden states to keep; the model appends them to `captured`
    # ([num_tokens, hidden] each, `HiddenCapture`'s order).
    capture: HiddenCapture | None = None
    captured: list[torch.Tensor] = field(default_factory=list)
    _parts: tuple[ForwardBatch, ForwardBatch] | None = None
    _verify_view: ForwardBatch | None = None
    # Verify, from `build`: the decode view's request slots, sequence lengths, ones
    # and row numbers per row (every verify batch is built there).
    _view_rows: tuple[torch.Tensor, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def mixed_parts(self) -> tuple[ForwardBatch, ForwardBatch]:
        """A mixed batch as (its extend requests, its decode requests): two batches
        over slices of this one's tensors (views, no copies), made once. Backends
        attend each part with their extend and decode paths."""
        assert self.mode.is_mixed(), "mixed_parts of a batch that is not mixed"
        if self._parts is None:
            self._parts = (self._part(ForwardMode.EXTEND, 0, self.num_extend),
                           self._part(ForwardMode.DECODE, self.num_extend, self.batch_size))
        return self._parts

    def verify_decode_view(self) -> ForwardBatch:
        """A verify batch as a decode batch of one row per token: row j of a request
        is its own pseudo-request with sequence length position + 1, so it sees the
        request's KV and the rows before it on its path (their K/V are stored first,
        as every row's is). A chain's rows use the request's own table row (row j
        at column prefix + j); a tree's (`tree`) each get a row of a small table
        of their own: the request's prefix slots, then the slots of the row's
        ancestors and its own at their positions, so a node never reads a
        sibling and computes exactly what a decode step after its path would.
        Backends attend it with their decode path; made once."""
        assert self.mode.is_verify(), "verify_decode_view of a batch that is not a verify"
        if self._verify_view is None:
            positions_cpu = _verify_positions(self.extend_prefix_lens_cpu,
                                              self.extend_seq_lens_cpu, self.tree)
            seq_lens_cpu = [p + 1 for p in positions_cpu]
            n = self.num_tokens
            pool = self.req_to_token_pool
            assert self._view_rows is not None, "a verify batch not made by build"
            req_pool_indices, seq_lens, ones, row_ids = self._view_rows
            if self.tree is not None:
                pool = _PathTable(self._tree_table(req_pool_indices, seq_lens_cpu))
                req_pool_indices = row_ids
            self._verify_view = ForwardBatch(
                mode=ForwardMode.DECODE, batch_size=n, input_ids=self.input_ids,
                positions=self.positions, req_pool_indices=req_pool_indices,
                seq_lens=seq_lens, out_cache_loc=self.out_cache_loc,
                extend_seq_lens=ones, extend_prefix_lens=self.positions,
                extend_start_loc=row_ids,
                seq_lens_cpu=seq_lens_cpu, extend_seq_lens_cpu=[1] * n,
                extend_prefix_lens_cpu=[s - 1 for s in seq_lens_cpu],
                req_to_token_pool=pool, token_to_kv_pool=self.token_to_kv_pool,
                attn_backend=self.attn_backend)
        return self._verify_view

    def _tree_table(self, req_pool_indices: torch.Tensor, seq_lens_cpu: list[int]
                    ) -> torch.Tensor:
        """[num_tokens, max seq len] slots: each verify row's request prefix, then its
        path's slots (the rows' own, from `out_cache_loc`) at columns prefix + depth
        (= the ancestor's position). One gather of the request rows, one host-to-
        device copy of the (row, column, source) indices and one scatter
        (`ancestor_levels` walks the tree a level per step): it runs every verify
        step of a tree."""
        from radixlm.speculative.tree import ancestor_levels

        assert self.tree is not None
        width = max(seq_lens_cpu)
        # Advanced indexing copies: the request table itself is never written.
        table = self.req_to_token_pool.req_to_token[req_pool_indices, :width]
        anc = ancestor_levels(self.tree, self.extend_seq_lens_cpu)  # [levels, rows]
        rows = torch.arange(anc.shape[1], dtype=torch.int64).expand_as(anc)
        positions = torch.tensor(seq_lens_cpu, dtype=torch.int64) - 1
        idx = to_device(torch.stack([rows, positions[anc], anc]).flatten(1), table.device)
        # A row above its depth repeats its root's entry: the same value, same place.
        table[idx[0], idx[1]] = self.out_cache_loc[idx[2]].to(table.dtype)
        return table

    def _part(self, mode: ForwardMode, lo: int, hi: int) -> ForwardBatch:
        first = sum(self.extend_seq_lens_cpu[:lo])
        last = first + sum(self.extend_seq_lens_cpu[lo:hi])
        return ForwardBatch(
            mode=mode, batch_size=hi - lo, input_ids=self.input_ids[first:last],
            positions=self.positions[first:last],
            req_pool_indices=self.req_pool_indices[lo:hi], seq_lens=self.seq_lens[lo:hi],
            out_cache_loc=self.out_cache_loc[first:last],
            extend_seq_lens=self.extend_seq_lens[lo:hi],
            extend_prefix_lens=self.extend_prefix_lens[lo:hi],
            extend_start_loc=self.extend_start_loc[lo:hi] - first,
            seq_lens_cpu=self.seq_lens_cpu[lo:hi],
            extend_seq_lens_cpu=self.extend_seq_lens_cpu[lo:hi],
            extend_prefix_lens_cpu=self.extend_prefix_lens_cpu[lo:hi],
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend)

    @classmethod
    def build(cls, mode: ForwardMode, input_ids: list[int], req_pool_indices: list[int],
              prefix_lens: list[int], extend_lens: list[int], out_cache_loc: torch.Tensor,
              req_to_token_pool: ReqToTokenPool, token_to_kv_pool: KVPool,
              attn_backend: AttentionBackend, device: torch.device,
              logit_rows: list[int] | None = None, num_extend: int | None = None,
              tree: list[list[int]] | None = None) -> ForwardBatch:
        """`num_extend`: for a MIXED batch, how many requests (the first) extend.
        `logit_rows` default: each request's last row (every row in verify mode).
        `tree` (verify): each request's draft parents (its rows sit at prefix +
        depth); None: chains."""
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        positions = _verify_positions(prefix_lens, extend_lens, tree)
        starts, acc = [], 0
        for e in extend_lens:
            starts.append(acc)
            acc += e

        if logit_rows is None:
            logit_rows = (list(range(len(positions))) if mode.is_verify()
                          else [s + e - 1 for s, e in zip(starts, extend_lens)])
        parts: list[Any] = [input_ids, positions, req_pool_indices, seq_lens, extend_lens,
                            prefix_lens, starts, logit_rows, out_cache_loc]
        if mode.is_verify():  # the decode view's own rows, in the same copy
            n = len(positions)
            parts += [[r for r, e in zip(req_pool_indices, extend_lens) for _ in range(e)],
                      [p + 1 for p in positions], [1] * n, list(range(n))]
        dev = ints_to_device(parts, device)
        fb = cls(
            mode=mode, batch_size=len(req_pool_indices), input_ids=dev[0], positions=dev[1],
            req_pool_indices=dev[2], seq_lens=dev[3], out_cache_loc=dev[8],
            extend_seq_lens=dev[4], extend_prefix_lens=dev[5], extend_start_loc=dev[6],
            seq_lens_cpu=seq_lens, extend_seq_lens_cpu=extend_lens,
            extend_prefix_lens_cpu=prefix_lens, req_to_token_pool=req_to_token_pool,
            token_to_kv_pool=token_to_kv_pool, attn_backend=attn_backend,
            logit_rows=dev[7],
            num_extend=len(extend_lens) if num_extend is None else num_extend, tree=tree)
        if mode.is_verify():
            fb._view_rows = tuple(dev[9:])
        return fb


class _PathTable:
    """A verify tree's per-row slot table where backends read `req_to_token`."""

    def __init__(self, req_to_token: torch.Tensor) -> None:
        self.req_to_token = req_to_token


def _verify_positions(prefix_lens: Sequence[int], extend_lens: Sequence[int],
                      tree: Sequence[Sequence[int]] | None) -> list[int]:
    """Every row's position: prefix + j, or in a tree prefix + the row's depth."""
    if tree is None:
        return [p + j for p, e in zip(prefix_lens, extend_lens) for j in range(e)]
    from radixlm.speculative.tree import depths

    out: list[int] = []
    for p, e, parents in zip(prefix_lens, extend_lens, tree):
        out += [p + d for d in (depths(parents) if len(parents) == e - 1 else range(e))]
    return out


# ---- shared prefixes in a decode batch (cascade attention) ------------------------
# A group saves (members - 1) x prefix_len K/V reads per layer and step; below this
# many tokens the saving does not pay for the extra kernel and merge.
MIN_SHARED_PREFIX = 64
# Depth of the search below a common prefix (a chain of ever longer shared
# prefixes); deeper levels join their parent's group.
_MAX_LEVELS = 32


@dataclass(frozen=True)
class PrefixGroups:
    """Requests of a decode batch whose KV slot lists begin with the same run of slots.

    `groups[k] = (prefix_len, members)`: the batch indices (ascending) of >= 2
    requests whose first `prefix_len` slots are identical; each member has at least
    one token after them. A request is in at most one group. A new object means a
    new grouping (backends may cache what they derive from one, by identity).
    """

    batch_size: int
    groups: tuple[tuple[int, tuple[int, ...]], ...]


def find_prefix_groups(slot_lists: Sequence[Sequence[int]],
                       min_prefix_len: int = MIN_SHARED_PREFIX) -> PrefixGroups:
    """Group requests by shared leading KV slots (their table rows' host copies).

    Relies on the pool's sharing rule: a slot held by two live requests came from
    the prefix cache, whose path to that slot is unique, so two requests with the
    same slot at position p also share every slot before p. The length two lists
    share is then found by bisection on single positions, O(log n) per request.

    Where the shared prefixes nest (a system prompt common to all, then a longer
    prefix per group), each subtree goes either to its own deeper groups or to its
    parent's group, whichever saves more K/V reads ((members - 1) x prefix_len).
    """
    caps = [len(s) - 1 for s in slot_lists]  # keep >= 1 own token per request
    min_prefix_len = max(1, min_prefix_len)
    buckets: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(slot_lists):
        if caps[i] >= min_prefix_len:
            buckets[s[0]].append(i)
    groups: list[tuple[int, tuple[int, ...]]] = []
    for members in buckets.values():
        if len(members) >= 2:
            groups += _plan_groups(members, 1, slot_lists, caps, min_prefix_len, 0)[1]
    groups.sort(key=lambda g: g[1][0])
    return PrefixGroups(len(slot_lists), tuple(groups))


def _plan_groups(members: list[int], lo: int, slots: Sequence[Sequence[int]],
                 caps: list[int], min_len: int, level: int
                 ) -> tuple[int, list[tuple[int, tuple[int, ...]]]]:
    """Best grouping of `members`, which share their first `lo` slots: (reads saved,
    groups)."""
    lead = slots[members[0]]
    depth = caps[members[0]]
    for j in members[1:]:
        depth = _shared_len(lead, slots[j], lo, min(depth, caps[j]))
    pool_value = depth if depth >= min_len else 0
    pooled: list[int] = []
    saved, groups = 0, []
    subtrees: dict[int, list[int]] = defaultdict(list)
    for j in members:
        if caps[j] > depth and level < _MAX_LEVELS:
            subtrees[slots[j][depth]].append(j)
        else:
            pooled.append(j)
    for sub in subtrees.values():
        if len(sub) >= 2:
            sub_saved, sub_groups = _plan_groups(sub, depth + 1, slots, caps, min_len,
                                                 level + 1)
            if sub_saved > len(sub) * pool_value:
                saved += sub_saved
                groups += sub_groups
                continue
        pooled += sub
    if len(pooled) >= 2 and pool_value:
        # The pool may share more than `depth` (e.g. one subtree whose own groups
        # lost): take all it shares.
        lp = min(caps[j] for j in pooled)
        first = slots[pooled[0]]
        for j in pooled[1:]:
            lp = _shared_len(first, slots[j], depth, lp)
        saved += (len(pooled) - 1) * lp
        groups.append((lp, tuple(sorted(pooled))))
    return saved, groups


def _shared_len(a: Sequence[int], b: Sequence[int], lo: int, hi: int) -> int:
    """Largest p in [lo, hi] with a[p - 1] == b[p - 1], given that it holds at lo and,
    by the sharing rule, at every p below the answer and at none above."""
    if a[hi - 1] == b[hi - 1]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


class SharedPrefixTracker:
    """`find_prefix_groups` for successive decode batches, recomputed only when the
    batch's requests change: a running request's prefix slots do not change while
    it decodes (it only appends slots of its own)."""

    def __init__(self, min_prefix_len: int = MIN_SHARED_PREFIX) -> None:
        self.min_prefix_len = min_prefix_len
        self._reqs: list[Any] = []
        self._groups: PrefixGroups | None = None

    def find(self, reqs: Sequence[Any]) -> PrefixGroups | None:
        """Groups of `reqs` (objects with a `slots` list: their table row's host
        copy); None when no group qualifies."""
        if len(reqs) != len(self._reqs) or not all(map(operator.is_, reqs, self._reqs)):
            self._reqs = list(reqs)  # holding them keeps their identities unique
            groups = find_prefix_groups([r.slots for r in reqs], self.min_prefix_len)
            self._groups = groups if groups.groups else None
        return self._groups


def cascade_attention_wanted(args: Any) -> bool:
    """Whether decode batches should look for shared prefixes (ServerArgs)."""
    return not (args.disable_cascade_attention or args.disable_radix_cache
                or args.is_embedding)
