"""Speculative decoding on CUDA with random weights in fp32: every algorithm gives the
plain run's greedy tokens, with the target's and the draft runner's CUDA graphs
(the draft's decode steps and catch-up rows replay them); a model drafting for
itself has every draft accepted; bf16 self-drafting keeps most drafts. Trees of
drafts (--speculative-eagle-topk 3) on the Triton backend: lossless with and
without CUDA graphs, their verifies replaying the target's graphs, and bit for
bit the plain run under --enable-deterministic-inference."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu

from gpu_models import save_random_llama  # noqa: E402
from spec_models import save_eagle_head  # noqa: E402

import radixlm  # noqa: E402
from radixlm.protocol import GenerateReq  # noqa: E402

NEW = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-gpu")
    target = save_random_llama(root / "target")
    return {
        "target": target,
        "draft": save_random_llama(root / "draft", seed=1, num_hidden_layers=2),
        "EAGLE": save_eagle_head(root / "eagle", target, "EAGLE", identity=False, std=0.05),
        "EAGLE3": save_eagle_head(root / "eagle3", target, "EAGLE3", identity=False,
                                  std=0.05),
    }


def _serve(model, dtype="float32", target_graphs=False, **kw):
    """(tokens by rid, stats, the drafter's graph runner; with `target_graphs` the
    target's)."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 32000, (n,), generator=g).tolist() for n in (20, 77, 150, 9)]
    with radixlm.Engine(model, dtype=dtype, skip_tokenizer_init=True, max_total_tokens=8192,
                        **kw) as e:
        sched = e.scheduler
        for i, ids in enumerate(prompts):
            sched.add_request(GenerateReq(rid=f"r{i}", input_ids=ids, sampling_params={
                "max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}))
        out = {f"r{i}": [] for i in range(len(prompts))}
        while sched.has_work:
            for o in sched.step():
                out[o.rid] += o.new_token_ids
        sched.check_invariants()
        drafter = sched.worker.model_drafter
        graphs = drafter.runner.graph_runner if drafter is not None else None
        if target_graphs:
            graphs = sched.worker.runner.graph_runner
        return out, sched.stats, graphs


@pytest.fixture(scope="module")
def plain(models):
    return _serve(models["target"])[0]


@pytest.mark.parametrize("algo", ["NGRAM", "STANDALONE", "EAGLE", "EAGLE3"])
def test_greedy_tokens_unchanged_on_cuda(models, plain, algo):
    draft = {"NGRAM": None, "STANDALONE": models["draft"]}.get(algo, models.get(algo))
    out, stats, graphs = _serve(models["target"], speculative_algorithm=algo,
                                speculative_draft_model_path=draft, speculative_num_steps=3)
    assert out == plain
    if algo != "NGRAM":  # a random model's text never repeats: nothing for NGRAM to match
        assert stats.num_draft_tokens > 0
        assert graphs is not None and graphs.use_graphs


def _save_repeating_llama(path) -> str:
    """A random Llama whose attention and MLP outputs are scaled down (x0.01) and
    whose LM head is its embedding: greedy decoding repeats the last token."""
    from gpu_models import BASE_CONFIG
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**BASE_CONFIG, "tie_word_embeddings": True}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.01)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def test_ngram_drafts_are_verified_on_cuda(tmp_path):
    """Repeating text, which NGRAM matches: its drafts are verified and accepted
    on CUDA (verify forwards replaying the target's graphs), tokens unchanged."""
    model = _save_repeating_llama(tmp_path / "repeat")
    plain = _serve(model)[0]
    out, stats, _ = _serve(model, speculative_algorithm="NGRAM", speculative_num_steps=3)
    assert out == plain
    assert stats.num_draft_tokens > 0 and stats.num_accepted_drafts > 0


def test_self_draft_accepts_everything_on_cuda(models, plain):
    target = models["target"]
    out, stats, _ = _serve(target, speculative_algorithm="STANDALONE",
                           speculative_draft_model_path=target, speculative_num_steps=4)
    assert out == plain
    assert stats.num_accepted_drafts == stats.num_draft_tokens > 0


def test_self_draft_in_bf16_keeps_most_drafts(models):
    target = models["target"]
    _, stats, _ = _serve(target, dtype="bfloat16", speculative_algorithm="STANDALONE",
                         speculative_draft_model_path=target, speculative_num_steps=4)
    # Draft rows (catch-up, decode graphs) and verify rows round differently in bf16.
    assert stats.num_accepted_drafts >= 0.8 * stats.num_draft_tokens > 0


# ---- trees of drafts (--speculative-eagle-topk > 1) on the Triton backend ---------------
# Graphs up to 64 rows: the 4 requests' trees (up to 10 rows each) replay, and
# capturing stays short.
GRAPH_BS = 64
TREE = dict(speculative_num_steps=3, speculative_eagle_topk=3)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "no-graphs"])
@pytest.mark.parametrize("algo", ["EAGLE", "STANDALONE"])
def test_tree_drafts_keep_the_greedy_tokens_on_cuda(models, plain, algo, graphs):
    """Lossless with trees: the plain run's greedy tokens, the verify forwards of
    trees replaying the target's decode graphs (the request table's path rows),
    or with --disable-cuda-graph the same static batches eagerly."""
    draft = models["draft"] if algo == "STANDALONE" else models["EAGLE"]
    out, stats, runner = _serve(models["target"], target_graphs=True,
                                speculative_algorithm=algo, speculative_draft_model_path=draft,
                                disable_cuda_graph=not graphs, cuda_graph_max_bs=GRAPH_BS,
                                **TREE)
    assert out == plain
    assert stats.num_draft_tokens > 3 * stats.num_spec_verifies > 0  # trees, not chains
    assert runner is not None and runner.use_graphs == graphs
    assert runner.max_tree_rows == GRAPH_BS
    assert runner.tree_replays > 0  # tree verifies went through the graph runner


def test_tree_verifies_replay_graphs_on_cuda(models):
    """A self-drafting target (every first-choice draft right): most verifies are
    trees and each replays a captured graph, not an eager forward."""
    target = models["target"]
    _, stats, runner = _serve(target, target_graphs=True, speculative_algorithm="STANDALONE",
                              speculative_draft_model_path=target, cuda_graph_max_bs=GRAPH_BS,
                              **TREE)
    assert stats.num_accepted_drafts > 0
    # num_spec_verifies counts requests (4 per verify batch at most), the replays
    # batches; verify steps whose drafts all fit to chains (near the end) are not trees.
    assert runner.use_graphs and 4 * runner.tree_replays >= stats.num_spec_verifies // 2 > 0


def test_deterministic_tree_verify_is_the_plain_run_bit_for_bit_on_cuda(models):
    """--enable-deterministic-inference in bf16: a tree row is computed as the
    decode step it stands for (the Triton backend's batch-invariant decode over
    the row's path), so tokens and logprobs are the plain run's exactly."""
    target = models["target"]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 32000, (n,), generator=g).tolist() for n in (33, 90, 7)]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    outs = []
    for spec in ({}, dict(speculative_algorithm="STANDALONE",
                          speculative_draft_model_path=target, **TREE)):
        with radixlm.Engine(target, dtype="bfloat16", skip_tokenizer_init=True,
                            max_total_tokens=8192, enable_deterministic_inference=True,
                            cuda_graph_max_bs=GRAPH_BS, **spec) as e:
            outs.append(e.generate(input_ids=prompts, sampling_params=params,
                                   return_logprob=True))
            if spec:
                assert e.scheduler.stats.num_accepted_drafts > 0
                assert e.scheduler.worker.runner.graph_runner.tree_replays > 0
    for a, b in zip(*outs):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
