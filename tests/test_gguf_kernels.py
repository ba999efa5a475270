"""Quantized-weight CPU kernels (layers/cpu_ops/qgemm*) against gguf's exact
dequantization followed by a float64 matmul.

Error bound. The weights are exact (the packed codes and scales reproduce
gguf's dequantized values bit for bit, checked below), so the one
approximation is the activations' int8 quantization: per block of 32 with
scale d, each x is off by at most d / 2, and an output by at most
sum over blocks of d_b / 2 * sum_k in b |W[n, k]|. On top of that the kernel
accumulates in float32: a few roundings per block, each below 2^-24 of the
running magnitude, bounded by FP32_SLACK * blocks * sum_k |W[n, k] x[k]|.
With activations whose quantization is exact (integers, each block's max
|x| = 127) only that float32 slack remains, which catches any error in the
weights' decoding (one code or scale off is orders of magnitude more).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf_blocks import GGUF_TYPES, exact_activations, random_blocks, require_kernels

from radixlm.layers.cpu_ops import qgemm, qpack

FP32_SLACK = 4 * 2.0**-24
# (n, k): odd row counts (partial tiles, a single row), several blocks; K-quants
# need k in multiples of 256.
# n = 355: 23 tiles of 16; on 2 threads a one-row product's chunks are 4 tiles
# and a last 3, which the AVX-512 kernel runs 4 at a time, then 2 + 1.
SHAPES = [(1, 256), (17, 512), (37, 768), (64, 256), (355, 256)]
ROWS = [1, 3, 4, 9, 130]  # every remainder of the 4-row micro-kernel; > 128 splits rows


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    require_kernels(qgemm.load, "quantized kernels")


def isas() -> list[str]:
    return qgemm.available_isas() if qgemm.load() else ["portable"]


def gguf_dequantized(raw: np.ndarray, fmt: str, n: int, k: int) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[GGUF_TYPES[fmt]]
    return gguf.quants.dequantize(raw, qtype).reshape(n, k)


def error_bound(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """Per-output bound on |kernel - exact| (module docstring)."""
    w64 = torch.from_numpy(w).double()
    x64 = x.double()
    d = x64.reshape(x.shape[0], -1, 32).abs().amax(-1) / 127  # the kernel's activation scales
    w_abs = w64.abs().reshape(w.shape[0], -1, 32).sum(-1)    # sum |W| per block
    quantization = (d / 2) @ w_abs.T
    blocks = w.shape[1] // 32
    return quantization * (1 + 1e-6) + FP32_SLACK * (blocks + 2) * (x64.abs() @ w64.abs().T)


@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
@pytest.mark.parametrize("n,k", SHAPES)
def test_packed_weights_dequantize_to_gguf_values_exactly(fmt, n, k):
    raw = random_blocks(fmt, n, k, seed=n + k)
    expected = gguf_dequantized(raw, fmt, n, k)
    codes = qpack.decompose_gguf(raw, fmt, n, k)
    np.testing.assert_array_equal(qpack.dequantize_codes(codes), expected)
    packed = qpack.pack(codes)
    np.testing.assert_array_equal(qgemm.dequantize(packed).numpy(), expected)
    rows = torch.tensor([n - 1, 0, n // 2])
    np.testing.assert_array_equal(qgemm.dequantize(packed, rows).numpy(), expected[rows.numpy()])


@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
@pytest.mark.parametrize("n,k", SHAPES)
def test_product_within_quantization_bound(fmt, n, k):
    raw = random_blocks(fmt, n, k, seed=2 * n + k)
    w = gguf_dequantized(raw, fmt, n, k)
    packed = qpack.pack_gguf(raw, GGUF_TYPES[fmt], n, k)
    gen = torch.Generator().manual_seed(n * k)
    for m in ROWS:
        x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
        exact = x.double() @ torch.from_numpy(w).double().T
        bound = error_bound(x, w)
        results = {isa: qgemm.linear(x, packed, isa=isa) for isa in isas()}
        for isa, y in results.items():
            err = (y.double() - exact).abs()
            worst = (err / bound).max().item()
            assert worst <= 1.0, f"{isa}, m={m}: error {worst:.3f}x the bound"
            # Every path computes the same bits as the portable one.
            assert torch.equal(y, results["portable"]), f"{isa} differs from portable, m={m}"


@pytest.mark.parametrize("fmt", list(GGUF_TYPES))
def test_product_exact_when_activations_quantize_exactly(fmt):
    n, k = 37, 768
    raw = random_blocks(fmt, n, k, seed=7)
    w = gguf_dequantized(raw, fmt, n, k)
    packed = qpack.pack_gguf(raw, GGUF_TYPES[fmt], n, k)
    x = exact_activations(5, k, seed=3)
    exact = x.double() @ torch.from_numpy(w).double().T
    slack = FP32_SLACK * (k // 32 + 2) * (x.double().abs() @ torch.from_numpy(w).double().abs().T)
    for isa in isas():
        err = (qgemm.linear(x, packed, isa=isa).double() - exact).abs()
        assert (err <= slack).all(), f"{isa}: {(err / slack).max().item():.2f}x the fp32 slack"


@pytest.mark.parametrize("isa", isas())
def test_bfloat16_in_and_out(isa):
    n, k = 40, 512
    raw = random_blocks("q4_1", n, k, seed=11)
    packed = qpack.pack_gguf(raw, "Q4_1", n, k)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = qgemm.linear(x, packed, isa=isa)
    assert y.dtype == torch.bfloat16
    # Same bits as the fp32 product of the same (bf16-valued) input, rounded once.
    assert torch.equal(y, qgemm.linear(x.float(), packed, isa=isa).to(torch.bfloat16))
    assert torch.equal(y, qgemm.linear(x, packed, isa="portable"))


def test_quantized_activations_match_llama_cpp_q8_0():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 96, generator=gen)
    x[1, 32:64] = 0.0  # an all-zero block: scale 0, codes 0
    w = qpack.pack_int8(torch.randn(16, 96, generator=gen))
    blocks = x.view(3, 3, 32)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)  # ties to even, as the kernels
    for isa in isas():
        act = qgemm.quantize_activations(x, w, isa=isa)
        assert torch.equal(act.d.view(3, 3), d)
        assert torch.equal(act.q.view(3, 3, 32), q)
        assert torch.equal(act.sum16.view(3, 3, 2), q.view(3, 3, 2, 16).int().sum(-1))
        assert torch.equal(act.dsum.view(3, 3), d * q.float().sum(-1))


def test_shared_activations_into_column_slices():
    """q/k/v of one layer, each in its own format, from one quantization into
    one output: the same bits as three separate products."""
    k = 512
    parts = [("q4_k", 48), ("q6_k", 16), ("q8_0", 17)]
    weights = [qpack.pack_gguf(random_blocks(f, n, k, seed=i), GGUF_TYPES[f], n, k)
               for i, (f, n) in enumerate(parts)]
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1))
    for isa in isas():
        out = torch.full((5, sum(n for _, n in parts)), float("nan"))
        act = qgemm.quantize_activations(x, weights[0], isa=isa)
        start = 0
        for w in weights:
            qgemm.gemm_into(act, w, out[:, start:start + w.n], isa=isa)
            start += w.n
        expected = torch.cat([qgemm.linear(x, w, isa=isa) for w in weights], dim=1)
        assert torch.equal(out, expected)


@pytest.mark.parametrize("n,k", [(50, 100), (16, 64), (3, 33)])
def test_int8_per_channel(n, k):
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)
    packed = qpack.pack_int8(w)
    assert packed.in_features == k and packed.k % 32 == 0
    deq = qgemm.dequantize(packed)
    scale = w.abs().amax(1, keepdim=True) / 127
    assert ((deq - w).abs() <= scale / 2 * (1 + 1e-5)).all()
    x = torch.randn(4, k, generator=gen)
    exact = x.double() @ deq.double().T
    bound = error_bound(torch.nn.functional.pad(x, (0, packed.k - k)),
                        torch.nn.functional.pad(deq, (0, packed.k - k)).numpy())
    results = {isa: qgemm.linear(x, packed, isa=isa) for isa in isas()}
    for isa, y in results.items():
        assert ((y.double() - exact).abs() <= bound).all(), isa
        assert torch.equal(y, results["portable"]), isa


def test_leading_dims_and_refusals():
    packed = qpack.pack_gguf(random_blocks("q4_0", 16, 256, seed=0), "Q4_0", 16, 256)
    x = torch.randn(2, 3, 256)
    assert torch.equal(qgemm.linear(x, packed), qgemm.linear(x.view(6, 256), packed).view(2, 3, 16))
    with pytest.raises(ValueError, match="input has 255 features, the weight 256"):
        qgemm.linear(torch.randn(2, 255), packed)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        qgemm.linear(x.half(), packed)
    with pytest.raises(ValueError, match="isa='sse9'"):
        qgemm.linear(x, packed, isa="sse9")
    with pytest.raises(ValueError, match="not a whole number of blocks"):
        qpack.decompose_gguf(np.zeros((1, 18), np.uint8), "q4_0", 1, 48)


def test_isa_env_pins_the_default(monkeypatch):
    monkeypatch.delenv(qgemm.ISA_ENV, raising=False)
    qgemm._default_isa.cache_clear()
    try:
        assert qgemm.default_isa() == qgemm.available_isas()[-1]
        monkeypatch.setenv(qgemm.ISA_ENV, "portable")
        qgemm._default_isa.cache_clear()
        assert qgemm.default_isa() == "portable"
        monkeypatch.setenv(qgemm.ISA_ENV, "nonsense")
        qgemm._default_isa.cache_clear()
        with pytest.raises(ValueError, match="isa='nonsense'"):
            qgemm.default_isa()
    finally:
        monkeypatch.undo()
        qgemm._default_isa.cache_clear()


@pytest.mark.parametrize("fmt", [*GGUF_TYPES, "int8"])
def test_tensor_parallel_slices(fmt):
    """A rank's rows (whole tiles) or input features (whole blocks) of a packed
    weight are the same weight's rows or columns, and multiply as such."""
    n, k = 72, 512
    if fmt == "int8":
        packed = qpack.pack_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(0)))
    else:
        packed = qpack.pack_gguf(random_blocks(fmt, n, k, seed=9), GGUF_TYPES[fmt], n, k)
    full = qgemm.dequantize(packed)
    rows = qpack.slice_rows(packed, 48, 24)  # ends at the last row: a partial tile is fine
    assert torch.equal(qgemm.dequantize(rows), full[48:])
    assert torch.equal(qgemm.dequantize(qpack.slice_rows(packed, 16, 32)), full[16:48])
    cols = qpack.slice_k(packed, 256, 256)
    assert torch.equal(qgemm.dequantize(cols), full[:, 256:])
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
    assert torch.equal(qgemm.linear(x, rows), qgemm.linear(x, packed)[:, 48:])
    with pytest.raises(ValueError, match="whole tiles"):
        qpack.slice_rows(packed, 8, 16)
    with pytest.raises(ValueError, match="whole blocks"):
        qpack.slice_k(packed, 16, 32)
