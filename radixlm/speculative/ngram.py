"""NGRAM drafting (prompt lookup): the request's own text predicts its continuation.

The newest tokens often repeat an earlier stretch of the prompt or output
(code edits, quoting, reformatting a given text). The drafter finds the longest
suffix of the request's tokens, between the min and max match window, that
occurred before, and proposes the tokens that followed that earlier occurrence
(the most recent one among equally long matches). No model runs.

Cheap by construction: each request keeps its tokens and an index from each
token bigram (and token) to the positions where it ends, extended by the new
tokens only. A proposal inspects at most `MAX_CANDIDATES` recent occurrences
of the last bigram, each compared backwards until its first mismatch.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from radixlm.config import ServerArgs
from radixlm.scheduler.drafter import Drafter, drafts_within
from radixlm.scheduler.req import Req
from radixlm.speculative.tree import DraftTree, is_chain

# Recent occurrences of the last bigram compared per proposal: older ones are
# rarely longer matches, and the cost per step stays bounded.
MAX_CANDIDATES = 32


@dataclass
class _Index:
    """One request's tokens and where each token / bigram occurs (end positions)."""

    tokens: list[int] = field(default_factory=list)
    unigrams: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    bigrams: dict[tuple[int, int], list[int]] = field(default_factory=lambda: defaultdict(list))

    def extend(self, new: list[int]) -> None:
        """Append tokens. Positions enter the index one token late, so a lookup of
        the current suffix only finds earlier occurrences."""
        toks = self.tokens
        for t in new:
            toks.append(t)
            end = len(toks) - 2  # the previous last token
            if end >= 0:
                self.unigrams[toks[end]].append(end)
                if end >= 1:
                    self.bigrams[(toks[end - 1], toks[end])].append(end)

    def candidates(self) -> list[int]:
        """End positions of earlier occurrences of the last bigram (else token)."""
        toks = self.tokens
        if len(toks) >= 2:
            found = self.bigrams.get((toks[-2], toks[-1]))
            if found:
                return found[-MAX_CANDIDATES:]
        return self.unigrams.get(toks[-1], [])[-MAX_CANDIDATES:] if toks else []

    def match_len(self, end: int, limit: int) -> int:
        """How many tokens ending at `end` equal those ending at the last position."""
        toks, last, n = self.tokens, len(self.tokens) - 1, 0
        while n < limit and end - n >= 0 and toks[end - n] == toks[last - n]:
            n += 1
        return n

    def propose(self, k: int, min_len: int, max_len: int) -> list[int]:
        best, best_len = -1, 0
        for end in reversed(self.candidates()):  # most recent first: it wins ties
            n = self.match_len(end, max_len)
            if n > best_len:
                best, best_len = end, n
                if n == max_len:
                    break
        if best_len < min_len:
            return []
        return self.continuation(best, k)

    def continuation(self, end: int, k: int) -> list[int]:
        """The k tokens after the occurrence ending at `end`."""
        toks, size, out = self.tokens, len(self.tokens), []
        for j in range(k):
            pos = end + 1 + j
            # Past the end, the text repeats with the match's period (a run, a cycle).
            out.append(toks[pos] if pos < size else out[pos - size])
        return out

    def propose_tree(self, k: int, width: int, nodes: int, min_len: int,
                     max_len: int) -> DraftTree | None:
        """Up to `width` distinct continuations of the longest matches (longest first,
        then the most recent), merged where they agree into a tree of at most
        `nodes` drafts; the best one is the first branch (the chain `propose` gives)."""
        found = []
        for end in reversed(self.candidates()):
            n = self.match_len(end, max_len)
            if n >= min_len:
                found.append((-n, len(found), end))
        tokens: list[int] = []
        parents: list[int] = []
        children: dict[tuple[int, int], int] = {}  # (row, token) -> its child's row
        seen: set[tuple[int, ...]] = set()
        for _, _, end in sorted(found):
            cont = self.continuation(end, k)
            if tuple(cont) in seen:
                continue
            seen.add(tuple(cont))
            row = 0
            for t in cont:
                nxt = children.get((row, t))
                if nxt is None:
                    if len(tokens) >= nodes:
                        break
                    tokens.append(t)
                    parents.append(row)
                    nxt = children[(row, t)] = len(tokens)
                row = nxt
            if len(seen) >= width or len(tokens) >= nodes:
                break
        return DraftTree(tokens, parents) if tokens else None


class NgramDrafter(Drafter):
    """`propose` drafts `speculative_num_drafts` tokens (fewer under the verify
    budget) for every running request whose recent text recurs."""

    @classmethod
    def create(cls, args: ServerArgs, target: object, target_dir: str, gpu_id: int | None,
               max_verify_tokens: int) -> NgramDrafter:
        return cls(args, max_verify_tokens)

    def __init__(self, args: ServerArgs, max_verify_tokens: int) -> None:
        self.num_drafts = args.speculative_num_drafts
        # Trees (topk > 1): several continuations, `tree_nodes` drafts in all.
        self.topk = args.speculative_topk
        self.tree_nodes = args.speculative_tree_nodes
        self.min_len = args.speculative_ngram_min_match_window_size
        self.max_len = args.speculative_ngram_max_match_window_size
        self.max_verify_tokens = max_verify_tokens
        self._index: dict[str, _Index] = {}

    def forget(self, rid: str) -> None:
        self._index.pop(rid, None)

    def propose(self, reqs: list[Req]) -> dict[str, list[int] | DraftTree]:
        live = {r.rid for r in reqs}
        for rid in [rid for rid in self._index if rid not in live]:
            del self._index[rid]
        if self.topk > 1:
            return self._propose_trees(reqs)
        k = drafts_within(len(reqs), self.num_drafts, self.max_verify_tokens)
        if k == 0:
            return {}
        out: dict[str, list[int] | DraftTree] = {}
        for req in reqs:
            index = self._index_of(req)
            drafts = index.propose(k, self.min_len, self.max_len)
            if drafts:
                out[req.rid] = drafts
        return out

    def _propose_trees(self, reqs: list[Req]) -> dict[str, list[int] | DraftTree]:
        nodes = drafts_within(len(reqs), self.tree_nodes, self.max_verify_tokens)
        if nodes == 0:
            return {}
        k = min(self.num_drafts, nodes)
        out: dict[str, list[int] | DraftTree] = {}
        for req in reqs:
            found = self._index_of(req).propose_tree(k, self.topk, nodes, self.min_len,
                                                     self.max_len)
            if found is not None:
                out[req.rid] = found.tokens if is_chain(found.parents) else found
        return out

    def _index_of(self, req: Req) -> _Index:
        index = self._index.get(req.rid)
        if index is None:
            index = self._index[req.rid] = _Index()
            index.extend(req.origin_input_ids)
        seen = len(index.tokens) - len(req.origin_input_ids)
        index.extend(req.output_ids[seen:])
        return index
