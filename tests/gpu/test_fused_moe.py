"""The fused-MoE Triton kernels (`radixlm/layers/moe/triton_ops/`) against a float64
per-expert loop: the alignment's invariants, `fused_experts` over dtypes, top-k
1/2/8, 8-128 experts, batches 1-512, empty experts, all tokens on one expert,
ids of -1 (experts on another rank), FP8 weight scales, CUDA-graph replay, and the
config table; and the router's fused softmax top-k (`triton_ops/topk.py`, CUDA only:
its interpreter checks are tests/test_moe_router_triton.py's) against the torch
router at Qwen3-30B-A3B's and Mixtral's sizes, bit for bit across batches, in a graph.

The config tests run anywhere. The kernel tests run on CUDA (the full grid), or on
the CPU under the Triton interpreter (`TRITON_INTERPRET=1`: a small subset, in fp32
and fp16, since the interpreter computes bf16 wrongly on the CPU; ~1 min on 2
cores). CI sets neither, so it runs only the config tests.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from devices import DEV, HAS_CUDA, INTERPRET, needs_cuda, needs_kernels

from radixlm.layers.moe.triton_ops.configs import (
    SMEM_BUDGET,
    TABLE_PATH,
    ConfigTable,
    GemmTile,
    MoEConfig,
    fit_tile,
    get_config,
    heuristic_config,
    shape_key,
)

pytestmark = pytest.mark.gpu
INTERPRET = INTERPRET and not HAS_CUDA  # the interpreter's shapes only where there is no GPU
# ||out - ref|| / ||ref|| bounds, as in test_triton_attention.py: bf16 keeps 8
# mantissa bits, fp16 11; fp32 runs true fp32 products.
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-4}
DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.bfloat16, torch.float16,
                                                           torch.float32]


# ---- references and inputs ---------------------------------------------------------

ACTS = {"silu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
        "gelu_tanh": lambda v: torch.nn.functional.gelu(v, approximate="tanh")}


def ref_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """float64 per-expert loop: each expert's tokens through gate/up, act-and-mul, down."""
    e_num, inter = w13.shape[0], w2.shape[2]
    xd = x.double()
    out = torch.zeros_like(xd)
    for e in range(e_num):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = xd[tok] @ w13[e].double().T
        act = ACTS[activation](h[:, :inter]) * h[:, inter:]
        y = (act @ w2[e].double().T) * topk_weights[tok, slot].double()[:, None]
        out.index_add_(0, tok, y)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_routing(t: int, e: int, k: int, kind: str,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32, topk_ids int32) [t, k], renormalised softmax top-k.

    kind: "random"; "one" (every token's first choice is expert 0: one group of t
    rows, most experts empty); "half" (only the first half of the experts used);
    "ep" (about a third of the pairs -1, as on one rank of expert parallelism)."""
    logits = torch.randn(t, e, generator=gen)
    if kind == "one":
        logits[:, 0] = 1e4
    elif kind == "half":
        logits[:, (e + 1) // 2:] = -1e4
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    ids = ids.to(torch.int32)
    if kind == "ep":
        ids[torch.rand(t, k, generator=gen) < 0.35] = -1
    return weights.float().contiguous().to(DEV), ids.contiguous().to(DEV)


def make_weights(e: int, h: int, inter: int, dtype: torch.dtype, gen: torch.Generator):
    x_scale, w13_scale, w2_scale = 1.0, h ** -0.5, inter ** -0.5
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * w13_scale).to(dtype).to(DEV)
    w2 = (torch.randn(e, h, inter, generator=gen) * w2_scale).to(dtype).to(DEV)
    return x_scale, w13, w2


def run_case(t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype, kind: str,
             seed: int = 0, **kwargs) -> float:
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    gen = torch.Generator().manual_seed(seed)
    _, w13, w2 = make_weights(e, h, inter, dtype, gen)
    x = torch.randn(t, h, generator=gen).to(dtype).to(DEV)
    topk_weights, topk_ids = make_routing(t, e, k, kind, gen)
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, **kwargs)
    assert out.shape == (t, h) and out.dtype == dtype
    ref = ref_experts(x, w13, w2, topk_weights, topk_ids, kwargs.get("activation", "silu"))
    return rel_err(out, ref)


# ---- the alignment -----------------------------------------------------------------

def check_alignment(topk_ids: torch.Tensor, e: int, block_m: int, aligned) -> None:
    from radixlm.layers.moe.triton_ops.moe_align import max_padded_rows

    ids = topk_ids.flatten().cpu().tolist()
    numel = len(ids)
    sorted_ids = aligned.sorted_ids.cpu().tolist()
    expert_ids = aligned.expert_ids.cpu().tolist()
    used = int(aligned.num_post_padded.item())
    assert len(sorted_ids) == max_padded_rows(numel, e, block_m) == len(expert_ids) * block_m
    assert used % block_m == 0 and used <= len(sorted_ids)
    row = 0
    for x in range(e):  # experts in id order, each group stable and padded
        pairs = [p for p, v in enumerate(ids) if v == x]
        size = -(-len(pairs) // block_m) * block_m
        assert sorted_ids[row:row + len(pairs)] == pairs, f"expert {x}'s rows"
        assert all(s == numel for s in sorted_ids[row + len(pairs):row + size]), "padding"
        assert expert_ids[row // block_m:(row + size) // block_m] == [x] * (size // block_m)
        row += size
    assert row == used, "rows in use"
    assert all(b == -1 for b in expert_ids[used // block_m:]), "blocks past the end"
    # Every valid pair exactly once; -1 and out-of-range ids nowhere.
    listed = sorted(s for s in sorted_ids[:used] if s != numel)
    assert listed == [p for p, v in enumerate(ids) if 0 <= v < e]


ALIGN_CASES = [  # (tokens, top_k, experts, block_m, max_chunks, kind)
    (1, 8, 128, 16, None, "random"),
    (5, 2, 8, 16, None, "random"),
    (40, 2, 8, 16, None, "ep"),
    (600, 2, 8, 32, None, "random"),  # past SINGLE_TILES tiles: count / scan / scatter
    (600, 2, 8, 16, 3, "one"),  # 3 chunks of several tiles each
    (50, 8, 60, 64, None, "half"),  # experts not a power of two; 400 pairs of 32-pair tiles
    (64, 8, 128, 128, 4, "random"),
    (33, 1, 8, 16, None, "one"),
]


@needs_kernels
@pytest.mark.parametrize("t,k,e,block_m,max_chunks,kind", ALIGN_CASES)
def test_align_invariants(t, k, e, block_m, max_chunks, kind):
    from radixlm.layers.moe.triton_ops.moe_align import moe_align_block_size

    gen = torch.Generator().manual_seed(t * 31 + e)
    _, topk_ids = make_routing(t, e, k, kind, gen)
    aligned = moe_align_block_size(topk_ids, e, block_m, max_chunks=max_chunks)
    check_alignment(topk_ids, e, block_m, aligned)


@needs_kernels
def test_align_all_remote_and_out_of_range():
    """All pairs -1 (every expert on another rank), and ids >= E: no rows at all."""
    from radixlm.layers.moe.triton_ops.moe_align import moe_align_block_size

    for fill in (-1, 8, 1000):
        topk_ids = torch.full((9, 2), fill, dtype=torch.int32, device=DEV)
        aligned = moe_align_block_size(topk_ids, 8, 16)
        assert int(aligned.num_post_padded.item()) == 0
        check_alignment(topk_ids, 8, 16, aligned)


# ---- fused_experts -----------------------------------------------------------------

if INTERPRET:
    SHAPES = [(8, 2, 64, 48)]  # (experts, top_k, hidden, intermediate)
    TOKENS = [1, 5, 40]
else:
    SHAPES = [(8, 1, 256, 192), (8, 2, 512, 256), (64, 8, 256, 128), (128, 8, 384, 192)]
    TOKENS = [1, 7, 64, 512]


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("e,k,h,inter", SHAPES)
@pytest.mark.parametrize("t", TOKENS)
def test_fused_experts_random(t, e, k, h, inter, dtype):
    err = run_case(t, e, k, h, inter, dtype, "random", seed=t + e, direct=False)
    assert err < TOL[dtype], err


@needs_kernels
@pytest.mark.parametrize("kind", ["one", "half", "ep"])
@pytest.mark.parametrize("t", [1, 40] if INTERPRET else [1, 64, 512])
@pytest.mark.parametrize("e,k", [(8, 2)] if INTERPRET else [(8, 1), (8, 2), (128, 8)])
def test_fused_experts_uneven_routing(t, e, k, kind):
    """All tokens on one expert, empty experts, and pairs of other ranks (-1)."""
    dtype = DTYPES[0] if INTERPRET else torch.bfloat16
    err = run_case(t, e, k, 64 if INTERPRET else 256, 48 if INTERPRET else 320, dtype, kind,
                   seed=7 * t + k, direct=False)
    assert err < TOL[dtype], err


@needs_kernels
@pytest.mark.parametrize("direct", [False, True], ids=["aligned", "direct"])
def test_unselected_experts_are_not_read(direct):
    """NaN in every expert no token selected (and in the rows of -1 pairs' experts'
    neighbours) leaves the output finite and right: only routed experts contribute."""
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    gen = torch.Generator().manual_seed(3)
    e, k, h, inter, t = 16, 2, 64, 32, 3
    _, w13, w2 = make_weights(e, h, inter, torch.float32, gen)
    x = torch.randn(t, h, generator=gen).to(DEV)
    topk_weights, topk_ids = make_routing(t, e, k, "random", gen)
    topk_ids[0, 1] = -1
    unused = torch.ones(e, dtype=torch.bool)
    unused[topk_ids[topk_ids >= 0].long().cpu()] = False
    w13[unused.to(DEV)] = float("nan")
    w2[unused.to(DEV)] = float("nan")
    out = fused_experts(x, w13, w2, topk_weights, topk_ids, direct=direct)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_experts(x, w13, w2, topk_weights, topk_ids)) < TOL[torch.float32]


@needs_kernels
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_gelu_activations(activation, fuse):
    """The other gated activations the MoE layers pass (GELU erf and tanh)."""
    dtype = DTYPES[-1] if INTERPRET else torch.bfloat16
    err = run_case(9, 8, 2, 64, 48, dtype, "ep", seed=12, activation=activation,
                   fuse_activation=fuse)
    assert err < TOL[dtype], err


@needs_kernels
@pytest.mark.parametrize("direct", [False, True], ids=["aligned", "direct"])
def test_out_and_unfused_variant(direct):
    """`out` is written and returned; the unfused gate/up + SiLU kernel agrees."""
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    gen = torch.Generator().manual_seed(4)
    e, k, h, inter, t = 8, 2, 64, 48, 6
    _, w13, w2 = make_weights(e, h, inter, torch.float32, gen)
    x = torch.randn(t, h, generator=gen).to(DEV)
    topk_weights, topk_ids = make_routing(t, e, k, "ep", gen)
    ref = ref_experts(x, w13, w2, topk_weights, topk_ids)
    out = torch.full((t, h), float("nan"), device=DEV)
    assert fused_experts(x, w13, w2, topk_weights, topk_ids, out=out, direct=direct) is out
    assert rel_err(out, ref) < TOL[torch.float32]
    unfused = fused_experts(x, w13, w2, topk_weights, topk_ids, fuse_activation=False)
    assert rel_err(unfused, ref) < TOL[torch.float32]


@needs_kernels
def test_token_chunks(monkeypatch):
    """Prefills longer than CHUNK_TOKENS run in passes that each align their own pairs."""
    from radixlm.layers.moe.triton_ops import fused_moe

    monkeypatch.setattr(fused_moe, "CHUNK_TOKENS", 4)
    err = run_case(11, 8, 2, 64, 32, torch.float32, "ep", seed=5)
    assert err < TOL[torch.float32], err


@needs_kernels
@pytest.mark.parametrize("config", [
    MoEConfig(16, GemmTile(16, 16, 1, 4, 2), GemmTile(16, 32, 2, 4, 2)),
    MoEConfig(32, GemmTile(32, 64, 4, 4, 3), GemmTile(64, 16, 1, 4, 2)),
], ids=["small", "grouped"])
def test_explicit_config(config):
    """Tiles other than the heuristic's (K not a multiple of BLOCK_K, GROUP_M > 1)."""
    err = run_case(21, 8, 2, 80, 40, torch.float32, "random", seed=6, config=config)
    assert err < TOL[torch.float32], err


def _fp8_case(block_shape, weight_dtype, act_dtype, gen):
    e, h, inter = 8, 64, 96
    w13 = torch.randn(e, 2 * inter, h, generator=gen).to(weight_dtype)
    w2 = torch.randn(e, h, inter, generator=gen).to(weight_dtype)
    if block_shape is None:
        s13 = torch.rand(e, 2 * inter, generator=gen) * h ** -0.5
        s2 = torch.rand(e, h, generator=gen) * inter ** -0.5
        d13, d2 = w13.double() * s13[..., None], w2.double() * s2[..., None]
    else:
        bn, bk = block_shape
        s13 = torch.rand(e, -(-2 * inter // bn), -(-h // bk), generator=gen) * h ** -0.5
        s2 = torch.rand(e, -(-h // bn), -(-inter // bk), generator=gen) * inter ** -0.5

        def expand(s, n, k):
            return s.repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)[:, :, :k].double()

        d13, d2 = w13.double() * expand(s13, 2 * inter, h), w2.double() * expand(s2, h, inter)
    return [v.to(DEV) for v in (w13, w2, s13, s2, d13, d2)]


@needs_kernels
@pytest.mark.parametrize("block_shape,direct", [(None, False), ((32, 32), False),
                                                ((64, 16), False), (None, True)],
                         ids=["aligned-channel", "aligned-32x32", "aligned-64x16",
                              "direct-channel"])
def test_scaled_weights(block_shape, direct):
    """Weight-only scales (the FP8 path): per channel and per block on the aligned
    path, per channel on the direct one, against the dequantized float64 weights.
    fp16 weights under fp32 activations test the scale math exactly;
    float8_e4m3fn under fp16 (and bf16 on CUDA) the conversion."""
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    gen = torch.Generator().manual_seed(8)
    pairs = [(torch.float16, torch.float32, 1e-4), (torch.float8_e4m3fn, torch.float16, 3e-3)]
    if HAS_CUDA:
        pairs.append((torch.float8_e4m3fn, torch.bfloat16, 1.5e-2))
    for wdt, adt, tol in pairs:
        w13, w2, s13, s2, d13, d2 = _fp8_case(block_shape, wdt, adt, gen)
        x = torch.randn(10, w13.shape[2], generator=gen).to(adt).to(DEV)
        topk_weights, topk_ids = make_routing(10, 8, 2, "ep", gen)
        out = fused_experts(x, w13, w2, topk_weights, topk_ids, w13_scale=s13.contiguous(),
                            w2_scale=s2.contiguous(), block_shape=block_shape, direct=direct)
        assert rel_err(out, ref_experts(x, d13, d2, topk_weights, topk_ids)) < tol, (wdt, adt)
        scaled = fused_experts(x, w13, w2, topk_weights, topk_ids, w13_scale=2 * s13,
                               w2_scale=s2.contiguous(), block_shape=block_shape, direct=direct)
        # Doubling the gate/up scales moves every output: the scales are read.
        assert (scaled.float() - out.float()).abs().max() > 0.1 * out.float().abs().max()


@needs_kernels
def test_matches_the_shared_reference():
    """Same answer as the MoE layers' torch reference (`layers/moe/torch_ref.py`, the
    contract every MoE backend shares), where that module is in the tree."""
    torch_ref = pytest.importorskip("radixlm.layers.moe.torch_ref")
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    gen = torch.Generator().manual_seed(13)
    _, w13, w2 = make_weights(8, 64, 48, torch.float32, gen)
    x = torch.randn(12, 64, generator=gen).to(DEV)
    topk_weights, topk_ids = make_routing(12, 8, 2, "ep", gen)
    for activation in ("silu", "gelu", "gelu_tanh"):
        ours = fused_experts(x, w13, w2, topk_weights, topk_ids, activation=activation)
        ref = torch_ref.fused_experts(x, w13, w2, topk_weights, topk_ids, activation=activation)
        assert rel_err(ours, ref.double()) < TOL[torch.float32], activation


@needs_kernels
def test_refusals():
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    gen = torch.Generator().manual_seed(9)
    _, w13, w2 = make_weights(8, 64, 32, torch.float32, gen)
    x = torch.randn(4, 64, generator=gen).to(DEV)
    tw, ti = make_routing(4, 8, 2, "random", gen)
    cases = [
        (dict(activation="relu"), "activation='relu'"),
        (dict(topk_ids=ti.long()), "topk_ids must be int32"),
        (dict(topk_weights=tw.half()), "topk_weights must be float32"),
        (dict(w2=w2[:, :, :16].contiguous()), "w2 must be"),
        (dict(hidden_states=x.double()), "dtype torch.float64"),
        (dict(w13=w13.half()), "w13_scale"),
        (dict(out=torch.empty(4, 64, dtype=torch.float16, device=DEV)), "out must be"),
        (dict(block_shape=(32, 32)), "block_shape given without"),
        (dict(w2_scale=torch.ones(8, 64, 2, device=DEV), w2=w2.half()), "w2_scale must be"),
    ]
    base = dict(hidden_states=x, w13=w13, w2=w2, topk_weights=tw, topk_ids=ti)
    for change, message in cases:
        args = {**base, **change}
        pos = [args.pop(n) for n in ("hidden_states", "w13", "w2", "topk_weights", "topk_ids")]
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            fused_experts(*pos, **args)


@needs_cuda
def test_cuda_graph_replay():
    """Captured once, replayed on new hidden states and new routings (other experts,
    -1 pairs, all on one expert): every replay matches the reference, no host sync."""
    gen = torch.Generator().manual_seed(10)
    t, e, k, h, inter, dtype = 48, 64, 8, 256, 128, torch.bfloat16
    _, w13, w2 = make_weights(e, h, inter, dtype, gen)
    x = torch.randn(t, h, generator=gen).to(dtype).to(DEV)
    topk_weights, topk_ids = make_routing(t, e, k, "random", gen)
    check_replays(x, w13, w2, topk_weights, topk_ids, gen)


def check_replays(x, w13, w2, topk_weights, topk_ids, gen, ref_weights=None,
                  with_pdl: bool = False, **kwargs) -> None:
    """`fused_experts(..., **kwargs)` captured in a CUDA graph (launched with PDL
    when `with_pdl`, as the engine does on Hopper), then replayed on new hidden
    states and each routing kind: every replay matches the reference of
    `ref_weights` (the dequantized (w13, w2) of quantized experts; default the
    weights themselves)."""
    from gpu_models import capture_graph, pdl_as

    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    (t, h), (e, k) = x.shape, (w13.shape[0], topk_ids.shape[1])
    r13, r2 = ref_weights if ref_weights is not None else (w13, w2)
    out = torch.empty_like(x)
    with pdl_as(with_pdl, x.device):
        graph, _ = capture_graph(lambda: fused_experts(x, w13, w2, topk_weights, topk_ids,
                                                       out=out, **kwargs))
    for kind in ("random", "ep", "one", "half"):
        new_w, new_ids = make_routing(t, e, k, kind, gen)
        x.copy_(torch.randn(t, h, generator=gen).to(x.dtype))
        topk_weights.copy_(new_w)
        topk_ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref_experts(x, r13, r2, topk_weights, topk_ids)) < TOL[x.dtype], kind


# ---- the direct small-batch path (`moe_gemv.py`) -----------------------------------
# Selected by `-k direct`; tests/test_moe_gemv_triton.py runs them under the
# interpreter in CPU CI.

if INTERPRET:
    DIRECT_SHAPES = [(8, 1, 80, 48), (8, 2, 64, 48), (128, 8, 64, 32)]  # (E, k, H, I)
    DIRECT_TOKENS = [1, 2, 8]
else:
    DIRECT_SHAPES = [(8, 1, 256, 192), (8, 2, 512, 320), (128, 8, 384, 192),
                     (128, 8, 2048, 768)]
    DIRECT_TOKENS = [1, 2, 3, 5, 8]


def _direct_inputs(t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype,
                   kind: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    _, w13, w2 = make_weights(e, h, inter, dtype, gen)
    x = torch.randn(t, h, generator=gen).to(dtype).to(DEV)
    return x, w13, w2, *make_routing(t, e, k, kind, gen)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("e,k,h,inter", DIRECT_SHAPES)
@pytest.mark.parametrize("t", DIRECT_TOKENS)
def test_direct_random(t, e, k, h, inter, dtype):
    """Against the float64 loop, about a third of the pairs -1 (ragged H and I:
    masked K steps and clamped rows)."""
    err = run_case(t, e, k, h, inter, dtype, "ep", seed=3 * t + e, direct=True)
    assert err < TOL[dtype], err


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_direct_matches_aligned(dtype):
    """Both paths round at the same points: they differ only by the K sums' order,
    far less than either's distance to the float64 reference."""
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    t, e, k, h, inter = (4, 8, 2, 64, 48) if INTERPRET else (2, 128, 8, 2048, 768)
    x, w13, w2, tw, ti = _direct_inputs(t, e, k, h, inter, dtype, "random", seed=21)
    direct = fused_experts(x, w13, w2, tw, ti, direct=True)
    aligned = fused_experts(x, w13, w2, tw, ti, direct=False)
    assert rel_err(direct, aligned.double()) < TOL[dtype] / 8
    assert rel_err(direct, ref_experts(x, w13, w2, tw, ti)) < TOL[dtype]


def _remote_experts_case(seed: int):
    """fp32 inputs of 8 experts, top-3: experts 3 and 5 shared between tokens in
    different slots, an id of -1 and one of E in one token, a token whose pairs are
    all elsewhere (row 2); NaN in every expert no token chose."""
    e = 8
    x, w13, w2, tw, _ = _direct_inputs(4, e, 3, 64, 48, torch.float32, "random", seed=seed)
    ti = torch.tensor([[3, -1, 5], [5, 3, e], [-1, -1, -1], [3, 6, 5]], dtype=torch.int32,
                      device=DEV)
    unused = torch.ones(e, dtype=torch.bool)
    unused[[3, 5, 6]] = False
    w13[unused.to(DEV)] = float("nan")
    w2[unused.to(DEV)] = float("nan")
    return x, w13, w2, tw, ti


@needs_kernels
def test_direct_shared_and_remote_experts():
    """One expert chosen by several tokens (in different slots), an id of -1 and one
    past E in the same token, and a token whose pairs are all elsewhere (its row is
    exactly zero); NaN in every expert not chosen shows none is read."""
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    x, w13, w2, tw, ti = _remote_experts_case(seed=22)
    out = fused_experts(x, w13, w2, tw, ti, direct=True)
    assert torch.isfinite(out).all() and torch.equal(out[2], torch.zeros_like(out[2]))
    assert rel_err(out, ref_experts(x, w13, w2, tw, ti)) < TOL[torch.float32]


@needs_kernels
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_direct_gelu_activations(activation):
    dtype = DTYPES[-1] if INTERPRET else torch.bfloat16
    err = run_case(5, 8, 2, 64, 48, dtype, "ep", seed=23, activation=activation, direct=True)
    assert err < TOL[dtype], err


@needs_kernels
def test_direct_strided_weights():
    """Rows and experts strided (as the online FP8 stacks are), K contiguous."""
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    x, w13, w2, tw, ti = _direct_inputs(3, 8, 2, 64, 48, torch.float32, "ep", seed=25)
    wide13 = torch.full((8, 96, 80), float("nan"), device=DEV)
    wide2 = torch.full((8, 64, 56), float("nan"), device=DEV)
    wide13[:, :, :64] = w13
    wide2[:, :, :48] = w2
    s13, s2 = wide13[:, :, :64], wide2[:, :, :48]
    assert not s13.is_contiguous() and not s2.is_contiguous()
    out = fused_experts(x, s13, s2, tw, ti, direct=True)
    assert rel_err(out, ref_experts(x, w13, w2, tw, ti)) < TOL[torch.float32]


@needs_kernels
def test_direct_auto_choice(monkeypatch):
    """Auto takes the direct path up to DIRECT_MAX_PAIRS pairs (and E / 4, or one
    token), and not with block scales or an unfused activation; zero tokens launch
    nothing."""
    from radixlm.layers.moe.triton_ops import fused_moe

    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    real = fused_moe.moe_gemv
    monkeypatch.setattr(fused_moe, "moe_gemv", spy)
    monkeypatch.setattr(fused_moe, "DIRECT_MAX_PAIRS", 16)  # the tuned value
    x, w13, w2, tw, ti = _direct_inputs(9, 64, 2, 64, 32, torch.float32, "random", seed=26)
    fused_moe.fused_experts(x[:8], w13, w2, tw[:8], ti[:8])  # 16 pairs
    fused_moe.fused_experts(x, w13, w2, tw, ti)  # 18 pairs: aligned
    fused_moe.fused_experts(x[:2], w13, w2, tw[:2], ti[:2], fuse_activation=False)
    fused_moe.fused_experts(x[:2], w13, w2, tw[:2], ti[:2], direct=False)
    fused_moe.fused_experts(x, w13, w2, tw, ti, direct=True)
    empty = fused_moe.fused_experts(x[:0], w13, w2, tw[:0], ti[:0], direct=True)
    assert calls == [8, 9] and empty.shape == (0, 64)
    monkeypatch.setattr(fused_moe, "DIRECT_MAX_PAIRS", 2)
    fused_moe.fused_experts(x[:2], w13, w2, tw[:2], ti[:2])
    assert calls == [8, 9]
    # 8 experts: only one token's pairs (2 > 8 // 4 pairs would share experts).
    x8, w13, w2, tw, ti = _direct_inputs(2, 8, 2, 64, 32, torch.float32, "random", seed=30)
    monkeypatch.setattr(fused_moe, "DIRECT_MAX_PAIRS", 16)
    fused_moe.fused_experts(x8, w13, w2, tw, ti)
    fused_moe.fused_experts(x8[:1], w13, w2, tw[:1], ti[:1])
    assert calls == [8, 9, 1]


@needs_kernels
def test_direct_refusals():
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    gen = torch.Generator().manual_seed(27)
    w13, w2, s13, s2, _, _ = _fp8_case((32, 32), torch.float16, torch.float32, gen)
    x = torch.randn(2, w13.shape[2], generator=gen).to(DEV)
    tw, ti = make_routing(2, 8, 2, "random", gen)
    with pytest.raises(ValueError, match=r"direct=True does not support block_shape=\(32, 32\)"):
        fused_experts(x, w13, w2, tw, ti, w13_scale=s13, w2_scale=s2, block_shape=(32, 32),
                      direct=True)
    with pytest.raises(ValueError, match="direct=True does not support fuse_activation=False"):
        fused_experts(x, w13.float(), w2.float(), tw, ti, fuse_activation=False, direct=True)
    # Auto routes block scales to the aligned path instead of refusing them.
    out = fused_experts(x, w13, w2, tw, ti, w13_scale=s13, w2_scale=s2, block_shape=(32, 32))
    assert torch.isfinite(out).all()


@needs_kernels
@pytest.mark.parametrize("case", ["random", "remote", "scaled"])
def test_direct_one_block_down(monkeypatch, case):
    """The down kernel's one-block form (`GemvTiles(hoist=True)`, the default, taken
    where K <= BK) against the looped form and the float64 loop: random routing with
    -1 ids; shared and remote experts with NaN in every expert not chosen (none is
    read); FP8-style per-channel scales (fp16 weights, fp32 activations: the scale
    math exactly)."""
    from radixlm.layers.moe.triton_ops import moe_gemv
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    real = moe_gemv.pick_gemv_tiles
    kw, dtype = {}, DTYPES[-1] if INTERPRET else torch.bfloat16
    if case == "random":
        t, e, k, h, inter = (3, 8, 2, 64, 48) if INTERPRET else (3, 128, 8, 2048, 768)
        x, w13, w2, tw, ti = _direct_inputs(t, e, k, h, inter, dtype, "ep", seed=40)
        ref = ref_experts(x, w13, w2, tw, ti)
    elif case == "remote":
        dtype = torch.float32
        x, w13, w2, tw, ti = _remote_experts_case(seed=41)
        ref = ref_experts(x, w13, w2, tw, ti)  # reads only the chosen experts
    else:
        gen = torch.Generator().manual_seed(42)
        dtype = torch.float32
        w13, w2, s13, s2, d13, d2 = _fp8_case(None, torch.float16, dtype, gen)
        x = torch.randn(5, w13.shape[2], generator=gen).to(dtype).to(DEV)
        tw, ti = make_routing(5, 8, 2, "ep", gen)
        kw = dict(w13_scale=s13.contiguous(), w2_scale=s2.contiguous())
        ref = ref_experts(x, d13, d2, tw, ti)
    tiles = real(x.shape[0], w2.shape[1], w2.shape[2], down=True)
    assert tiles.hoist and tiles.block_k >= w2.shape[2]  # the default takes one block
    hoisted = fused_experts(x, w13, w2, tw, ti, direct=True, **kw)
    monkeypatch.setattr(moe_gemv, "pick_gemv_tiles",
                        lambda *a, **kw: real(*a, **kw)._replace(hoist=False))
    looped = fused_experts(x, w13, w2, tw, ti, direct=True, **kw)
    assert torch.isfinite(hoisted).all()
    assert rel_err(hoisted, looped.double()) < TOL[dtype] / 8
    assert rel_err(hoisted, ref) < TOL[dtype]
    if case == "remote":
        assert torch.equal(hoisted[2], torch.zeros_like(hoisted[2]))


@needs_kernels
def test_direct_tiles_follow_the_weights_bytes(monkeypatch):
    """FP8 experts take tiles of more rows than bf16 ones (`pick_gemv_tiles`'s
    `fp8`, from the weights' element size) in both kernels, and still match the
    dequantized float64 loop."""
    from radixlm.layers.moe.triton_ops import moe_gemv
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    real, asked = moe_gemv.pick_gemv_tiles, []

    def pick(*a, **kw):
        asked.append((kw.get("down", False), kw.get("fp8", False)))
        return real(*a, **kw)

    monkeypatch.setattr(moe_gemv, "pick_gemv_tiles", pick)
    gen = torch.Generator().manual_seed(9)
    adt = torch.bfloat16 if HAS_CUDA else torch.float16
    for wdt in (torch.float8_e4m3fn, adt):
        w13, w2, s13, s2, d13, d2 = _fp8_case(None, wdt, adt, gen)
        x = torch.randn(1, w13.shape[2], generator=gen).to(adt).to(DEV)
        tw, ti = make_routing(1, 8, 2, "ep", gen)
        asked.clear()
        out = fused_experts(x, w13, w2, tw, ti, w13_scale=s13.contiguous(),
                            w2_scale=s2.contiguous(), direct=True)
        fp8 = wdt == torch.float8_e4m3fn
        assert asked == [(False, fp8), (True, fp8)]
        assert rel_err(out, ref_experts(x, d13, d2, tw, ti)) < 1.5e-2
    if not INTERPRET:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        assert real(8, 768, 2048) == moe_gemv.GemvTiles(2, 1024, 4)
        assert real(1, 2048, 768, down=True) == moe_gemv.GemvTiles(1, 1024, 4)
        assert real(8, 768, 2048, fp8=True) == moe_gemv.GemvTiles(4, 1024, 4)
        assert real(1, 2048, 768, down=True, fp8=True) == moe_gemv.GemvTiles(8, 1024, 8)


@needs_cuda
def test_direct_cuda_graph_replay():
    """The direct path captured at decode size (Qwen3-30B-A3B's layer shape),
    replayed on new hidden states and routings: every replay matches the reference."""
    t, e, k, h, inter, dtype = 2, 128, 8, 2048, 768, torch.bfloat16
    x, w13, w2, topk_weights, topk_ids = _direct_inputs(t, e, k, h, inter, dtype, "random", 28)
    check_replays(x, w13, w2, topk_weights, topk_ids, torch.Generator().manual_seed(29),
                  direct=True)


BENCH_SHAPES = {"qwen3-30b-a3b": (128, 2048, 768, 8), "mixtral-8x7b": (8, 4096, 14336, 2),
                "olmoe-1b-7b": (64, 2048, 1024, 8)}


# ---- FP8 experts on the tensor cores (`moe_mma.py`, CUDA only: inline PTX) ---------

MMA_SHAPES = [(8, 1, 256, 384), (8, 2, 512, 256), (128, 8, 2048, 768), (64, 8, 2048, 1024)]


def _mma_case(t: int, e: int, k: int, h: int, inter: int, kind: str, seed: int,
              row_pad: int = 0):
    """bf16 x, FP8 weights with per-row scales (rows `row_pad` bytes longer than
    their codes, as online FP8 stores them), routing of `kind`, and the
    dequantized float64 weights."""
    gen = torch.Generator().manual_seed(seed)

    def weight(n, kk):
        codes = torch.randn(e, n, kk + row_pad, generator=gen).to(torch.float8_e4m3fn)
        return codes.to(DEV)[:, :, :kk]

    w13, w2 = weight(2 * inter, h), weight(h, inter)
    s13 = (torch.rand(e, 2 * inter, generator=gen) * h ** -0.5).to(DEV)
    s2 = (torch.rand(e, h, generator=gen) * inter ** -0.5).to(DEV)
    x = torch.randn(t, h, generator=gen).bfloat16().to(DEV)
    tw, ti = make_routing(t, e, k, kind, gen)
    d13, d2 = w13.double() * s13[..., None], w2.double() * s2[..., None]
    return x, w13, w2, s13, s2, tw, ti, d13, d2


def _fma(monkeypatch, fn):
    """fn() with the direct path's FMA kernels for FP8 experts too."""
    from radixlm.layers.moe.triton_ops import moe_mma

    monkeypatch.setenv(moe_mma.ENV, "fma")
    try:
        return fn()
    finally:
        monkeypatch.delenv(moe_mma.ENV)


def test_mma_splits_rule():
    """Warps along K: about 8 steps of 128 features a gate/up warp and 3 a down warp,
    powers of two, no run empty, at most 16 warps a program (runs anywhere)."""
    from radixlm.layers.moe.triton_ops import moe_mma

    assert moe_mma.pick_splits(2048, 768, 8) == (2, 2)  # Qwen3-30B-A3B
    assert moe_mma.pick_splits(4096, 14336, 2) == (4, 8)  # Mixtral-8x7B
    assert moe_mma.pick_splits(256, 384, 1) == (1, 1)
    assert moe_mma.exact_split(6, 4) == 2 and moe_mma.exact_split(16, 16) == 16
    assert moe_mma.exact_split(11, 2) == 2 and moe_mma.exact_split(3, 2) == 2
    assert moe_mma.exact_split(3, 4) == 2  # cdiv(3, 4) = 1 step a run: 3 runs, not 4


@needs_cuda
@pytest.mark.parametrize("kind", ["random", "ep", "one"])
@pytest.mark.parametrize("e,k,h,inter", MMA_SHAPES)
@pytest.mark.parametrize("t", [1, 2, 3])
def test_mma_fp8_experts(monkeypatch, t, e, k, h, inter, kind):
    """The tensor-core path against the dequantized float64 loop, and beside the FMA
    kernels (same rounding points, other K order): far closer to them than either
    to the reference. Pairs of -1 (another rank's experts) add nothing."""
    from radixlm.layers.moe.triton_ops import moe_mma
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    x, w13, w2, s13, s2, tw, ti, d13, d2 = _mma_case(t, e, k, h, inter, kind, 7 * t + e)
    assert moe_mma.takes(x, w13, w2, s13, s2, k)

    def run():
        return fused_experts(x, w13, w2, tw, ti, w13_scale=s13, w2_scale=s2, direct=True)

    out, fma = run(), _fma(monkeypatch, run)
    ref = ref_experts(x, d13, d2, tw, ti)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    assert rel_err(out, fma.double()) < TOL[torch.bfloat16] / 4


@needs_cuda
@pytest.mark.parametrize("split", [(1, 1), (2, 2), (4, 1), (8, 2), (16, 4)])
def test_mma_splits_and_strided_rows(split):
    """Every split of K (warps a tile) gives the same answer within fp32 sums' order,
    rows longer than their codes (online FP8's scale bytes) included; a split that
    would leave a run empty is halved."""
    from radixlm.layers.moe.triton_ops import moe_mma

    t, e, k, h, inter = 2, 128, 8, 2048, 768
    x, w13, w2, s13, s2, tw, ti, d13, d2 = _mma_case(t, e, k, h, inter, "random", 5, 16)
    assert w13.stride(1) == h + 16
    out = moe_mma.moe_mma(x, w13, w2, tw, ti, torch.empty_like(x), "silu", s13, s2,
                          split=moe_mma.MmaSplits(*split))
    assert rel_err(out, ref_experts(x, d13, d2, tw, ti)) < TOL[torch.bfloat16]
    assert moe_mma.exact_split(6, 4) == 2 and moe_mma.exact_split(16, 16) == 16


@needs_cuda
def test_mma_unselected_experts_are_not_read():
    """NaN codes in every expert no pair selected leave the output finite and right."""
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    t, e, k, h, inter = 2, 16, 2, 256, 128
    x, w13, w2, s13, s2, tw, ti, d13, d2 = _mma_case(t, e, k, h, inter, "random", 3)
    ti[0, 1] = -1
    unused = torch.ones(e, dtype=torch.bool, device=DEV)
    unused[ti[ti >= 0].long()] = False
    w13.view(torch.uint8)[unused] = 0x7F  # e4m3 NaN
    w2.view(torch.uint8)[unused] = 0x7F
    out = fused_experts(x, w13, w2, tw, ti, w13_scale=s13, w2_scale=s2, direct=True)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref_experts(x, d13, d2, tw, ti)) < TOL[torch.bfloat16]


@needs_cuda
def test_mma_takes():
    """What the tensor-core path takes; the rest stays on the FMA kernels."""
    from radixlm.layers.moe.triton_ops import moe_mma

    x, w13, w2, s13, s2, *_ = _mma_case(1, 8, 2, 256, 128, "random", 1)
    assert moe_mma.takes(x, w13, w2, s13, s2, 2)
    assert not moe_mma.takes(x.half(), w13, w2, s13, s2, 2)
    assert not moe_mma.takes(x, w13.bfloat16(), w2, s13, s2, 2)
    assert not moe_mma.takes(x, w13, w2, None, None, 2)
    blocks = torch.ones(8, 2, 2, device=DEV)  # block scales: the aligned path's
    assert not moe_mma.takes(x, w13, w2, blocks, s2, 2)
    assert not moe_mma.takes(x[:, :192].contiguous(), w13[:, :, :192], w2, s13, s2, 2)


@needs_cuda
def test_mma_cuda_graph_replay():
    """Captured at decode size with PDL as the engine runs it, replayed on new hidden
    states and routings: every replay matches the reference."""
    t, e, k, h, inter = 2, 128, 8, 2048, 768
    x, w13, w2, s13, s2, tw, ti, d13, d2 = _mma_case(t, e, k, h, inter, "random", 30)
    check_replays(x, w13, w2, tw, ti, torch.Generator().manual_seed(31), ref_weights=(d13, d2),
                  with_pdl=True, w13_scale=s13, w2_scale=s2, direct=True)


@functools.cache
def bench_layer(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's bf16 experts, drawn on the GPU (a CPU draw of Mixtral's 2 x 940M
    weights takes ~15 s) and kept for the token counts."""
    e, h, inter, _ = BENCH_SHAPES[name]
    gen = torch.Generator(device=DEV).manual_seed(11)
    w13 = torch.randn(e, 2 * inter, h, generator=gen, device=DEV).mul_(h ** -0.5).bfloat16()
    w2 = torch.randn(e, h, inter, generator=gen, device=DEV).mul_(inter ** -0.5).bfloat16()
    return w13, w2


@needs_cuda
@pytest.mark.parametrize("name", list(BENCH_SHAPES))
@pytest.mark.parametrize("t", [1, 64, 512])
def test_benchmark_shapes(name, t):
    """The benchmark shapes with the committed table's configs."""
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts

    e, h, _, k = BENCH_SHAPES[name]
    w13, w2 = bench_layer(name)
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, h, generator=gen).bfloat16().to(DEV)
    topk_weights, topk_ids = make_routing(t, e, k, "random", gen)
    out = fused_experts(x, w13, w2, topk_weights, topk_ids)
    err = rel_err(out, ref_experts(x, w13, w2, topk_weights, topk_ids))
    assert err < TOL[torch.bfloat16], err



# ---- the router's fused softmax top-k (`triton_ops/topk.py`, CUDA only) -------------
# Inputs, reference and tolerance are the CPU test's (tests/test_moe_router_triton.py):
# dyadic inputs make every logit exact in fp32, so ids must equal the torch router's
# and weights agree within 1e-6 relative (a rounded weight within one rounding).

ROUTER_SHAPES = [(128, 8, 2048), (8, 2, 4096)]  # (E, k, H): Qwen3-30B-A3B's, Mixtral's


def _router_inputs(t: int, e: int, h: int, dtype: torch.dtype, seed: int):
    from test_moe_router_triton import dyadic_inputs

    x, weight = dyadic_inputs(t, e, h, dtype, seed)
    return x.to(DEV), weight.to(DEV)


@needs_cuda
@pytest.mark.parametrize("e,k,h", ROUTER_SHAPES)
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_router_matches_torch(e, k, h, t):
    from test_moe_router_triton import assert_weights_match, torch_router

    from radixlm.layers.moe.triton_ops.topk import fused_topk

    for dtype in (torch.bfloat16, torch.float32):
        x, weight = _router_inputs(t, e, h, dtype, seed=t + e)
        for renormalize in (False, True):
            for round_weights in (False, True):
                weights, ids = fused_topk(x, weight, k, renormalize,
                                          dtype if round_weights else None)
                ref_w, ref_ids = torch_router(x, weight, k, renormalize, round_weights=False)
                assert torch.equal(ids, ref_ids), (dtype, renormalize, round_weights)
                rounds = round_weights and dtype != torch.float32
                assert_weights_match(weights, ref_w, dtype if rounds else None)


@needs_cuda
def test_router_fp32_products():
    """Gaussian inputs against float64: TF32 products would put weights ~1e-3 off."""
    from test_moe_router_triton import assert_weights_match

    from radixlm.layers.moe.triton_ops.topk import fused_topk

    e, k, h, t = 128, 8, 2048, 64
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(t, h, generator=gen)
    weight = torch.randn(e, h, generator=gen) * 0.03
    weights, ids = fused_topk(x.to(DEV), weight.to(DEV), k, False)
    logits = x.double() @ weight.double().T
    ref_w, ref_ids = logits.softmax(-1).topk(k, dim=-1)
    top = logits.sort(dim=-1, descending=True).values[:, :k + 1]
    clear = (top.diff(dim=-1) < -1e-4).all(dim=-1)
    assert clear.sum() >= t - 4
    assert torch.equal(ids.cpu()[clear].long(), ref_ids[clear])
    # fp32's own error over 2048 terms is ~1e-6 of a weight; TF32's would be ~1e-3.
    assert_weights_match(weights.cpu()[clear], ref_w[clear], rel=3e-5)


@needs_cuda
@pytest.mark.parametrize("e,k,h", ROUTER_SHAPES)
def test_router_batch_invariant(e, k, h):
    """Every token of a batch of 512 bit for bit as alone; the first 512 of 4096 and the
    last of 16385 (a second pass of CHUNK_TOKENS) as in the smaller batch."""
    from radixlm.layers.moe.triton_ops.topk import CHUNK_TOKENS, fused_topk

    gen = torch.Generator(device=DEV).manual_seed(15)
    t = CHUNK_TOKENS + 1
    x = torch.randn(t, h, generator=gen, device=DEV).bfloat16()
    weight = torch.randn(e, h, generator=gen, device=DEV) * 0.03
    big_w, big_ids = fused_topk(x, weight, k, True, torch.bfloat16)
    mid_w, mid_ids = fused_topk(x[:4096], weight, k, True, torch.bfloat16)
    w512, ids512 = fused_topk(x[:512], weight, k, True, torch.bfloat16)
    assert torch.equal(mid_w[:512], w512) and torch.equal(mid_ids[:512], ids512)
    assert torch.equal(big_w[:4096], mid_w) and torch.equal(big_ids[:4096], mid_ids)
    for row in [*range(512), t - 1]:
        one_w, one_ids = fused_topk(x[row:row + 1], weight, k, True, torch.bfloat16)
        ref_w, ref_ids = (big_w, big_ids) if row == t - 1 else (w512, ids512)
        assert torch.equal(one_w[0], ref_w[row]) and torch.equal(one_ids[0], ref_ids[row]), row


@needs_cuda
@pytest.mark.parametrize("t", [1, 64])
def test_router_cuda_graph_replay(t):
    """The router captured once (two launches, no host sync), replayed on new inputs:
    each replay equals an eager call bit for bit."""
    from gpu_models import capture_graph

    from radixlm.layers.moe.triton_ops.topk import fused_topk

    e, k, h = 128, 8, 2048
    gen = torch.Generator(device=DEV).manual_seed(16)
    x = torch.randn(t, h, generator=gen, device=DEV).bfloat16()
    weight = torch.randn(e, h, generator=gen, device=DEV) * 0.03
    graph, (weights, ids) = capture_graph(lambda: fused_topk(x, weight, k, True, torch.bfloat16))
    for _ in range(3):
        x.copy_(torch.randn(t, h, generator=gen, device=DEV))
        graph.replay()
        ref_w, ref_ids = fused_topk(x, weight, k, True, torch.bfloat16)
        torch.cuda.synchronize()
        assert torch.equal(weights, ref_w) and torch.equal(ids, ref_ids)


@needs_cuda
def test_router_on_triton_experts():
    """Float experts built on CUDA take the Triton backend (auto), and their router the
    fused kernel, which then answers as the torch router does."""
    from test_moe_router_triton import assert_weights_match

    from radixlm.layers.moe.fused_moe import FusedMoE
    from radixlm.layers.moe.router import TopKRouter
    from radixlm.models.decoder import _experts_on_triton

    with torch.device(DEV):
        experts = FusedMoE(8, 256, 64, params_dtype=torch.bfloat16)
        fused_router = TopKRouter(8, 256, 2, True, True, fused_kernel=_experts_on_triton(experts))
        plain_router = TopKRouter(8, 256, 2, True, False)
    assert fused_router.fused_kernel
    x, weight = _router_inputs(33, 8, 256, torch.bfloat16, seed=17)
    fused_router.weight.data.copy_(weight)
    plain_router.weight.data.copy_(weight)
    (weights, ids), (ref_w, ref_ids) = fused_router(x), plain_router(x)
    assert torch.equal(ids, ref_ids)
    assert_weights_match(weights, ref_w, torch.bfloat16)


@needs_cuda
@pytest.mark.parametrize("e,k,h", ROUTER_SHAPES)
@pytest.mark.parametrize("t", [1, 8])
def test_norm_router_matches_two_launches(e, k, h, t):
    """`fused_norm_topk` against the Triton norm + `fused_topk` (the CPU test's check),
    and the residual as torch adds it."""
    from test_moe_router_triton import check_norm_router, norm_inputs

    x, residual, norm_w, weight = (v.to(DEV) for v in norm_inputs(t, h, e, seed=t + e))
    assert torch.equal(check_norm_router(x, residual, norm_w, weight, k), x + residual)


@needs_cuda
def test_norm_router_cuda_graph_replay():
    """Captured once with PDL on (as the decode graphs run it), replayed on new inputs:
    each replay equals an eager call bit for bit."""
    from gpu_models import capture_graph, pdl_as

    from radixlm.layers.moe.triton_ops.topk import fused_norm_topk

    e, k, h, t = 128, 8, 2048, 1
    gen = torch.Generator(device=DEV).manual_seed(18)
    x = torch.randn(t, h, generator=gen, device=DEV).bfloat16()
    residual = torch.randn(t, h, generator=gen, device=DEV).bfloat16()
    norm_w = torch.rand(h, generator=gen, device=DEV).bfloat16() + 0.5
    weight = torch.randn(e, h, generator=gen, device=DEV) * 0.03
    def step():
        return fused_norm_topk(x, residual, norm_w, 1e-6, weight, k, True, torch.bfloat16)

    with pdl_as(True):
        graph, outs = capture_graph(step)
        for _ in range(3):
            x.copy_(torch.randn(t, h, generator=gen, device=DEV))
            residual.copy_(torch.randn(t, h, generator=gen, device=DEV))
            graph.replay()
            refs = step()
            torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(outs, refs))


# ---- configs (run anywhere) ---------------------------------------------------------

def test_committed_table_is_valid():
    """Every committed config parses, is a power-of-two tiling and fits shared memory
    unchanged at the shape it is listed for."""
    data = json.loads(TABLE_PATH.read_text())
    table = ConfigTable.from_json(data)
    assert table.entries, "an empty table"
    for shapes in table.entries.values():
        for key, buckets in shapes.items():
            fields = dict(f.split("=") for f in key.split(","))
            h, inter = int(fields["H"]), int(fields["I"])
            assert {1, 64, 512, 4096} <= set(buckets), key
            for cfg in buckets.values():
                assert cfg.block_m in (16, 32, 64, 128)
                for tile, n, k, halves in ((cfg.gate_up, inter, h, 2), (cfg.down, h, inter, 1)):
                    for v in (tile.block_n, tile.block_k):
                        assert v >= 16 and v & (v - 1) == 0
                    assert fit_tile(tile, n, k, cfg.block_m, 2, 2, halves) == tile, (key, tile)
    assert ConfigTable.from_json(json.loads(table.dumps("x"))).entries == table.entries


def test_table_lookup_and_fallback():
    cfg = heuristic_config(1, 8, 2, torch.bfloat16)
    table = ConfigTable({"dev": {shape_key(8, 64, 32, torch.bfloat16): {1: cfg, 64: cfg}}})
    key = shape_key(8, 64, 32, torch.bfloat16)
    assert table.lookup("dev", key, 5) is cfg  # nearest bucket in log scale
    assert table.lookup("other", key, 5) is None
    assert table.lookup("dev", shape_key(8, 64, 32, torch.float16), 5) is None
    # Off CUDA the heuristic decides; larger batches get taller blocks.
    cpu = torch.device("cpu")
    small = get_config(1, 128, 2048, 768, 8, torch.bfloat16, cpu)
    large = get_config(4096, 128, 2048, 768, 8, torch.bfloat16, cpu)
    assert small.block_m == 16 and large.block_m == 128


def test_fit_tile_limits():
    big = GemmTile(256, 256, 1, 8, 5)
    tile = fit_tile(big, 4096, 4096, 128, 4, 4, 2)
    smem = tile.num_stages * tile.block_k * (128 * 4 + 2 * tile.block_n * 4)
    assert smem <= SMEM_BUDGET and tile.num_stages >= 2
    small = fit_tile(big, 40, 24, 16, 2, 2, 1)
    assert (small.block_n, small.block_k) == (64, 32)  # no wider than the shape needs
    assert fit_tile(big, 4096, 4096, 16, 2, 1, 1, k_multiple_of=96).block_k == 32
