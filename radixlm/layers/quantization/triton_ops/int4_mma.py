"""The int4 GEMV of 1-128 rows on the tensor cores (the CUDA default): the weights
in the fragment order of `mma.m16n8k16`, so that each 32-bit word a lane loads
is, after three shifts and four LOP3, exactly its A operand for one MMA.

Why: the CUDA-core GEMV (`int4.py`, packed halves) spends ~19 instructions on a
word of 8 weights (unpack, zero, 4 packed multiply-adds, widening to fp32 and
scaling), and at ~3 instructions a weight it issues, not reads, at its limit.
Here a word costs 3 shifts, 4 LOP3 (the nibble pairs OR-ed into the bits of
128.0 in bf16, 1024.0 in fp16: offset + q, exact) and one MMA: the products are
exact and summed in fp32 (the packed halves round every product to bf16). The
zero point is not subtracted per weight: s sum (q - z) x = s sum (offset + q) x -
s (offset + z) sum x, and sum x over a group comes from one more MMA per 16
features with an all-ones A, shared by every column tile. sm_90 SASS of the
group loop: 1.5-1.8 instructions a weight (3.8 for the packed halves;
`benchmarks/int4_gemv_sass.py`). The price of the fold: the fp32 sums carry
(offset + q) x, so their rounding is that of ~(offset + 16) |x| s, not |q - z|
|x| s (tests/test_int4_mma.py bounds it).

The product is y^T = W x^T as an MMA with the weights as A (16 output columns
by 16 features) and x as B (16 features by 8 columns, every column the same x,
so every column of D is the same y): lane (g, t) = (lane / 4, lane % 4) holds A's
rows g and g + 8 at features 2t, 2t + 1, 2t + 8, 2t + 9, and D's rows g and g + 8.
The features of a 64-feature chunk are permuted so that a lane's x is 16
contiguous features (two 16-byte loads): MMA block b's feature kappa of lane t
is chunk feature 16 t + 4 b + 2 (kappa >= 8) + kappa % 2. Any permutation of
the features applied to both operands leaves the sum unchanged.

Word layout (`mma_layout`): int32 [N / 16, K / 64, 32, 4], word (tile, chunk,
lane, b) holds for pair j = 0..3 (A register j) the weights of output column
16 tile + g + 8 (j % 2) at chunk features 16 t + 4 b + 2 (j // 2) + {0, 1} in
nibbles j and j + 4. A warp reads a tile's chunk as 512 contiguous bytes.

Each warp owns NT column tiles and walks its program's groups (the K split is in
whole groups): per group it loads every chunk's words and x, then the zero
points and scales of its columns, runs the MMAs into fresh fp32 accumulators
(x's sum in its own) and adds s D - s (offset + z) sum x to its sums. Lanes t
= 0 write fp32 partial sums [split, N]; the second launch of the CUDA-core path
(`_int4_split_sum_kernel`) adds them, the bias and the SiLU-and-mul. The whole
loop is PTX inside one Triton program of one element a thread (the lane and
warp come from %tid.x, so nothing depends on how Triton lays a tensor out);
Triton launches it and handles PDL. Groups must be whole chunks of 64 (64 or
128 features); act-order and other shapes take the CUDA-core path.

Up to 8 rows of x (`_PtxGroup`'s `rows`) take B's 8 columns, one row each; the
one-row code above is kept as it was measured (an H100 call of 2026-12-05:
AWQ single stream 2.23x bf16 with it, 2.00x on the CUDA-core GEMV). 9-64 rows
take up to 8 runs of 8, each its own B operand against the same unpacked words
(`gemv_ptx`'s `runs`; the PTX of 1-8 rows is text for text what it was);
above 4 runs the loop does not prefetch (its registers would spill). On an
H100 the GEMV beat every GEMM over these words at 16-64 rows at all four
Llama-8B shapes (BENCHMARKS.md). 65-128 rows take a launch per 64
(`int4_gemv_mma_rows`): at 80-128 rows that beat the folded GEMM over these
words on all four shapes (AWQ offline decode with 96 prompts 1.35x, 128
prompts 1.10x). Above 128 rows the words are dequantized whole for cuBLAS
(`int4_gemm_mma`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from radixlm.layers import pdl, split_sums
from radixlm.layers.norm_fold import FoldedNorm, NormTarget
from radixlm.layers.quantization.triton_ops import int4 as _int4
from radixlm.layers.quantization.triton_ops.mma_gemv import (
    CHUNK,
    MAX_ROWS,
    MmaConfig,
    check_rows,
    cta_fits,
    folds_out,
    lane_lines,
    later_run_declarations,
    later_run_lines,
    launch,
    loop_ptx,
    output,
    pick_config,
    regs,
    row_runs,
    rows_fit,
    run_suffixes,
    x_advance_lines,
    x_load_lines,
    x_row_lines,
    y_row_lines,
)
from radixlm.layers.split_sums import SplitSums

GROUPS = (64, 128)  # group sizes the kernel takes (whole chunks, <= 2 chunks unrolled)
GEMV_ROWS = 2 * MAX_ROWS  # rows `int4.int4_linear` gives the GEMV, MAX_ROWS a launch


# ---- the layout (torch, any device) --------------------------------------------------
def mma_layout(q: torch.Tensor) -> torch.Tensor:
    """int4 values q [K, N] (0..15, any integer dtype) -> the fragment-order words
    int32 [N / 16, K / 64, 32, 4] (module docstring)."""
    k, n = q.shape
    assert n % 16 == 0 and k % CHUNK == 0, (n, k)
    v = q.t().to(torch.int64).reshape(n // 16, 2, 8, k // CHUNK, 4, 4, 2, 2)
    # dims: tile, j % 2, g, chunk, t, b, j // 2, h  ->  tile, chunk, g, t, b, h, j // 2, j % 2
    v = v.permute(0, 3, 2, 4, 5, 7, 6, 1).reshape(n // 16, k // CHUNK, 32, 4, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    words = (v << shifts).sum(-1)  # nibble h * 4 + (j // 2) * 2 + j % 2 = j + 4 h
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def mma_unlayout(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `mma_layout`: int32 q [K, N]."""
    tiles, chunks = words.shape[:2]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    v = (words[..., None] >> shifts) & 0xF  # tile, chunk, lane, b, nibble
    v = v.reshape(tiles, chunks, 8, 4, 4, 2, 2, 2).permute(0, 7, 2, 1, 3, 4, 6, 5)
    return v.reshape(tiles * 16, chunks * CHUNK).t().contiguous()


def takes(n: int, k: int, group: int, g_idx: torch.Tensor | None) -> bool:
    """Whether the MMA GEMV takes this layer: whole tiles of 16 columns, a group of
    64 or 128 features (or one per column when K is 64 or 128), no act-order."""
    return g_idx is None and group in GROUPS and n % 16 == 0 and k % group == 0


# ---- the PTX --------------------------------------------------------------------------
@functools.cache
def gemv_ptx(nt: int, chunks: int, bf16: bool, prefetch: bool = False,
             rows: bool = False, pdl: bool = False, runs: int = 1, pair: bool = False) -> str:
    """The PTX of one thread's work: `nt` column tiles, `chunks` chunks a group (a
    step of the loop); with `prefetch` the next group's loads are issued before
    this group's MMAs (two register buffers, the loop unrolled twice), so a warp
    keeps a group in flight while it computes. `rows`: x has up to 8 rows, one
    per column of B (`_PtxGroup`); else one row, the code of the one-row GEMV.
    `pdl`: the PDL wait inside, after the first group's weight loads (`loop_ptx`).
    `runs` (with `rows`): x has up to 8 `runs` rows, each run of 8 rows a
    B operand of its own against the same unpacked weights (`_PtxGroup`).
    `pair` (nt 2): a merged [gate; up] weight, a warp's two tiles its gate tile
    and the up tile of the same features (`_PtxGroup`).
    Operands (`mma_gemv.mma_gemv_kernel`'s): $1 x, $2 words, $3 zeros, $4 scales,
    $5 this program's partial sums; $6 its first warp index, $7 / $8 its first /
    past-last group, $9 column tiles in all, $10 chunks a row of tiles (K / 64),
    $11 N, $12 / $13 the zeros' / scales' row strides (in elements), $14 x's rows."""
    return loop_ptx(_PtxGroup(nt, chunks, bf16, rows, runs, pair), "int4_mma", "grp", "$8",
                    prefetch, pdl)


class _PtxGroup:
    """The pieces of `gemv_ptx`: per register buffer (A, B) the words `w`, x `x` and
    the raw zero points `zr` / scales `sr` of one group.

    With `rows`, B's column c is x's row c (lane g loads row min(g, M - 1); columns
    past M are never stored), so D holds a different row in each column: lane
    (g, t)'s d0 / d1 are output column g at rows 2t / 2t + 1 and d2 / d3 column
    g + 8 at the same rows, each with its own accumulator (4 a tile), and the
    all-ones MMA's e0 / e1 are rows 2t / 2t + 1's sums of x. The lanes of rows
    below M write [M, N] partial sums.

    `runs` > 1: rows 8 r .. 8 r + 7 are run r's B (x address xa{r}, lane g
    loading row min(8 r + g, M - 1)), each word unpacked once for all runs; run
    r has its own D, e and sums (registers 4 (tile runs + r) + j, e 4 r + j)
    and writes rows 8 r + 2t, 8 r + 2t + 1 (ya{r} / yb{r}). runs = 1 is the
    code above, text for text.

    `pair` (two tiles a warp): the weight is a merged [gate; up] of N columns
    and $9 is N / 32, the gate's tiles. Warp tile p (< $9) takes gate tile p and
    up tile p + $9 (the same 16 features of the up half), so that one program
    can finish silu(gate) * up (`mma_gemv.mma_gemv_cta_kernel`'s SILU_W 16). Its
    partial sums go to columns 32 p .. 32 p + 31 of the [M, N] sums, gate's
    16 then up's (the "pair order"): the stores of consecutive tiles, unchanged."""

    def __init__(self, nt: int, chunks: int, bf16: bool, rows: bool = False,
                 runs: int = 1, pair: bool = False) -> None:
        assert runs == 1 or rows
        assert not pair or nt == 2
        self.nt, self.chunks, self.t = nt, chunks, "bf16" if bf16 else "f16"
        self.rows, self.runs, self.pair = rows, runs, pair
        self.accs = 4 * nt * runs if rows else 2 * nt
        self.magic = "0x43004300" if bf16 else "0x64006400"  # 128.0 / 1024.0, both halves
        self.offset = "0f43000000" if bf16 else "0f44800000"  # the same, one fp32
        self.one = "0x3F803F80" if bf16 else "0x3C003C00"  # 1.0 in both halves

    def declarations(self, bufs: tuple[str, ...]) -> list[str]:
        nt, chunks = self.nt, self.chunks
        out = [".reg .pred skip, more, writer, row0, row1;" if self.rows else
               ".reg .pred skip, more, writer;",
               ".reg .b32 tid, lane, warp, g, t, tile, grp, tmp, q0, q1, q2, q3, ones;",
               f".reg .f32 {regs('s', 2 * nt)}, {regs('sz', 2 * nt)}, zf, "
               f"{regs('e', 4 * self.runs)};",
               f".reg .f32 {regs('acc', self.accs)}, {regs('d', 4 * nt * self.runs)};",
               f".reg .b64 {regs('wa', nt)}, xa, za, sa, zn, sn, ya, {'yb, ' * self.rows}off;",
               *([".reg .b64 zh, sh, zq, sq;"] if self.pair else []),
               *later_run_declarations(self.runs)]
        for b in bufs:
            out += [f".reg .b32 {regs(f'w{b}', nt * chunks * 4)};",
                    f".reg .b32 {regs(f'x{b}', chunks * 8 * self.runs)}, "
                    f"{regs(f'zr{b}', 2 * nt)};",
                    f".reg .b16 {regs(f'sr{b}', 2 * nt)};"]
        return out

    def setup(self) -> list[str]:
        """Lane and warp; this warp's tile (past the last: straight to the end); the
        addresses of its first group's words, x, zero points and scales and of its
        partial sums; the sums zeroed."""
        nt, chunks = self.nt, self.chunks
        # pair: warp tile p is gate tile p; its up tile is $9 tiles on (words,
        # zero points and scales), its sums at column 32 p (pair order)
        nxt = ["mul.lo.u32 q0, $9, $10;", "mul.wide.u32 off, q0, 512;"] if self.pair else \
            ["mul.wide.u32 off, $10, 512;"]  # the next tile's stream: K / 64 chunks on
        up_cols = ["mul.wide.u32 zh, $9, 16;", "mul.wide.u32 sh, $9, 32;",
                   "mad.lo.u32 tmp, tile, 32, g;"] if self.pair else []
        return [
            *lane_lines(1 if self.pair else nt, "$6", "$9", "L_int4_mma_done"),
            # words: ((tile * chunks_per_row + grp * chunks) * 32 + lane) * 16 bytes
            f"mul.lo.u32 tmp, $7, {chunks};",
            "mad.lo.u32 tmp, tile, $10, tmp;",
            "mad.lo.u32 tmp, tmp, 32, lane;",
            "mul.wide.u32 off, tmp, 16;",
            "add.u64 wa0, $2, off;",
            *nxt,
            *[f"add.u64 wa{i}, wa{i - 1}, off;" for i in range(1, nt)],
            # x: (grp * chunks * 64 + 16 t) * 2 bytes (rows: + min(g, M - 1) * K)
            f"mul.lo.u32 tmp, $7, {chunks * CHUNK};",
            "mad.lo.u32 tmp, t, 16, tmp;",
            *x_row_lines(self.rows),
            "mul.wide.u32 off, tmp, 2;",
            "add.u64 xa, $1, off;",
            # zero points (u8) and scales (fp16) of column tile * 16 + g at group grp
            "mad.lo.u32 tmp, tile, 16, g;",
            "mad.lo.u32 q0, $7, $12, tmp;",
            "cvt.u64.u32 off, q0;",
            "add.u64 za, $3, off;",
            "mad.lo.u32 q0, $7, $13, tmp;",
            "mul.wide.u32 off, q0, 2;",
            "add.u64 sa, $4, off;",
            *up_cols,
            # partial sums of column tile * 16 + g (4 bytes each; rows: at row 2t)
            "mul.wide.u32 off, tmp, 4;",
            "add.u64 ya, $5, off;",
            *y_row_lines(self.rows),
            *later_run_lines(self.runs, self.chunks * CHUNK),
            *[f"mov.f32 acc{i}, 0f00000000;" for i in range(self.accs)],
            f"mov.b32 ones, {self.one};",
            "mov.u32 grp, $7;",
        ]

    def loads(self, b: str, ahead: bool, pred: str = "") -> list[str]:
        """Buffer b's loads of this group (`ahead`: the next one): the words of each
        chunk and tile, x, then the zero points and scales of rows g and g + 8."""
        nt, chunks = self.nt, self.chunks
        skip_w, skip_x = (chunks * 512, chunks * CHUNK * 2) if ahead else (0, 0)
        out = []
        for c in range(chunks):
            for i in range(nt):
                r = (c * nt + i) * 4
                out.append(f"{pred}ld.global.nc.L1::no_allocate.v4.u32 {{w{b}{r}, w{b}{r + 1}, "
                           f"w{b}{r + 2}, w{b}{r + 3}}}, [wa{i}+{skip_w + c * 512}];")
            out += x_load_lines(b, self.runs, chunks, c, skip_x, pred)
        if ahead:
            out += ["cvt.u64.u32 off, $12;", "add.u64 zn, za, off;",
                    "mul.wide.u32 off, $13, 2;", "add.u64 sn, sa, off;"]
        zbase, sbase = ("zn", "sn") if ahead else ("za", "sa")
        for i in range(nt):
            if self.pair and i == 1:  # the up tile's columns, N / 2 on
                out += [f"add.u64 zq, {zbase}, zh;", f"add.u64 sq, {sbase}, sh;"]
                zbase, sbase = "zq", "sq"
            for half in range(2):
                col = (0 if self.pair else 16 * i) + 8 * half
                r = 2 * i + half
                out += [f"{pred}ld.global.u8 zr{b}{r}, [{zbase}+{col}];",
                        f"{pred}ld.global.b16 sr{b}{r}, [{sbase}+{2 * col}];"]
        return out

    def compute(self, b: str) -> list[str]:
        """Buffer b's group: s and -s (offset + z) per row, the MMAs (x's sums in e
        from an all-ones A), then acc += s D - s (offset + z) sum x."""
        nt, chunks, t, magic = self.nt, self.chunks, self.t, self.magic
        out = []
        for r in range(2 * nt):
            out += [f"cvt.f32.f16 s{r}, sr{b}{r};",
                    f"cvt.rn.f32.u32 zf, zr{b}{r};",
                    f"add.f32 zf, zf, {self.offset};",
                    f"mul.f32 sz{r}, s{r}, zf;",
                    f"neg.f32 sz{r}, sz{r};"]
        runs = self.runs
        out += [f"mov.f32 d{i}, 0f00000000;" for i in range(4 * nt * runs)]
        out += [f"mov.f32 e{i}, 0f00000000;" for i in range(4 * runs)]
        mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"
        for c in range(chunks):
            for k in range(4):  # MMA block k of the chunk
                xbs = [f"x{b}{(run * chunks + c) * 8 + 2 * k}, "
                       f"x{b}{(run * chunks + c) * 8 + 2 * k + 1}" for run in range(runs)]
                for i in range(nt):
                    w = f"w{b}{(c * nt + i) * 4 + k}"
                    out += [f"lop3.b32 q0, {w}, 0x000F000F, {magic}, 0xEA;",
                            f"shr.u32 tmp, {w}, 4;",
                            f"lop3.b32 q1, tmp, 0x000F000F, {magic}, 0xEA;",
                            f"shr.u32 tmp, {w}, 8;",
                            f"lop3.b32 q2, tmp, 0x000F000F, {magic}, 0xEA;",
                            f"shr.u32 tmp, {w}, 12;",
                            f"lop3.b32 q3, tmp, 0x000F000F, {magic}, 0xEA;"]
                    for run, xb in enumerate(xbs):
                        d = ", ".join(f"d{4 * (i * runs + run) + j}" for j in range(4))
                        out.append(f"{mma} {{{d}}}, {{q0, q1, q2, q3}}, {{{xb}}}, {{{d}}};")
                for run, xb in enumerate(xbs):
                    e = ", ".join(f"e{4 * run + j}" for j in range(4))
                    out.append(f"{mma} {{{e}}}, {{ones, ones, ones, ones}}, {{{xb}}}, {{{e}}};")
        if self.rows:  # acc 4i + j from d 4i + j: column g + 8 (j // 2), row 2t + j % 2
            for i in range(nt):
                for run in range(runs):
                    for j in range(4):
                        a, r = 4 * (i * runs + run) + j, 2 * i + j // 2
                        out += [f"fma.rn.f32 acc{a}, s{r}, d{a}, acc{a};",
                                f"fma.rn.f32 acc{a}, sz{r}, e{4 * run + j % 2}, acc{a};"]
            return out
        for i in range(nt):  # D rows g (d0) and g + 8 (d2)
            for half in range(2):
                r = 2 * i + half
                out += [f"fma.rn.f32 acc{r}, s{r}, d{4 * i + 2 * half}, acc{r};",
                        f"fma.rn.f32 acc{r}, sz{r}, e0, acc{r};"]
        return out

    def advance(self) -> list[str]:
        return ["add.u32 grp, grp, 1;",
                *[f"add.u64 wa{i}, wa{i}, {self.chunks * 512};" for i in range(self.nt)],
                *x_advance_lines(self.runs, self.chunks * CHUNK * 2),
                "cvt.u64.u32 off, $12;", "add.u64 za, za, off;",
                "mul.wide.u32 off, $13, 2;", "add.u64 sa, sa, off;"]

    def epilogue(self) -> list[str]:
        """Lanes t = 0 write rows g and g + 8 of each tile (every column of D is
        the same y, so any t would do); with rows, every lane writes its two rows
        of x that exist."""
        if self.rows:
            out = []
            for i in range(self.nt):
                for run, (_, ya, yb, sfx) in enumerate(run_suffixes(self.runs)):
                    for j in range(4):
                        y = ya if j % 2 == 0 else yb
                        pred = f"row{j % 2}{sfx}"
                        out.append(f"@{pred} st.global.f32 [{y}+{4 * (16 * i + 8 * (j // 2))}], "
                                   f"acc{4 * (i * self.runs + run) + j};")
            return out
        out = ["setp.eq.u32 writer, t, 0;"]
        for i in range(self.nt):
            for half in range(2):
                out.append(f"@writer st.global.f32 [ya+{4 * (16 * i + 8 * half)}], "
                           f"acc{2 * i + half};")
        return out


def int4_gemv_mma(x: torch.Tensor, words: torch.Tensor, zeros: torch.Tensor,
                  scales: torch.Tensor, group: int, bias: torch.Tensor | None = None,
                  config: MmaConfig | None = None, out: torch.Tensor | None = None,
                  silu_mul: bool = False, norm_in: FoldedNorm | None = None,
                  norm_out: NormTarget | None = None, defer_sum: bool = False
                  ) -> torch.Tensor | FoldedNorm | SplitSums:
    """x [M, K] (1 <= M <= MAX_ROWS contiguous rows, bf16 / fp16, 16-byte aligned)
    times the int4 weight in `mma_layout` `words`, [M, N] (`silu_mul`: silu(gate) *
    up, [M, N / 2]). One row runs the one-row PTX; more, the rows PTX (`_PtxGroup`,
    a run of 8 rows per B operand),
    whose split-K sums the epilogue adds per row in split order, so a row's sums
    are added in the same order whatever M is. `norm_in`, `norm_out`: a folded
    norm (`mma_gemv.launch`; x is then `norm_in.x`); `defer_sum`: the split-K
    sum left to the consumer where it takes a second launch (`launch`)."""
    m, n, k = check_rows(x, words)
    assert x.dtype in (torch.bfloat16, torch.float16)
    assert group in GROUPS and k % group == 0 and zeros.stride(1) == scales.stride(1) == 1
    runs, cfg = row_runs(m, config or pick_config(n, pair=pairs(m, n, silu_mul, bias, k // group)))
    ptx = gemv_ptx(cfg.nt, group // CHUNK, x.dtype == torch.bfloat16, cfg.prefetch, m > 1,
                   pdl.pdl_on(), runs, cfg.pair)
    # A step is a group; the zero points' and scales' rows are their strides apart.
    return launch(ptx, cfg, x, words, zeros, scales, k // group, zeros.stride(0),
                  scales.stride(0), bias, out, silu_mul, norm_in=norm_in, norm_out=norm_out,
                  defer_sum=defer_sum)


def pairs(m: int, n: int, silu_mul: bool, bias: torch.Tensor | None, steps: int) -> bool:
    """Whether a product of `steps` groups takes the pair form (`pick_config`'s
    `pair`): a bias-free [gate; up] with its SiLU, whole pairs of tiles, one run of
    up to 8 rows (more runs would hold twice the accumulators), K split into a
    power of two of runs (`cta_fits`), unless $RADIXLM_SPLIT_SUMS=launch keeps the
    second launch (`split_sums.deferred`)."""
    return (silu_mul and bias is None and n % 32 == 0 and m <= 8
            and cta_fits(pick_config(n, pair=True), steps, True) and split_sums.deferred())


def norm_fold_rows(words: torch.Tensor, group: int, output: bool) -> int:
    """The rows up to which `int4_gemv_mma` takes a folded norm in one launch: as
    its input at any, as its output (`output`) where its split-K sum is in the
    program (`mma_gemv.folds_out`)."""
    tiles, chunks_per_row = words.shape[:2]
    if output and not folds_out(16 * tiles, chunks_per_row * CHUNK // group):
        return 0
    return MAX_ROWS


def takes_rows(x: torch.Tensor, words: torch.Tensor) -> bool:
    """Whether `int4_gemv_mma` reads x as it is, in one launch."""
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and rows_fit(x) \
        and x.shape[1] == words.shape[1] * CHUNK


def int4_gemv_mma_rows(x: torch.Tensor, words: torch.Tensor, zeros: torch.Tensor,
                       scales: torch.Tensor, group: int, bias: torch.Tensor | None = None,
                       out: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor:
    """`int4_gemv_mma` over any number of rows, a launch per MAX_ROWS of them (each
    row's bits are its own, as in one launch): what `int4.int4_linear` runs up to
    GEMV_ROWS."""
    m, n = x.shape[0], 16 * words.shape[0]
    if m <= MAX_ROWS:
        return int4_gemv_mma(x, words, zeros, scales, group, bias, out=out, silu_mul=silu_mul)
    y = output(x, n // 2 if silu_mul else n, out)
    for i in range(0, m, MAX_ROWS):
        int4_gemv_mma(x[i:i + MAX_ROWS], words, zeros, scales, group, bias,
                      out=y[i:i + MAX_ROWS], silu_mul=silu_mul)
    return y


# ---- above GEMV_ROWS: the same words dequantized whole ------------------------------
def int4_gemm_mma(x: torch.Tensor, words: torch.Tensor, zeros: torch.Tensor,
                  scales: torch.Tensor, group: int, bias: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp16, rows contiguous) times the int4 weight in `mma_layout`
    `words`: [M, N]. What rows above `GEMV_ROWS` take, so that the fragment-order
    words serve every product: the weight dequantized whole
    (`int4_dequantize_mma`, the GPTQ form's bits) and cuBLAS. Up to 128 rows the
    GEMV's launches of 64 rows beat the folded GEMM over these words, which was
    taken out (H100, BENCHMARKS.md 2026-12-05 19:35); above 128 the whole
    dequantization beats the folded GEMM on the GPTQ form too (`int4.DEQUANT_ABOVE`)."""
    tiles, chunks_per_row = words.shape[:2]
    n, k = tiles * 16, chunks_per_row * CHUNK
    m = x.shape[0]
    assert x.shape == (m, k) and x.stride(1) == 1 and words.is_contiguous()
    assert group in GROUPS and k % group == 0 and zeros.stride(1) == scales.stride(1) == 1
    y = output(x, n, out)
    if m == 0:
        return y
    w = int4_dequantize_mma(words, zeros, scales, group, x.dtype)
    return _int4.dense_product(x, w, bias, y)


def int4_dequantize_mma(words: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                        group: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight (q - z) s of fragment-order `words` in `dtype`, [K, N] (x @ it is
    the layer's product), rounded once from fp32: `int4.int4_dequantize`'s."""
    tiles, chunks_per_row = words.shape[:2]
    n, k = tiles * 16, chunks_per_row * CHUNK
    w = torch.empty((k, n), device=words.device, dtype=dtype)
    bk, bn = 64, 64
    assert group % bk == 0, group  # a program's features inside one group
    _int4_frag_dequant_kernel[(triton.cdiv(n, bn), k // bk)](
        words, zeros, scales, w, n, chunks_per_row, zeros.stride(0), scales.stride(0),
        w.stride(0), BK=bk, BN=bn, GROUP=group, num_warps=4)
    return w


@triton.jit
def _int4_frag_dequant_kernel(w_ptr, z_ptr, s_ptr, out_ptr, N, CHUNKS_PER_ROW, stride_z,
                              stride_s, stride_o, BK: tl.constexpr, BN: tl.constexpr,
                              GROUP: tl.constexpr):
    """BK features (inside one group) of BN columns of fragment-order words -> (q - z)
    s in fp32, rounded once to out's dtype, at out [feature, column]. Each element
    reads its own word (a word serves 8, from L1), so the tile is laid out as it is
    stored: columns in order, no reshape, whole rows written (`mma_layout`: column
    16 tile + 8 jm + g, feature 64 chunk + 16 t + 4 b + q is word (tile, chunk, 4 g +
    t, b)'s nibble jm + 2 (q // 2) + 4 (q % 2))."""
    k0 = tl.program_id(1) * BK
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    ok = (cols < N)[None, :]
    cols_c = tl.minimum(cols, N - 1)
    f = k0 + tl.arange(0, BK)
    # word and shift are a column's part plus a feature's (int32 words: 128 a chunk)
    col_word = (cols_c // 16) * CHUNKS_PER_ROW * 128 + (cols_c % 8) * 16
    f_word = (f // 64) * 128 + ((f // 16) % 4) * 4 + (f // 4) % 4
    shift = 4 * ((cols_c // 8) % 2)[None, :] + (8 * ((f % 4) // 2) + 16 * (f % 2))[:, None]
    nib = ((tl.load(w_ptr + col_word[None, :] + f_word[:, None]) >> shift) & 0xF)
    nib = nib.to(tl.float32)
    grp = k0 // GROUP
    z = tl.load(z_ptr + grp * stride_z + cols_c).to(tl.float32)
    s = tl.load(s_ptr + grp * stride_s + cols_c).to(tl.float32)
    tl.store(out_ptr + f[:, None].to(tl.int64) * stride_o + cols[None, :],
             ((nib - z[None, :]) * s[None, :]).to(out_ptr.dtype.element_ty), mask=ok)
