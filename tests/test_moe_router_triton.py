"""The router's Triton kernel (`radixlm/layers/moe/triton_ops/topk.py`) against the
torch router (`TopKRouter` without `fused_kernel`), on the CPU under Triton's interpreter.

- Exact agreement where the math allows it: inputs on a dyadic grid (x in eighths,
  weights in 64ths) make every logit exact in fp32 whatever the summation order,
  and tokens are drawn so that the top k + 1 logits are apart; ids then match the
  torch router's exactly and weights within 1e-6 relative (a rounded weight within
  one rounding of that), over E 8 / 60 / 64 / 128, k 1 / 2 / 4 / 8, H 64 / 100 / 256,
  T 0 / 1 / 5 / 33, renormalised or not, rounded to bf16 or not, x bf16 or fp32.
- Gaussian inputs against a float64 softmax top-k (where TF32 products would show).
- A token's outputs bit for bit alone and inside a batch of 33; padded experts
  (E = 60) never chosen, ties to the lower id; NaN rows; the refusals; the router's
  switch.
- `fused_norm_topk` (the post-attention norm in the logits kernel, decode batches)
  against the Triton norm + `fused_topk`: the residual bit for bit, the normalized
  row within one rounding, ids equal away from near-ties; where the MoE block takes
  it and where it falls back.

The interpreter must be on before triton is first imported in a process, and a
process that imported it otherwise (the full suite: other modules import triton
at collection) cannot interpret a kernel. So the checks run here when the process
started with TRITON_INTERPRET=1; otherwise `test_under_interpreter` runs this file
again in a child pytest with it set (~30 s on 2 cores) and the checks here skip.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import in_interpreter, run_file_under_interpreter

from radixlm.utils import triton_installed

if not triton_installed():
    pytest.skip("Triton is not installed", allow_module_level=True)


def test_under_interpreter() -> None:
    run_file_under_interpreter(__file__)


# ---- inputs and references ---------------------------------------------------------

def torch_router(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool,
                 round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from radixlm.layers.moe.router import TopKRouter

    router = TopKRouter(weight.shape[0], weight.shape[1], k, renormalize, round_weights)
    router.to(weight.device).weight.data.copy_(weight)
    return router(x)


def dyadic_inputs(t: int, e: int, h: int, dtype: torch.dtype, seed: int,
                  separated: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    """x [t, h] in eighths of [-1, 1], weight [e, h] in 64ths of [-1/4, 1/4]: products
    are multiples of 2**-9 and every partial sum fits fp32's 24 bits (H <= 2**13), so
    any order of summation gives the exact logits. Each token is redrawn until its
    `separated` largest logits are pairwise apart (no ties at or above the k-th)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randint(-16, 17, (e, h), generator=gen).float() / 64
    rows = []
    while len(rows) < t:
        row = torch.randint(-8, 9, (h,), generator=gen).float() / 8
        top = torch.sort((weight.double() @ row.double()), descending=True).values
        if (top[:min(separated, e)].diff() < 0).all():
            rows.append(row)
    x = torch.stack(rows) if rows else torch.empty(0, h)
    return x.to(dtype), weight


def assert_weights_match(out: torch.Tensor, ref: torch.Tensor,
                         round_dtype: torch.dtype | None = None, rel: float = 1e-6) -> None:
    """out within `rel` of ref (the unrounded weights); with round_dtype, out is
    round_dtype's rounding of a value within `rel` of ref (rounding is monotone, so
    between the roundings of ref's bounds)."""
    ref = ref.double()
    lo, hi = ref * (1 - rel), ref * (1 + rel)
    if round_dtype is not None:
        lo, hi = lo.to(round_dtype).double(), hi.to(round_dtype).double()
        assert torch.equal(out.to(round_dtype).float(), out), "weights not rounded"
    ok = (out.double() >= lo) & (out.double() <= hi)
    err = ((out.double() - ref).abs() / ref.abs()).max().item() if out.numel() else 0.0
    assert bool(ok.all()), f"weights off by up to {err:.3g} relative"


def fused(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool,
          round_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from radixlm.layers.moe.triton_ops.topk import fused_topk

    weights, ids = fused_topk(x, weight, k, renormalize, x.dtype if round_weights else None)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (x.shape[0], k)
    assert weights.is_contiguous() and ids.is_contiguous()
    return weights, ids


def check_against_torch(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool,
                        round_weights: bool) -> None:
    weights, ids = fused(x, weight, k, renormalize, round_weights)
    ref_w, ref_ids = torch_router(x, weight, k, renormalize, round_weights=False)
    assert torch.equal(ids, ref_ids), "expert ids differ from the torch router's"
    rounds = round_weights and x.dtype != torch.float32
    assert_weights_match(weights, ref_w, x.dtype if rounds else None)


EXPERTS = (8, 60, 64, 128)
HIDDEN = (64, 100, 256)
TOKENS = (0, 1, 5, 33)
TOP_K = (1, 2, 4, 8)
# (renormalize, round_weights, x dtype): every combination, cycled over the shapes so
# that each meets every E, H, T and k.
FLAGS = [(r, q, d) for r in (False, True) for q in (False, True)
         for d in (torch.bfloat16, torch.float32)]


@in_interpreter
@pytest.mark.parametrize("e", EXPERTS)
@pytest.mark.parametrize("h", HIDDEN)
def test_matches_torch_router(e: int, h: int) -> None:
    inputs = {d: dyadic_inputs(max(TOKENS), e, h, d, seed=e * 1000 + h)
              for d in (torch.bfloat16, torch.float32)}
    for i, t in enumerate(TOKENS):
        for j, k in enumerate(TOP_K):
            renormalize, round_weights, dtype = FLAGS[(i + j + EXPERTS.index(e)
                                                       + HIDDEN.index(h)) % len(FLAGS)]
            x, weight = inputs[dtype]
            check_against_torch(x[:t], weight, k, renormalize, round_weights)


@in_interpreter
@pytest.mark.parametrize("e,h,t,k", [(60, 100, 33, 4), (128, 256, 5, 8), (8, 64, 33, 8)])
def test_every_flag(e: int, h: int, t: int, k: int) -> None:
    for renormalize, round_weights, dtype in FLAGS:
        x, weight = dyadic_inputs(t, e, h, dtype, seed=7)
        check_against_torch(x, weight, k, renormalize, round_weights)


@in_interpreter
def test_gaussian_against_float64() -> None:
    """True fp32 products: TF32's 10-bit mantissas would put weights ~1e-3 off."""
    gen = torch.Generator().manual_seed(3)
    e, h, t, k = 64, 256, 33, 8
    x = torch.randn(t, h, generator=gen)
    weight = torch.randn(e, h, generator=gen) * 0.1
    weights, ids = fused(x, weight, k, renormalize=False, round_weights=False)
    logits = x.double() @ weight.double().T
    ref_w, ref_ids = logits.softmax(-1).topk(k, dim=-1)
    top = logits.sort(dim=-1, descending=True).values[:, :k + 1]
    clear = (top.diff(dim=-1) < -1e-4).all(dim=-1)  # no near tie at or above the k-th
    assert clear.sum() >= t - 2
    assert torch.equal(ids[clear].long(), ref_ids[clear])
    assert_weights_match(weights[clear], ref_w[clear], rel=1e-5)


@in_interpreter
@pytest.mark.parametrize("e,h", [(128, 256), (60, 100)])
def test_batch_invariant(e: int, h: int) -> None:
    """A token's weights and ids bit for bit alone and at any row of a batch of 33
    (Gaussian inputs: the dyadic ones would be exact in any order)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(33, h, generator=gen).to(torch.bfloat16)
    weight = torch.randn(e, h, generator=gen) * 0.1
    batch_w, batch_ids = fused(x, weight, 8, renormalize=True, round_weights=False)
    for row in (0, 1, 15, 16, 17, 31, 32):
        one_w, one_ids = fused(x[row:row + 1], weight, 8, renormalize=True,
                               round_weights=False)
        assert torch.equal(one_w[0], batch_w[row]) and torch.equal(one_ids[0], batch_ids[row])


@in_interpreter
def test_padded_experts_never_chosen() -> None:
    e, h = 60, 64
    weight = torch.randn(e, h, generator=torch.Generator().manual_seed(9))
    # All logits tie at 0: ties go to the lower ids.
    weights, ids = fused(torch.zeros(5, h), weight, 8, renormalize=False, round_weights=False)
    assert torch.equal(ids, torch.arange(8, dtype=torch.int32).expand(5, 8))
    assert torch.equal(weights, torch.full((5, 8), 1 / 60))
    # One expert takes all the probability; the others' underflow to 0 and rank
    # still above the padding.
    hot = torch.full((e, h), -100 / h)
    hot[37] = 100 / h
    weights, ids = fused(torch.ones(2, h), hot, 8, renormalize=True, round_weights=False)
    assert ids.tolist() == [[37, 0, 1, 2, 3, 4, 5, 6]] * 2
    assert weights[:, 0].tolist() == [1.0, 1.0] and not weights[:, 1:].any()
    # k = E: every real expert, once.
    x = torch.randn(3, h, generator=torch.Generator().manual_seed(10))
    _, ids = fused(x, weight, e, renormalize=True, round_weights=False)
    assert torch.equal(ids.sort(dim=-1).values, torch.arange(e, dtype=torch.int32).expand(3, e))


@in_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the NaN row's softmax
def test_nan_rows() -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(11))
    x[1, 5] = float("nan")
    weight = torch.randn(60, 64, generator=torch.Generator().manual_seed(12))
    weights, ids = fused(x, weight, 4, renormalize=True, round_weights=False)
    assert weights[1].isnan().all() and not weights[[0, 2]].isnan().any()
    assert ids[1].tolist() == [0, 1, 2, 3]  # all NaN: ranked alike, lower ids first
    _, ref_ids = torch_router(x[[0, 2]], weight, 4, True, False)
    assert torch.equal(ids[[0, 2]], ref_ids)


@in_interpreter
def test_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixlm.layers.moe.triton_ops.topk import fused_topk

    x, w = torch.randn(2, 64), torch.randn(8, 64)
    cases = [
        ((x.double(), w, 2), "x must be"),
        ((torch.randn(2, 0), torch.randn(8, 0), 2), "H >= 1"),
        ((torch.randn(64, 2).T, w, 2), "contiguous rows"),
        ((x, w.bfloat16(), 2), "weight must be"),
        ((x, torch.randn(8, 32), 2), "weight must be"),
        ((x, torch.randn(513, 64), 2), "E <= 512"),
        ((x, w, 0), "top_k=0"),
        ((x, w, 9), "top_k=9"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            fused_topk(*args, renormalize=True)
    with pytest.raises(ValueError, match="round_dtype"):
        fused_topk(x, w, 2, True, torch.int8)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="CUDA tensors, or TRITON_INTERPRET=1"):
        fused_topk(x, w, 2, True)


@in_interpreter
@pytest.mark.parametrize("renormalize,round_weights", [(True, True), (False, False)])
def test_router_switch(renormalize: bool, round_weights: bool,
                       monkeypatch: pytest.MonkeyPatch) -> None:
    from radixlm.layers.moe.router import TopKRouter

    x, weight = dyadic_inputs(9, 64, 100, torch.bfloat16, seed=13)
    router = TopKRouter(64, 100, 4, renormalize, round_weights, fused_kernel=True)
    router.weight.data.copy_(weight)
    weights, ids = router(x)
    ref_w, ref_ids = torch_router(x, weight, 4, renormalize, round_weights=False)
    assert torch.equal(ids, ref_ids)
    assert_weights_match(weights, ref_w, torch.bfloat16 if round_weights else None)
    # CPU tensors without the interpreter: the torch code, exactly.
    monkeypatch.delenv("TRITON_INTERPRET")
    torch_w, torch_ids = router(x)
    ref_w, ref_ids = torch_router(x, weight, 4, renormalize, round_weights)
    assert torch.equal(torch_w, ref_w) and torch.equal(torch_ids, ref_ids)


def test_router_follows_the_experts_backend() -> None:
    from types import SimpleNamespace

    from radixlm.layers.moe.backends import MOE_BACKENDS
    from radixlm.models.decoder import _experts_on_triton

    def experts(method) -> SimpleNamespace:
        return SimpleNamespace(quant_method=method)

    assert _experts_on_triton(experts(SimpleNamespace(backend=MOE_BACKENDS["triton"])))
    for name in ("torch", "cpu"):
        assert not _experts_on_triton(experts(SimpleNamespace(backend=MOE_BACKENDS[name])))
    assert not _experts_on_triton(experts(SimpleNamespace()))  # GGUF experts: no backend


# ---- the post-attention norm folded into the logits kernel ---------------------------

def norm_inputs(t: int, h: int, e: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    residual = (torch.randn(t, h, generator=gen) * 4).to(dtype)
    norm_w = (1 + torch.randn(h, generator=gen) * 0.2).to(dtype)
    weight = torch.randn(e, h, generator=gen) * 0.1
    return x, residual, norm_w, weight


def check_norm_router(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
                      weight: torch.Tensor, k: int) -> torch.Tensor:
    """`fused_norm_topk` against the Triton norm + `fused_topk` (renormalized, rounded
    to bf16): the residual bit for bit, the normalized row within one rounding (both
    round s * rstd * w once; only the order of the row's sum of squares may differ),
    ids equal away from near-ties, weights within 1e-5. Returns the residual."""
    from radixlm.layers import fused_ops
    from radixlm.layers.moe.triton_ops.topk import fused_norm_topk, fused_topk

    normed, res, weights, ids = fused_norm_topk(x, residual, norm_w, 1e-6, weight, k, True,
                                                torch.bfloat16)
    ref_h, ref_res = fused_ops.rms_norm(x, norm_w, 1e-6, residual, use_triton=True)
    assert torch.equal(res, ref_res)
    ulp = (ref_h.float().abs() * 2.0 ** -7).clamp_min(2.0 ** -126)
    assert ((normed.float() - ref_h.float()).abs() <= ulp).all()
    ref_w, ref_ids = fused_topk(ref_h, weight, k, True, torch.bfloat16)
    logits = normed.double() @ weight.double().T
    top = logits.sort(dim=-1, descending=True).values[:, :k + 1]
    clear = (top.diff(dim=-1) < -1e-4).all(dim=-1)
    assert clear.sum() >= x.shape[0] - 1
    assert torch.equal(ids[clear], ref_ids[clear])
    assert_weights_match(weights[clear], ref_w[clear], torch.bfloat16, rel=1e-5)
    return res


@in_interpreter
@pytest.mark.parametrize("t,h,e,k", [(1, 2048, 128, 8), (8, 256, 60, 4), (3, 100, 8, 2),
                                     (5, 4096, 64, 8)])
def test_norm_fused_matches_two_launches(t: int, h: int, e: int, k: int) -> None:
    # (The interpreter's bf16 casts truncate: the residual is compared with the
    # interpreted norm kernel's only.)
    check_norm_router(*norm_inputs(t, h, e, seed=t * 100 + e), k)


@in_interpreter
def test_norm_fused_rows_are_independent() -> None:
    """A token's outputs bit for bit alone and at any row of a batch of 8."""
    from radixlm.layers.moe.triton_ops.topk import fused_norm_topk

    x, residual, norm_w, weight = norm_inputs(8, 256, 64, seed=21)
    batch = fused_norm_topk(x, residual, norm_w, 1e-5, weight, 4, False)
    for row in (0, 3, 7):
        one = fused_norm_topk(x[row:row + 1], residual[row:row + 1], norm_w, 1e-5, weight, 4,
                              False)
        assert all(torch.equal(a[0], b[row]) for a, b in zip(one, batch))


@in_interpreter
def test_norm_fused_refuses_what_it_cannot_take() -> None:
    from radixlm.layers.moe.triton_ops.topk import (
        NORM_FUSED_MAX_TOKENS,
        fused_norm_topk,
        norm_fusable,
    )

    x, residual, norm_w, weight = norm_inputs(2, 64, 8, seed=22)
    assert norm_fusable(x, residual, norm_w, weight)
    big = torch.zeros(NORM_FUSED_MAX_TOKENS + 1, 64, dtype=torch.bfloat16)
    for args in [(big, big, norm_w, weight), (x.float(), residual.float(), norm_w.float(), weight),
                 (x, residual, norm_w, weight.bfloat16()), (x, residual.float(), norm_w, weight),
                 (x, residual, norm_w.float(), weight), (x[:0], residual[:0], norm_w, weight)]:
        assert not norm_fusable(*args)
    with pytest.raises(ValueError, match="outside norm_fusable"):
        fused_norm_topk(big, big, norm_w, 1e-6, weight, 2, True)


@in_interpreter
@pytest.mark.parametrize("t", [1, 8, 9])
def test_moe_block_folds_the_norm(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """SparseMoeBlock.forward_after_norm: the fused router for a decode batch (t <= 8),
    norm + forward beyond it, and for norms or tensor parallelism it cannot fold; the
    block's output and residual as norm + forward give them."""
    from radixlm import distributed as tp
    from radixlm.layers.moe import block as block_mod
    from radixlm.layers.moe.router import TopKRouter
    from radixlm.layers.norm import GemmaRMSNorm, RMSNorm

    h, e, k = 128, 16, 2
    x, residual, norm_w, weight = norm_inputs(t, h, e, seed=23)
    # Eighths in [-4, 4]: x + residual is exact in bf16 (the interpreter's casts
    # truncate where torch's round).
    x, residual = ((v.float() * 8).round().clamp(-32, 32) / 8 for v in (x, residual))
    x, residual = x.bfloat16(), residual.bfloat16()
    router = TopKRouter(e, h, k, renormalize=True, fused_kernel=True)
    router.weight.data.copy_(weight)
    seen = []

    def experts(x, weights, ids):  # stands for FusedMoE: a function of all three
        seen.append(ids.clone())
        return x * weights.sum(-1, keepdim=True).to(x.dtype) + ids.sum(-1, keepdim=True)

    block = block_mod.SparseMoeBlock(router, experts)
    norm = RMSNorm(h, 1e-6, torch.bfloat16)
    norm.weight.data.copy_(norm_w)
    calls = []
    real = router.route_after_norm
    monkeypatch.setattr(router, "route_after_norm",
                        lambda *a: calls.append(r := real(*a)) or r)
    out, res = block.forward_after_norm(x, residual, norm)
    ref_h, ref_res = norm(x, residual, reduce=True)
    assert (calls[-1] is not None) == (t <= 8)
    assert torch.equal(res, ref_res)
    ref_out = block(ref_h)
    assert torch.equal(seen[0], seen[1]) and torch.allclose(out, ref_out, rtol=2e-2, atol=2e-2)
    # A Gemma norm and a second rank: norm, then forward.
    gemma = GemmaRMSNorm(h, 1e-6, torch.bfloat16)
    assert router.route_after_norm(x[:1], residual[:1], gemma) is None
    monkeypatch.setattr(tp, "get_tp_size", lambda: 2)
    assert router.route_after_norm(x[:1], residual[:1], norm) is None
