"""The tensor-core FP8 GEMV (`triton_ops/fp8_mma.py`) on the CPU: its weight layout,
its exact PTX run by the warp-level simulator (tests/ptx_sim.py) against float64,
and its compiled sm_90 code. The GPU test is tests/gpu/test_quant_kernels.py -k
fp8_gemv_mma."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from radixlm.layers.quantization.triton_ops import fp8_mma as M
from radixlm.layers.quantization.triton_ops import mma_gemv as MG

sys.path.insert(0, os.path.dirname(__file__))
from ptx_sim import run_mma_gemv  # noqa: E402


def e4m3_weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Normals of both signs over the whole range, subnormals (|w| < 2^-6) and zeros."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 60
    tiny = torch.rand(n, k, generator=gen) < 0.05
    w = torch.where(tiny, torch.randn(n, k, generator=gen) * 2.0 ** -8, w)
    return w.clamp(-448, 448).to(torch.float8_e4m3fn)


def test_layout_round_trip_and_formula() -> None:
    w = e4m3_weight(32, 128, seed=0)
    words = M.mma_layout(w)
    assert words.shape == (2, 2, 32, 8) and words.dtype == torch.int32
    assert torch.equal(M.mma_unlayout(words).view(torch.uint8), w.view(torch.uint8))
    raw = w.view(torch.uint8)
    for tile, chunk, lane, b in [(0, 0, 0, 0), (1, 1, 13, 3), (1, 0, 31, 2)]:
        g, t = lane // 4, lane % 4
        for part in range(2):
            word = int(words[tile, chunk, lane, 2 * b + part]) & 0xFFFFFFFF
            for h in range(2):
                feat = 64 * chunk + 16 * t + 4 * b + 2 * part + h
                assert (word >> (8 * (2 * h + 1))) & 0xFF == int(raw[16 * tile + g, feat])
                assert (word >> (8 * (2 * h))) & 0xFF == int(raw[16 * tile + g + 8, feat])


def simulate(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, cfg: M.MmaConfig,
             pdl: bool = False):
    """The PTX of every program (the rows PTX where x has more than one) in the
    simulator, operands as `mma_gemv_kernel` gets them; the split-K partial sums
    added: fp32 [M, N]. `pdl`: the PTX holding the PDL wait (the simulator refuses
    x or the sums touched before it)."""
    k = w.shape[1]
    ptx = M.gemv_ptx(cfg.nt, cfg.prefetch, rows=x.shape[0] > 1, pdl=pdl,
                     runs=-(-x.shape[0] // 8))
    return run_mma_gemv(ptx, cfg, x, M.mma_layout(w), s, s, k // (M.STEP_CHUNKS * M.CHUNK))


@pytest.mark.parametrize("n,k,cfg", [
    (16, 128, M.MmaConfig(1, 1, 1)),
    (48, 256, M.MmaConfig(2, 1, 2)),  # a warp past the last tile idles
    (64, 384, M.MmaConfig(1, 2, 2)),  # 3 steps in splits of 2 + 1
    (32, 640, M.MmaConfig(2, 1, 2, prefetch=True)),  # splits of 3 and 2 steps
    (32, 256, M.MmaConfig(1, 2, 1, prefetch=True)),
])
def test_ptx_against_float64(n, k, cfg) -> None:
    check_against_float64(1, n, k, cfg)


@pytest.mark.parametrize("m,n,k,cfg", [
    (2, 16, 128, M.MmaConfig(1, 1, 1)),
    (3, 48, 256, M.MmaConfig(2, 1, 2)),  # rows past M: lanes load row M - 1
    (8, 64, 384, M.MmaConfig(1, 2, 2)),  # every column of B a row
    (5, 32, 640, M.MmaConfig(2, 1, 2, prefetch=True)),
])
def test_rows_ptx_against_float64(m, n, k, cfg) -> None:
    check_against_float64(m, n, k, cfg)


@pytest.mark.parametrize("m,n,k,cfg,pdl,pad", [
    (16, 16, 128, M.MmaConfig(1, 1, 1), False, None),  # two full runs of 8 rows
    (27, 32, 640, M.MmaConfig(2, 1, 2, prefetch=True), True, None),  # 4 runs, the last short
    (64, 16, 256, M.MmaConfig(1, 1, 1), False, 16),  # 8 full runs (MAX_ROWS), plain
    (41, 48, 256, M.MmaConfig(2, 1, 2), True, 0),  # 6 runs, rows past M: row M - 1, plain
])
def test_runs_of_rows_ptx_against_float64(m, n, k, cfg, pdl, pad) -> None:
    """9-64 rows: up to 8 runs of 8 rows, each its own B operand, sums, x address
    and row predicates against the same unpacked words (stored or plain); the
    PTX of 1-8 rows is unchanged by it."""
    check_against_float64(m, n, k, cfg, pdl, pad=pad)


@pytest.mark.parametrize("m,n,k,cfg", [
    (1, 48, 256, M.MmaConfig(2, 1, 2)),  # a warp past the last tile waits too
    (1, 32, 640, M.MmaConfig(2, 1, 2, prefetch=True)),
    (3, 32, 640, M.MmaConfig(2, 1, 2, prefetch=True)),
])
def test_ptx_with_the_pdl_wait_inside(m, n, k, cfg) -> None:
    """The PTX that holds the PDL wait (the first step's words loaded before it):
    nothing of x or the sums touched before the wait, every lane waits, same sums."""
    check_against_float64(m, n, k, cfg, pdl=True)


@pytest.mark.parametrize("m,n,k,cfg,pad", [
    (1, 16, 128, M.MmaConfig(1, 1, 1), 0),
    (1, 48, 256, M.MmaConfig(2, 1, 2), 16),  # an idle warp; rows 16 bytes apart more
    (1, 64, 384, M.MmaConfig(1, 2, 2), 0),  # two tiles a warp: wa1 / wb1
    (1, 32, 640, M.MmaConfig(2, 1, 2, prefetch=True), 144),
    (5, 32, 640, M.MmaConfig(2, 1, 2, prefetch=True), 16),
    (3, 64, 256, M.MmaConfig(2, 2, 1, prefetch=True), 0),
])
@pytest.mark.parametrize("pdl", [False, True])
def test_plain_layout_ptx_against_float64(m, n, k, cfg, pad, pdl) -> None:
    """`gemv_ptx(plain=True)`: the weight read where it lies, [N, K] codes in rows
    of K + pad bytes (an online weight keeps its scale after its codes), the
    fragment words made by `prmt`; the same sums as the stored words give."""
    check_against_float64(m, n, k, cfg, pdl, pad=pad)


def check_against_float64(m, n, k, cfg, pdl: bool = False, pad: int | None = None) -> None:
    w = e4m3_weight(n, k, seed=n + k)
    s = torch.rand(n, generator=torch.Generator().manual_seed(1)) * 0.01 + 0.001
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 0.5).bfloat16()
    if pad is None:
        got = simulate(x, w, s, cfg, pdl)
    else:
        rows = torch.full((n, k + pad), 0x7F, dtype=torch.uint8)  # NaN codes past K
        rows[:, :k] = w.view(torch.uint8)
        ptx = M.gemv_ptx(cfg.nt, cfg.prefetch, m > 1, pdl, plain=True, runs=-(-m // 8))
        got = run_mma_gemv(ptx, cfg, x, rows, s, s, k // (M.STEP_CHUNKS * M.CHUNK), k + pad,
                           grid_shape=(n // 16, k // M.CHUNK))
        assert torch.equal(got, simulate(x, w, s, cfg, pdl)), "plain and stored words differ"
    wd = w.double() * s.double()[:, None]
    ref = x.double() @ wd.T
    mag = x.double().abs() @ wd.abs().T
    # exact products summed in fp32 (the device may flush products below 2^-126:
    # the weights are read as 2^-120 times their values, see the module docstring)
    err = (got.double() - ref).abs()
    assert got.shape == (m, n) and not got.isnan().any(), "an output was not written"
    assert (err <= 2.0 ** -20 * mag).all(), (err / mag).max()


@pytest.mark.parametrize("m,n,k,cfg,scale_rows,pad,pdl", [
    (1, 32, 384, M.MmaConfig(2, 1, 2), 16, None, False),  # a block a tile, 3 steps in 2 + 1
    (5, 64, 640, M.MmaConfig(2, 1, 2, prefetch=True), 32, 16, True),  # plain, prefetching
    (13, 64, 256, M.MmaConfig(1, 2, 1, prefetch=True), 16, None, False),  # 2 tiles, 2 runs
    (1, 256, 256, M.MmaConfig(2, 1, 1), 128, 0, True),  # DeepSeek's 128 x 128 blocks
])
def test_block_scales_ptx_against_float64(m, n, k, cfg, scale_rows, pad, pdl) -> None:
    """Block scales (`block_shift`): each step's sums scaled by the scale of its
    block of 128 features and 2^block_shift rows, as the float64 product of the
    block-scaled weight; stored words and the weight where it lies alike."""
    w = e4m3_weight(n, k, seed=n + k + scale_rows)
    blocks = torch.rand(n // scale_rows, k // 128,
                        generator=torch.Generator().manual_seed(2)) * 0.01 + 0.001
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 0.5).bfloat16()
    shift = M.block_shift(128, scale_rows)
    steps = k // (M.STEP_CHUNKS * M.CHUNK)
    runs = -(-m // 8)
    ptx = M.gemv_ptx(cfg.nt, cfg.prefetch, m > 1, pdl, runs=runs, block_shift=shift)
    got = run_mma_gemv(ptx, cfg, x, M.mma_layout(w), blocks, blocks, steps, 0, k // 128)
    if pad is not None:
        rows = torch.full((n, k + pad), 0x7F, dtype=torch.uint8)  # NaN codes past K
        rows[:, :k] = w.view(torch.uint8)
        ptx = M.gemv_ptx(cfg.nt, cfg.prefetch, m > 1, pdl, plain=True, runs=runs,
                         block_shift=shift)
        plain = run_mma_gemv(ptx, cfg, x, rows, blocks, blocks, steps, k + pad, k // 128,
                             grid_shape=(n // 16, k // M.CHUNK))
        assert torch.equal(plain, got), "plain and stored words differ"
    scale = blocks.double().repeat_interleave(scale_rows, 0).repeat_interleave(128, 1)
    wd = w.double() * scale
    ref = x.double() @ wd.T
    mag = x.double().abs() @ wd.abs().T
    err = (got.double() - ref).abs()
    assert got.shape == (m, n) and not got.isnan().any(), "an output was not written"
    assert (err <= 2.0 ** -20 * mag).all(), (err / mag).max()
    assert M.takes(n, k, 128, torch.bfloat16, scale_rows)


def halves_order(n: int) -> torch.Tensor:
    """The merged [gate; up] row of each sums column of the halves form: a tile's
    columns 0-7 gate rows 8 tile .., its 8-15 the up rows N / 2 on."""
    col = torch.arange(n)
    tile, j = col // 16, col % 16
    return torch.where(j < 8, 8 * tile + j, n // 2 + 8 * tile + j - 8)


@pytest.mark.parametrize("m,n,k,cfg,pad", [
    (1, 32, 256, M.MmaConfig(1, 1, 1), 0),
    (1, 64, 640, M.MmaConfig(2, 1, 2, prefetch=True), 16),  # rows 16 bytes apart more
    (1, 48, 256, M.MmaConfig(2, 1, 2), 0),  # 3 tiles: a warp past the last idles
    (5, 32, 384, M.MmaConfig(2, 1, 2, prefetch=True), 144),
    (11, 64, 256, M.MmaConfig(1, 1, 2), 0),  # 2 runs of rows
])
@pytest.mark.parametrize("pdl", [False, True])
def test_halves_ptx_against_float64(m, n, k, cfg, pad, pdl) -> None:
    """`gemv_ptx(halves=True)`: a merged [gate; up] read where it lies with a tile's
    rows 0-7 gate rows and 8-15 their up rows (N / 2 on), scales alike: every
    sums column the float64 product of its row, and the same bits as the plain
    PTX gives that row."""
    w = e4m3_weight(n, k, seed=n + k)
    s = torch.rand(n, generator=torch.Generator().manual_seed(1)) * 0.01 + 0.001
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 0.5).bfloat16()
    rows = torch.full((n, k + pad), 0x7F, dtype=torch.uint8)  # NaN codes past K
    rows[:, :k] = w.view(torch.uint8)
    steps, grid = k // (M.STEP_CHUNKS * M.CHUNK), (n // 16, k // M.CHUNK)
    runs = -(-m // 8)
    ptx = M.gemv_ptx(cfg.nt, cfg.prefetch, m > 1, pdl, plain=True, runs=runs, halves=True)
    got = run_mma_gemv(ptx, cfg, x, rows, s, s, steps, k + pad, grid_shape=grid)
    order = halves_order(n)
    ptx = M.gemv_ptx(cfg.nt, cfg.prefetch, m > 1, pdl, plain=True, runs=runs)
    plain = run_mma_gemv(ptx, cfg, x, rows, s, s, steps, k + pad, grid_shape=grid)
    assert torch.equal(got, plain[:, order]), "halves and plain sums differ"
    wd = w.double()[order] * s.double()[order, None]
    err = (got.double() - x.double() @ wd.T).abs()
    assert not got.isnan().any(), "an output was not written"
    assert (err <= 2.0 ** -20 * (x.double().abs() @ wd.abs().T)).all()


def test_halves_form_is_picked_where_it_fits(monkeypatch) -> None:
    """`fp8_mma.halves`: a bias-free gate/up with its SiLU, per-row scales, K split
    into a power of two of runs; never under $RADIXLM_SPLIT_SUMS=launch."""
    assert M.halves(28672, 32, True, None, 0) and M.halves(64, 2, True, None, 0)
    assert not M.halves(28672, 32, False, None, 0)  # no SiLU
    assert not M.halves(64, 2, True, torch.zeros(64), 0)
    assert not M.halves(28672, 32, True, None, 128)  # block scales
    assert not M.halves(64, 10, True, None, 0)  # 10 steps in 8 splits: 5 runs of 2
    monkeypatch.setenv("RADIXLM_SPLIT_SUMS", "launch")
    assert not M.halves(28672, 32, True, None, 0)


def test_takes_only_what_it_can() -> None:
    assert M.takes(4096, 4096, 0, torch.bfloat16)
    assert M.takes(4096, 4096, 128, torch.bfloat16, 128)  # 128 x 128 block scales
    assert not M.takes(4096, 4096, 128, torch.bfloat16, 8)  # a tile across blocks
    assert not M.takes(4096, 4096, 128, torch.bfloat16, 48)  # not a power of two
    assert not M.takes(4096, 4096, 64, torch.bfloat16, 128)  # a step across blocks
    assert not M.takes(4096, 4096, 0, torch.float16)
    assert not M.takes(4104, 4096, 0, torch.bfloat16)
    assert not M.takes(4096, 4160, 0, torch.bfloat16)


def test_sm90_code_one_mma_per_two_words_no_shared_memory() -> None:
    pytest.importorskip("triton")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    from sass import mma_gemv_loop, opcode_counts

    block, halves = {"block_shift": 7}, {"plain": True, "halves": True}
    for nt, warps, prefetch, rows, runs, form in [
            (1, 4, False, False, 1, {}), (2, 2, False, False, 1, {}), (1, 4, True, False, 1, {}),
            (1, 4, True, True, 1, {}), (1, 4, True, True, MG.PREFETCH_RUNS, {}),
            (1, 4, False, True, MG.MAX_RUNS, {}),  # `row_runs`' rule: no spill
            (1, 4, True, False, 1, block), (1, 4, True, True, MG.PREFETCH_RUNS, block),
            (1, 4, False, True, MG.MAX_RUNS, block),  # block scales too
            (1, 4, True, False, 1, halves), (1, 4, True, True, MG.PREFETCH_RUNS, halves)]:
        ptx = M.gemv_ptx(nt, prefetch, rows, runs=runs, **form)
        ops = opcode_counts(mma_gemv_loop(ptx, warps))
        steps = 2 if prefetch else 1  # the prefetching loop is unrolled twice
        assert ops["HMMA"] == steps * runs * nt * M.STEP_CHUNKS * 4, ops
        assert ops["LDS"] == ops["STS"] == ops["BAR"] == 0, ops
        assert ops["LDL"] == ops["STL"] == 0, ops  # no register spills
