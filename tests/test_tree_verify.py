"""Tree drafts: the verify forward over a tree (each node sees the request's KV and
its own ancestors, never its siblings), greedy acceptance along the longest
agreeing path, the KV slots of the kept path becoming the request's positions,
and the refusal of backends without tree attention; on the embedded model in
fp32 on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from kv_runner import KVRunner
from verify_runs import BACKENDS, NEW_TOKENS
from verify_runs import serve as _serve

from radixlm.forward_batch import ForwardBatch, ForwardMode
from radixlm.layers.attention.base import AttentionBackend
from radixlm.layers.attention.cpu_backend import CpuAttentionBackend
from radixlm.layers.attention.torch_native import TorchNativeBackend
from radixlm.models.loader import load_config, load_model
from radixlm.speculative import tree
from radixlm.tokenizer import get_tokenizer
from radixlm.utils import triton_installed

# Rows: 0 root; 1, 2, 3 its children; 4 under 1; 5, 6 under 4; 7 under 2.
PARENTS = [0, 0, 0, 1, 4, 4, 2]


@pytest.fixture(scope="module")
def smol(model_dir: str) -> torch.nn.Module:
    return load_model(model_dir, load_config(model_dir), "auto", torch.float32, "cpu")


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    return get_tokenizer(model_dir)


def test_tree_helpers() -> None:
    assert tree.depths(PARENTS) == [0, 1, 1, 1, 2, 3, 3, 2]
    assert tree.path_rows(PARENTS, 6) == [0, 1, 4, 6]
    mask = tree.ancestor_mask(PARENTS)
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 4, 6]
    assert not mask[2, 1] and not mask[5, 6]  # siblings do not see each other
    assert torch.equal(tree.ancestor_mask(tree.chain_parents(4)),
                       torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    assert tree.fit(list(range(10, 17)), PARENTS, 2, 10) == ([10, 11, 12, 13, 16],
                                                             [0, 0, 0, 1, 2])
    assert tree.fit(list(range(10, 17)), PARENTS, 5, 2) == ([10, 11], [0, 0])
    assert tree.first_branch(list(range(10, 17)), PARENTS) == [10, 13, 14]
    assert tree.row_contexts([10, 11, 13], [0, 0, 1]) == [[], [10], [11], [10, 13]]
    with pytest.raises(ValueError, match="earlier row"):
        tree.DraftTree([1, 2], [0, 2])


def test_accept_path_walks_the_agreeing_children() -> None:
    # Request a: tree PARENTS with tokens; the target says root -> 11 (row 2), row 2
    # -> 16 (row 7), row 7 -> 99. Request b: a chain of 3, two agree.
    drafts_a = [10, 11, 12, 13, 14, 15, 16]
    sampled_a = [11, 0, 16, 0, 0, 0, 0, 99]
    drafts_b = [5, 6, 7]
    sampled_b = [5, 6, 8, 9]
    sampled = torch.tensor(sampled_a + sampled_b)
    tokens, counts, path = tree.accept_path(sampled, [drafts_a, drafts_b],
                                            [PARENTS, tree.chain_parents(3)], torch.device("cpu"))
    assert counts.tolist() == [3, 3]
    assert tokens[0, :3].tolist() == [11, 16, 99] and path[0, :3].tolist() == [0, 2, 7]
    assert tokens[1, :3].tolist() == [5, 6, 8] and path[1, :3].tolist() == [0, 1, 2]
    # Nothing agrees: the root's token alone.
    tokens, counts, path = tree.accept_path(torch.tensor([42] + [0] * 7), [drafts_a],
                                            [PARENTS], torch.device("cpu"))
    assert counts.tolist() == [1] and tokens[0, 0] == 42 and path[0, 0] == 0


def _tree_forward(runner: KVRunner, slot: int, root: int, drafts: list[int],
                  parents: list[int]) -> torch.Tensor:
    pre = runner.kv_len[slot]
    n = len(drafts) + 1
    loc = runner.kv_pool.alloc(n)
    runner.req_pool.req_to_token[slot, pre:pre + n] = loc.to(torch.int32)
    runner.kv_len[slot] = pre + n
    fb = ForwardBatch.build(ForwardMode.VERIFY, [root, *drafts], [slot], [pre], [n], loc,
                            runner.req_pool, runner.kv_pool, runner.backend,
                            torch.device("cpu"), tree=[parents])
    runner.backend.begin_forward(fb)
    with torch.inference_mode():
        return runner.model(fb.input_ids, fb.positions, fb)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_tree_rows_equal_decode_steps_of_their_paths(smol: torch.nn.Module, tokenizer: Any,
                                                     backend: str) -> None:
    """Every node's verify logits are those of decoding its own path after the
    prompt: a node does not see its siblings (nor their subtrees)."""
    if backend == "cpu" and not CpuAttentionBackend.supports(smol.kv_spec().k_head_dim):
        pytest.skip("the CPU kernels need a C++ compiler")
    runner = KVRunner(smol, max_requests=12, backend=BACKENDS[backend]())
    prompt = tokenizer.encode("The capital of France is")
    words = tokenizer.encode(" Paris, and the capital of Spain is Madrid")
    root, drafts = words[0], words[1:1 + len(PARENTS)]
    verified = runner.new_request()
    runner.extend([(verified, prompt)])
    rows = _tree_forward(runner, verified, root, drafts, PARENTS)
    assert rows.shape[0] == len(PARENTS) + 1
    tokens = [root, *drafts]
    for r in range(len(tokens)):
        path = [tokens[a] for a in tree.path_rows(PARENTS, r)]
        stepped = runner.new_request()
        runner.extend([(stepped, prompt)])
        for t in path:
            step = runner.decode([(stepped, t)])
        ref = step[0]
        diff = (rows[r] - ref).abs().max().item()
        assert diff <= 1e-5 * ref.abs().max().item(), (r, diff)
        # The wrong mask (a chain over the node order) would differ for branching rows.
    chain = runner.new_request()
    runner.extend([(chain, prompt)])
    chained = runner.run(ForwardMode.VERIFY, [(chain, tokens)])
    assert (chained[2] - rows[2]).abs().max() > 1e-3  # row 2 would see its sibling row 1


class _NoTrees(AttentionBackend):
    """Stands for a backend without tree attention."""

    def init_forward_metadata(self, fb: ForwardBatch) -> None: ...

    def forward_extend(self, *a: Any) -> torch.Tensor: ...

    def forward_decode(self, *a: Any) -> torch.Tensor: ...


def test_backends_without_tree_attention_refuse_trees() -> None:
    _NoTrees.check_tree_drafts(None)
    _NoTrees.check_tree_drafts(1)  # chains are served
    with pytest.raises(ValueError, match="--speculative-eagle-topk 4.*_NoTrees"):
        _NoTrees.check_tree_drafts(4)
    TorchNativeBackend.check_tree_drafts(4)
    CpuAttentionBackend.check_tree_drafts(4)
    if triton_installed():
        from radixlm.layers.attention.triton_backend import TritonAttentionBackend

        TritonAttentionBackend.check_tree_drafts(4)  # tests/gpu/test_tree_attention.py


@pytest.mark.skipif(not triton_installed(), reason="Triton is not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the file runs as it is")
def test_triton_tree_rows_under_interpreter() -> None:
    """The Triton backend's tree verify rows against decode steps of their paths
    (tests/gpu/test_tree_attention.py) on the CPU, under Triton's interpreter:
    it must be on before triton is first imported, hence a child pytest."""
    path = Path(__file__).parent / "gpu" / "test_tree_attention.py"
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-m", "gpu", str(path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    assert "5 passed" in done.stdout, done.stdout[-2000:]  # the fp32 cases ran


# ---- through the scheduler ----------------------------------------------------------


class TreeScriptDrafter:
    """Proposes trees over a known continuation: at each of `depth` levels `topk`
    children, the right token among wrong ones (at a varying place), the right one
    expanded further and (with `bushy`) the first wrong one given a wrong child too.
    `wrong`: output indices where even the right child is wrong."""

    needs_host_tokens = True
    drafts_on_device = False

    def __init__(self, continuations: dict[str, list[int]], depth: int, topk: int,
                 wrong: frozenset[int] = frozenset(), bushy: bool = True) -> None:
        self.continuations, self.depth, self.topk = continuations, depth, topk
        self.wrong, self.bushy = wrong, bushy

    def forget(self, rid: str) -> None:
        return None

    def propose(self, reqs: list[Any]) -> dict[str, tree.DraftTree]:
        out = {}
        for r in reqs:
            n = len(r.output_ids)
            ahead = self.continuations[r.rid][n:n + self.depth]
            tokens: list[int] = []
            parents: list[int] = []
            at = 0  # the row of the right path so far
            for j, t in enumerate(ahead):
                right = (t + 1) % 1000 if n + j in self.wrong else t
                place = (n + j) % self.topk
                kids = [(t + 3 + c) % 1000 for c in range(self.topk - 1)]
                kids.insert(place, right)
                first_row = len(tokens) + 1
                for c in kids:
                    tokens.append(c)
                    parents.append(at)
                if self.bushy and self.topk > 1:
                    wrong_row = first_row + (1 if place == 0 else 0)
                    tokens.append((t + 7) % 1000)
                    parents.append(wrong_row)
                at = first_row + place
            if tokens:
                out[r.rid] = tree.DraftTree(tokens, parents)
        return out


@pytest.mark.parametrize("params", [{"temperature": 0.0},
                                    {"temperature": 0.8, "top_p": 0.9, "seed": 7}],
                         ids=["greedy", "seeded"])
def test_tree_drafts_change_forwards_not_tokens(model_dir: str, tokenizer: Any,
                                                params: dict[str, Any]) -> None:
    plain, base = _serve(model_dir, tokenizer, params)
    assert all(len(v) == NEW_TOKENS for v in plain.values())
    right, sched = _serve(model_dir, tokenizer, params, TreeScriptDrafter(plain, 3, 3))
    assert right == plain
    assert sched.forward_ct < base.forward_ct
    assert sched.stats.num_accepted_drafts > 0
    partly, sched = _serve(model_dir, tokenizer, params,
                           TreeScriptDrafter(plain, 4, 2, wrong=frozenset({2, 5, 6, 9})),
                           backend="torch_native")
    assert partly == plain
    assert sched.stats.num_accepted_drafts > 0
