"""Speculative decoding's parts on their own: the flags and their refusals, the
n-gram matcher, the verify budget, speculative sampling's output distribution
(chi-square against the target's, and failing for biased variants), and grammar
masks per draft position."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixlm.config import ServerArgs
from radixlm.layers.sampler import SamplingBatchInfo
from radixlm.sampling_params import SamplingParams
from radixlm.scheduler.drafter import drafts_within
from radixlm.speculative import rejection
from radixlm.speculative.ngram import NgramDrafter


@pytest.mark.parametrize("kwargs, match", [
    (dict(speculative_num_steps=3), "speculative_algorithm is not"),
    (dict(speculative_algorithm="STANDALONE"), "needs speculative_draft_model_path"),
    (dict(speculative_algorithm="NGRAM", speculative_draft_model_path="/x"), "loads no draft"),
    (dict(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
          speculative_eagle_topk=4, speculative_num_steps=2,
          speculative_num_draft_tokens=10), "at most num_steps x topk"),
    (dict(speculative_algorithm="NGRAM", speculative_num_steps=3,
          speculative_num_draft_tokens=8), "num_steps \\+ 1"),
    (dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=1), ">= 1"),
    (dict(speculative_algorithm="NGRAM", speculative_ngram_min_match_window_size=5,
          speculative_ngram_max_match_window_size=2), "min <= max"),
    (dict(speculative_algorithm="NGRAM", is_embedding=True), "embedding"),
    (dict(speculative_algorithm="NEXTN"), "expected one of"),
])
def test_speculative_flags_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServerArgs(**kwargs)


def test_draft_count_from_either_flag() -> None:
    assert ServerArgs(speculative_algorithm="NGRAM").speculative_num_drafts == 4
    assert ServerArgs(speculative_algorithm="NGRAM",
                      speculative_num_draft_tokens=6).speculative_num_drafts == 5
    assert ServerArgs(speculative_algorithm="EAGLE", speculative_draft_model_path="/x",
                      speculative_num_steps=2).speculative_num_drafts == 2


def test_verify_budget_shortens_then_pauses_drafts() -> None:
    assert drafts_within(1, 4, 16) == 4
    assert drafts_within(4, 4, 16) == 3  # 4 x (3 + 1) rows
    assert drafts_within(8, 4, 16) == 1
    assert drafts_within(9, 4, 16) == 0
    assert drafts_within(1000, 4, 0) == 4  # no limit


# ---- NGRAM ------------------------------------------------------------------------
def _req(rid: str, prompt: list[int], output: list[int]) -> Any:
    return SimpleNamespace(rid=rid, origin_input_ids=prompt, output_ids=output)


def _ngram(k: int = 4, lo: int = 1, hi: int = 12) -> NgramDrafter:
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_num_steps=k,
                      speculative_ngram_min_match_window_size=lo,
                      speculative_ngram_max_match_window_size=hi)
    return NgramDrafter(args, max_verify_tokens=0)


def test_ngram_proposes_the_continuation_of_the_longest_match() -> None:
    # The suffix [1, 2, 3] occurs twice: after 7 (followed by 4 5 6 7) and, longer,
    # as [9, 1, 2, 3] (followed by 8 8): the longer match wins.
    prompt = [9, 1, 2, 3, 8, 8, 0, 7, 1, 2, 3, 4, 5, 6, 7, 0, 9, 1, 2, 3]
    drafter = _ngram()
    assert drafter.propose([_req("a", prompt, [])]) == {"a": [8, 8, 0, 7]}
    # Equally long matches: the most recent one.
    drafter = _ngram(k=2)
    assert drafter.propose([_req("b", [5, 1, 6, 5, 1, 7, 5, 1], [])]) == {"b": [7, 5]}


def test_ngram_windows_and_no_match() -> None:
    assert _ngram(lo=3).propose([_req("a", [1, 2, 5, 2], [])]) == {}  # only "2" recurs
    assert _ngram().propose([_req("a", [1, 2, 3, 4], [])]) == {}
    # max window 1: the last token alone decides (its latest occurrence).
    assert _ngram(k=1, hi=1).propose([_req("a", [4, 1, 6, 2, 1, 7, 3, 1], [])]) == {"a": [7]}


def test_ngram_extends_a_run_periodically() -> None:
    # The match ends one token before the end: the draft continues the cycle.
    assert _ngram(k=5).propose([_req("a", [3, 4, 3, 4], [])]) == {"a": [3, 4, 3, 4, 3]}


def test_ngram_indexes_only_new_tokens() -> None:
    drafter = _ngram(k=3)
    prompt = list(range(50)) * 2
    req = _req("a", prompt, [])
    assert drafter.propose([req]) == {"a": [0, 1, 2]}
    index = drafter._index["a"]
    before = sum(len(v) for v in index.unigrams.values())
    req.output_ids += [0, 1]
    assert drafter.propose([req]) == {"a": [2, 3, 4]}
    assert sum(len(v) for v in index.unigrams.values()) == before + 2
    drafter.propose([])  # the request left: its index goes
    assert drafter._index == {}


def test_ngram_respects_the_verify_budget() -> None:
    args = ServerArgs(speculative_algorithm="NGRAM", speculative_num_steps=4)
    drafter = NgramDrafter(args, max_verify_tokens=6)
    reqs = [_req(str(i), [1, 2, 1, 2], []) for i in range(3)]
    assert all(len(d) == 1 for d in drafter.propose(reqs).values())
    assert drafter.propose(reqs + [_req("x", [1, 2, 1, 2], [])]) == {}


# ---- speculative sampling -------------------------------------------------------------
V = 6
P_LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, 0.0])
Q_LOGITS = torch.tensor([0.0, 1.0, 2.0, 1.5, -1.0, 0.5])


def _chi2_critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty's upper quantile of chi-square (z 3.29: p = 5e-4)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _generate(n: int, length: int, k: int) -> torch.Tensor:
    """`n` sequences of `length` tokens made by verify steps of k drafts drawn from q,
    when the target's distribution at every position is p: [n, length]."""
    out = [[] for _ in range(n)]
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(Q_LOGITS, dim=0)
    while True:
        live = [i for i in range(n) if len(out[i]) < length]
        if not live:
            return torch.tensor([s[:length] for s in out])
        m = len(live)
        drafts = torch.multinomial(q.expand(m * k, V), 1, generator=g).view(m, k).tolist()
        logits = P_LOGITS.expand(m * (k + 1), V).clone()
        params = [SamplingParams(temperature=1.0)] * (m * (k + 1))
        steps = [len(out[i]) + j for i in live for j in range(k + 1)]
        seeds = [1000 + i for i in live for _ in range(k + 1)]
        info = SamplingBatchInfo.build(params, seeds, steps, [[]] * len(params),
                                       [[]] * len(params), [set()] * len(params), V, "cpu")
        from radixlm.layers.sampler import Sampler
        sampled = Sampler()(logits, info).next_token_ids
        rows = [list(range(a * (k + 1), (a + 1) * (k + 1))) for a in range(m)]
        tokens, counts = rejection.verify_sampled(
            logits, info, rows, drafts, [q.expand(k, V)] * m, sampled,
            [1000 + i for i in live], [len(out[i]) for i in live])
        for a, i in enumerate(live):
            out[i] += tokens[a, :counts[a]].tolist()


def _fit(seqs: torch.Tensor) -> list[float]:
    """Chi-square of each position's tokens, and of position pairs (0, 1), against p."""
    p = torch.softmax(P_LOGITS, dim=0)
    stats = [_chi2(torch.bincount(seqs[:, j], minlength=V).float(), p)
             for j in range(seqs.shape[1])]
    pairs = torch.bincount(seqs[:, 0] * V + seqs[:, 1], minlength=V * V).float()
    stats.append(_chi2(pairs, torch.outer(p, p).flatten()))
    return stats


N_SEQS = 6000


def test_speculative_sampling_keeps_the_target_distribution() -> None:
    stats = _fit(_generate(N_SEQS, 3, k=2))
    crit = _chi2_critical(V - 1)
    assert all(s < crit for s in stats[:3]), (stats, crit)
    assert stats[3] < _chi2_critical(V * V - 1), stats


@pytest.mark.parametrize("bias", ["accept_all", "redraw_from_p"])
def test_chi_square_fails_for_biased_samplers(bias: str, monkeypatch: Any) -> None:
    if bias == "accept_all":  # u = 0: every draft kept -> tokens follow q
        monkeypatch.setattr(rejection, "uniform", lambda keys: torch.zeros(keys.shape))
    else:  # a rejected position redrawn from p instead of norm(max(0, p - q))
        monkeypatch.setattr(rejection, "residual", lambda p, q: p)
    stats = _fit(_generate(N_SEQS, 3, k=2))
    assert max(stats[:3]) > 10 * _chi2_critical(V - 1), stats


def test_drafts_from_the_target_distribution_are_all_kept() -> None:
    """q == p (a model drafting for itself): min(1, p/q) = 1 keeps every draft, and
    the last row's draw is the bonus token."""
    k, m = 3, 64
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(m * (k + 1), V, generator=g) * 2
    params = [SamplingParams(temperature=0.7, top_k=4)] * (m * (k + 1))
    info = SamplingBatchInfo.build(params, [7] * len(params), list(range(k + 1)) * m,
                                   [[]] * len(params), [[]] * len(params),
                                   [set()] * len(params), V, "cpu")
    p = torch.softmax(rejection.filtered_logits(logits, info), dim=-1).view(m, k + 1, V)
    drafts = torch.multinomial(p[:, :k].reshape(-1, V), 1, generator=g).view(m, k)
    from radixlm.layers.sampler import Sampler
    sampled = Sampler()(logits, info).next_token_ids
    rows = [list(range(a * (k + 1), (a + 1) * (k + 1))) for a in range(m)]
    tokens, counts = rejection.verify_sampled(logits, info, rows, drafts.tolist(),
                                              list(p[:, :k]), sampled, [7] * m, [0] * m)
    assert bool((counts == k + 1).all())
    assert torch.equal(tokens[:, :k], drafts)
    assert torch.equal(tokens[:, k], sampled.view(m, k + 1)[:, k])


# ---- visibility ---------------------------------------------------------------------
def test_acceptance_is_reported(caplog: Any) -> None:
    """meta_info, OpenAI usage's extension fields, the stats line and /metrics."""
    from radixlm.outputs import SeqOutput
    from radixlm.protocol import StrOut, TokenOut
    from radixlm.server.metrics import Metrics
    from radixlm.server.openai_api import Call
    from radixlm.server.scheduler_process import StatsLogger

    seq = SeqOutput("a", 0)
    seq.update(StrOut(TokenOut(rid="a", new_token_ids=[1, 2, 3], finish_reason=None,
                               prompt_tokens=4, completion_tokens=3, cached_tokens=0,
                               spec_verify_ct=2, spec_accepted_drafts=3), "x"))
    meta = seq.meta_info()
    assert (meta["spec_verify_ct"], meta["spec_accepted_drafts"]) == (2, 3)
    assert meta["spec_accept_length"] == 2.5
    assert "spec_verify_ct" not in SeqOutput("b", 0).meta_info()
    usage = Call("c", 0, "m", [0]).usage([seq])
    assert (usage["spec_verify_ct"], usage["spec_accepted_drafts"]) == (2, 3)

    info = {"num_running_requests": 1, "num_queued_requests": 0, "kv_tokens_in_use": 1,
            "kv_tokens_total": 8, "kv_tokens_cached": 0, "cache_hit_rate": 0.0,
            "num_generated_tokens": 30, "num_spec_verifies": 10, "num_draft_tokens": 30,
            "num_accepted_drafts": 15}
    metrics = Metrics("m")
    metrics.set_scheduler_state(info)
    text = metrics.render().decode()
    assert 'radixlm:spec_accept_length{model_name="m"} 2.5' in text
    assert 'radixlm:spec_accept_rate{model_name="m"} 0.5' in text
    stats = StatsLogger(SimpleNamespace(server_info=lambda: info), interval=1e-9)
    with caplog.at_level("INFO", logger="radixlm.scheduler"):
        stats.maybe_log()
    assert "accept len: 2.50" in caplog.text


def test_bench_decode_rate_counts_every_streamed_token():
    """`bench speculative copy` times streamed requests: chunks carry their new
    tokens only (it once read one token per request and divided by zero)."""
    from radixlm.bench.speculative import _decode_rate

    class Streams:
        def generate(self, prompt, sampling_params, stream):
            for ids in ([5], [6, 7], [8]):  # several tokens per chunk, as a verify gives
                yield {"output_ids": ids}

    rate, n = _decode_rate(Streams(), "x", 4)
    assert n == 4 and rate > 0


@pytest.mark.parametrize("k,length,topk", [(6, 4, 2), (6, 3, 3), (5, 9, 2), (7, 2, 4)])
def test_bench_replayed_tree_keeps_the_simulated_acceptance(k, length, topk):
    """`bench speculative simulated` with a k,L,T case: a tree of k drafts whose
    walk keeps min(L, depth + 1) - 1 of them, as the chain k,L keeps L - 1."""
    from types import SimpleNamespace

    from radixlm.bench.speculative import ReplayTreeDrafter, _case_name, _tree_flags
    from radixlm.speculative import tree

    continuation = list(range(100, 140))
    for done in (0, 3):
        req = SimpleNamespace(rid="r", output_ids=[0] * done)
        proposal = ReplayTreeDrafter(continuation, k, length, 1000, topk).propose([req])["r"]
        assert len(proposal) == k
        # The target's token after a right path is the continuation's next; after a
        # wrong one (the target saw another text) something no draft is.
        rows = tree.row_contexts(proposal.tokens, proposal.parents)
        sampled = torch.tensor([continuation[done + len(r)]
                                if r == continuation[done:done + len(r)] else -5 for r in rows])
        _, counts, _ = tree.accept_path(sampled, [proposal.tokens], [proposal.parents],
                                        torch.device("cpu"))
        depth = max(tree.depths(proposal.parents))
        assert counts.item() == min(length, depth + 1)
    assert _case_name((6, 4, 2)) == "tree k=6 T=2 L=4" and _case_name((6, 4)) == "k=6 L=4"
    assert _tree_flags([(6, 4), (6, 4, 2), (8, 3, 4)]) == dict(
        speculative_algorithm="NGRAM", speculative_eagle_topk=4, speculative_num_steps=3)
    assert _tree_flags([(6, 4)]) == {}


def test_bench_calibration_replays_the_verifies_own_continuation():
    """`bench speculative simulated` without the deterministic flag: where verify
    rows round otherwise than decode rows, the replay must draft what the
    verifies produce, found by replaying each run's output until it holds."""
    from types import SimpleNamespace

    from radixlm.bench.speculative import _calibrate

    plain = list(range(100, 120))

    class Verifies:
        """Greedy tokens under speculation: the plain run's, except that token 7
        and (from a run that drafted the new token 7) token 12 round otherwise;
        what the drafts were does not change a row's own token."""

        def __init__(self):
            self.scheduler = SimpleNamespace(drafter=None)
            self.runs = 0

        def generate(self, input_ids, sampling_params):
            self.runs += 1
            out = list(plain)
            out[7] = 7
            if self.scheduler.drafter.continuation[7] == 7:
                out[12] = 12
            return {"output_ids": out}

    engine = Verifies()
    ref, (runs, first) = _calibrate(engine, (2, 3), plain, 1000, [1, 2], {})
    assert ref[7] == 7 and ref[12] == 12 and ref[:7] == plain[:7]
    assert (runs, first, engine.runs) == (3, 7, 3)  # plain, then each new parting, then held
    engine = Verifies()
    ref, (runs, _) = _calibrate(engine, (2, 3), plain, 1000, [1, 2], {}, passes=2)
    assert runs == 2 and ref[12] == 12  # stops at `passes`, returning the latest output
    same = SimpleNamespace(scheduler=SimpleNamespace(drafter=None),
                           generate=lambda **kw: {"output_ids": list(plain)})
    assert _calibrate(same, (4, 4), plain, 1000, [1], {}) == (plain, (1, -1))
