"""Draft trees: the shape a verify step checks, and what it keeps of it.

A request's verify rows are its newest token (row 0, the root: at the position
after its KV) and its draft tokens (draft j on row j + 1). `parents[j]` is the
row of draft j's parent, always an earlier row (parents before children), so
row r sits at position base + depth(r) and sees the request's KV plus its own
ancestors and itself, never its siblings. A chain is the tree whose draft j has
row j as parent (`chain_parents`): every function here gives a chain's result
when handed one, so chains and trees share one verify path.

Acceptance (`accept_path`) walks from the root: at each row, the child whose
token equals the target's token there (its argmax, or for a sampling request
the token the sampler drew with that output position's seed) is kept and the
walk goes on from it; the target's token at the last kept row ends the run. The
kept rows are one chain (`path_rows`), whose slots become the request's next
positions (`KVManager.keep_rows`); the other rows' slots are freed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from radixlm.utils import to_device


@dataclass
class DraftTree:
    """A drafter's proposal for one request: `tokens[j]` on row j + 1 under row
    `parents[j]` (0: the request's newest token). A plain list of tokens is a chain."""

    tokens: list[int]
    parents: list[int]

    def __post_init__(self) -> None:
        check_parents(self.parents)
        if len(self.parents) != len(self.tokens):
            raise ValueError("a draft tree needs one parent per token")

    def __len__(self) -> int:
        return len(self.tokens)


def chain_parents(k: int) -> list[int]:
    return list(range(k))


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == j for j, p in enumerate(parents))


def check_parents(parents: Sequence[int]) -> None:
    for j, p in enumerate(parents):
        if not 0 <= p <= j:
            raise ValueError(f"draft {j}'s parent row {p} is not an earlier row (0..{j})")


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every row, the root's (0) first: row r's position is base + depth."""
    out = [0]
    for p in parents:
        out.append(out[p] + 1)
    return out


def path_rows(parents: Sequence[int], row: int) -> list[int]:
    """The rows from the root to `row` (both included), root first."""
    path = [row]
    while row:
        row = parents[row - 1]
        path.append(row)
    return path[::-1]


def ancestor_levels(trees: Sequence[Sequence[int]], ext_lens: Sequence[int]) -> torch.Tensor:
    """Over the flat verify rows of several requests (request i: `ext_lens[i]` rows
    and draft parents `trees[i]`, read as a chain when they do not have ext - 1
    entries): [max depth + 1, rows] host int64, entry [k, r] row r's k-th ancestor
    (k = 0: r itself), or its request's root once k passes r's depth. Each row's
    column is `path_rows` of it, root repeated: (r, column entries) pairs cover
    exactly the row and its ancestors. Python touches each row once; each level
    is one gather."""
    parent: list[int] = []
    offset = deepest = 0
    for parents, ext in zip(trees, ext_lens):
        if len(parents) != ext - 1:
            parents = chain_parents(ext - 1)
        parent.append(offset)  # a root is its own parent: the walk stays there
        parent += [offset + p for p in parents]
        deepest = max(deepest, max(depths(parents)))
        offset += ext
    parent_t = torch.tensor(parent, dtype=torch.int64)
    levels = [torch.arange(offset, dtype=torch.int64)]
    for _ in range(deepest):
        levels.append(parent_t[levels[-1]])
    return torch.stack(levels)


def ancestor_mask(parents: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """[n + 1, n + 1] bool over the rows: True where row i attends to row j (j is i
    or one of its ancestors). A chain's is the lower triangle."""
    n = len(parents) + 1
    mask = torch.zeros((n, n), dtype=torch.bool)
    mask[0, 0] = True
    for j, p in enumerate(parents, start=1):
        mask[j] = mask[p]
        mask[j, j] = True
    return mask.to(device)


def fit(tokens: Sequence[int], parents: Sequence[int], max_depth: int,
        max_nodes: int) -> tuple[list[int], list[int]]:
    """The drafts of depth <= `max_depth`, at most `max_nodes` of them (the first:
    parents come before children, so what is kept is a tree), re-indexed."""
    d = depths(parents)
    row_of = {0: 0}
    out_t, out_p = [], []
    for j, (t, p) in enumerate(zip(tokens, parents), start=1):
        if len(out_t) >= max_nodes:
            break
        if d[j] <= max_depth and p in row_of:
            row_of[j] = len(out_t) + 1
            out_t.append(t)
            out_p.append(row_of[p])
    return out_t, out_p


def first_branch(tokens: Sequence[int], parents: Sequence[int]) -> list[int]:
    """The chain of first children from the root (what a request that cannot
    verify a tree keeps of one)."""
    out, row = [], 0
    for j, p in enumerate(parents, start=1):
        if p == row:
            out.append(tokens[j - 1])
            row = j
    return out


def row_contexts(drafts: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """Per row, the draft tokens before it on its path (a row's sampling context)."""
    out: list[list[int]] = [[]]
    for t, p in zip(drafts, parents):
        out.append(out[p] + [t])
    return out


def accept_path(sampled: torch.Tensor, drafts: Sequence[Sequence[int]],
                parents: Sequence[Sequence[int]], device: torch.device
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Acceptance over the flat verify rows of n requests (request i has
    len(drafts[i]) + 1 rows, `sampled` the target's token of every row): (tokens
    [n, W] padded, the kept run: the target's tokens along the accepted path;
    counts [n]; path rows [n, W] padded, request-local, root first). A chain
    keeps drafts while they equal the row before's token, as before."""
    lens = [len(d) for d in drafts]
    width = max(lens) + 1
    n = len(lens)
    # Per row (padded to width): its flat row, its parent's flat row, its draft token.
    flat, parent_flat, toks, anc = [], [], [], []
    offset = 0
    for k, d, par in zip(lens, drafts, parents):
        rows = [offset + min(j, k) for j in range(width)]
        flat.append(rows)
        parent_flat.append([offset] + [offset + par[j] if j < k else offset
                                       for j in range(width - 1)])
        toks.append([-1] + list(d) + [-1] * (width - 1 - k))  # -1 never matches
        m = torch.zeros((width, width), dtype=torch.bool)
        m[:k + 1, :k + 1] = ancestor_mask(par)
        anc.append(m)
        offset += k + 1
    flat_t = to_device(torch.tensor(flat, dtype=torch.int64), device)
    parent_t = to_device(torch.tensor(parent_flat, dtype=torch.int64), device)
    toks_t = to_device(torch.tensor(toks, dtype=torch.int64), device)
    anc_t = to_device(torch.stack(anc), device)  # [n, W, W]
    match = sampled[parent_t] == toks_t  # [n, W]: row j's draft is its parent's token
    match[:, 0] = True
    # A row is accepted when it and all its ancestors match.
    ok = ~(anc_t & ~match[:, None, :]).any(dim=2)  # [n, W]
    depth = anc_t.sum(dim=2)  # 1 + depth
    cols = torch.arange(width, device=device)
    # The deepest accepted row (the first among equals: a duplicate sibling loses).
    score = torch.where(ok, depth * (width + 1) - cols[None, :], torch.zeros_like(depth))
    best = score.argmax(dim=1)
    on_path = anc_t[torch.arange(n, device=device), best]  # [n, W]
    counts = on_path.sum(dim=1)
    # Path rows in row order are root first (parents precede children).
    key = torch.where(on_path, cols[None, :], cols[None, :] + width)
    path = key.sort(dim=1).values
    path = torch.where(path < width, path, path.gather(1, (counts - 1)[:, None]))
    tokens = sampled[flat_t.gather(1, path)]
    return tokens, counts, path
