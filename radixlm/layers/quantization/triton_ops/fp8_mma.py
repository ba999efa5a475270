"""The FP8 GEMV of 1-64 rows on the tensor cores (the CUDA default): the int4
MMA GEMV's scheme (`int4_mma.py`: weights in `mma.m16n8k16` fragment order, x as
B, the loop in PTX) for e4m3 weights with one fp32 scale per output row, or one
per block of 128 features by 2^block_shift rows (below).

An e4m3 byte s eeee mmm becomes a bf16 of the same value times 2^-120 by moving
bits: s to bit 15, eeee mmm to bits 10-4 (bf16's exponent bias is 127, e4m3's
7; subnormals land on bf16 subnormals of the same scaled value). Two weights
sit in bytes 1 and 3 of a word for one A register ((q >> 4) & 0x07F007F0 for
the magnitudes, q & 0x80008000 for the signs: 3 instructions) and two in
bytes 0 and 2 for the next (shifted by 8 first: 4). So a lane's 8 weights of
one MMA are 2 words and 14 instructions, and the 2^120 rides on the row scale.
Products of the exact bf16 weights and bf16 x are exact in fp32 and summed there.
sm_90 SASS of the loop: ~2 instructions a weight (the FMA GEMV: 3.1-3.6).

Word layout (`mma_layout`): int32 [N / 16, K / 64, 32, 8]: lane (g, t) of tile
and chunk holds for MMA block b words 2b and 2b + 1 (features kappa < 8, >= 8
of the block); in word 2b + part, byte 2h + 1 holds the weight of output row
16 tile + g and byte 2h that of row + 8, at chunk feature 16 t + 4 b + 2 part + h
(the feature order of `int4_mma`, so a lane's x is 16 contiguous features).

Each warp owns NT row tiles of 16 and its program's run of steps (2 chunks of
64 features each; K splits into whole steps); per step it loads its words and
x (with `prefetch`, the next step's before this step's MMAs), runs the MMAs
into one fp32 accumulator per tile, and at the end lanes t = 0 write
s 2^120 D as fp32 partial sums; `_int4_split_sum_kernel` adds them, the bias
and the SiLU. bf16 x only (fp16 x and other shapes take the FMA GEMV).

Block scales (DeepSeek-V3 / Qwen3-FP8's 128 x 128; `takes`): a step is one block
of K and a tile of 16 rows lies in one block, so each step's MMAs start from
zero and one FMA per sum adds scale x D into fp32 accumulators; the epilogue
multiplies by 2^120 alone. On an H100 as fast as the per-row form.

Up to 8 rows of x take B's 8 columns as in `int4_mma` (`_Fp8Ptx`'s `rows`); the
one-row code is kept as measured (an H100 call of 2026-12-05: FP8 single stream
1.56x bf16 with it, 1.33x on the FMA GEMV). 9-64 rows take up to 8 runs of 8,
each its own B operand against the same unpacked words (`runs`), as int4's do.
On an H100 the GEMV beat the W8A8 GEMM at 16 and 32 rows on all four Llama-8B
shapes but gate_up at 32 (even), and lost at 48 and 64 (gate_up 64 rows: 141
us against 55), so `fp8.fp8_linear` gives it up to GEMV_ROWS = 32 rows: FP8
offline with 16 prompts went from 0.77x to 1.31x bf16's decode, 32 prompts
from 0.91x to 1.12x (BENCHMARKS.md).

A lane's 16 bytes of a chunk are 16 consecutive features of one row, so the
words can also be made from the weight as it lies: `gemv_ptx(plain=True)` loads
16 bytes of rows g and g + 8 and interleaves them with one `prmt` a word (2.38
SASS instructions a weight against 2.16), with no second copy of the weight
(`fp8_gemv_mma_plain`, the engine's default; $RADIXLM_FP8_GEMV=mma takes the
copy). On an H100 it was 9 % faster than the copy at qkv but 11 % slower at gate/up (a warp's
load covers 8 runs of 64 bytes, not 512 in a row); end to end the copy was 4 %
faster (single stream 1.52x bf16 against 1.46x), not worth a second 8 GB.

A merged [gate; up] with its SiLU (`halves`, the plain weight with per-row
scales): tile i reads gate rows 8 i .. 8 i + 7 as its rows 0-7 and their up
rows, N / 2 on, as rows 8-15, so the lane holding a gate's sum holds its up's,
and the program that adds the split-K sums applies the SiLU
(`mma_gemv.mma_gemv_cta_kernel`): one launch a layer less, the same bits as
the two launches, the weight where it lies. int4's pair form (two tiles a
warp) was 10 % slower for FP8 on an H200; this form keeps one tile a warp. On
an H100 gate/up at one row 41.4 us against 43.3, single stream +2 % (1.49x
bf16 against 1.45-1.46x; BENCHMARKS.md 2026-12-07 22:36).
"""

from __future__ import annotations

import functools

import torch

from radixlm.layers import pdl, split_sums
from radixlm.layers.norm_fold import FoldedNorm, NormTarget
from radixlm.layers.quantization.triton_ops.mma_gemv import (
    CHUNK,
    MmaConfig,
    check_rows,
    cta_fits,
    lane_lines,
    later_run_declarations,
    later_run_lines,
    launch,
    loop_ptx,
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
from radixlm.layers.quantization.triton_ops.mma_gemv import folds_out as mma_folds_out
from radixlm.layers.split_sums import SplitSums

STEP_CHUNKS = 2  # chunks a loop step loads before its MMAs
GEMV_ROWS = 32  # rows `fp8.fp8_linear` gives the GEMV (more: the W8A8 GEMM)
TWO_POW_120 = "0f7B800000"  # 2^120 in fp32: e4m3 (bias 7) read as bf16 (bias 127)


def mma_layout(w: torch.Tensor) -> torch.Tensor:
    """FP8 weight [N, K] (any strides) -> the fragment-order words int32
    [N / 16, K / 64, 32, 8] (module docstring)."""
    n, k = w.shape
    assert n % 16 == 0 and k % CHUNK == 0, (n, k)
    v = w.contiguous().view(torch.uint8).reshape(n // 16, 2, 8, k // CHUNK, 4, 4, 2, 2)
    # dims: tile, row + 8, g, chunk, t, b, part, h  ->  tile, chunk, g, t, b, part, h, row + 8
    v = v.permute(0, 3, 2, 4, 5, 6, 7, 1).flip(-1)  # byte 2h + 1: row g; byte 2h: row g + 8
    return v.contiguous().reshape(n // 16, k // CHUNK, 32, 32).view(torch.int32)


def mma_unlayout(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `mma_layout`: the FP8 weight [N, K] (torch.float8_e4m3fn)."""
    tiles, chunks = words.shape[:2]
    v = words.contiguous().view(torch.uint8).reshape(tiles, chunks, 8, 4, 4, 2, 2, 2)
    v = v.flip(-1).permute(0, 7, 2, 1, 3, 4, 5, 6)
    return v.reshape(tiles * 16, chunks * CHUNK).view(torch.float8_e4m3fn)


def takes(n: int, k: int, block_k: int, x_dtype: torch.dtype, scale_rows: int = 1) -> bool:
    """Whether the MMA GEMV takes this layer: bf16 x, whole tiles of 16 rows and
    steps of 128 features, and per-row scales or blocks of 128 features by a
    power of two >= 16 rows (a step and a tile inside one block: `block_shift`)."""
    blocks = block_k == 0 or (block_k == STEP_CHUNKS * CHUNK and scale_rows >= 16
                              and scale_rows & (scale_rows - 1) == 0)
    return blocks and x_dtype == torch.bfloat16 and n % 16 == 0 and k % (STEP_CHUNKS * CHUNK) == 0


def block_shift(block_k: int, scale_rows: int) -> int:
    """`gemv_ptx`'s block_shift: log2 of the rows a block scale covers; 0 for
    per-row scales."""
    return scale_rows.bit_length() - 1 if block_k else 0


@functools.cache
def gemv_ptx(nt: int, prefetch: bool = False, rows: bool = False, pdl: bool = False,
             plain: bool = False, runs: int = 1, block_shift: int = 0,
             halves: bool = False) -> str:
    """One thread's PTX: `nt` row tiles; with `prefetch` the next step's loads
    before this step's MMAs (two register buffers, the loop unrolled twice);
    `rows`: x has up to 8 rows, one per column of B (else one row, the code of
    the one-row GEMV); `pdl`: the PDL wait inside, after the first step's weight
    loads (`mma_gemv.loop_ptx`); `plain`: the weight as it is, [N, K] rows $12
    bytes apart, instead of `mma_layout` words (`_Fp8Ptx`); `runs` (with `rows`):
    x has up to 8 `runs` rows, each run of 8 a B operand of its own against the
    same unpacked words, as `int4_mma.gemv_ptx`'s groups; `block_shift` > 0: the
    scales are per block of 128 features (a step) by 2^block_shift rows, [N /
    2^block_shift, K / 128] fp32 at $3 with rows $13 apart, each step's sums
    scaled by its block's scale (else one fp32 scale a row at $3); `halves` (plain,
    one tile a warp, per-row scales): the weight is a merged [gate; up] of N rows
    and tile i's rows 0-7 are gate rows 8 i .. 8 i + 7, its rows 8-15 the up rows
    N / 2 on (`_Fp8Ptx`). Operands
    (`mma_gemv.mma_gemv_kernel`'s): $1 x, $2 words (plain: the weight), $3 row
    scales (fp32), $5 this program's partial sums; $6 its first warp index, $7 /
    $8 its first / past-last step, $9 row tiles in all, $10 chunks a row of tiles
    (K / 64), $11 N, $12 (plain) the weight's row stride in bytes, $14 x's rows."""
    return loop_ptx(_Fp8Ptx(nt, rows, plain, runs, block_shift, halves), "fp8_mma", "stp",
                    "$8", prefetch, pdl)


class _Fp8Ptx:
    """The pieces of `gemv_ptx`: per register buffer (A, B) one step's words `w`
    and x `x`. With `rows`, as `int4_mma._PtxGroup`'s: B's column c is x's row
    c, so d0 / d1 (d2 / d3) are output row g (g + 8) at x's rows 2t / 2t + 1.

    With `plain` the weight is read where it lies: a lane's weights of one chunk
    are features 16 t .. 16 t + 15 of rows g and g + 8, 16 bytes of each row
    (address registers `wa`, `wb`), and one `prmt` a word interleaves the two
    rows' bytes into the fragment word `mma_layout` would have stored (byte 2 h +
    1 row g, byte 2 h row g + 8). A warp's load then covers 8 runs of 64 bytes
    instead of 512 contiguous ones, and there is no second copy of the weight.

    `runs` > 1: rows 8 r .. 8 r + 7 are run r's B (`mma_gemv.later_run_lines`),
    each block's words unpacked once for all runs; run r has its own D (registers
    4 (tile runs + r) + j) and writes rows 8 r + 2t, 8 r + 2t + 1. runs = 1 is the
    code above, text for text.

    `block_shift` > 0 (block scales): each step loads its block's scale for each
    tile (`bs`, from `sb`: a tile's 16 rows and a step's 128 features lie in one
    block), its MMAs start from zero and `acc` += scale x D; the epilogue then
    scales by 2^120 alone. 0: the per-row form above, text for text.

    `halves`: a merged [gate; up] weight of N rows read so that a tile's rows g
    are gate rows 8 tile + g and its rows g + 8 the up rows of the same features
    (N / 2 rows on: `wb`, and their scales at `su`), while the sums go where the
    tile's 16 rows would (`mma_gemv.mma_gemv_cta_kernel`'s SILU_W 8): each lane
    holding a gate sum holds its up too, and the weight stays where it lies."""

    def __init__(self, nt: int, rows: bool = False, plain: bool = False,
                 runs: int = 1, block_shift: int = 0, halves: bool = False) -> None:
        assert runs == 1 or rows
        assert not halves or (plain and nt == 1 and not block_shift)
        self.nt, self.rows, self.plain, self.runs = nt, rows, plain, runs
        self.block_shift, self.halves = block_shift, halves

    def declarations(self, bufs: tuple[str, ...]) -> list[str]:
        nt = self.nt
        out = [".reg .pred skip, more, writer, row0, row1;" if self.rows else
               ".reg .pred skip, more, writer;",
               ".reg .b32 tid, lane, warp, g, t, tile, stp, tmp, p, q0, q1, q2, q3"
               f"{', p0, p1' * self.plain};",
               f".reg .f32 {regs('d', 4 * nt * self.runs)}, sc{', yv' * self.rows};",
               f".reg .b64 {regs('wa', nt)}, {(regs('wb', nt) + ', ') * self.plain}xa, sa, "
               f"{'su, ' * self.halves}ya, "
               f"{'yb, ' * self.rows}off;",
               *later_run_declarations(self.runs)]
        if self.block_shift:
            out += [f".reg .b64 {regs('sb', nt)};",
                    f".reg .f32 {regs('acc', 4 * nt * self.runs)};"]
        for b in bufs:
            out += [f".reg .b32 {regs(f'w{b}', nt * STEP_CHUNKS * 8)};",
                    f".reg .b32 {regs(f'x{b}', STEP_CHUNKS * 8 * self.runs)};"]
            if self.block_shift:
                out.append(f".reg .f32 {regs(f'bs{b}', nt)};")
        return out

    def setup(self) -> list[str]:
        """Lane and warp; this warp's tile (past the last: straight to the end); the
        addresses of its first step's words and x, of its rows' scales and partial
        sums; the accumulators zeroed."""
        nt = self.nt
        return [
            *lane_lines(nt, "$6", "$9", "L_fp8_mma_done"),
            *(self._plain_addresses() if self.plain else self._word_addresses()),
            # x: (step * STEP_CHUNKS * 64 + 16 t) * 2 bytes
            f"mul.lo.u32 tmp, $7, {STEP_CHUNKS * CHUNK};",
            "mad.lo.u32 tmp, t, 16, tmp;",
            *x_row_lines(self.rows),
            "mul.wide.u32 off, tmp, 2;",
            "add.u64 xa, $1, off;",
            # scales and partial sums of row tile * 16 + g (4 bytes each)
            "mad.lo.u32 tmp, tile, 16, g;",
            "mul.wide.u32 off, tmp, 4;",
            "add.u64 sa, $3, off;",
            "add.u64 ya, $5, off;",
            *self._halves_scale_lines(),
            *y_row_lines(self.rows),
            *later_run_lines(self.runs, STEP_CHUNKS * CHUNK),
            *self._block_scale_lines(),
            *[f"mov.f32 {self._sums()}{i}, 0f00000000;" for i in range(4 * nt * self.runs)],
            "mov.u32 stp, $7;",
        ]

    def _halves_scale_lines(self) -> list[str]:
        """Halves: sa moved to gate row 8 tile + g's scale, su at its up row's, N / 2
        on (the sums' ya stays at the tile's row)."""
        if not self.halves:
            return []
        return ["mad.lo.u32 tmp, tile, 8, g;", "mul.wide.u32 off, tmp, 4;",
                "add.u64 sa, $3, off;", "shr.u32 q3, $11, 1;", "mul.wide.u32 off, q3, 4;",
                "add.u64 su, sa, off;"]

    def _sums(self) -> str:
        """The registers the epilogue writes: D itself, or (block scales) acc."""
        return "acc" if self.block_shift else "d"

    def _block_scale_lines(self) -> list[str]:
        """Block scales: sb{i}, the address of tile i's block scale at the first
        step, ((tile + i) * 16 >> block_shift) * $13 + $7 fp32 elements into $3."""
        out = []
        for i in range(self.nt if self.block_shift else 0):
            out += [f"add.u32 q3, tile, {i};", "shl.b32 q3, q3, 4;",
                    f"shr.u32 q3, q3, {self.block_shift};", "mad.lo.u32 q3, q3, $13, $7;",
                    "mul.wide.u32 off, q3, 4;", f"add.u64 sb{i}, $3, off;"]
        return out

    def _word_addresses(self) -> list[str]:
        """wa: ((tile * chunks_per_row + step * STEP_CHUNKS) * 32 + lane) * 32 bytes
        into the words, a tile's stream K / 64 chunks after the one before."""
        return [f"mul.lo.u32 tmp, $7, {STEP_CHUNKS};",
                "mad.lo.u32 tmp, tile, $10, tmp;",
                "mad.lo.u32 tmp, tmp, 32, lane;",
                "mul.wide.u32 off, tmp, 32;",
                "add.u64 wa0, $2, off;",
                "mul.wide.u32 off, $10, 1024;",
                *[f"add.u64 wa{i}, wa{i - 1}, off;" for i in range(1, self.nt)]]

    def _plain_addresses(self) -> list[str]:
        """wa: row tile * 16 + g of the weight ($12 bytes a row) at feature
        step * STEP_CHUNKS * 64 + 16 t; wb: the same eight rows on; a tile 16 rows
        after the one before. Halves: wa at gate row tile * 8 + g, wb N / 2 rows on."""
        return [f"mad.lo.u32 tmp, tile, {8 if self.halves else 16}, g;",
                "mul.wide.u32 off, tmp, $12;",
                "add.u64 wa0, $2, off;",
                f"mul.lo.u32 tmp, $7, {STEP_CHUNKS * CHUNK};",
                "mad.lo.u32 tmp, t, 16, tmp;",
                "cvt.u64.u32 off, tmp;",
                "add.u64 wa0, wa0, off;",
                *(["shr.u32 q3, $11, 1;", "mul.wide.u32 off, q3, $12;"] if self.halves
                  else ["mul.wide.u32 off, $12, 8;"]),
                "add.u64 wb0, wa0, off;",
                "mul.wide.u32 off, $12, 16;",
                *[f"add.u64 w{ab}{i}, w{ab}{i - 1}, off;" for i in range(1, self.nt)
                  for ab in "ab"]]

    def loads(self, b: str, ahead: bool, pred: str = "") -> list[str]:
        """Buffer b's loads of this step (`ahead`: the next one): 32 bytes of words
        per chunk and tile (plain: 16 bytes of each of the lane's two rows), then x."""
        skip_x = STEP_CHUNKS * CHUNK * 2 if ahead else 0
        out = []
        for c in range(STEP_CHUNKS):
            for i in range(self.nt):
                r = (c * self.nt + i) * 8
                for h in range(2):
                    out.append(f"{pred}ld.global.nc.L1::no_allocate.v4.u32 {{w{b}{r + 4 * h}, "
                               f"w{b}{r + 4 * h + 1}, w{b}{r + 4 * h + 2}, w{b}{r + 4 * h + 3}}}, "
                               f"[{self._weight_at(i, c, h, ahead)}];")
            out += x_load_lines(b, self.runs, STEP_CHUNKS, c, skip_x, pred)
        for i in range(self.nt if self.block_shift else 0):
            out.append(f"{pred}ld.global.f32 bs{b}{i}, [sb{i}+{4 if ahead else 0}];")
        return out

    def _weight_at(self, i: int, c: int, h: int, ahead: bool) -> str:
        """Where load h of tile i's chunk c reads: 16 h bytes into the lane's 32 bytes
        of words; plain, row g (h 0) or g + 8 (h 1) at the lane's 16 bytes."""
        if self.plain:
            return f"w{'ab'[h]}{i}+{(STEP_CHUNKS if ahead else 0) * CHUNK + c * CHUNK}"
        return f"wa{i}+{(STEP_CHUNKS if ahead else 0) * 1024 + c * 1024 + 16 * h}"

    @staticmethod
    def _unpack(word: str, hi: str, lo: str) -> list[str]:
        """Bytes 1, 3 of `word` -> bf16 pair `hi`; bytes 0, 2 -> `lo` (values 2^-120 x)."""
        return [f"shr.u32 tmp, {word}, 4;",
                "and.b32 tmp, tmp, 0x07F007F0;",
                f"lop3.b32 {hi}, {word}, 0x80008000, tmp, 0xEA;",  # (a & b) | c
                f"shl.b32 p, {word}, 8;",
                "shr.u32 tmp, p, 4;",
                "and.b32 tmp, tmp, 0x07F007F0;",
                f"lop3.b32 {lo}, p, 0x80008000, tmp, 0xEA;"]

    def compute(self, b: str) -> list[str]:
        out = []
        if self.block_shift:  # this step's sums from zero, then scaled into acc
            out += [f"mov.f32 d{i}, 0f00000000;" for i in range(4 * self.nt * self.runs)]
        mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
        for c in range(STEP_CHUNKS):
            for k in range(4):  # MMA block k of the chunk
                xbs = [f"x{b}{(run * STEP_CHUNKS + c) * 8 + 2 * k}, "
                       f"x{b}{(run * STEP_CHUNKS + c) * 8 + 2 * k + 1}" for run in range(self.runs)]
                for i in range(self.nt):
                    words = self._block_words(b, (c * self.nt + i) * 8, k)
                    out += [*words[2:],
                            *self._unpack(words[0], "q0", "q1"),
                            *self._unpack(words[1], "q2", "q3")]
                    for run, xb in enumerate(xbs):
                        d = ", ".join(f"d{4 * (i * self.runs + run) + j}" for j in range(4))
                        out.append(f"{mma} {{{d}}}, {{q0, q1, q2, q3}}, {{{xb}}}, {{{d}}};")
        for i in range(self.nt if self.block_shift else 0):
            for a in range(4 * i * self.runs, 4 * (i + 1) * self.runs):
                out.append(f"fma.rn.f32 acc{a}, bs{b}{i}, d{a}, acc{a};")
        return out

    def _block_words(self, b: str, r: int, k: int) -> list[str]:
        """[word of part 0, word of part 1, *the lines that make them] for MMA block
        k of the 8 registers from r: stored words 2k, 2k + 1; plain, registers k
        (row g) and 4 + k (row g + 8) interleaved by byte (features 4k, 4k + 1 for
        part 0, 4k + 2, 4k + 3 for part 1)."""
        if not self.plain:
            return [f"w{b}{r + 2 * k}", f"w{b}{r + 2 * k + 1}"]
        g, g8 = f"w{b}{r + k}", f"w{b}{r + 4 + k}"
        return ["p0", "p1", f"prmt.b32 p0, {g}, {g8}, 0x1504;",
                f"prmt.b32 p1, {g}, {g8}, 0x3726;"]

    def advance(self) -> list[str]:
        if self.plain:
            w = [f"add.u64 w{ab}{i}, w{ab}{i}, {STEP_CHUNKS * CHUNK};"
                 for i in range(self.nt) for ab in "ab"]
        else:
            w = [f"add.u64 wa{i}, wa{i}, {STEP_CHUNKS * 1024};" for i in range(self.nt)]
        return ["add.u32 stp, stp, 1;", *w, *x_advance_lines(self.runs, STEP_CHUNKS * CHUNK * 2),
                *[f"add.u64 sb{i}, sb{i}, 4;" for i in range(self.nt if self.block_shift else 0)]]

    def epilogue(self) -> list[str]:
        """Lanes t = 0 write rows g and g + 8 of each tile, times s 2^120 (block
        scales: 2^120, the scales already in); with rows, every lane its two rows
        of x that exist."""
        d = self._sums()
        if self.rows:
            out = []
            for i in range(self.nt):
                for half in range(2):
                    row = 16 * i + 8 * half
                    out += self._scale(row, "")
                    for run, (_, ya, yb, sfx) in enumerate(run_suffixes(self.runs)):
                        r = 4 * (i * self.runs + run) + 2 * half
                        out += [f"mul.f32 yv, sc, {d}{r};",
                                f"@row0{sfx} st.global.f32 [{ya}+{4 * row}], yv;",
                                f"mul.f32 yv, sc, {d}{r + 1};",
                                f"@row1{sfx} st.global.f32 [{yb}+{4 * row}], yv;"]
            return out
        out = ["setp.eq.u32 writer, t, 0;"]
        for i in range(self.nt):
            for half in range(2):
                row = 16 * i + 8 * half
                out += [*self._scale(row, "@writer "),
                        f"mul.f32 sc, sc, {d}{4 * i + 2 * half};",
                        f"@writer st.global.f32 [ya+{4 * row}], sc;"]
        return out

    def _scale(self, row: int, pred: str) -> list[str]:
        """sc = the output scale of the tile's row `row`: its row scale times 2^120,
        or (block scales) 2^120."""
        if self.block_shift:
            return [f"mov.f32 sc, {TWO_POW_120};"]
        at = ("su" if row else "sa") if self.halves else f"sa+{4 * row}"
        return [f"{pred}ld.global.f32 sc, [{at}];", f"mul.f32 sc, sc, {TWO_POW_120};"]


def fp8_gemv_mma(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, config: MmaConfig | None = None,
                 out: torch.Tensor | None = None, silu_mul: bool = False,
                 scale_rows: int = 0, norm_in: FoldedNorm | None = None,
                 norm_out: NormTarget | None = None, defer_sum: bool = False
                 ) -> torch.Tensor | FoldedNorm | SplitSums:
    """x [M, K] (1 <= M <= MAX_ROWS contiguous rows, bf16, 16-byte aligned) times
    the FP8 weight in `mma_layout` `words` with fp32 row scales [N] (`scale_rows`
    > 0: block scales [N / scale_rows, K / 128], `takes`): [M, N] (`silu_mul`: [M,
    N / 2]). One row runs the one-row PTX, more the rows PTX (a run of 8 rows per
    B operand). `norm_in`, `norm_out`: a folded norm (`mma_gemv.launch`; x is
    then `norm_in.x`); `defer_sum`: the split-K sum left to the consumer where it
    takes a second launch (`launch`)."""
    m, n, k = check_rows(x, words)
    assert x.dtype == torch.bfloat16
    return _launch(x, words, scales, n, k, config, 0, bias, out, silu_mul, scale_rows,
                   norm_in=norm_in, norm_out=norm_out, defer_sum=defer_sum)


def plain_fits(weight: torch.Tensor) -> bool:
    """Whether `gemv_ptx(plain=True)` reads this FP8 weight [N, K] where it lies:
    16-byte aligned rows (start and row stride)."""
    return weight.data_ptr() % 16 == 0 and weight.stride(0) % 16 == 0


def fp8_gemv_mma_plain(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None, config: MmaConfig | None = None,
                       out: torch.Tensor | None = None, silu_mul: bool = False,
                       scale_rows: int = 0, norm_in: FoldedNorm | None = None,
                       norm_out: NormTarget | None = None, defer_sum: bool = False
                       ) -> torch.Tensor | FoldedNorm | SplitSums:
    """`fp8_gemv_mma` reading the FP8 weight [N, K] as it is (rows 16-byte aligned,
    any row stride that is a multiple of 16 bytes: an online-quantized weight's
    codes with their scale bytes after them are fine): `gemv_ptx(plain=True)`.
    The engine's GEMV for such layers unless $RADIXLM_FP8_GEMV says otherwise."""
    n, k = weight.shape
    assert rows_fit(x) and x.shape == (x.shape[0], k) and x.dtype == torch.bfloat16
    assert weight.dtype == torch.float8_e4m3fn and weight.stride(1) == 1
    assert plain_fits(weight)
    return _launch(x, weight, scales, n, k, config, weight.stride(0), bias, out, silu_mul,
                   scale_rows, plain=True, norm_in=norm_in, norm_out=norm_out,
                   defer_sum=defer_sum)


def folds_out(n: int, k: int) -> bool:
    """Whether an [N, K] FP8 GEMV can give a folded norm (`mma_gemv.folds_out`)."""
    return mma_folds_out(n, k // (STEP_CHUNKS * CHUNK), fp8=True)


def _launch(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, n: int, k: int,
            config: MmaConfig | None, stride: int, bias: torch.Tensor | None,
            out: torch.Tensor | None, silu_mul: bool, scale_rows: int,
            plain: bool = False, norm_in: FoldedNorm | None = None,
            norm_out: NormTarget | None = None, defer_sum: bool = False
            ) -> torch.Tensor | FoldedNorm | SplitSums:
    """Both forms' checks of the scales and their launch: `weight` the words, or
    (`plain`) the weight with rows `stride` bytes apart ($12); block scales' rows
    are $13 elements apart."""
    block_k = STEP_CHUNKS * CHUNK if scale_rows else 0
    assert takes(n, k, block_k, x.dtype, scale_rows), (n, k, scale_rows)
    shape = (-(-n // scale_rows), k // block_k) if scale_rows else (n,)
    assert scales.shape == shape and scales.dtype == torch.float32 and scales.is_contiguous()
    m = x.shape[0]
    steps = k // (STEP_CHUNKS * CHUNK)
    if config is None:
        config = pick_config(n, fp8=True)
        if plain and halves(n, steps, silu_mul, bias, scale_rows):
            config = config._replace(halves=True)
    runs, cfg = row_runs(m, config)
    ptx = gemv_ptx(cfg.nt, cfg.prefetch, m > 1, pdl.pdl_on(), plain=plain, runs=runs,
                   block_shift=block_shift(block_k, scale_rows), halves=cfg.halves)
    return launch(ptx, cfg, x, weight, scales, scales, steps, stride,
                  scales.stride(0) if scale_rows else 0, bias, out, silu_mul,
                  grid_shape=(n // 16, k // CHUNK) if plain else None, norm_in=norm_in,
                  norm_out=norm_out, defer_sum=defer_sum)


def halves(n: int, steps: int, silu_mul: bool, bias: torch.Tensor | None,
           scale_rows: int) -> bool:
    """Whether the plain GEMV of a merged [gate; up] (N rows, `steps` loop steps)
    takes the halves form (`MmaConfig.halves`: the SiLU in the product's program,
    one launch): bias-free, per-row scales (a block scale's 128 rows would span a
    tile's gate and up halves), whole tiles of 8 features, K split into a power of
    two of runs (`cta_fits`), unless $RADIXLM_SPLIT_SUMS=launch keeps the second
    launch (`split_sums.deferred`)."""
    cfg = pick_config(n, fp8=True)._replace(halves=True)
    return (silu_mul and bias is None and not scale_rows and n % 16 == 0
            and cta_fits(cfg, steps, True) and split_sums.deferred())
