"""The tensor-core int4 GEMV (`triton_ops/int4_mma.py`) on the CPU: its weight layout,
its exact PTX run by a warp-level simulator (tests/ptx_sim.py) against float64, and
its compiled sm_90 code (one MMA per word and one per block for x's sums, no shared
memory: the one-element-a-thread launch holds). The GPU test is
tests/gpu/test_quant_kernels.py -k mma."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from radixlm.layers.quantization import int4 as I
from radixlm.layers.quantization.triton_ops import int4_mma as M
from radixlm.layers.quantization.triton_ops import mma_gemv as MG

sys.path.insert(0, os.path.dirname(__file__))
from ptx_sim import run_mma_gemv  # noqa: E402


def int4_case(n: int, k: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    z = torch.randint(0, 16, (k // group, n), generator=gen).to(torch.uint8)
    s = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.005).half()
    return q, z, s


def test_layout_round_trip_and_formula() -> None:
    n, k = 48, 192
    q = torch.randint(0, 16, (k, n), generator=torch.Generator().manual_seed(0))
    words = M.mma_layout(q)
    assert words.shape == (3, 3, 32, 4) and words.dtype == torch.int32
    assert torch.equal(M.mma_unlayout(words), q.to(torch.int32))
    # The docstring's formula, word by word: nibble j + 4h of (tile, chunk, lane, b) is
    # column 16 tile + g + 8 (j % 2), feature 64 chunk + 16 t + 4 b + 2 (j // 2) + h.
    for tile, chunk, lane, b in [(0, 0, 0, 0), (2, 1, 13, 3), (1, 2, 31, 2)]:
        g, t = lane // 4, lane % 4
        word = int(words[tile, chunk, lane, b]) & 0xFFFFFFFF
        for j in range(4):
            for h in range(2):
                col = 16 * tile + g + 8 * (j % 2)
                feat = 64 * chunk + 16 * t + 4 * b + 2 * (j // 2) + h
                assert (word >> (4 * (j + 4 * h))) & 0xF == int(q[feat, col])


def simulate(x: torch.Tensor, q, z, s, group: int, cfg: M.MmaConfig,
             pdl: bool = False, pair: bool = False) -> torch.Tensor:
    """What `int4_gemv_mma` computes before its split-K sum: the PTX of every program
    (the rows PTX where x has more than one) in the simulator, operands as
    `mma_gemv_kernel` gets them; fp32 [M, N]. `pdl`: the PTX holding the PDL wait
    (the simulator refuses x or the sums touched before it). `pair`: the gate/up
    pair form, its sums in pair order (`pair_order`)."""
    k, n = q.shape
    ptx = M.gemv_ptx(cfg.nt, group // M.CHUNK, x.dtype == torch.bfloat16, cfg.prefetch,
                     rows=x.shape[0] > 1, pdl=pdl, runs=-(-x.shape[0] // 8), pair=pair)
    # A step is a group; the zero points' and scales' rows are N apart.
    return run_mma_gemv(ptx, cfg, x, M.mma_layout(q), z, s.view(torch.int16), k // group,
                        n, n, pair=pair)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,group,cfg", [
    (16, 128, 64, M.MmaConfig(1, 1, 1)),
    (48, 256, 128, M.MmaConfig(2, 1, 2)),  # a warp past the last tile idles
    (64, 384, 128, M.MmaConfig(1, 2, 2)),  # 3 groups in splits of 2 + 1
    (96, 256, 64, M.MmaConfig(4, 2, 3)),
    # the next group's loads ahead: splits of 1, 2 and 3 groups (both buffers' exits)
    (32, 384, 64, M.MmaConfig(2, 1, 3, prefetch=True)),
    (64, 512, 128, M.MmaConfig(1, 2, 2, prefetch=True)),
    (32, 384, 128, M.MmaConfig(1, 1, 1, prefetch=True)),
])
def test_ptx_against_float64(dtype, n, k, group, cfg) -> None:
    check_against_float64(1, dtype, n, k, group, cfg)


@pytest.mark.parametrize("m,n,k,group,cfg", [
    (2, 16, 128, 64, M.MmaConfig(1, 1, 1)),
    (3, 48, 256, 128, M.MmaConfig(2, 1, 2)),  # rows past M: lanes load row M - 1
    (8, 64, 384, 128, M.MmaConfig(1, 2, 2)),  # every column of B a row
    (5, 32, 384, 64, M.MmaConfig(2, 1, 3, prefetch=True)),
    (7, 64, 512, 128, M.MmaConfig(1, 2, 2, prefetch=True)),
])
def test_rows_ptx_against_float64(m, n, k, group, cfg) -> None:
    check_against_float64(m, torch.bfloat16, n, k, group, cfg)


@pytest.mark.parametrize("m,n,k,group,cfg,pdl", [
    (16, 16, 128, 64, M.MmaConfig(1, 1, 1), False),  # two full runs of 8 rows
    (11, 48, 256, 128, M.MmaConfig(2, 1, 2), False),  # the second run past M: row M - 1
    (9, 64, 384, 128, M.MmaConfig(1, 2, 2, prefetch=True), False),
    (13, 32, 384, 64, M.MmaConfig(2, 1, 3, prefetch=True), True),  # x of both runs after
])                                                                   # the wait
def test_two_runs_of_rows_ptx_against_float64(m, n, k, group, cfg, pdl) -> None:
    """9-16 rows: rows 8-15 a second B operand against the same unpacked words, with
    their own sums, x address and row predicates; the one-row and up-to-8-row PTX
    is unchanged by it."""
    check_against_float64(m, torch.bfloat16, n, k, group, cfg, pdl=pdl)


@pytest.mark.parametrize("m,n,k,group,cfg,pdl", [
    (27, 32, 256, 128, M.MmaConfig(1, 1, 2, prefetch=True), True),  # 4 runs, the last short
    (64, 16, 128, 64, M.MmaConfig(1, 1, 1), False),  # 8 full runs (MAX_ROWS)
    (41, 48, 256, 128, M.MmaConfig(2, 1, 2), True),  # 6 runs, rows past M: row M - 1
])
def test_up_to_eight_runs_of_rows_ptx_against_float64(m, n, k, group, cfg, pdl) -> None:
    """17-64 rows: up to 8 runs of 8 rows, each its own B operand, sums, x address
    and row predicates against the same unpacked words."""
    check_against_float64(m, torch.bfloat16, n, k, group, cfg, pdl=pdl)


@pytest.mark.parametrize("m,n,k,group,cfg", [
    (1, 48, 256, 128, M.MmaConfig(2, 1, 2)),  # a warp past the last tile waits too
    (1, 32, 384, 64, M.MmaConfig(2, 1, 3, prefetch=True)),
    (5, 32, 384, 64, M.MmaConfig(2, 1, 3, prefetch=True)),
])
def test_ptx_with_the_pdl_wait_inside(m, n, k, group, cfg) -> None:
    """The PTX that holds the PDL wait (the first group's weights loaded before it):
    nothing of x or the sums touched before the wait, every lane waits, same sums."""
    check_against_float64(m, torch.bfloat16, n, k, group, cfg, pdl=True)


@pytest.mark.parametrize("m,n,k,group,cfg,pdl", [
    (1, 64, 256, 128, M.MmaConfig(2, 2, 2), False),  # a warp past the last pair idles
    (1, 96, 384, 64, M.MmaConfig(1, 2, 3, prefetch=True), True),
    (1, 64, 512, 128, M.MmaConfig(2, 2, 2, prefetch=True), False),
    (5, 64, 384, 128, M.MmaConfig(1, 2, 2, prefetch=True), True),
    (8, 32, 256, 64, M.MmaConfig(1, 2, 2), False),
])
def test_pair_ptx_against_float64(m, n, k, group, cfg, pdl) -> None:
    """A merged [gate; up] weight with a warp's two tiles its gate tile and the up
    tile of the same features: every column's sum right, stored in pair order
    (gate tile p's 16 columns at 32 p, its up tile's after them)."""
    check_against_float64(m, torch.bfloat16, n, k, group, cfg, pdl=pdl, pair=True)


def test_int4_pair_form_is_picked_where_it_fits(monkeypatch):
    """`int4_mma.pairs`: bias-free gate/up with the SiLU at up to 8 rows, whole
    pairs of tiles; never under $RADIXLM_SPLIT_SUMS=launch."""
    from radixlm.layers.quantization.triton_ops import int4_mma as MM

    assert MM.pairs(1, 28672, True, None, 32) and MM.pairs(8, 64, True, None, 8)
    assert not MM.pairs(9, 28672, True, None, 32)  # two runs of rows
    assert not MM.pairs(1, 28672, False, None, 32)  # no SiLU
    assert not MM.pairs(1, 48, True, None, 8)  # 3 tiles: no whole pairs
    assert not MM.pairs(1, 64, True, torch.zeros(64), 8)
    assert not MM.pairs(1, 64, True, None, 10)  # 10 groups in 8 splits: 5 runs of 2
    monkeypatch.setenv("RADIXLM_SPLIT_SUMS", "launch")
    assert not MM.pairs(1, 28672, True, None, 32)


def pair_order(n: int) -> torch.Tensor:
    """The logical column of each pair-order column of a [gate; up] of n columns."""
    c = torch.arange(n)
    p, i, j = c // 32, (c // 16) % 2, c % 16
    return i * (n // 2) + 16 * p + j


def check_against_float64(m, dtype, n, k, group, cfg, pdl: bool = False,
                          pair: bool = False) -> None:
    q, z, s = int4_case(n, k, group, seed=n + k)
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 0.5).to(dtype)
    got = simulate(x, q, z, s, group, cfg, pdl, pair)
    if pair:
        got = torch.empty_like(got).index_copy_(1, pair_order(n), got)
    scale = s.double().repeat_interleave(group, 0)  # [K, N]: each weight's scale
    w = (q.double() - z.double().repeat_interleave(group, 0)) * scale
    ref = x.double() @ w
    # Exact products summed in fp32, but of offset + q (128 + q in bf16, 1024 + q in
    # fp16), the zero point's term taken out once per group: fp32 roundings of
    # (offset + 16) |x| s, a few units of 2^-24 each.
    offset = 128 if dtype == torch.bfloat16 else 1024
    folded = (x.double().abs() @ scale) * (offset + 16)
    err = (got.double() - ref).abs()
    assert got.shape == (m, n) and not got.isnan().any(), "an output was not written"
    assert (err <= 2.0 ** -20 * folded).all(), (err / folded).max()


def test_refuses_act_order_and_odd_groups() -> None:
    assert M.takes(4096, 4096, 128, None) and M.takes(4096, 128, 128, None)
    assert not M.takes(4096, 4096, 32, None)
    assert not M.takes(4096, 4096, 128, torch.zeros(4096, dtype=torch.int32))
    assert not M.takes(4100, 4096, 128, None)


def test_layout_of_a_gptq_checkpoint() -> None:
    """From our [K / 8, N] words (GPTQ's packing) to the fragment layout and back."""
    q, _, _ = int4_case(32, 128, 64, seed=5)
    packed = I.pack_rows(q)
    assert torch.equal(M.mma_unlayout(M.mma_layout(I.unpack_rows(packed))), q)


def test_sm90_code_one_mma_a_word_no_shared_memory() -> None:
    """Compiled for sm_90 here: the group loop holds one HMMA per word and thread
    (per run of 8 rows), and one per block of 16 features for x's sums (so Triton
    gave each thread exactly one element: two would run the PTX twice), and no
    shared memory, barrier or spill: up to PREFETCH_RUNS runs with the prefetching
    loop, MAX_RUNS without (`mma_gemv.row_runs`' rule)."""
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from sass import mma_gemv_loop, opcode_counts

    for nt, chunks, warps, prefetch, rows, runs, pair in [
            (1, 2, 4, False, False, 1, False), (2, 1, 2, False, False, 1, False),
            (1, 2, 4, True, False, 1, False), (1, 2, 4, True, True, 1, False),
            (1, 2, 4, True, True, 2, False), (2, 1, 4, False, True, 2, False),
            (1, 2, 4, True, True, MG.PREFETCH_RUNS, False),
            (1, 2, 4, False, True, MG.MAX_RUNS, False),
            (2, 2, 4, True, False, 1, True), (2, 2, 4, True, True, 1, True)]:  # gate/up pairs
        ptx = M.gemv_ptx(nt, chunks, True, prefetch, rows, runs=runs, pair=pair)
        loop = mma_gemv_loop(ptx, warps)
        ops = opcode_counts(loop)
        groups = 2 if prefetch else 1  # the prefetching loop is unrolled twice
        # One MMA a word for each run of 8 rows, + each run's x sums (all-ones A).
        assert ops["HMMA"] == groups * runs * (nt + 1) * chunks * 4, ops
        assert ops["LDS"] == ops["STS"] == ops["BAR"] == 0, ops
        assert ops["LDL"] == ops["STL"] == 0, ops  # no register spills


def test_the_variables_are_named_at_start_up_and_cost_the_cpu_nothing(monkeypatch) -> None:
    """Unset, $RADIXLM_INT4_GEMV / $RADIXLM_FP8_GEMV leave the GEMVs on the tensor
    cores (int4 from the weights held in fragment order, FP8 reading the weight
    where it lies) and the start-up line says so; "fma" opts out, FP8's "mma"
    takes a second copy, and each is named there. Off CUDA nothing changes (a
    layer built on the CPU keeps FP8's `mma` None and int4's qweight in GPTQ
    form); a value that is not a mode is refused by name."""
    from quant_checkpoints import tiny_llama

    from radixlm.layers.linear import MergedColumnParallelLinear
    from radixlm.layers.quantization import get_quantization_config

    def describe(method: str) -> str:
        return get_quantization_config(tiny_llama(), method).describe()

    for var in ("RADIXLM_INT4_GEMV", "RADIXLM_FP8_GEMV"):
        monkeypatch.delenv(var, raising=False)
    assert "1-128 rows on the tensor cores" in describe("awq")
    assert "on the tensor cores, reading the per-row-scaled weights" in describe("fp8")
    layer = MergedColumnParallelLinear(256, [128, 128], params_dtype=torch.bfloat16,
                                       quant_config=get_quantization_config(tiny_llama(),
                                                                            "fp8"))
    layer.weight.weight_loader(layer.weight, torch.randn(256, 256) * 0.05)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.fp8.mma is None
    layer = MergedColumnParallelLinear(256, [128, 128], params_dtype=torch.float16,
                                       quant_config=get_quantization_config(tiny_llama(),
                                                                            "awq"))
    assert layer.qweight.shape == (32, 256) and not layer.quant_method.fragment
    monkeypatch.setenv("RADIXLM_FP8_GEMV", "mma")
    assert "$RADIXLM_FP8_GEMV=mma: a second copy" in describe("fp8")
    for var, method in (("RADIXLM_FP8_GEMV", "fp8"), ("RADIXLM_INT4_GEMV", "awq")):
        monkeypatch.setenv(var, "fma")
        assert f"${var}=fma" in describe(method) and "tensor cores" not in describe(method)
        monkeypatch.setenv(var, "fast")  # not a mode: refused by name
        with pytest.raises(ValueError, match=f"{var}='fast'"):
            describe(method)
