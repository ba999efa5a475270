"""Our FP8 and int4 Triton kernels (layers/quantization/triton_ops/) against float64
references, each kernel and shape class: one row (FMA GEMV), 2-8 rows (tensor-core
GEMV), many rows (GEMM); per-row and block scales with ragged edges; static and
weight-only activations; fused SiLU; bias; an output buffer; act-order int4.

Needs CUDA, or the Triton interpreter on the CPU (`TRITON_INTERPRET=1`, small
shapes). The interpreter's bf16 arithmetic is not the GPU's (its tl.dot in bf16
is wrong and its casts to bf16 truncate), so there the tensor-core paths run in
fp16; on CUDA every case runs in bf16 and fp16. The Llama-8B shapes and CUDA-graph
capture run on CUDA only.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (HAS_CUDA or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from radixlm.layers.fp8_rows import to_fp8_rows  # noqa: E402
from radixlm.layers.fused_ops import rms_norm, silu_and_mul  # noqa: E402
from radixlm.layers.quantization import int4 as I  # noqa: E402
from radixlm.layers.quantization.fp8 import Fp8Weight, block_table, quantize_rows  # noqa: E402
from radixlm.layers.quantization.triton_ops import fp8 as F  # noqa: E402
from radixlm.layers.quantization.triton_ops import int4 as T  # noqa: E402

DEV = torch.device("cuda" if HAS_CUDA else "cpu")
FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16] if HAS_CUDA else [torch.float16]
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape, seed: int = 0, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed), device=DEV) * scale).to(dtype)


# Hopper's FP8 MMA keeps about 14 bits while it sums (DeepSeek-V3 report, sec. 3.3.2);
# the W8A8 GEMM promotes to fp32 every block of K, so a block's sum carries that.
FP8_MMA_BITS, FP8_MMA_TERMS = 14, 128


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, k: int,
          fp8_mma: bool = False, mma_terms: int = FP8_MMA_TERMS) -> None:
    """Within one rounding to `dtype` of the output plus fp32 summation over k terms
    (and, for W8A8 products on FP8 tensor cores, their narrower sums over
    `mma_terms` terms between promotions: a K block, or all of K unpromoted)."""
    assert out.dtype == dtype and out.shape == ref.shape and torch.isfinite(out).all()
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    acc = k * 2.0 ** -23
    if fp8_mma and HAS_CUDA:
        acc += min(k, mma_terms) * 2.0 ** -FP8_MMA_BITS
    bound = eps * ref.abs() + (acc + 1e-3 * eps) * ref.abs().max()
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


def fp8_ref_quant(x: torch.Tensor, group: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (group None) or per token and group: (FP8 codes, fp32 scales), RNE."""
    m, k = x.shape
    g = group or k
    xf = x.float()
    scales = torch.stack([xf[:, j:j + g].abs().amax(1) for j in range(0, k, g)], 1)
    # A tensor divisor: a CUDA division by a Python scalar multiplies by its reciprocal.
    scales = scales.clamp(min=1e-12) / torch.full_like(scales, 448.0)
    full = scales.repeat_interleave(g, 1)[:, :k]
    return (xf / full).clamp(-448, 448).to(FP8), scales


# ---- activation quantization -----------------------------------------------------------------
@pytest.mark.parametrize("m,k", [(1, 200), (5, 256), (33, 1000), (2, 4104), (3, 14336),
                                 (2, 20000)])  # down_proj's input and a longer row
@pytest.mark.parametrize("group", [None, 128, 64])
def test_activation_quantization_matches_round_to_nearest_even(m, k, group):
    x = randn(m, k, seed=k, dtype=torch.bfloat16) * 3
    x[0, 7] = 0.0001  # a subnormal code
    q, s = F.quantize_activations(x, group or 0)
    want_q, want_s = fp8_ref_quant(x, group)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    full = s.repeat_interleave(group or k, 1)[:, :k]
    # 3 mantissa bits; below 2^-6 (in scale units) a fixed step of 2^-9
    assert ((q.float() * full - x.float()).abs() <= x.float().abs() / 16 + full * 2 ** -10).all()


@pytest.mark.parametrize("k", [300, 20000])
def test_static_activation_scale_and_saturation(k):
    x = randn(4, k, seed=3, dtype=torch.float16) * 4
    scale = torch.tensor([0.005], device=DEV)
    q, s = F.quantize_activations(x, 0, scale)
    assert s.shape == (4, 1) and s.stride(0) == 0
    want = (x.float() / 0.005).clamp(-448, 448).to(FP8)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert q.float().abs().max() == 448  # the static scale saturates


@pytest.mark.parametrize("n", [200, 4096])
@pytest.mark.parametrize("residual,pre", [(False, False), (True, False), (True, True)])
def test_fp8_out_of_the_norm_is_its_output_quantized(n, residual, pre):
    """`rms_norm(fp8_out=True)` (the norm before a W8A8 product: `Fp8Rows`): the
    codes and scales `quantize_activations` makes of the unfused norm's output,
    bit for bit, and the same residual."""
    dtype = DTYPES[0]
    x, r = randn(5, n, seed=n, scale=3, dtype=dtype), randn(5, n, seed=n + 1, dtype=dtype)
    w, pw = ((1 + 0.1 * randn(n, seed=s)).to(dtype) for s in (2, 3))
    args = (x, w, 1e-6, r if residual else None)
    kw = {"pre_weight": pw} if pre else {}
    ref, got = rms_norm(*args, **kw), rms_norm(*args, **kw, fp8_out=True, use_triton=True)
    if residual:
        assert torch.equal(got[1], ref[1])
        ref, got = ref[0], got[0]
    codes, scales = got
    want_q, want_s = F.quantize_activations(ref)
    assert torch.equal(codes.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scales, want_s)


@pytest.mark.parametrize("d", [100, 14336, 20000])  # down_proj's input; a row read twice
def test_fp8_out_of_silu_and_mul_is_its_output_quantized(d):
    x = randn(3, 2 * d, seed=d, scale=2, dtype=DTYPES[0])
    q, s = silu_and_mul(x, fp8_out=True, use_triton=True)
    want_q, want_s = F.quantize_activations(silu_and_mul(x, use_triton=True))
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s, want_s)


def test_fp8_rows_where_the_gemm_quantizes_per_token():
    """`takes_fp8_rows`: only rows `fp8_linear` would quantize per token for the
    W8A8 GEMM (above the GEMVs, per-channel, dynamic, FP8 activations); and
    `fp8_linear` on those rows given as `Fp8Rows` computes what it does on x."""
    mma = torch.empty(1)
    takes = functools.partial(F.takes_fp8_rows, block_k=0, scale_rows=1, input_scale=None,
                              weight_only=False)
    assert not any(takes(m, mma=mma, w8a8_from=17) for m in range(1, 65))
    assert takes(65, mma=mma, w8a8_from=17)
    assert not any(takes(m, mma=None, w8a8_from=0) for m in range(1, 9))
    assert takes(9, mma=None, w8a8_from=0)
    assert not takes(300, mma=None, w8a8_from=0, block_k=128)
    assert not takes(300, mma=None, w8a8_from=0, input_scale=torch.ones(1))
    assert not takes(300, mma=None, w8a8_from=0, weight_only=True)
    n, k, block, parts = CASES["channel-ragged"]
    w = fp8_weight(n, k, block, parts, seed=4)
    x = randn(70, k, seed=5, dtype=DTYPES[0])
    want = F.fp8_linear(x, w.weight, w.scales, 0, 1, None)
    got = F.fp8_linear(to_fp8_rows(x), w.weight, w.scales, 0, 1, None)
    assert torch.equal(got, want)
    assert F.fp8_linear(to_fp8_rows(x), w.weight, w.scales, 0, 1, None, silu_mul=True) is None


# ---- FP8 products -----------------------------------------------------------------------------
def fp8_weight(n: int, k: int, block: tuple[int, int] | None, parts: list[int] | None = None,
               seed: int = 0) -> Fp8Weight:
    w = randn(n, k, seed=seed, scale=0.05)
    if block is None:
        q, s = quantize_rows(w)
        return Fp8Weight(q, s)
    bn, bk = block
    parts = parts or [n]
    grids, codes = [], []
    for i, rows in enumerate(parts):
        start = sum(parts[:i])
        g = torch.rand(-(-rows // bn), -(-k // bk), generator=gen(seed + i), device=DEV) + 0.5
        full = g.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :k] * 1e-3
        codes.append((w[start:start + rows] / full).clamp(-448, 448).to(FP8))
        grids.append(g * 1e-3)
    table, rows_per = block_table(torch.cat(grids), parts, bn)
    return Fp8Weight(torch.cat(codes), table, bk, rows_per)


CASES = {  # name -> (n, k, block, parts)
    "channel": (96, 256, None, None),
    "channel-ragged": (100, 300, None, None),
    "block": (256, 384, (128, 128), None),
    "block-ragged": (200, 300, (128, 128), None),
    "block-fused-parts": (320, 256, (128, 128), [192, 64, 64]),  # k/v of 64 rows: ragged
    "block-64x64": (128, 200, (64, 64), None),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_gemv(case, m, dtype):
    n, k, block, parts = CASES[case]
    w = fp8_weight(n, k, block, parts)
    x = randn(m, k, seed=m, dtype=dtype)
    bias = randn(n, seed=9, dtype=dtype)
    out = F.fp8_linear(x, w.weight, w.scales, w.block_k, w.scale_rows, None, bias)
    ref = x.double() @ w.dequantize().double().T + bias.double()
    if F.gemv_fits(m, w.block_k, w.scale_rows):
        check(out, ref, dtype, k)
    else:  # a scale row narrower than the tensor-core tile: the W8A8 GEMM took it
        xq, xs = fp8_ref_quant(x, w.block_k or None)
        xd = xq.double() * xs.double().repeat_interleave(w.block_k or k, 1)[:, :k]
        check(out, xd @ w.dequantize().double().T + bias.double(), dtype, k, fp8_mma=True)


@pytest.mark.parametrize("case", ["channel", "channel-ragged", "block-ragged", "block-64x64"])
@pytest.mark.parametrize("bk", [64, 128])
@pytest.mark.parametrize("loads", ["pairs", "vec8", "pairs-vec8"])
def test_fp8_gemv_tile_loads(case, bk, loads):
    """The one-row kernel loading its tiles in pairs (stages 2) and/or in 8-byte
    vectors (vec8): odd and even tile counts (the last tile left over by the
    pairs), ragged K, block scales, fused SiLU: the float64 product within one
    GEMV's rounding."""
    n, k, block, parts = CASES[case]
    dtype = DTYPES[0]
    w = fp8_weight(n, k, block, parts, seed=6)
    x = randn(1, k, seed=7, dtype=dtype)
    bias = randn(n, seed=8, dtype=dtype)
    cfg = F.GemvConfig("fma", 4, bk, 4, 2 if "pairs" in loads else 1, vec8="vec8" in loads)
    out = F.fp8_gemv(x, w.weight, w.scales, w.block_k, w.scale_rows, bias, config=cfg)
    check(out, x.double() @ w.dequantize().double().T + bias.double(), dtype, k)
    if n % 2 == 0 and block is None:
        fused = F.fp8_gemv(x, w.weight, w.scales, 0, 1, config=cfg, silu_mul=True)
        plain = F.fp8_gemv(x, w.weight, w.scales, 0, 1, config=cfg._replace(stages=1))
        check_silu_mul(fused, plain)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_gemv_silu_mul_and_out_buffer(m, block):
    dtype = DTYPES[0]
    d, k = 128, 256
    w = fp8_weight(2 * d, k, block, [d, d] if block else None, seed=4)
    x = randn(m, k, seed=5, dtype=dtype)
    fused = F.fp8_linear(x, w.weight, w.scales, w.block_k, w.scale_rows, None, silu_mul=True)
    plain = F.fp8_linear(x, w.weight, w.scales, w.block_k, w.scale_rows, None)
    check_silu_mul(fused, plain)
    buf = torch.empty(m, 2 * d, device=DEV, dtype=dtype)
    got = F.fp8_linear(x, w.weight, w.scales, w.block_k, w.scale_rows, None, out=buf)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf, plain)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("m", [9, 40, 130])
def test_fp8_gemm_w8a8(case, m):
    n, k, block, parts = CASES[case]
    dtype = DTYPES[0]
    w = fp8_weight(n, k, block, parts, seed=2)
    x = randn(m, k, seed=m, dtype=dtype)
    bias = randn(n, seed=8, dtype=dtype)
    out = F.fp8_linear(x, w.weight, w.scales, w.block_k, w.scale_rows, None, bias)
    xq, xs = fp8_ref_quant(x, w.block_k or None)
    xd = xq.double() * xs.double().repeat_interleave(w.block_k or k, 1)[:, :k]
    check(out, xd @ w.dequantize().double().T + bias.double(), dtype, k, fp8_mma=True)


GEMM_TILES = sorted({F.pick_gemm_config(m, n, block_k, a_fp8) for m in (64, 128, 256, 4096)
                     for n in (4096, 28672) for block_k in (0, 128) for a_fp8 in (True, False)})


def check_tile(cfg: F.GemmConfig, case: str, seed: int) -> None:
    """300 rows (partial row tiles) of `case` through tile `cfg`, against float64
    of the same quantized activations."""
    n, k, block, parts = CASES[case]
    dtype = DTYPES[0]
    w = fp8_weight(n, k, block, parts, seed=seed)
    x = randn(300, k, seed=seed + 1, dtype=dtype)
    xq, xs = F.quantize_activations(x, w.block_k)
    assert F.tma_fits(xq, w.weight) == (k % 16 == 0)
    out = F.fp8_gemm(xq, xs, w.weight, w.scales, w.block_k, w.scale_rows, None, dtype,
                     config=cfg)
    rq, rs = fp8_ref_quant(x, w.block_k or None)
    xd = rq.double() * rs.double().repeat_interleave(w.block_k or k, 1)[:, :k]
    terms = FP8_MMA_TERMS if cfg.promote or w.block_k else k
    check(out, xd @ w.dequantize().double().T, dtype, k, fp8_mma=True, mma_terms=terms)


@pytest.mark.parametrize("cfg", GEMM_TILES, ids=F.GemmConfig.label)
@pytest.mark.parametrize("case", ["channel-ragged", "block-ragged", "block-fused-parts"])
def test_fp8_gemm_every_picked_tile(cfg, case):
    """Each tile the heuristic can pick, on rows and columns that leave partial
    tiles at both edges (the 256-row one too), against float64."""
    check_tile(cfg, case, seed=3)


TMA_TILES = [F.GemmConfig(*c) for c in [(64, 128, 128, 4, 4, 8, True),
                                        (256, 128, 128, 8, 3, 8, True),
                                        (128, 256, 128, 8, 3, 8, True),
                                        (128, 128, 128, 8, 4, 8, True, True),
                                        (256, 128, 128, 8, 3, 8, True, True),
                                        (64, 128, 128, 4, 4, 8, False, False, False),
                                        (128, 256, 128, 8, 3, 8, True, True, False),
                                        (256, 128, 128, 8, 3, 8, True, True, False)]]


@pytest.mark.parametrize("cfg", TMA_TILES, ids=F.GemmConfig.label)
@pytest.mark.parametrize("case", ["channel", "block", "block-fused-parts", "channel-ragged"])
def test_fp8_gemm_tma_tiles(cfg, case):
    """The TMA kernel (one tile per program, or persistent) on partial row
    tiles; channel-ragged's K of 300 is no multiple of 16, so it takes the
    pointer kernel: the fallback is pinned too."""
    check_tile(cfg, case, seed=5)


def test_fp8_gemm_picks_the_wide_tile_only_where_it_fills_the_gpu():
    wide = F.GemmConfig(128, 256, 128, 8, 3, tma=True, persistent=True, promote=False)
    assert F.pick_gemm_config(4096, 4096, 0) == wide
    assert F.pick_gemm_config(256, 28672, 0) == wide  # 224 tiles
    assert F.pick_gemm_config(256, 6144, 0).bm == 64  # 48 tiles of 128 x 256: too few
    assert not F.pick_gemm_config(256, 6144, 0).promote  # fast sums in the small tile too
    assert F.pick_gemm_config(4096, 4096, 128) == F.GemmConfig(64, 128, 128, 4, 4, tma=True)
    assert F.pick_gemm_config(4096, 28672, 0, a_fp8=False).bm == 128  # shared memory


@pytest.mark.parametrize("case", ["channel-ragged", "block-ragged"])
def test_fp8_gemm_static_and_weight_only(case):
    n, k, block, parts = CASES[case]
    dtype = DTYPES[0]
    w = fp8_weight(n, k, block, parts, seed=6)
    x = randn(20, k, seed=7, dtype=dtype)
    scale = torch.tensor([0.01], device=DEV)
    out = F.fp8_linear(x, w.weight, w.scales, w.block_k, w.scale_rows, scale)
    xd = (x.float() / 0.01).clamp(-448, 448).to(FP8).double() * 0.01
    check(out, xd @ w.dequantize().double().T, dtype, k, fp8_mma=True)
    out = F.fp8_linear(x, w.weight, w.scales, w.block_k, w.scale_rows, None, weight_only=True)
    check(out, x.double() @ w.dequantize().double().T, dtype, k)


# ---- int4 products ------------------------------------------------------------------------------
def int4_weight(n: int, k: int, group: int, act_order: bool, seed: int = 0) -> I.Int4Weight:
    w = randn(n, k, seed=seed, scale=0.05).cpu()
    q, z, s = I.quantize_int4(w, group)
    g_idx = None
    if act_order:  # features of each group scattered: quantized as if permuted
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = (torch.argsort(perm) // group).to(torch.int32).to(DEV)
    return I.Int4Weight(I.pack_rows(q).to(DEV), z.to(torch.uint8).to(DEV), s.to(DEV), group,
                        g_idx)


INT4_CASES = {  # name -> (n, k, group)
    "g128": (96, 512, 128),
    "g128-even": (128, 1024, 128),  # N a multiple of the tile, K of the step: no masks
    "g64-ragged-n": (100, 384, 64),
    "g32": (64, 256, 32),
    "per-column": (72, 576, 576),  # group_size -1
}


def check_int4_rows(out: torch.Tensor, w: I.Int4Weight, x: torch.Tensor,
                    bias: torch.Tensor | None = None) -> None:
    """Many rows: within the rounding of the dequantized weight to x's dtype (the
    bound of every int4 GEMM, whether it rounds the weight or not)."""
    ref = x.double() @ w.dequantize().double().T
    if bias is not None:
        ref += bias.double()
    eps = 2.0 ** -8 if x.dtype == torch.bfloat16 else 2.0 ** -11
    tile = eps * (x.double().abs() @ w.dequantize().double().abs().T)
    err = (out.double() - ref).abs()
    assert (err <= tile + 2 * eps * ref.abs() + 1e-6 * ref.abs().max()).all(), err.max()


@pytest.mark.parametrize("case", sorted(INT4_CASES))
@pytest.mark.parametrize("m", [1, 2, 8, 40])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_products(case, m, act_order):
    n, k, group = INT4_CASES[case]
    dtype = DTYPES[-1] if m > 1 else DTYPES[0]
    w = int4_weight(n, k, group, act_order)
    x = randn(m, k, seed=m, dtype=dtype)
    bias = randn(n, seed=3, dtype=dtype)
    out = T.int4_linear(x, w.qweight, w.zeros, w.scales, w.group, w.g_idx, bias)
    ref = x.double() @ w.dequantize().double().T + bias.double()
    if m == 1 and T.gemv_packs(n, k, group, w.g_idx):  # products rounded to x's dtype
        check_packed(out, ref, x, w, dtype)
    elif m == 1:
        check(out, ref, dtype, k)
    else:
        check_int4_rows(out, w, x, bias)


@pytest.mark.parametrize("case", sorted(INT4_CASES))
@pytest.mark.parametrize("bm,bn,split", [(16, 32, 1), (64, 64, 1), (16, 64, 3), (64, 128, 2)])
def test_int4_folded_gemm(case, bm, bn, split):
    """The GEMM with the scale folded out of the weights (q - z exact on the tensor
    cores, s times each step's sums), tiles ragged in rows
    (70 rows) and columns (100 columns); the group of 576 (per column) taken in
    steps of 64; K split in up to 3 equal runs of whole steps (g32: 8 steps, 2
    runs; per-column: 9 steps, 3 runs), the bias in the first run's sums."""
    n, k, group = INT4_CASES[case]
    dtype = DTYPES[0]
    w = int4_weight(n, k, group, False, seed=71)
    x = randn(70, k, seed=72, dtype=dtype)
    bias = randn(n, seed=73, dtype=dtype)
    cfg = T.Int4Config(bm, bn, 128, 4, 3, split=split)
    out = T.int4_gemm(x, w.qweight, w.zeros, w.scales, group, None, bias, config=cfg)
    check_int4_rows(out, w, x, bias)


@pytest.mark.parametrize("case", ["g128", "g64-ragged-n", "per-column"])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_dequantized_gemm(case, act_order, monkeypatch):
    """Above DEQUANT_ABOVE rows: the weight dequantized whole ((q - z) s in fp32,
    rounded once: the bits of the reference's), then the dense GEMM."""
    n, k, group = INT4_CASES[case]
    dtype = DTYPES[0]
    w = int4_weight(n, k, group, act_order, seed=74)
    dq = T.int4_dequantize(w.qweight, w.zeros, w.scales, group, w.g_idx, dtype)
    assert torch.equal(dq, w.dequantize().T.to(dtype))
    monkeypatch.setattr(T, "DEQUANT_ABOVE", 16)
    x = randn(24, k, seed=75, dtype=dtype)
    bias = randn(n, seed=76, dtype=dtype)
    out = T.int4_linear(x, w.qweight, w.zeros, w.scales, group, w.g_idx, bias)
    torch.testing.assert_close(out, torch.addmm(bias, x, dq), rtol=0, atol=0)
    check_int4_rows(out, w, x, bias)


@needs_cuda
@pytest.mark.parametrize("silu_mul", [False, True])
def test_int4_gemv_mma_rows_past_one_launch(silu_mul):
    """Above MAX_ROWS rows the tensor-core GEMV runs a launch per MAX_ROWS
    (`int4_gemv_mma_rows`): every row the bits of that row alone, and
    `int4_linear` routes up to `int4_mma.GEMV_ROWS` rows there (100 here: a full
    launch and a ragged one)."""
    from radixlm.layers.quantization.triton_ops import int4_mma as MM

    n, k, group, m = 256, 512, 128, 100
    assert MM.MAX_ROWS < m <= MM.GEMV_ROWS
    w = int4_weight(n, k, group, False, seed=71)
    words = MM.mma_layout(I.unpack_rows(w.qweight))
    x = randn(m, k, seed=72, dtype=DTYPES[-1])
    bias = None if silu_mul else randn(n, seed=73, dtype=DTYPES[-1])
    out = MM.int4_gemv_mma_rows(x, words, w.zeros, w.scales, group, bias, silu_mul=silu_mul)
    check_rows_alone(out, lambda r: MM.int4_gemv_mma(x[r:r + 1], words, w.zeros, w.scales,
                                                     group, bias, silu_mul=silu_mul))
    if silu_mul:
        check_silu_mul(out, MM.int4_gemv_mma_rows(x, words, w.zeros, w.scales, group))
    else:
        check_int4_rows(out, w, x, bias)
        assert torch.equal(T.int4_linear(x, w.qweight, w.zeros, w.scales, group, None, bias,
                                         mma=words), out)


@pytest.mark.parametrize("silu_mul", [False, True])
def test_split_sums_of_every_row_in_one_launch(silu_mul):
    """The tensor-core GEMVs' second launch (`mma_gemv.sum_splits`) takes all rows
    at once: each row the bits of that row's sums added alone, in split order
    (+ bias, SiLU-and-mul over [gate | up] halves)."""
    from radixlm.layers.quantization.triton_ops import mma_gemv as MG

    n_out, m, split = 300, 5, 3
    dtype = DTYPES[0]
    ws = randn(split, m, 2 * n_out if silu_mul else n_out, seed=81)
    bias = None if silu_mul else randn(n_out, seed=82, dtype=dtype)
    y = MG.sum_splits(ws, bias, torch.empty(m, n_out, device=DEV, dtype=dtype), silu_mul)
    for r in range(m):
        alone = MG.sum_splits(ws[:, r:r + 1].contiguous(), bias,
                              torch.empty(1, n_out, device=DEV, dtype=dtype), silu_mul)
        assert torch.equal(y[r:r + 1], alone), r
    total = ws.double().sum(0)
    if silu_mul:  # gate and up each rounded to the output dtype first (`_silu_mul`)
        gate, up = (h.to(dtype).double() for h in (total[:, :n_out], total[:, n_out:]))
        total = torch.nn.functional.silu(gate) * up
    else:
        total = total + bias.double()
    torch.testing.assert_close(y.double(), total, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("silu_mul", [False, True])
def test_split_sums_scale_by_a_folded_norm(silu_mul):
    """The second launch of a product whose x holds a folded norm unscaled
    (`layers/norm_fold.py`): each row's sums times rsqrt(mean + eps) of its
    partial sums of squares, before the bias and the SiLU-and-mul."""
    from radixlm.layers.norm_fold import FoldedNorm
    from radixlm.layers.quantization.triton_ops import mma_gemv as MG

    n_out, m, split, features, parts = 300, 5, 3, 96, 6
    dtype = DTYPES[0]
    ws = randn(split, m, 2 * n_out if silu_mul else n_out, seed=83)
    bias = None if silu_mul else randn(n_out, seed=84, dtype=dtype)
    squares = randn(m, parts, seed=85).abs() * 20
    x = torch.empty(m, features, device=DEV, dtype=dtype)
    folded = FoldedNorm(x, squares, x, 1e-5)
    y = MG.sum_splits(ws, bias, torch.empty(m, n_out, device=DEV, dtype=dtype), silu_mul,
                      folded)
    total = ws.double().sum(0) * folded.rstd().double()
    if silu_mul:
        gate, up = (h.to(dtype).double() for h in (total[:, :n_out], total[:, n_out:]))
        total = torch.nn.functional.silu(gate) * up
    else:
        total = total + bias.double()
    torch.testing.assert_close(y.double(), total, rtol=2 ** -7, atol=1e-5)


def folding_gemv(fmt: str, n: int, k: int, seed: int):
    """A tensor-core GEMV of an [n, k] weight that folds norms: (product(x, bias,
    **kw), the weight in float64, bound(x): its rounding beyond the output's,
    whether it can give a folded norm)."""
    from radixlm.layers.quantization.triton_ops import fp8_mma as FM
    from radixlm.layers.quantization.triton_ops import int4_mma as MM

    if fmt == "int4":
        w = int4_weight(n, k, 128, False, seed=seed)
        words = MM.mma_layout(I.unpack_rows(w.qweight))
        scale = w.scales.double().repeat_interleave(128, 0)  # [K, N]
        return (lambda x, bias, **kw: MM.int4_gemv_mma(x, words, w.zeros, w.scales, 128, bias,
                                                       **kw),
                w.dequantize().double(), lambda x: (x.double().abs() @ scale) * 144 * 2.0 ** -18,
                MM.norm_fold_rows(words, 128, output=True) == MM.MAX_ROWS)
    q, s = quantize_rows(randn(n, k, seed=seed, scale=0.05))
    wd = q.double() * s.double()[:, None]
    return (lambda x, bias, **kw: FM.fp8_gemv_mma_plain(x, q, s, bias, **kw), wd,
            lambda x: (x.double().abs() @ wd.abs().T) * 2.0 ** -18, FM.folds_out(n, k))


@needs_cuda
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("m", [1, 3, 12])
def test_gemv_mma_folds_a_norm_in_and_out(fmt, m):
    """A residual RMSNorm folded into the tensor-core GEMVs around it: the product
    before it (its split-K sum in the program) adds the residual, rounded as the
    norm kernel rounds it, and gives x' = (h + r) * w and each tile's sum of
    squares; the products after it (qkv-like, gate/up with the SiLU) take x' and
    scale their sums by rstd before the bias and the SiLU: within the GEMV's
    bound of the float64 product, times rstd."""
    from radixlm.layers.norm_fold import NormTarget

    dtype, n, k = torch.bfloat16, 512, 1024
    product, _, _, folds = folding_gemv(fmt, n, k, seed=91)
    assert folds
    x = randn(m, k, seed=92, dtype=dtype)
    bias, res = randn(n, seed=93, dtype=dtype), randn(m, n, seed=94, dtype=dtype)
    gamma = (1 + 0.1 * randn(n, seed=95)).to(dtype)
    folded = product(x, bias, norm_out=NormTarget(res, gamma, 1e-5))
    s = (product(x, bias).float() + res.float()).to(dtype)
    assert torch.equal(folded.residual, s)
    assert torch.equal(folded.x, (s.float() * gamma.float()).to(dtype))
    assert folded.squares.shape == (m, n // 16)
    torch.testing.assert_close(folded.squares.sum(-1), (s.float() ** 2).sum(-1), rtol=1e-5,
                               atol=0)
    rstd = folded.rstd().double()
    # 256 columns: the sum in the program (int4) or not (FP8 picks it for any N);
    # 7168: int4's second launch; gate/up: the SiLU in the second launch.
    for n2, silu_mul in ((256, False), (7168, False), (512, True)):
        product2, w2, bound, _ = folding_gemv(fmt, n2, n, seed=96 + n2)
        bias2 = None if silu_mul else randn(n2, seed=97, dtype=dtype)
        out = product2(folded.x, bias2, silu_mul=silu_mul, norm_in=folded)
        sums = (folded.x.double() @ w2.T) * rstd
        if silu_mul:  # silu(gate) * up of the scaled sums, each rounded first
            gate, up = sums.split(n2 // 2, -1)
            want = torch.nn.functional.silu(gate.to(dtype).double()) * up.to(dtype).double()
            torch.testing.assert_close(out.double(), want, rtol=2 ** -6, atol=1e-3)
            continue
        ref = sums + bias2.double()
        err = (out.double() - ref).abs()
        assert (err <= 2.0 ** -8 * ref.abs() + bound(folded.x) * rstd
                + 1e-6 * ref.abs()).all(), (n2, err.max())


@pytest.mark.parametrize("n,group", [(80, 64), (48, 128)])
def test_int4_frag_dequantized_gemm(n, group):
    """Above `int4_mma.GEMV_ROWS` rows the fragment-order words are dequantized
    whole (`int4_gemm_mma`): the same bits as the GPTQ form's dequantization,
    then the dense GEMM; `int4_linear` routes such rows there when given the
    words."""
    from radixlm.layers.quantization.triton_ops import int4_mma as MM

    k, dtype = 256, DTYPES[0]
    w = int4_weight(n, k, group, False, seed=64)
    words = MM.mma_layout(I.unpack_rows(w.qweight))
    dq = MM.int4_dequantize_mma(words, w.zeros, w.scales, group, dtype)
    assert torch.equal(dq, T.int4_dequantize(w.qweight, w.zeros, w.scales, group, None, dtype))
    m = MM.GEMV_ROWS + 12
    x = randn(m, k, seed=65, dtype=dtype)
    bias = randn(n, seed=66, dtype=dtype)
    out = MM.int4_gemm_mma(x, words, w.zeros, w.scales, group, bias)
    torch.testing.assert_close(out, torch.addmm(bias, x, dq), rtol=0, atol=0)
    assert torch.equal(T.int4_linear(x, w.qweight, w.zeros, w.scales, group, None, bias,
                                     mma=words), out)


@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("case,act_order", [("g128", False), ("g64-ragged-n", True),
                                            ("per-column", False)])
def test_int4_gemv_split_k(case, act_order, split):
    """Split-K GEMV (fp32 partial sums, then a second launch adds them, the bias and
    the SiLU): the float64 product within one GEMV's rounding, fused SiLU too."""
    n, k, group = INT4_CASES[case]
    dtype = DTYPES[0]
    w = int4_weight(n, k, group, act_order, seed=21)
    x = randn(1, k, seed=22, dtype=dtype)
    bias = randn(n, seed=23, dtype=dtype)
    cfg = T.Int4Config(1, 16, 64, 4, 1, split)
    out = T.int4_gemv(x, w.qweight, w.zeros, w.scales, w.group, w.g_idx, bias, config=cfg)
    check(out, x.double() @ w.dequantize().double().T + bias.double(), dtype, k)
    if n % 2 == 0:
        check_int4_silu_mul(x, w, cfg)


def check_silu_mul(fused: torch.Tensor, plain: torch.Tensor) -> None:
    """A fused SiLU-and-mul output equals silu(gate) * up of the plain product of
    the merged [gate; up] weight (its halves along the last dim)."""
    gate, up = plain.float().split(plain.shape[-1] // 2, -1)
    torch.testing.assert_close(fused.float(), torch.nn.functional.silu(gate) * up,
                               rtol=2e-2, atol=2e-2)


def check_int4_silu_mul(x, w, cfg) -> None:
    """The GEMV's fused SiLU-and-mul on a merged [gate; up] equals the plain product's."""
    fused = T.int4_gemv(x, w.qweight, w.zeros, w.scales, w.group, w.g_idx, config=cfg,
                        silu_mul=True)
    plain = T.int4_gemv(x, w.qweight, w.zeros, w.scales, w.group, w.g_idx, config=cfg)
    check_silu_mul(fused, plain)


def check_packed(out, ref, x, w, dtype) -> torch.Tensor:
    """Within one rounding of the output plus three of x's dtype of the products'
    magnitudes |x| @ |W|^T (the packed GEMV rounds each product and 4-term sum)."""
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    mag = x.double().abs() @ w.dequantize().double().abs().T
    err = (out.double() - ref).abs()
    assert (err <= eps * ref.abs() + 3 * eps * mag).all(), f"max {(err / mag).max():.3g}"
    return mag


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("lean", [False, True])
def test_int4_gemv_packed_halves(dtype, split, lean):
    """The packed-halves GEMV (`Int4Config.packed`; inline PTX on the GPU, emulated
    under the interpreter), also in its lean form: products and 4-term sums rounded
    to x's dtype, so the error is bounded by a few of its roundings of the products'
    magnitudes (|x| @ |W|^T), where a wrong nibble, zero or pairing would be off by
    the products themselves; the fused SiLU too."""
    n, k, group = 256, 2048, 128
    w = int4_weight(n, k, group, False, seed=31)
    x = randn(1, k, seed=32, dtype=dtype)
    bias = randn(n, seed=33, dtype=dtype)
    cfg = T.Int4Config(1, 64, 256, 4, 3, split, packed=True, lean=lean)
    assert T.gemv_packs(n, k, group, None, cfg)
    out = T.int4_gemv(x, w.qweight, w.zeros, w.scales, w.group, w.g_idx, bias, config=cfg)
    ref = x.double() @ w.dequantize().double().T + bias.double()
    mag = check_packed(out, ref, x, w, dtype)
    fp32 = T.int4_gemv(x, w.qweight, w.zeros, w.scales, w.group, w.g_idx, bias,
                       config=cfg._replace(packed=False))
    print(f"packed {dtype}: max |err| / mag {((out.double() - ref).abs() / mag).max():.2e}, "
          f"fp32 path {((fp32.double() - ref).abs() / mag).max():.2e}")
    check_int4_silu_mul(x, w, cfg)


# (rows, config): one row at every config, 2-8 rows (each a column of B) at two.
MMA_INT4_CASES = [(1, 128, (4, 1, 1, False)), (1, 128, (4, 2, 4, True)), (1, 64, (2, 1, 3, True)),
                  (1, 128, (8, 4, 8, False)), (2, 128, (4, 1, 4, True)), (5, 64, (2, 2, 3, False)),
                  (8, 128, (4, 1, 4, True)), (11, 128, (4, 1, 4, True)),  # 2 runs of 8 rows
                  (16, 64, (2, 2, 3, False)), (27, 128, (4, 1, 4, True)),  # 4 runs
                  (40, 64, (2, 2, 3, False)), (64, 128, (4, 1, 4, True))]  # 8: no prefetch
MMA_FP8_CASES = [(1, (4, 1, 1, False)), (1, (4, 2, 4, True)), (1, (2, 1, 8, False)),
                 (1, (8, 1, 3, True)), (2, (4, 1, 4, True)), (5, (2, 2, 3, False)),
                 (8, (4, 1, 4, True)), (13, (4, 1, 4, True)), (27, (4, 1, 4, True)),
                 (40, (2, 2, 3, False)), (64, (4, 1, 4, True))]  # runs of 8 rows


def check_rows_alone(out, one_row) -> None:
    """Each row of a product of several rows is the same bits as that row alone
    (a row's sums do not depend on how many rows share the launch)."""
    for r in range(out.shape[0]):
        assert torch.equal(out[r:r + 1], one_row(r)), f"row {r} differs from itself alone"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,group,cfg", MMA_INT4_CASES)
def test_int4_gemv_mma(dtype, m, group, cfg):
    """The tensor-core GEMV (`int4_mma.py`, weights in MMA fragment order) at 1-64
    rows (a B operand per run of 8): exact products of offset + q summed in fp32,
    the zero point's term taken out per group, so within the output's rounding of
    the float64 product and a few fp32 roundings of (offset + 16) |x| s
    (tests/test_int4_mma.py's bound, x4 for the hardware's order of summation); a
    row alone the same bits; bias, the fused SiLU, and the route through
    `int4_linear` (its `mma` argument, up to GEMV_ROWS) too."""
    from radixlm.layers.quantization.triton_ops import int4_mma as MM

    n, k = 512, 2048
    w = int4_weight(n, k, group, False, seed=41)
    words = MM.mma_layout(I.unpack_rows(w.qweight))
    x = randn(m, k, seed=42, dtype=dtype)
    bias = randn(n, seed=43, dtype=dtype)
    config = MM.MmaConfig(*cfg)
    out = MM.int4_gemv_mma(x, words, w.zeros, w.scales, group, bias, config=config)
    ref = x.double() @ w.dequantize().double().T + bias.double()
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    offset = 128 if dtype == torch.bfloat16 else 1024
    scale = w.scales.double().repeat_interleave(group, 0)  # [K, N]
    folded = (x.double().abs() @ scale) * (offset + 16)
    err = (out.double() - ref).abs()
    assert (err <= eps * ref.abs() + 2.0 ** -18 * folded).all(), f"max {(err / folded).max():.3g}"
    check_rows_alone(out, lambda r: MM.int4_gemv_mma(x[r:r + 1], words, w.zeros, w.scales,
                                                     group, bias, config=config))
    if m <= MM.GEMV_ROWS:
        assert torch.equal(T.int4_linear(x, w.qweight, w.zeros, w.scales, group, None, bias,
                                         mma=words),
                           MM.int4_gemv_mma(x, words, w.zeros, w.scales, group, bias))
    fused = MM.int4_gemv_mma(x, words, w.zeros, w.scales, group, config=config, silu_mul=True)
    plain = MM.int4_gemv_mma(x, words, w.zeros, w.scales, group, config=config)
    check_silu_mul(fused, plain)


@needs_cuda
@pytest.mark.parametrize("m,cfg", MMA_FP8_CASES)
def test_fp8_gemv_mma(m, cfg):
    """The tensor-core FP8 GEMV (`fp8_mma.py`, per-row scales, bf16 x) at 1-64 rows
    (a B operand per run of 8):
    e4m3 read as bf16 times 2^-120 (exact), products exact and summed in fp32, so
    within the output's rounding of the float64 product and a few fp32 roundings
    of the magnitudes; a row alone the same bits; bias, the fused SiLU and the
    route through `fp8_linear` (its `mma` argument, up to GEMV_ROWS) too; the plain-layout form
    (`fp8_gemv_mma_plain`) bit for bit."""
    from radixlm.layers.quantization.triton_ops import fp8_mma as FM

    n, k = 512, 2048
    q, s = quantize_rows(randn(n, k, seed=51, scale=0.05))
    words = FM.mma_layout(q)
    x = randn(m, k, seed=52, dtype=torch.bfloat16)
    bias = randn(n, seed=53, dtype=torch.bfloat16)
    config = FM.MmaConfig(*cfg)
    out = FM.fp8_gemv_mma(x, words, s, bias, config=config)
    w = q.double() * s.double()[:, None]
    ref = x.double() @ w.T + bias.double()
    mag = x.double().abs() @ w.abs().T
    err = (out.double() - ref).abs()
    assert (err <= 2.0 ** -8 * ref.abs() + 2.0 ** -18 * mag).all(), f"max {(err / mag).max():.3g}"
    check_rows_alone(out, lambda r: FM.fp8_gemv_mma(x[r:r + 1], words, s, bias, config=config))
    if m <= FM.GEMV_ROWS:
        assert torch.equal(F.fp8_linear(x, q, s, 0, 1, None, bias, mma=words),
                           FM.fp8_gemv_mma(x, words, s, bias))
    fused = FM.fp8_gemv_mma(x, words, s, config=config, silu_mul=True)
    plain = FM.fp8_gemv_mma(x, words, s, config=config)
    check_silu_mul(fused, plain)
    # The weight read where it lies (rows with 16 bytes more, as online weights
    # keep their scales): the same words reach the same MMAs, so the same bits.
    rows = torch.zeros(n, k + 16, device=DEV, dtype=torch.uint8)
    rows[:, :k] = q.view(torch.uint8)
    lying = rows[:, :k].view(torch.float8_e4m3fn)
    assert torch.equal(FM.fp8_gemv_mma_plain(x, lying, s, bias, config=config), out)
    assert torch.equal(FM.fp8_gemv_mma_plain(x, q, s, config=config, silu_mul=True), fused)


def mma_gemv_case(fmt: str, m: int, n: int, k: int, seed: int):
    """x [m, k] bf16, a bias [n] and `gemv(x, bias=None, cfg=None, **kw)`: the
    tensor-core GEMV of `fmt` (int4 g128; FP8 "fp8" from the words, "fp8-plain"
    read where it lies, "fp8-block" so with 128 x 128 block scales) over a random weight
    [n, k] (drawn from `seed`, x and the bias from the next two)."""
    from radixlm.layers.quantization.triton_ops import fp8_mma as FM
    from radixlm.layers.quantization.triton_ops import int4_mma as MM

    x = randn(m, k, seed=seed + 1, dtype=torch.bfloat16)
    bias = randn(n, seed=seed + 2, dtype=torch.bfloat16)
    if fmt == "int4":
        w = int4_weight(n, k, 128, False, seed=seed)
        words = MM.mma_layout(I.unpack_rows(w.qweight))

        def gemv(x, bias=None, cfg=None, **kw):
            return MM.int4_gemv_mma(x, words, w.zeros, w.scales, 128, bias, config=cfg, **kw)
        return x, bias, gemv
    q, s = quantize_rows(randn(n, k, seed=seed, scale=0.05))
    scale_rows = 0
    if fmt == "fp8-block":
        grid = torch.rand(n // 128, k // 128, device=DEV) * 1e-3 + 1e-4
        s, scale_rows = block_table(grid, [n], 128)
    words = FM.mma_layout(q)

    def gemv(x, bias=None, cfg=None, **kw):
        if fmt == "fp8":
            return FM.fp8_gemv_mma(x, words, s, bias, config=cfg, scale_rows=scale_rows, **kw)
        return FM.fp8_gemv_mma_plain(x, q, s, bias, config=cfg, scale_rows=scale_rows, **kw)
    return x, bias, gemv


@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8", "fp8-plain", "fp8-block", "int4"])
@pytest.mark.parametrize("m", [1, 3, 8, 27])
@pytest.mark.parametrize("split", [4, 8])
def test_mma_gemv_sum_in_the_program(fmt, m, split):
    """`MmaConfig.cta_sum` (the split-K sum after a barrier in the program, not a
    second launch): the same bits as the two launches, with and without bias, for
    both formats at 1-27 rows; the fused SiLU keeps two launches; inside a CUDA
    graph replayed on new inputs the sums follow the new x."""
    from radixlm.layers.quantization.triton_ops import mma_gemv as MG

    n, k = 512, 2048
    x, bias, gemv = mma_gemv_case(fmt, m, n, k, seed=61)
    two = MG.MmaConfig(4, 1, split, prefetch=m <= 32)
    one = two._replace(cta_sum=True)
    steps = k // 128  # FP8: 128 features a step; int4: a group of 128
    assert MG.cta_fits(one, steps, False) and not MG.cta_fits(one, steps, True)
    assert not MG.cta_fits(one._replace(split=3), steps, False)  # 3 warps: two launches
    for b in (None, bias):
        assert torch.equal(gemv(x, b, cfg=one), gemv(x, b, cfg=two)), f"bias {b is not None}"
    assert torch.equal(gemv(x, silu_mul=True, cfg=one), gemv(x, silu_mul=True, cfg=two))
    # Captured once, replayed on another x: the sums follow the new x.
    x2 = randn(m, k, seed=64, dtype=torch.bfloat16)
    assert torch.equal(replayed(lambda v: gemv(v, bias, cfg=one), x, x2),
                       gemv(x2, bias, cfg=two))


def replayed(product, x: torch.Tensor, x_new: torch.Tensor) -> torch.Tensor:
    """`product(x)` captured in a CUDA graph on a copy of x, then replayed after the
    copy took x_new's values: the graph's output (what the replay computed)."""
    xs = x.clone()
    product(xs)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = product(xs)
    xs.copy_(x_new)
    graph.replay()
    torch.cuda.synchronize()
    return out


@needs_cuda
@pytest.mark.parametrize("fmt", ["fp8-plain", "int4"])
@pytest.mark.parametrize("m", [1, 3, 27])
def test_mma_gemv_leaves_its_split_sums(fmt, m):
    """`defer_sum` (`layers/split_sums.py`): where the sum takes a second launch the
    GEMV returns its partial sums, which `finish()` adds into the same bits; where
    the sum is in the program, or the SiLU is fused, it returns the product."""
    from radixlm.layers.quantization.triton_ops import mma_gemv as MG
    from radixlm.layers.split_sums import SplitSums

    x, bias, gemv = mma_gemv_case(fmt, m, 6144, 1024, seed=71)
    two = MG.MmaConfig(4, 1, 4, prefetch=m <= 32)
    for b in (None, bias):
        left = gemv(x, b, cfg=two, defer_sum=True)
        assert isinstance(left, SplitSums) and left.partials.shape == (4, m, 6144)
        assert torch.equal(left.finish(), gemv(x, b, cfg=two)), f"bias {b is not None}"
    assert isinstance(gemv(x, bias, cfg=two._replace(cta_sum=True), defer_sum=True),
                      torch.Tensor)
    assert isinstance(gemv(x, cfg=two, defer_sum=True, silu_mul=True), torch.Tensor)


@needs_cuda
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(28672, 1024), (512, 2048), (96, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_gemv_pair_form_finishes_the_silu(m, n, k, dtype):
    """The int4 [gate; up] GEMV with its SiLU in one launch (`MmaConfig.pair`: a
    warp's gate and up tiles of the same features, the split-K sum and SiLU in
    the program): the same bits as the two launches at 1-8 rows, splits 2, 4 and
    8 (the default picks at gate/up's width and a narrower one), a pair count
    that leaves a program's warps idle; under a CUDA graph replayed on new x;
    the default pick takes it."""
    from radixlm.layers.quantization.triton_ops import int4_mma as MM
    from radixlm.layers.quantization.triton_ops import mma_gemv as MG

    x, _, gemv = mma_gemv_case("int4", m, n, k, seed=81)
    x = x.to(dtype)
    steps = k // 128
    for split in (2, 4, 8):
        two = MG.MmaConfig(4, 1, split, prefetch=True)
        pair = MG.MmaConfig(split, 2, split, prefetch=True, cta_sum=True, pair=True)
        assert MG.cta_fits(pair, steps, True) and not MG.cta_fits(pair, steps, False)
        want = gemv(x, silu_mul=True, cfg=two)
        assert want.shape == (m, n // 2)
        assert torch.equal(gemv(x, silu_mul=True, cfg=pair), want), f"split {split}"
    assert MM.pairs(m, n, True, None, steps) and MG.pick_config(n, pair=True).pair
    two = MG.MmaConfig(4, 1, MG.pick_config(n, pair=True).split, prefetch=True)
    assert torch.equal(gemv(x, silu_mul=True), gemv(x, silu_mul=True, cfg=two))
    x2 = randn(m, k, seed=82, dtype=dtype)
    assert torch.equal(replayed(lambda v: gemv(v, silu_mul=True), x, x2),
                       gemv(x2, silu_mul=True, cfg=two))


@needs_cuda
@pytest.mark.parametrize("m", [1, 3, 8, 27])
@pytest.mark.parametrize("n,k", [(28672, 1024), (512, 2048), (96, 512)])
def test_fp8_gemv_halves_form_finishes_the_silu(m, n, k):
    """The FP8 [gate; up] GEMV with its SiLU in one launch (`MmaConfig.halves`: a
    tile's rows 0-7 gate rows, 8-15 their up rows, the split-K sum and SiLU in the
    program): the same bits as the two launches at 1-27 rows, splits 2, 4 and 8,
    a tile count that leaves a program's warps idle, the weight's rows with its
    online scale bytes after them; under a CUDA graph replayed on new x; the
    default pick takes it."""
    from radixlm.layers.quantization.triton_ops import fp8_mma as FM
    from radixlm.layers.quantization.triton_ops import mma_gemv as MG

    x, _, gemv = mma_gemv_case("fp8-plain", m, n, k, seed=91)
    q, s = quantize_rows(randn(n, k, seed=91, scale=0.05))
    rows = torch.zeros(n, k + 16, device=DEV, dtype=torch.uint8)  # an online weight's stride
    rows[:, :k] = q.view(torch.uint8)
    lying = rows[:, :k].view(torch.float8_e4m3fn)
    steps = k // 128
    for split in (2, 4, 8):
        two = MG.MmaConfig(4, 1, split, prefetch=True)
        one = two._replace(cta_sum=True, halves=True)
        assert MG.cta_fits(one, steps, True) and not MG.cta_fits(one, steps, False)
        want = gemv(x, silu_mul=True, cfg=two)
        assert want.shape == (m, n // 2)
        assert torch.equal(gemv(x, silu_mul=True, cfg=one), want), f"split {split}"
        assert torch.equal(FM.fp8_gemv_mma_plain(x, lying, s, config=one, silu_mul=True), want)
    assert FM.halves(n, steps, True, None, 0)
    two = MG.MmaConfig(4, 1, MG.pick_config(n, fp8=True).split, prefetch=True)
    assert torch.equal(gemv(x, silu_mul=True), gemv(x, silu_mul=True, cfg=two))
    x2 = randn(m, k, seed=92, dtype=torch.bfloat16)
    assert torch.equal(replayed(lambda v: gemv(v, silu_mul=True), x, x2),
                       gemv(x2, silu_mul=True, cfg=two))


@needs_cuda
@pytest.mark.parametrize("m", [1, 8, 27])
@pytest.mark.parametrize("case", ["block", "block-fused-parts"])
def test_fp8_gemv_mma_block_scales(case, m):
    """The tensor-core FP8 GEMV with 128 x 128 block scales (each step's sums
    scaled by its block's scale; a fused layer's table of 64-row blocks too):
    within the output's rounding of the float64 product and fp32 roundings of the
    magnitudes; the weight where it lies the same bits as the copy; the route
    through `fp8_linear` (its `mma` argument) too; the fused SiLU."""
    from radixlm.layers.quantization.triton_ops import fp8_mma as FM

    n, k, block, parts = CASES[case]
    w = fp8_weight(n, k, block, parts, seed=9)
    assert FM.takes(n, k, w.block_k, torch.bfloat16, w.scale_rows)
    x = randn(m, k, seed=91, dtype=torch.bfloat16)
    bias = randn(n, seed=92, dtype=torch.bfloat16)
    words = FM.mma_layout(w.weight)
    out = FM.fp8_gemv_mma(x, words, w.scales, bias, scale_rows=w.scale_rows)
    wd = w.dequantize().double()
    ref = x.double() @ wd.T + bias.double()
    mag = x.double().abs() @ wd.abs().T
    err = (out.double() - ref).abs()
    assert (err <= 2.0 ** -8 * ref.abs() + 2.0 ** -18 * mag).all(), f"max {(err / mag).max():.3g}"
    plain = FM.fp8_gemv_mma_plain(x, w.weight, w.scales, bias, scale_rows=w.scale_rows)
    assert torch.equal(plain, out)
    via = F.fp8_linear(x, w.weight, w.scales, w.block_k, w.scale_rows, None, bias, mma=w.weight)
    assert torch.equal(via, out)
    fused = FM.fp8_gemv_mma_plain(x, w.weight, w.scales, scale_rows=w.scale_rows,
                                  silu_mul=True)
    check_silu_mul(fused, FM.fp8_gemv_mma_plain(x, w.weight, w.scales,
                                                scale_rows=w.scale_rows))


def test_int4_out_buffer_and_awq_repacking():
    """An AWQ checkpoint's qweight repacked at load gives the same products as the
    GPTQ-packed words of the same values."""
    w = randn(64, 256, seed=11, scale=0.05).cpu()
    awq = I.awq_tensors(w, 64)
    ours = I.AwqQweightSpec().to_ours(awq["qweight"])
    zeros = I.ZerosSpec(order=I.AWQ_ORDER).to_ours(awq["qzeros"]).to(torch.uint8)
    q, z, s = I.quantize_int4(w, 64)
    assert torch.equal(ours, I.pack_rows(q)) and torch.equal(zeros, z.to(torch.uint8))
    x = randn(1, 256, seed=12, dtype=DTYPES[0])
    buf = torch.empty(1, 64, device=DEV, dtype=x.dtype)
    got = T.int4_linear(x, ours.to(DEV), zeros.to(DEV), s.to(DEV), 64, None, out=buf)
    assert got.data_ptr() == buf.data_ptr()


# ---- CUDA: the Llama-8B shapes, graphs ------------------------------------------------------
LLAMA = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N) at tp 1


@needs_cuda
@pytest.mark.parametrize("k,n", LLAMA)
@pytest.mark.parametrize("m", [1, 8, 64, 600])
def test_llama_shapes_on_cuda(k, n, m):
    x = randn(m, k, seed=1, dtype=torch.bfloat16)
    for block in (None, (128, 128)):
        w = fp8_weight(n, k, block, seed=2)
        out = F.fp8_linear(x, w.weight, w.scales, w.block_k, w.scale_rows, None)
        if m <= 8:
            check(out, x.double() @ w.dequantize().double().T, torch.bfloat16, k)
        else:
            xq, xs = fp8_ref_quant(x, w.block_k or None)
            xd = xq.double() * xs.double().repeat_interleave(w.block_k or k, 1)[:, :k]
            check(out, xd @ w.dequantize().double().T, torch.bfloat16, k, fp8_mma=True)
    w4 = int4_weight(n, k, 128, False, seed=3)
    out = T.int4_linear(x, w4.qweight, w4.zeros, w4.scales, 128, None)
    ref = x.double() @ w4.dequantize().double().T
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    torch.cuda.empty_cache()


@needs_cuda
@pytest.mark.parametrize("m", [1, 4, 8])
def test_kernels_replay_in_a_cuda_graph(m):
    x = randn(m, 4096, seed=1, dtype=torch.bfloat16)
    w8 = fp8_weight(4096, 4096, (128, 128), seed=4)
    w4 = int4_weight(4096, 4096, 128, False, seed=5)

    def step():
        a = F.fp8_linear(x, w8.weight, w8.scales, w8.block_k, w8.scale_rows, None)
        return T.int4_linear(a, w4.qweight, w4.zeros, w4.scales, 128, None)

    eager = step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_gemv_silu_mul(act_order):
    """The fused gate/up GEMV equals the GEMV followed by silu(gate) * up on its
    rounded outputs; more rows return None (the caller runs the activation)."""
    d, k = 96, 256
    w = int4_weight(2 * d, k, 64, act_order, seed=13)
    x = randn(1, k, seed=14, dtype=DTYPES[0])
    fused = T.int4_linear(x, w.qweight, w.zeros, w.scales, 64, w.g_idx, silu_mul=True)
    plain = T.int4_linear(x, w.qweight, w.zeros, w.scales, 64, w.g_idx)
    check_silu_mul(fused, plain)
    x2 = randn(2, k, seed=15, dtype=DTYPES[0])
    assert T.int4_linear(x2, w.qweight, w.zeros, w.scales, 64, w.g_idx, silu_mul=True) is None


# ---- the methods on the kernels -------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["fp8-online", "fp8-block", "awq", "gptq-act-order"])
@pytest.mark.parametrize("m", [1, 3, 12])
def test_layers_run_the_kernels_on_their_weights(fmt, m):
    """A fused layer built in fp16 on the kernels' device: its products (and the
    fused SiLU of a gate/up layer) equal the dequantized weights' up to rounding."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from quant_checkpoints import (
        HF_FP8_BLOCK_CONFIG,
        awq,
        awq_config,
        gptq,
        gptq_config,
        hf_fp8_block,
        tiny_llama,
    )

    from radixlm.layers.linear import MergedColumnParallelLinear
    from radixlm.layers.quantization import get_quantization_config

    qconfig, make = {
        "fp8-online": (None, lambda name, w: ({"weight": w}, w)),
        "fp8-block": (HF_FP8_BLOCK_CONFIG, hf_fp8_block()),
        "awq": (awq_config(64), awq(64)),
        "gptq-act-order": (gptq_config(64, desc_act=True), gptq(64, desc_act=True)),
    }[fmt]
    config = tiny_llama(quantization_config=qconfig) if qconfig else tiny_llama()
    quant = get_quantization_config(config, "fp8" if qconfig is None else None)
    with torch.device(DEV):
        layer = MergedColumnParallelLinear(256, [256, 256], params_dtype=torch.float16,
                                           fused_silu_mul=True, quant_config=quant,
                                           prefix="model.layers.0.mlp.gate_up_proj")
    dequantized = []
    for shard, name in ((0, "gate_proj"), (1, "up_proj")):
        w = randn(256, 256, seed=20 + shard, scale=0.1).cpu()
        tensors, deq = make(f"model.layers.0.mlp.{name}.weight", w)
        for key, t in tensors.items():
            p = getattr(layer, key)
            p.weight_loader(p, t.to(DEV), shard)
        dequantized.append(deq)
    layer.quant_method.process_weights_after_loading(layer)
    x = randn(m, 256, seed=m, dtype=torch.float16)
    if fmt == "fp8-online":
        dequantized = [fp8_weight_of(d) for d in dequantized]
    w = torch.cat(dequantized).double().to(DEV)
    want = x.double() @ w.T
    got = layer.quant_method.apply(layer, x)
    torch.testing.assert_close(got.double(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item())
    gate, up = want.split(256, -1)
    act = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(layer(x).double(), act, rtol=5e-2,
                               atol=5e-2 * act.abs().max().item())


def fp8_weight_of(w: torch.Tensor) -> torch.Tensor:
    q, s = quantize_rows(w)
    return q.float() * s[:, None]


# ---- the W8A8 GEMV (FP8 activations per token and group of 128) -------------------------------
from radixlm.layers.quantization.triton_ops import fp8_w8a8_gemv as W8  # noqa: E402

W8A8_CASES = {  # name -> (n, k, block, parts)
    "channel": (96, 256, None, None),
    "channel-ragged-n": (100, 384, None, None),
    "block": (256, 384, (128, 128), None),
    "block-ragged-n": (200, 256, (128, 128), None),
    "block-fused-parts": (320, 256, (128, 128), [192, 64, 64]),
}
W8A8_TILES = [W8.W8A8Config(64, 4, 2, 1), W8.W8A8Config(64, 4, 3, 2),
              W8.W8A8Config(128, 4, 2, 4), W8.W8A8Config(32, 2, 2, 2)]


def w8a8_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The W8A8 GEMV's activation codes in torch: x [M, K] -> (e4m3 [M, K], fp32
    scales [M, K / 128]), the kernel's arithmetic (x times 448 / amax)."""
    m, k = x.shape
    g = x.float().reshape(m, k // W8.GROUP, W8.GROUP)
    amax = g.abs().amax(dim=2).clamp(min=1e-12)
    # Tensor divisions, correctly rounded as the kernel's div_rn: torch turns a
    # Python scalar over a tensor (and, on CUDA, a tensor over a scalar) into a
    # product with a reciprocal.
    top = torch.full_like(amax, 448.0)
    q = (g * (top / amax)[..., None]).clamp(-448, 448).to(FP8)
    return q.reshape(m, k), amax / top


def w8a8_reference(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """What the W8A8 GEMV computes, in float64 (before bias and dtype): x's group
    codes times their scales, times the dequantized weight."""
    m, k = x.shape
    q, s = w8a8_codes(x)
    xd = q.double().reshape(m, k // W8.GROUP, W8.GROUP) * s.double()[..., None]
    return xd.reshape(m, k) @ w.dequantize().double().T


def test_w8a8_gemv_codes_are_the_gemm_paths_group_codes():
    """The GEMV's activation codes and scales (`w8a8_codes`, the kernel's
    arithmetic: x times 448 / amax) are the W8A8 GEMM's per-group codes (x / scale)
    but where the product and the quotient round apart, there one code step."""
    x = randn(4, 1024, seed=11, dtype=torch.bfloat16) * 3
    q, s = w8a8_codes(x)
    want_q, want_s = fp8_ref_quant(x, 128)
    assert torch.equal(s, want_s)
    a, b = q.view(torch.uint8).int(), want_q.view(torch.uint8).int()
    apart = a != b
    assert apart.float().mean() < 0.01 and ((a - b)[apart].abs() == 1).all()


@pytest.mark.parametrize("case", sorted(W8A8_CASES))
@pytest.mark.parametrize("m", [1, 2, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_gemv(case, m, dtype):
    """Per-row and 128 x 128 block scales (ragged N, fused parts), one row (its
    own tile), 2-16 rows (the MMA's 16 columns), 17-32 (32) and 33-64 (64): within the
    FP8 MMA's sums of the float64 product of the same codes, with the bias."""
    n, k, block, parts = W8A8_CASES[case]
    w = fp8_weight(n, k, block, parts, seed=m)
    x = randn(m, k, seed=m + 1, dtype=dtype) * 2
    x[0, 3] = 40.0  # an outlier: its group's scale, not its row's
    bias = randn(n, seed=9, dtype=dtype)
    out = W8.fp8_gemv_w8a8(x, w.weight, w.scales, w.block_k, w.scale_rows, bias)
    check(out, w8a8_reference(x, w) + bias.double(), dtype, k, fp8_mma=True)


@pytest.mark.parametrize("cfg", W8A8_TILES, ids=lambda c: c.label())
@pytest.mark.parametrize("m", [1, 5])
def test_w8a8_gemv_tiles_and_splits(cfg, m):
    """Every tile the sweep tries: fewer groups than splits, ragged N, a split
    whose last program has fewer groups."""
    dtype = DTYPES[0]
    for n, k in ((100, 384), (64, 640)):
        w = fp8_weight(n, k, None, seed=n)
        x = randn(m, k, seed=k, dtype=dtype)
        bias = randn(n, seed=3, dtype=dtype)
        out = W8.fp8_gemv_w8a8(x, w.weight, w.scales, bias=bias, config=cfg)
        check(out, w8a8_reference(x, w) + bias.double(), dtype, k, fp8_mma=True)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("block", [None, (128, 128)])
def test_w8a8_gemv_silu_mul_and_routing(m, block):
    """silu(gate) * up, in the kernel (one split) or from the split sums, equals
    the activation applied to the plain product's rounded outputs; `fp8_linear`
    routes 1 to ROUTE_MAX_ROWS rows here when asked, and rows past them to the
    W8A8 GEMM (which leaves the activation to its caller)."""
    dtype = DTYPES[0]
    d, k = 128, 256
    w = fp8_weight(2 * d, k, block, [d, d] if block else None, seed=4)
    x = randn(m, k, seed=5, dtype=dtype)
    args = (w.weight, w.scales, w.block_k, w.scale_rows, None)
    fused = F.fp8_linear(x, *args, silu_mul=True, w8a8_from=1)
    plain = F.fp8_linear(x, *args, w8a8_from=1)
    check_silu_mul(fused, plain)
    assert torch.equal(plain, W8.fp8_gemv_w8a8(x, w.weight, w.scales, w.block_k, w.scale_rows))
    split = W8.W8A8Config(64, 4, 2, 2)  # the activation in the split sums' launch
    check_silu_mul(W8.fp8_gemv_w8a8(x, w.weight, w.scales, w.block_k, w.scale_rows,
                                    config=split, silu_mul=True), plain)
    many = randn(W8.ROUTE_MAX_ROWS + 1, k, seed=6, dtype=dtype)
    assert F.fp8_linear(many, *args, silu_mul=True, w8a8_from=1) is None


def test_w8a8_gemv_refuses_what_it_cannot_take():
    assert not W8.takes(200, 0, 1)  # K not whole groups
    assert not W8.takes(256, 64, 1)  # blocks of 64 features
    assert not W8.takes(256, 0, 65)  # rows past the MMA's 64 columns
    assert W8.takes(256, 128, 64)


@needs_cuda
@pytest.mark.parametrize("k,n", LLAMA)
@pytest.mark.parametrize("m", [1, 12, 20, 32, 64])
def test_w8a8_gemv_llama_shapes_and_graphs(k, n, m):
    """Llama-8B's four shapes at the picked tiles (gate/up also with its SiLU, an
    unsplit tile of its own), per-row and block scales; a CUDA graph's replay
    gives the eager bits."""
    x = randn(m, k, seed=1, dtype=torch.bfloat16)
    for block in (None, (128, 128)):
        w = fp8_weight(n, k, block, seed=2)
        out = W8.fp8_gemv_w8a8(x, w.weight, w.scales, w.block_k, w.scale_rows)
        check(out, w8a8_reference(x, w), torch.bfloat16, k, fp8_mma=True)
    if n > k:
        check_silu_mul(W8.fp8_gemv_w8a8(x, w.weight, w.scales, w.block_k, w.scale_rows,
                                        silu_mul=True), out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = W8.fp8_gemv_w8a8(x, w.weight, w.scales, w.block_k, w.scale_rows)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)
    torch.cuda.empty_cache()


@needs_cuda
def test_fp8_linear_takes_the_w8a8_gemv_from_its_rows():
    """The engine's route (`Fp8Weight.w8a8_from` = MIN_ROWS beside the tensor-core
    GEMV reading the weight where it lies): below MIN_ROWS the bits of that GEMV,
    from MIN_ROWS to ROUTE_MAX_ROWS those of the W8A8 GEMV, past them the W8A8 GEMM's."""
    n, k = 256, 512
    w = fp8_weight(n, k, None, seed=7)
    args = (w.weight, w.scales, 0, 1, None)
    for m in (W8.MIN_ROWS - 1, W8.MIN_ROWS, W8.ROUTE_MAX_ROWS, W8.ROUTE_MAX_ROWS + 1):
        x = randn(m, k, seed=m, dtype=torch.bfloat16)
        routed = F.fp8_linear(x, *args, mma=w.weight, w8a8_from=W8.MIN_ROWS)
        if m < W8.MIN_ROWS:
            want = F.fp8_linear(x, *args, mma=w.weight)
        elif m <= W8.ROUTE_MAX_ROWS:
            want = W8.fp8_gemv_w8a8(x, w.weight, w.scales)
        else:
            want = F.fp8_linear(x, *args)
        assert torch.equal(routed, want), m
