"""A verify tree's per-row slot table (`ForwardBatch._tree_table`, built every
verify step of a tree) is vectorised (`speculative.tree.ancestor_levels`); this
pins it to the per-row loop it replaced, entry for entry, over random trees,
chains and rows without drafts in one batch."""

from __future__ import annotations

import random

import pytest
import torch

from radixlm.cache.memory_pool import ReqToTokenPool
from radixlm.forward_batch import ForwardBatch, ForwardMode
from radixlm.layers.attention.torch_native import TorchNativeBackend
from radixlm.speculative import tree


def loop_table(fb: ForwardBatch, req_pool_indices: torch.Tensor,
               seq_lens_cpu: list[int]) -> torch.Tensor:
    """The table as the loop before vectorisation built it (the reference)."""
    width = max(seq_lens_cpu)
    table = fb.req_to_token_pool.req_to_token[req_pool_indices, :width].clone()
    row = 0
    for pre, ext, parents in zip(fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, fb.tree):
        parents = parents if len(parents) == ext - 1 else tree.chain_parents(ext - 1)
        for r in range(ext):
            for d, a in enumerate(tree.path_rows(parents, r)):
                table[row + r, pre + d] = fb.out_cache_loc[row + a]
        row += ext
    return table


def random_parents(rng: random.Random, k: int) -> list[int]:
    return [rng.randrange(j + 1) for j in range(k)]


def random_verify(rng: random.Random, trees: list[list[int]]) -> ForwardBatch:
    """A verify batch over random request rows and prefixes, its rows at fresh slots."""
    pool = ReqToTokenPool(len(trees) + 3, 96, "cpu")
    pool.req_to_token.copy_(torch.randint(1, 10_000, pool.req_to_token.shape))
    slots = rng.sample(range(pool.size), len(trees))
    prefix = [rng.randrange(0, 40) for _ in trees]
    ext = [len(p) + 1 for p in trees]
    loc = torch.randperm(20_000)[:sum(ext)] + 10_001
    return ForwardBatch.build(ForwardMode.VERIFY, [0] * sum(ext), slots, prefix, ext, loc,
                              pool, None, TorchNativeBackend(), torch.device("cpu"),
                              tree=trees)


@pytest.mark.parametrize("seed", range(6))
def test_tree_table_equals_the_loop(seed: int) -> None:
    rng = random.Random(seed)
    trees = [random_parents(rng, rng.randrange(0, 12)) for _ in range(rng.randrange(1, 6))]
    trees.append(tree.chain_parents(4))  # a chain among trees
    fb = random_verify(rng, trees)
    view = fb.verify_decode_view()
    got = view.req_to_token_pool.req_to_token
    rows = fb.req_pool_indices[torch.repeat_interleave(
        torch.arange(fb.batch_size), torch.tensor(fb.extend_seq_lens_cpu))]
    want = loop_table(fb, rows, view.seq_lens_cpu)
    assert got.dtype == want.dtype == torch.int32
    assert torch.equal(got, want)
    # The request table is read, never written.
    assert not torch.equal(got[:, :1], torch.zeros_like(got[:, :1]))


def _pairs(levels: torch.Tensor) -> list[tuple[int, int]]:
    rows = torch.arange(levels.shape[1]).expand_as(levels)
    return sorted(set(zip(rows.flatten().tolist(), levels.flatten().tolist())))


def test_ancestor_levels_are_the_paths() -> None:
    parents = [0, 0, 0, 1, 4, 4, 2]  # test_tree_verify's PARENTS
    levels = tree.ancestor_levels([parents, [], [0, 1]], [8, 1, 3])
    assert levels.shape == (4, 12)  # depth 3: row 5 is 0 -> 1 -> 4 -> 5
    assert levels[:, 5].tolist() == [5, 4, 1, 0] and levels[:, 2].tolist() == [2, 0, 0, 0]
    want = sorted([(r, a) for r in range(8) for a in tree.path_rows(parents, r)]
                  + [(8, 8)] + [(9 + r, 9 + a) for r in range(3) for a in range(r + 1)])
    assert _pairs(levels) == want
    # Parents that do not fit the row count are read as a chain (as before).
    assert _pairs(tree.ancestor_levels([[0, 0]], [2])) == [(0, 0), (1, 0), (1, 1)]
