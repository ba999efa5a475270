"""Tree drafts through the real scheduler and worker, on tiny random models (CPU
fp32): a STANDALONE draft model's trees (topk 2-4, several depths) keep the plain
run's greedy and seeded tokens, verify at least as many tokens per step as its
chain of the same depth, and keep the KV accounting through retraction and abort
mid-speculation; the flags' refusals."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from spec_models import save_eagle_head, save_tiny_target
from test_speculative_engine import (
    NEW_TOKENS,
    _prompts,
    _scheduler,
    _serve,
    _serve_aborting_r1,
    _spec,
)

from radixlm.config import ServerArgs


def _save_noisy_copy(path: Path, src: str, scale: float, seed: int = 0) -> str:
    """The model at `src` with every weight matrix perturbed: a draft model that
    agrees with it often, not always (its second choices then matter)."""
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    for f in Path(src).iterdir():
        if f.suffix == ".safetensors":
            tensors = {k: (v + scale * v.std() * torch.randn(v.shape, generator=g)
                           if v.dim() == 2 else v) for k, v in load_file(f).items()}
            save_file(tensors, path / f.name)
        elif f.is_file():
            shutil.copy(f, path / f.name)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory: Any) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tree")
    target = save_tiny_target(root / "target", seed=1)
    looping = save_tiny_target(root / "looping", seed=3, std=0.02, tie_word_embeddings=True)
    return {"target": target, "draft": save_tiny_target(root / "draft", seed=2),
            "near": _save_noisy_copy(root / "near", target, 0.1), "looping": looping,
            "eagle": save_eagle_head(root / "eagle", target, "EAGLE", identity=False, std=0.3),
            "eagle3": save_eagle_head(root / "eagle3", target, "EAGLE3", identity=False,
                                      std=0.3),
            "eagle3_id": save_eagle_head(root / "eagle3_id", looping, "EAGLE3")}


@pytest.fixture(scope="module")
def plain(models: dict[str, str]) -> dict[str, list[int]]:
    out, _, _ = _serve(models["target"], _prompts())
    assert all(len(v) == NEW_TOKENS for v in out.values())
    return out


def _tokens_per_verify(sched: Any) -> float:
    st = sched.stats
    return (st.num_spec_verifies + st.num_accepted_drafts) / max(st.num_spec_verifies, 1)


@pytest.mark.parametrize("topk, steps", [(2, 2), (3, 3), (4, 2)])
def test_tree_drafts_keep_the_greedy_tokens(models: dict[str, str],
                                            plain: dict[str, list[int]], topk: int,
                                            steps: int) -> None:
    out, sched, _ = _serve(models["target"], _prompts(), **_spec(
        "STANDALONE", models["draft"], speculative_num_steps=steps,
        speculative_eagle_topk=topk))
    assert out == plain
    st = sched.stats
    assert st.num_spec_verifies > 0
    assert st.num_draft_tokens > st.num_spec_verifies * steps  # trees: more nodes than depth


def test_tree_verifies_at_least_the_chains_tokens(models: dict[str, str],
                                                  plain: dict[str, list[int]]) -> None:
    """A draft model close to the target (a perturbed copy): the tree's leaves catch
    some of the chain's misses."""
    prompts = _prompts()
    base, chain, _ = _serve(models["target"], prompts, new_tokens=32,
                            **_spec("STANDALONE", models["near"], speculative_num_steps=3))
    out, tree, _ = _serve(models["target"], prompts, new_tokens=32, **_spec(
        "STANDALONE", models["near"], speculative_num_steps=3, speculative_eagle_topk=4))
    assert out == base
    c, t = _tokens_per_verify(chain), _tokens_per_verify(tree)
    print(f"tokens per verify (depth 3): chain {c:.3f}, tree topk 4 {t:.3f}; forwards "
          f"{chain.forward_ct} vs {tree.forward_ct}")
    assert 1.1 < c <= t
    assert tree.forward_ct <= chain.forward_ct


def test_seeded_sampling_with_tree_drafts_is_unchanged(models: dict[str, str]) -> None:
    """Tree drafts are kept by equality with the target's seeded token at each node:
    a sampling request's tokens are those of the run without drafts."""
    params = {"temperature": 0.7, "top_p": 0.95, "seed": 11}
    base, _, _ = _serve(models["target"], _prompts(), params)
    out, sched, _ = _serve(models["target"], _prompts(), params, **_spec(
        "STANDALONE", models["target"], speculative_num_steps=3, speculative_eagle_topk=2))
    assert out == base and sched.stats.num_accepted_drafts > 0


def test_retraction_mid_tree_speculation(models: dict[str, str]) -> None:
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 96, (20,), generator=g).tolist() for _ in range(4)]
    small = dict(max_total_tokens=150, new_tokens=24)
    plain, base, _ = _serve(models["target"], prompts, **small)
    out, sched, _ = _serve(models["target"], prompts, **small, **_spec(
        "STANDALONE", models["draft"], speculative_num_steps=3, speculative_eagle_topk=3))
    assert out == plain
    assert sched.stats.num_retractions > 0 and sched.stats.num_draft_tokens > 0


def test_abort_mid_tree_speculation(models: dict[str, str],
                                    plain: dict[str, list[int]]) -> None:
    sched = _scheduler(models["target"], **_spec("STANDALONE", models["draft"],
                                                 speculative_eagle_topk=3))
    out, finish = _serve_aborting_r1(sched)
    assert finish["r1"]["type"] == "abort"
    assert out["r0"] == plain["r0"] and out["r2"] == plain["r2"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2, tp_size=2),
      "tensor parallelism"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=2, speculative_num_steps=3,
          speculative_num_draft_tokens=8), "at most num_steps x topk \\+ 1 = 7"),
    (dict(speculative_algorithm="NGRAM", speculative_eagle_topk=0), ">= 1"),
])
def test_tree_flags_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kwargs)


def test_tree_flags() -> None:
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_eagle_topk=2,
                      speculative_num_steps=3)
    assert (args.speculative_num_drafts, args.speculative_tree_nodes) == (3, 6)
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_eagle_topk=2,
                      speculative_num_steps=3, speculative_num_draft_tokens=5)
    assert (args.speculative_num_drafts, args.speculative_tree_nodes) == (3, 4)
    chain = ServerArgs(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)
    assert (chain.speculative_num_drafts, chain.speculative_tree_nodes) == (5, 5)


def test_ngram_tree_merges_continuations() -> None:
    from radixlm.speculative.ngram import _Index

    index = _Index()
    index.extend([1, 2, 3, 4, 9, 1, 2, 5, 6, 9, 1, 2, 3, 7, 9, 1, 2])
    assert index.propose(3, 1, 12) == [3, 7, 9]
    found = index.propose_tree(3, 3, 9, 1, 12)
    # The best continuation first (the chain), the others merged where they agree.
    assert found.tokens == [3, 7, 9, 5, 6, 9, 4, 9]
    assert found.parents == [0, 1, 2, 0, 4, 5, 1, 7]
    small = index.propose_tree(3, 3, 4, 1, 12)
    assert small.tokens == [3, 7, 9, 5] and small.parents == [0, 1, 2, 0]


def test_ngram_trees_keep_the_greedy_tokens(models: dict[str, str],
                                            plain: dict[str, list[int]]) -> None:
    out, sched, _ = _serve(models["target"], _prompts(), **_spec(
        "NGRAM", None, speculative_num_steps=3, speculative_eagle_topk=3))
    assert out == plain and sched.stats.num_draft_tokens > 0


@pytest.mark.parametrize("kind", ["EAGLE", "EAGLE3"])
def test_head_trees_keep_the_greedy_tokens(models: dict[str, str],
                                           plain: dict[str, list[int]], kind: str) -> None:
    """A head's features after a tree verify are the kept path's rows' states."""
    head = models["eagle" if kind == "EAGLE" else "eagle3"]
    out, sched, _ = _serve(models["target"], _prompts(), **_spec(
        kind, head, speculative_num_steps=3, speculative_eagle_topk=3))
    assert out == plain
    st = sched.stats
    assert st.num_draft_tokens > 3 * st.num_spec_verifies > 0  # trees, not chains


def test_head_trees_draft_right(models: dict[str, str]) -> None:
    looping = models["looping"]
    base, _, _ = _serve(looping, _prompts())
    _, chain, _ = _serve(looping, _prompts(), **_spec(
        "EAGLE3", models["eagle3_id"], speculative_num_steps=3))
    out, tree, _ = _serve(looping, _prompts(), **_spec(
        "EAGLE3", models["eagle3_id"], speculative_num_steps=3, speculative_eagle_topk=2))
    assert out == base
    c, t = _tokens_per_verify(chain), _tokens_per_verify(tree)
    print(f"EAGLE3 tokens per verify (depth 3): chain {c:.3f}, tree topk 2 {t:.3f}")
    assert t >= c > 1.5


def test_deterministic_tree_rows_are_the_decode_steps(models: dict[str, str]) -> None:
    """With --enable-deterministic-inference on the cpu backend a tree row is
    computed as the decode step it stands for (the decode kernel over the same
    positions and K/V): the logprobs are the plain run's bit for bit."""
    import radixlm
    from radixlm.layers.attention.cpu_backend import CpuAttentionBackend

    if not CpuAttentionBackend.supports(16):
        pytest.skip("the CPU kernels need a C++ compiler")
    common = dict(model_path=models["target"], skip_tokenizer_init=True, device="cpu",
                  dtype="float32", quantization="none", enable_deterministic_inference=True,
                  log_level="warning")
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    outs = []
    for spec in ({}, _spec("STANDALONE", models["near"], speculative_num_steps=3,
                           speculative_eagle_topk=3)):
        with radixlm.Engine(**common, **spec) as e:
            outs.append(e.generate(input_ids=_prompts(), sampling_params=params,
                                   return_logprob=True))
            if spec:
                assert e.scheduler.stats.num_accepted_drafts > 0
    for a, b in zip(*outs):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]


def test_sampled_tree_walk_keeps_the_target_distribution() -> None:
    """Deterministic tree drafts (q one-hot) kept where they equal the target's
    seeded draw at their node: each kept token is distributed as p (the multi-
    candidate rejection rule for one-hot q), whatever the tree. Chi-square of each
    position and of the first pair against p, as for chains (test_speculative.py)."""
    from test_speculative import N_SEQS, P_LOGITS, V, _chi2_critical, _fit

    from radixlm.layers.sampler import Sampler, SamplingBatchInfo
    from radixlm.sampling_params import SamplingParams
    from radixlm.speculative import tree

    # Two children per node, depth 2: the draft's two best tokens under q, where
    # q disagrees with p (tokens 2 and 3 are p's third and fourth choices).
    drafts, parents = [2, 3, 2, 3, 2, 3], [0, 0, 1, 1, 2, 2]
    depth = tree.depths(parents)
    k = len(drafts)
    out: list[list[int]] = [[] for _ in range(N_SEQS)]
    accepted = 0
    while True:
        live = [i for i in range(N_SEQS) if len(out[i]) < 3]
        if not live:
            break
        m = len(live)
        logits = P_LOGITS.expand(m * (k + 1), V).clone()
        params = [SamplingParams(temperature=1.0)] * (m * (k + 1))
        steps = [len(out[i]) + depth[r] for i in live for r in range(k + 1)]
        seeds = [1000 + i for i in live for _ in range(k + 1)]
        info = SamplingBatchInfo.build(params, seeds, steps, [[]] * len(params),
                                       [[]] * len(params), [set()] * len(params), V, "cpu")
        sampled = Sampler()(logits, info).next_token_ids
        tokens, counts, _ = tree.accept_path(sampled, [drafts] * m, [parents] * m,
                                             torch.device("cpu"))
        accepted += int((counts - 1).sum())
        for a, i in enumerate(live):
            out[i] += tokens[a, :counts[a]].tolist()
    stats = _fit(torch.tensor([s[:3] for s in out]))
    crit = _chi2_critical(V - 1)
    assert all(s < crit for s in stats[:3]), (stats, crit)
    assert stats[3] < _chi2_critical(V * V - 1), stats
    assert accepted > N_SEQS // 4  # the trees were used
