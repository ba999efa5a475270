"""The batched sampler against plain per-row references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.layers.sampler import (
    Sampler,
    SamplingBatchInfo,
    _mix32,
    filter_logits,
    gumbel_argmax,
    neg_gumbel_noise,
    noise_key,
    process_logits,
)
from radixlm.sampling_params import SamplingParams as SP

V = 64
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# CUDA runs the fused Triton Gumbel-argmax; the CPU the torch path.
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, CUDA])]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # These tensors are small: OpenMP fan-out costs more than it saves (40x
    # slower with 2 threads on a 2-vCPU box).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build(params: list[SP], seeds: list[int] | None = None, steps: list[int] | None = None,
          prompts: list[list[int]] | None = None, outputs: list[list[int]] | None = None,
          stops: list[set[int]] | None = None, vocab: int = V,
          device: str = "cpu") -> SamplingBatchInfo:
    n = len(params)
    return SamplingBatchInfo.build(
        params, seeds if seeds is not None else list(range(n)),
        steps if steps is not None else [0] * n, prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)], stops or [set() for _ in range(n)], vocab, device)


def sample(logits: torch.Tensor, info: SamplingBatchInfo) -> list[int]:
    return Sampler()(logits.to(info.device), info).next_token_ids.tolist()


# ---- greedy, bias, penalties, min_new_tokens --------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_equals_argmax_in_mixed_batch(device):
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    params = [SP(temperature=0.0), SP(temperature=0.7), SP(top_k=1), SP(top_p=0.5),
              SP(temperature=0.0), SP(min_p=0.2), SP(temperature=1e-7), SP()]
    out = torch.tensor(sample(logits, build(params, vocab=1000, device=device)))
    greedy = [0, 2, 4, 6]
    assert torch.equal(out[greedy], logits.argmax(-1)[greedy])
    all_greedy = build([SP(temperature=0)] * 8, vocab=1000, device=device)
    assert torch.equal(torch.tensor(sample(logits, all_greedy)), logits.argmax(-1))
    # An all-greedy batch copies none of its per-row fields: only sampling reads them.
    assert all_greedy.temperatures.device.type == "cpu"
    mixed = build(params, vocab=1000, device=device)
    assert mixed.temperatures.device.type == mixed.noise_keys.device.type == device


def test_logits_are_not_modified():
    logits = torch.randn(2, V)
    before = logits.clone()
    info = build([SP(temperature=0, logit_bias={3: 5.0}, frequency_penalty=1.0),
                  SP(top_p=0.5, min_p=0.1)], outputs=[[1, 1], [2]])
    Sampler()(logits, info, True, 3)
    assert torch.equal(logits, before)


def test_logit_bias_forces_and_bans():
    logits = torch.zeros(3, V)
    logits[:, 7] = 10.0
    info = build([SP(temperature=0, logit_bias={5: 100.0}),
                  SP(temperature=0, logit_bias={7: -100.0, 9: 0.5}),
                  SP(temperature=0)])
    assert sample(logits, info) == [5, 9, 7]


def reference_penalties(logits: torch.Tensor, p: SP, prompt: list[int],
                        output: list[int]) -> torch.Tensor:
    out = logits.clone().double()
    for t in range(out.shape[0]):
        count = output.count(t)
        if t in prompt or count:
            x = out[t].item()
            out[t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out.float()


def test_penalties_match_hand_computed_reference():
    torch.manual_seed(1)
    logits = torch.randn(4, V) * 3
    params = [SP(temperature=0, repetition_penalty=1.3),
              SP(temperature=0, frequency_penalty=0.7, presence_penalty=-0.4),
              SP(temperature=0, frequency_penalty=-1.1, presence_penalty=1.5,
                 repetition_penalty=0.8),
              SP(temperature=0)]
    prompts = [[1, 2, 3, 60], [4, 5], [6, 7, 7], [8]]
    outputs = [[2, 9, 9, 10], [5, 5, 5, 11], [7, 12, 12], [8, 8]]
    got = process_logits(logits, build(params, prompts=prompts, outputs=outputs))
    for i in range(4):
        want = reference_penalties(logits[i], params[i], prompts[i], outputs[i])
        torch.testing.assert_close(got[i], want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3], logits[3])  # no penalty: untouched


def test_hand_computed_penalty_values():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    info = build([SP(temperature=0, repetition_penalty=2.0, frequency_penalty=0.5,
                     presence_penalty=0.25)], prompts=[[0]], outputs=[[1, 1, 2]], vocab=4)
    # token 0: prompt only -> 2/2; token 1: output x2 -> -2*2 - 0.5*2 - 0.25;
    # token 2: output x1 -> 1/2 - 0.5 - 0.25; token 3: untouched.
    want = torch.tensor([[1.0, -5.25, -0.25, 0.5]])
    torch.testing.assert_close(process_logits(logits, info), want)


def test_min_new_tokens_masks_stop_tokens_until_reached():
    logits = torch.zeros(3, V)
    logits[:, 2] = 10.0  # eos
    logits[:, 4] = 9.0  # a stop_token_id
    logits[:, 6] = 8.0
    params = [SP(temperature=0, min_new_tokens=3)] * 3
    outputs = [[1, 1], [1, 1, 1], []]
    stops = [{2, 4}, {2, 4}, {2}]
    assert sample(logits, build(params, outputs=outputs, stops=stops)) == [6, 2, 4]


# ---- logprobs ----------------------------------------------------------------
def test_logprobs_are_of_processed_untempered_distribution():
    torch.manual_seed(2)
    logits = torch.randn(3, V)
    params = [SP(temperature=0.3, logit_bias={1: 2.0}), SP(top_k=5, presence_penalty=1.0),
              SP(temperature=0)]
    info = build(params, outputs=[[], [3, 4], []], seeds=[5, 6, 7])
    out = Sampler()(logits, info, return_logprob=True, top_logprobs_num=4)
    ref = torch.log_softmax(process_logits(logits, info), dim=-1)
    ids = out.next_token_ids
    torch.testing.assert_close(out.logprobs, ref.gather(1, ids[:, None]).squeeze(1))
    values, top_ids = out.top_logprobs
    torch.testing.assert_close(values, ref.topk(4, dim=-1).values)
    assert torch.equal(top_ids, ref.topk(4, dim=-1).indices)
    plain = Sampler()(logits, info)
    assert plain.logprobs is None and plain.top_logprobs is None
    assert torch.equal(plain.next_token_ids, ids)


# ---- filters against a straightforward reference -----------------------------
def reference_keep(row: np.ndarray, p: SP) -> np.ndarray:
    """Kept tokens of one tempered row: top-k (ties kept), top-p over the
    renormalized top-k set (ties kept), min-p relative to the best token."""
    x = row.astype(np.float64)
    keep = np.ones_like(x, dtype=bool)
    if 0 < p.top_k < len(x):
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    if p.top_p < 1.0:
        probs = np.where(keep, np.exp(x - x.max()), 0.0)
        probs /= probs.sum()
        order = np.argsort(-x, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        n_keep = max(1, int((before < p.top_p).sum()))
        keep &= x >= x[order[n_keep - 1]]
    if p.min_p > 0:
        probs = np.exp(x - x.max())
        keep &= probs >= p.min_p
    return keep


def filtered_mask(logits: torch.Tensor, params: list[SP]) -> np.ndarray:
    info = build(params, vocab=logits.shape[1])
    scaled = filter_logits(logits / info.temperatures, info, None)
    return torch.isfinite(scaled).numpy()


FILTER_CASES = [SP(top_k=5), SP(top_k=1000), SP(top_p=0.3), SP(top_p=0.9, temperature=0.5),
                SP(min_p=0.05), SP(min_p=0.3, temperature=2.0), SP(top_k=20, top_p=0.6),
                SP(top_k=40, top_p=0.95, min_p=0.02), SP(), SP(temperature=0.7)]


@pytest.mark.parametrize("width", [256, 5000])
def test_filters_match_reference_on_random_logits(width):
    torch.manual_seed(3)
    logits = torch.randn(len(FILTER_CASES), width) * 2.5
    mask = filtered_mask(logits, FILTER_CASES)
    for i, p in enumerate(FILTER_CASES):
        tempered = (logits[i] / p.temperature).numpy()
        np.testing.assert_array_equal(mask[i], reference_keep(tempered, p), err_msg=str(p))


def test_rows_without_filters_are_untouched_by_their_neighbours():
    torch.manual_seed(4)
    logits = torch.randn(4, 300)
    mask = filtered_mask(logits, [SP(), SP(top_k=3), SP(top_p=0.2), SP(min_p=0.5)])
    assert mask[0].all() and mask[1].sum() == 3


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_filters_with_ties_match_reference(data):
    """Small integer logits make ties common: kept sets include whole tie groups."""
    vocab = data.draw(st.integers(2, 24))
    rows = data.draw(st.integers(1, 4))
    values = data.draw(st.lists(st.lists(st.integers(-4, 4), min_size=vocab, max_size=vocab),
                                min_size=rows, max_size=rows))
    params = [SP(top_k=data.draw(st.sampled_from([-1, 1, 2, 3, 7, 30])),
                 top_p=data.draw(st.sampled_from([1.0, 0.97, 0.83, 0.61, 0.37])),
                 min_p=data.draw(st.sampled_from([0.0, 0.1, 0.45])),
                 temperature=data.draw(st.sampled_from([1.0, 0.5])))
              for _ in range(rows)]
    logits = torch.tensor(values, dtype=torch.float32)
    info = build(params, vocab=vocab)
    if info.is_all_greedy:
        return
    sampled = [i for i, p in enumerate(params) if not p.is_greedy]
    rows_t = info.sampled_rows
    scaled = filter_logits(logits[sampled] / info.temperatures[sampled], info, rows_t)
    for j, i in enumerate(sampled):
        want = reference_keep((logits[i] / params[i].temperature).numpy(), params[i])
        np.testing.assert_array_equal(torch.isfinite(scaled[j]).numpy(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_draws_stay_inside_the_kept_set(device):
    torch.manual_seed(5)
    logits = torch.randn(1, 200).repeat(500, 1) * 2
    p = SP(top_k=30, top_p=0.7, min_p=0.1, temperature=1.3)
    keep = reference_keep((logits[0] / p.temperature).numpy(), p)
    ids = sample(logits, build([p] * 500, seeds=list(range(500)), vocab=200, device=device))
    assert all(keep[i] for i in ids)
    assert len(set(ids)) > 1


# ---- seeded, batch-independent draws -----------------------------------------
def test_noise_is_a_pure_function_of_seed_step_token():
    keys = torch.tensor([noise_key(s, t) for s, t in [(7, 0), (7, 1), (8, 0), (-3, 5),
                                                        (2**40 + 7, 0)]])
    full = neg_gumbel_noise(keys, 1000)
    for i in range(5):
        assert torch.equal(neg_gumbel_noise(keys[i:i + 1], 1000)[0], full[i])
    assert torch.isfinite(full).all()
    # A larger vocabulary extends the same noise: it is keyed by token id.
    assert torch.equal(neg_gumbel_noise(keys, 1500)[:, :1000], full)
    assert len(set(keys.tolist())) == 5
    assert noise_key(-3, 5) == noise_key(2**64 - 3, 5)  # seeds are taken mod 2**64


def test_noise_matches_a_scalar_reference():
    key = noise_key(123, 4)
    noise = neg_gumbel_noise(torch.tensor([key]), 300)[0]
    for token in (0, 1, 2, 150, 299):
        h = _mix32(key ^ ((token * 0x9E3779B1) & 0xFFFFFFFF))
        u = ((h >> 9) + 0.5) / 2**23
        assert noise[token].item() == pytest.approx(math.log(-math.log(u)), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("target", [SP(temperature=0.9), SP(top_k=40, top_p=0.8),
                                    SP(min_p=0.05, temperature=1.5), SP(top_p=0.95)])
def test_same_seed_and_step_same_token_at_any_position_and_batch_size(target, device):
    gen = torch.Generator().manual_seed(6)
    vocab = 3000
    others = [SP(temperature=0), SP(top_k=5), SP(top_p=0.3), SP(min_p=0.2), SP(),
              SP(top_k=100, frequency_penalty=0.5), SP(logit_bias={3: 4.0}, temperature=0.5)]
    for trial in range(10):
        row = torch.randn(vocab, generator=gen) * 2
        seed, step = 1000 + trial, trial * 3
        alone = sample(row[None], build([target], [seed], [step], vocab=vocab,
                                        device=device))[0]
        for bs in (2, 5, 17):
            pos = int(torch.randint(bs, (1,), generator=gen))
            logits = torch.randn(bs, vocab, generator=gen) * 2
            logits[pos] = row
            params = [others[(i + trial) % len(others)] for i in range(bs)]
            params[pos] = target
            seeds = [int(s) for s in torch.randint(10**6, (bs,), generator=gen)]
            seeds[pos] = seed
            steps = [step] * bs
            outputs = [[1, 2]] * bs
            outputs[pos] = []
            info = build(params, seeds, steps, outputs=outputs, vocab=vocab, device=device)
            assert sample(logits, info)[pos] == alone, (trial, bs, pos)


def test_different_seeds_and_steps_give_different_draws():
    logits = torch.zeros(200, 1000)  # uniform: 200 draws nearly all distinct
    by_seed = sample(logits, build([SP()] * 200, seeds=list(range(200)), vocab=1000))
    by_step = sample(logits, build([SP()] * 200, seeds=[42] * 200, steps=list(range(200)),
                                   vocab=1000))
    assert len(set(by_seed)) > 150 and len(set(by_step)) > 150
    again = sample(logits, build([SP()] * 200, seeds=list(range(200)), vocab=1000))
    assert by_seed == again


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical values at p = 0.001 for the degrees of freedom used below.
CHI2_999 = {3: 16.27, 5: 20.52, 7: 24.32}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("params,by", [(SP(), "seed"), (SP(temperature=0.6), "step"),
                                       (SP(top_k=4), "seed"), (SP(top_p=0.8), "seed"),
                                       (SP(min_p=0.15, temperature=1.4), "seed")])
def test_draws_follow_the_distribution(params, by, device):
    n = 40000
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
    logits = base.repeat(n, 1)
    seeds, steps = (list(range(n)), [3] * n) if by == "seed" else ([12345] * n, list(range(n)))
    ids = sample(logits, build([params] * n, seeds, steps, vocab=8, device=device))
    tempered = (base / params.temperature).numpy()
    keep = reference_keep(tempered, params)
    probs = np.where(keep, np.exp(tempered - tempered.max()), 0.0)
    probs /= probs.sum()
    counts = np.bincount(ids, minlength=8)
    assert counts[~keep].sum() == 0
    df = int(keep.sum()) - 1
    stat = chi_square(counts[keep], probs[keep])
    assert stat < CHI2_999[df], (stat, counts, probs * n)


@pytest.mark.parametrize("device", DEVICES)
def test_uniform_draw_covers_all_tokens_evenly(device):
    """Marginal uniformity of the hashed noise: every token of a flat row is
    drawn about equally often (catches biased or correlated hash bits)."""
    n, vocab = 20000, 50
    ids = sample(torch.zeros(n, vocab), build([SP()] * n, seeds=[9] * n,
                                              steps=list(range(n)), vocab=vocab,
                                              device=device))
    counts = np.bincount(ids, minlength=vocab)
    stat = chi_square(counts, np.full(vocab, 1 / vocab))
    assert stat < 49 + 4 * math.sqrt(2 * 49), counts  # ~4 sigma above df=49


def test_build_flags_and_skips():
    info = build([SP(temperature=0), SP(temperature=0)])
    assert info.is_all_greedy and not info.needs_processing
    info = build([SP(temperature=0), SP(top_k=5), SP(top_p=0.9), SP()])
    assert info.sampled_rows.tolist() == [1, 2, 3]
    assert info.filter_rows.tolist() == [0, 1]
    assert info.need_top_k and info.need_top_p and not info.need_min_p
    assert info.filter_width == V  # top-p without top-k needs a full sort
    assert build([SP(top_k=5), SP(top_k=9, top_p=0.5)]).filter_width == 9
    assert build([SP(seed=1)], seeds=[2**64 - 1]).seeds.tolist() == [-1]


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=[pytest.mark.gpu, CUDA])])
def test_gumbel_argmax_paths_agree(use_triton):
    """The fused kernel hashes the same u as the torch path (its log may round
    differently, so a near-tie could differ: none expected in 3000 rows)."""
    torch.manual_seed(7)
    device = "cuda" if use_triton else "cpu"
    for n, vocab in [(1000, 50), (7, 70000), (2000, 4097)]:
        scores = torch.randn(n, vocab) * 2
        scores[0, :] = float("-inf")  # an all -inf row: id 0, like argmax
        keys = torch.tensor([noise_key(i, 11) for i in range(n)])
        ref = gumbel_argmax(scores.clone(), keys, use_triton=False)
        got = gumbel_argmax(scores.to(device), keys.to(device), use_triton=use_triton)
        assert (got.cpu() != ref).sum() <= 1 and got[0] == 0
