"""What the tensor-core one-row GEMVs (`int4_mma.py`, `fp8_mma.py`) share: the shape
of their PTX (a warp per run of 16-row tiles, a loop over steps of K with an
optional prefetch of the next step), their launch config and their epilogue
launch (the split-K sum).

The PTX is assembled from a format's `MmaPieces`: register declarations, the
setup after the common lane/warp/tile lines, a step's loads (into register
buffer A or B, optionally the next step's, optionally predicated), its compute,
the address advance, and the partial-sum stores. `loop_ptx` strings them into
the plain loop or the prefetching one (two buffers, unrolled twice: load the
next step into one buffer while computing the other). One Triton kernel,
`mma_gemv_kernel`, launches any format's PTX with the same operands.

Under PDL the wait sits inside the PTX, after the first step's weight loads
(`loop_ptx`'s `pdl`): on an H100, 1-3 % off three of four Llama-8B shapes
(`benchmarks/quant_kernels.py --mma-launch --pdl`, BENCHMARKS.md 2026-12-05).
Adding the split-K sums in the kernel's last program instead of a second
launch was measured there too and lost 0.7-3.6 us a call (a counter across
programs, then one program's serial sum).

More steps in flight do not help: the words copied 1-7 steps ahead (2-8
stages) through a ring of `cp.async` stages in shared memory (no registers
held) were slower on an H100 at almost every shape and depth, FP8 and AWQ
single stream at 5 stages -11 % (BENCHMARKS.md 2026-12-07 21:42).

The split-K sum in the program (`MmaConfig.cta_sum`, `mma_gemv_cta_kernel`):
one program holds all `split` warps of one row tile, each warp a run of K, so
after the same PTX has stored the warps' partial sums a barrier is all the sum
waits for (no counter, no other program): the program adds them in split order
with the bias, as the second launch would, so the bits are the same. Only the
PTX's operands differ: per-thread values (the tile, the run of K, the partial
sums' row), which the PTX reads from operands anyway. On an H100 at one row
(the kernels alone in CUDA graphs with PDL, BENCHMARKS.md 2026-12-06): FP8 qkv
11.6 -> 11.1 us, o 8.2 -> 7.1, down 23.6 -> 22.3; int4 o 5.2 -> 4.6, down 12.8
-> 12.5, but int4 qkv (split 4) 7.1 -> 7.2, so `pick_config` takes it for FP8
and for the split-8 layers of int4. End to end: FP8 single stream +3 %, AWQ +2 %.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Protocol

import torch
import triton
import triton.language as tl

from radixlm.layers import pdl
from radixlm.layers.gemv import _silu_mul
from radixlm.layers.norm_fold import FoldedNorm, NormTarget
from radixlm.layers.pdl import pdl_trigger, pdl_wait
from radixlm.layers.quantization.triton_ops.int4 import rstd_rows, sum_splits
from radixlm.layers.split_sums import SplitSums

CHUNK = 64  # features a lane's words of one tile cover: 4 MMA blocks of 16
MAX_RUNS = 8  # runs of 8 rows of x (B's 8 columns), each its own B operand
MAX_ROWS = 8 * MAX_RUNS  # rows of x one launch takes
PREFETCH_RUNS = 4  # above this many runs the prefetching loop spills (sm_90 SASS): off


class MmaConfig(NamedTuple):
    warps: int = 4
    nt: int = 1  # tiles (16 output rows) a warp
    split: int = 8  # programs along K (whole steps each)
    prefetch: bool = False  # the next step's loads before this step's MMAs
    # The split-K sum inside the program (module docstring; `cta_fits` says when):
    # then `warps` is unused, a program has `split` warps a tile.
    cta_sum: bool = False
    # A merged [gate; up] with its SiLU (int4 only, with cta_sum and nt 2): a warp's
    # tiles are a gate tile and the up tile of its features, so the program
    # finishes silu(gate) * up (`int4_mma._PtxGroup`'s pair).
    pair: bool = False
    # A merged [gate; up] with its SiLU (FP8 plain only, with cta_sum and nt 1): a
    # tile's rows 0-7 are 8 gate rows and rows 8-15 the up rows of the same
    # features, so each lane's two sums are a gate and its up (`fp8_mma._Fp8Ptx`'s
    # halves) and the program finishes silu(gate) * up for its 8 features.
    halves: bool = False


def pick_config(n: int, fp8: bool = False, pair: bool = False) -> MmaConfig:
    """4 warps of one tile each and the prefetching loop (in the sm_90 SASS of the
    plain loop ptxas sinks a step's later loads below its first MMAs: two round
    trips a step). K split in 4 where N >= 6144, else in 8: the best or within
    3 % of it for both formats at Llama-3.1-8B's four shapes on an H100
    (`python benchmarks/quant_kernels.py --sweep`, BENCHMARKS.md 2026-12-05),
    where split 16 at K 14336 lost 4-30 %. `cta_sum` (the split-K sum in the
    program) for FP8 (`fp8`) and for int4's split-8 layers, where it won on an
    H100 (module docstring).

    `pair`: an int4 [gate; up] product with its SiLU: the split-K sum and the
    SiLU in the program, each warp the gate and up tiles of 16 features (one
    launch where the sum and SiLU took a second; `cta_fits`), K split in 2 where
    N >= 6144: Llama-8B's gate_up on an H100 at one row 22.05 us (split 4 22.29,
    the two launches 22.75), at 8 rows 22.99 (23.78, 24.02), and end to end AWQ
    +1.3 % against the two launches where split 4 gave +0.4 % (BENCHMARKS.md
    2026-12-07 16:09)."""
    split = 4 if n >= 6144 else 8
    if pair:
        split = 2 if n >= 6144 else split
        return MmaConfig(split, 2, split, prefetch=True, cta_sum=True, pair=True)
    return MmaConfig(4, 1, split, prefetch=True, cta_sum=fp8 or split == 8)


def regs(prefix: str, n: int) -> str:
    return ", ".join(f"{prefix}{i}" for i in range(n))


class MmaPieces(Protocol):
    """One format's PTX pieces (`loop_ptx` says when each runs)."""

    def declarations(self, bufs: tuple[str, ...]) -> list[str]: ...
    def setup(self) -> list[str]: ...
    def loads(self, b: str, ahead: bool, pred: str = "") -> list[str]: ...
    def compute(self, b: str) -> list[str]: ...
    def advance(self) -> list[str]: ...
    def epilogue(self) -> list[str]: ...


def lane_lines(nt: int, first_warp: str, tiles: str, done: str) -> list[str]:
    """Lane (g, t) and warp from %tid.x; this warp's first tile, (warp + first_warp)
    * nt; warps past the last tile go straight to `done` (warp-uniform)."""
    return ["mov.u32 tid, %tid.x;",
            "and.b32 lane, tid, 31;",
            "shr.u32 warp, tid, 5;",
            "shr.u32 g, lane, 2;",
            "and.b32 t, lane, 3;",
            f"add.u32 tile, {first_warp}, warp;",
            f"mul.lo.u32 tile, tile, {nt};",
            f"setp.ge.u32 skip, tile, {tiles};",
            f"@skip bra.uni {done};"]


def x_row_lines(rows: bool) -> list[str]:
    """rows: tmp += min(g, M - 1) * K, lane g's row of x as B's column g (uses q1).
    One row: nothing (every column of B is x)."""
    if not rows:
        return []
    return ["sub.u32 q1, $14, 1;", "min.u32 q1, g, q1;", "mul.lo.u32 q1, q1, $10;",
            f"mad.lo.u32 tmp, q1, {CHUNK}, tmp;"]


def y_row_lines(rows: bool) -> list[str]:
    """rows: ya (at column tile * 16 + g of the [M, N] partial sums) moved to row
    2t, yb a row below; predicates row0 / row1: whether those rows exist (uses q1,
    q2). D's columns 2t and 2t + 1 are then rows 2t and 2t + 1."""
    if not rows:
        return []
    return ["shl.b32 q1, t, 1;",
            "setp.lt.u32 row0, q1, $14;",
            "add.u32 q2, q1, 1;",
            "setp.lt.u32 row1, q2, $14;",
            "mul.lo.u32 q1, q1, $11;",
            "mul.wide.u32 off, q1, 4;",
            "add.u64 ya, ya, off;",
            "mul.wide.u32 off, $11, 4;",
            "add.u64 yb, ya, off;"]


def later_run_lines(runs: int, step_features: int) -> list[str]:
    """Setup of runs r = 1 .. runs - 1 of 8 rows of x (each its own B operand): x
    address xa{r} (row min(8 r + g, M - 1) at this program's first step of
    `step_features` features, 16 t on), sums' addresses ya{r} / yb{r} (rows 8 r +
    2t, + 1, from ya at row 2t) and their predicates row0g{r} / row1g{r} (uses
    tmp, q1, q2, off)."""
    out = []
    for r in range(1, runs):
        out += [f"mul.lo.u32 tmp, $7, {step_features};",
                "mad.lo.u32 tmp, t, 16, tmp;",
                f"add.u32 q2, g, {8 * r};", "sub.u32 q1, $14, 1;", "min.u32 q1, q2, q1;",
                "mul.lo.u32 q1, q1, $10;", f"mad.lo.u32 tmp, q1, {CHUNK}, tmp;",
                "mul.wide.u32 off, tmp, 2;", f"add.u64 xa{r}, $1, off;",
                "shl.b32 q1, t, 1;", f"add.u32 q1, q1, {8 * r};",
                f"setp.lt.u32 row0g{r}, q1, $14;", "add.u32 q2, q1, 1;",
                f"setp.lt.u32 row1g{r}, q2, $14;",
                f"mul.lo.u32 q1, $11, {8 * r};", "mul.wide.u32 off, q1, 4;",
                f"add.u64 ya{r}, ya, off;", "mul.wide.u32 off, $11, 4;",
                f"add.u64 yb{r}, ya{r}, off;"]
    return out


def later_run_declarations(runs: int) -> list[str]:
    """The registers of `later_run_lines` (none for one run)."""
    if runs == 1:
        return []
    later = range(1, runs)
    return [".reg .pred " + ", ".join(f"row0g{r}, row1g{r}" for r in later) + ";",
            ".reg .b64 " + ", ".join(f"xa{r}, ya{r}, yb{r}" for r in later) + ";"]


def run_suffixes(runs: int) -> list[tuple[str, str, str, str]]:
    """Per run of 8 rows, its (x address, sums at row 2t, at 2t + 1, predicate
    suffix) registers: run 0 the rows form's own xa / ya / yb / row0, row1."""
    return [("xa", "ya", "yb", "")] + [(f"xa{r}", f"ya{r}", f"yb{r}", f"g{r}")
                                       for r in range(1, runs)]


def x_load_lines(b: str, runs: int, chunks: int, c: int, skip_x: int, pred: str) -> list[str]:
    """Chunk c (of `chunks` a step) of x for every run of 8 rows: two 16-byte loads
    a lane into x{b} (run r's at (r chunks + c) 8 ..), from its x address +
    skip_x bytes."""
    out = []
    for run, (xa, _, _, _) in enumerate(run_suffixes(runs)):
        for h in range(2):
            r = (run * chunks + c) * 8 + h * 4
            out.append(f"{pred}ld.global.v4.u32 {{x{b}{r}, x{b}{r + 1}, x{b}{r + 2}, "
                       f"x{b}{r + 3}}}, [{xa}+{skip_x + c * 128 + h * 16}];")
    return out


def x_advance_lines(runs: int, step_bytes: int) -> list[str]:
    """Every run's x address moved on by a step of x (`step_bytes`)."""
    return [f"add.u64 {xa}, {xa}, {step_bytes};" for xa, _, _, _ in run_suffixes(runs)]


PDL_LINES = ["griddepcontrol.wait;", "griddepcontrol.launch_dependents;"]
_X_LOAD = re.compile(r"\[xa\d*\+")


def loop_ptx(p: MmaPieces, name: str, step: str, hi: str, prefetch: bool,
             pdl: bool = False) -> str:
    """The whole asm block: declarations, setup, the loop over steps (register
    `step` counts them up to operand `hi`), the epilogue.

    `pdl`: the block holds the kernel's one PDL wait and trigger
    (`radixlm/layers/pdl.py`), so the first step's weights (every load but x's,
    which the kernel before may write) are in flight while the kernel before
    finishes. Warps with no tile wait too: their branch to the end moves below
    the wait, and their early loads are predicated off."""
    top, end, done = f"L_{name}_step", f"L_{name}_end", f"L_{name}_done"
    setup = p.setup()
    leave = f"@skip bra.uni {done};"
    if pdl:
        setup.remove(leave)
    wait = [*PDL_LINES, leave] if pdl else []
    lines = ["{", *p.declarations(("A", "B") if prefetch else ("A",)), *setup]
    if not prefetch:
        lines += [*wait, f"{top}:", *p.loads("A", ahead=False), *p.compute("A"), *p.advance(),
                  f"setp.lt.u32 more, {step}, {hi};", f"@more bra.uni {top};"]
    else:
        first = p.loads("A", ahead=False, pred="@!skip " if pdl else "")
        if pdl:  # x's loads read "[xa+...]" ("[xa1+...]": further runs of rows); the
            # weights', every other address register
            first = ([ln for ln in first if not _X_LOAD.search(ln)] + wait
                     + [ln for ln in first if _X_LOAD.search(ln)])
        lines += [*first, f"{top}:"]
        for cur, nxt, last in (("A", "B", False), ("B", "A", True)):
            lines += [f"add.u32 tmp, {step}, 1;", f"setp.lt.u32 more, tmp, {hi};",
                      *p.loads(nxt, ahead=True, pred="@more "), *p.compute(cur), *p.advance()]
            lines.append(f"@more bra.uni {top};" if last else f"@!more bra.uni {end};")
        lines.append(f"{end}:")
    lines += [*p.epilogue(), f"{done}:", "mov.u32 $0, 0;", "}"]
    return "\n".join(lines)


@triton.jit
def mma_gemv_kernel(x_ptr, w_ptr, a_ptr, b_ptr, ws_ptr, TILES, CHUNKS_PER_ROW, N, STEPS,
                    SPLIT_STEPS, int_a, int_b, stride_ws, M, WARPS: tl.constexpr,
                    PTX: tl.constexpr, PDL: tl.constexpr, PTX_WAITS: tl.constexpr):
    """Program (pid 0: WARPS warps' tiles; pid 1: a run of SPLIT_STEPS steps of K)
    running PTX, one element a thread (the PTX takes its lane and warp from
    %tid.x, so nothing depends on how Triton lays the tensor out). Operands: $0 a
    dummy output; $1 x, $2 the words, $3 / $4 the format's two other addresses, $5
    the program's partial sums (64-bit); $6 its first warp index, $7 / $8 its
    first / past-last step, $9 TILES, $10 CHUNKS_PER_ROW, $11 N, $12 / $13 the
    format's two integers, $14 M (x's rows). PTX_WAITS: the PTX holds the PDL
    wait and trigger (`loop_ptx`'s `pdl`), else they come before it."""
    lo = tl.program_id(1) * SPLIT_STEPS
    hi = tl.minimum(STEPS, lo + SPLIT_STEPS)
    ws_row = ws_ptr + tl.program_id(1).to(tl.int64) * stride_ws
    _run_ptx(PTX, tl.zeros([32 * WARPS], dtype=tl.int32), x_ptr, w_ptr, a_ptr, b_ptr,
             ws_row.to(tl.int64, bitcast=True), tl.program_id(0) * WARPS, lo, hi, TILES,
             CHUNKS_PER_ROW, N, int_a, int_b, M, PDL, PTX_WAITS)


@triton.jit
def _run_ptx(PTX: tl.constexpr, one, x_ptr, w_ptr, a_ptr, b_ptr, ws_row, first_warp, lo, hi,
             TILES, CHUNKS_PER_ROW, N, int_a, int_b, M, PDL: tl.constexpr,
             PTX_WAITS: tl.constexpr):
    """The PTX over `one`'s threads (a [32 warps] tensor of zeros), each operand a
    scalar or a per-thread tensor (`mma_gemv_kernel` says what $0-$14 are); the PDL
    wait and trigger before it unless the PTX holds them."""
    if not PTX_WAITS:
        pdl_wait(PDL)
        pdl_trigger(PDL)
    tl.inline_asm_elementwise(
        PTX, "=r,l,l,l,l,l,r,r,r,r,r,r,r,r,r",
        [x_ptr.to(tl.int64, bitcast=True) + one, w_ptr.to(tl.int64, bitcast=True) + one,
         a_ptr.to(tl.int64, bitcast=True) + one, b_ptr.to(tl.int64, bitcast=True) + one,
         ws_row + one, first_warp + one, lo + one, hi + one, TILES + one,
         CHUNKS_PER_ROW + one, N + one, int_a + one, int_b + one, M + one],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def mma_gemv_cta_kernel(x_ptr, w_ptr, a_ptr, b_ptr, ws_ptr, bias_ptr, y_ptr, TILES,
                        CHUNKS_PER_ROW, N, STEPS, SPLIT_STEPS, int_a, int_b, stride_ws, M,
                        stride_y, sq_in_ptr, P_IN, features, eps_in, res_ptr, gamma_ptr,
                        res_out_ptr, sq_out_ptr, SPLIT: tl.constexpr, ROWS: tl.constexpr,
                        HAS_BIAS: tl.constexpr, NORM_IN: tl.constexpr, P_BLOCK: tl.constexpr,
                        NORM_OUT: tl.constexpr, SILU_W: tl.constexpr, PTX: tl.constexpr,
                        PDL: tl.constexpr, PTX_WAITS: tl.constexpr):
    """`mma_gemv_kernel`'s PTX with the split-K sum in the program: program p owns
    row tile p with SPLIT warps, warp w taking run w of the steps. The PTX computes
    its tile as $6 + warp, so $6 is passed as p - warp; its run of steps and its
    partial sums' row ($5, $7, $8) per thread too (one element a thread: thread i
    holds element i of a [32 SPLIT] tensor). After the PTX a barrier, then the
    program adds its [SPLIT, M, 16] partial sums in split order and the bias: the
    second launch's arithmetic (`int4._int4_split_sum_kernel`), so the same bits.
    ROWS: a power of two >= M. y: [M, N] rows `stride_y` apart.

    A folded norm (`layers/norm_fold.py`). NORM_IN: x holds the norm unscaled,
    so the sums are multiplied by each row's rstd (`rstd_of` its P_IN partial
    sums of squares at sq_in, over `features`) before the bias. NORM_OUT: the
    rounded product is added to the residual [M, N] (contiguous) into res_out;
    y gets the sum times the norm's weight `gamma`, and sq_out [M, TILES] at
    column p the sum of the tile's squares.

    SILU_W > 0: a merged [gate; up] with its SiLU, program p's sums the gate's
    SILU_W features at columns 2 SILU_W p .. of [M, N] (N the merged width) and
    their up's SILU_W after them; y [M, N / 2] gets silu(gate) * up at SILU_W p ..
    SILU_W p + SILU_W - 1, the second launch's arithmetic
    (`int4._int4_split_sum_kernel`'s SILU_MUL). 16: the PTX's pair form (TILES
    the gate's tiles); 8: its halves form (a tile's rows 8-15 the up of rows 0-7)."""
    pid = tl.program_id(0)
    warp = tl.arange(0, 32 * SPLIT) // 32
    lo = warp * SPLIT_STEPS
    hi = tl.minimum(STEPS, lo + SPLIT_STEPS)
    ws_rows = ws_ptr.to(tl.int64, bitcast=True) + warp.to(tl.int64) * stride_ws * 4
    if NORM_OUT:  # the norm's weights: a constant, read before the wait in the PTX
        gamma = tl.load(gamma_ptr + pid * 16 + tl.arange(0, 16)).to(tl.float32)[None, :]
    _run_ptx(PTX, tl.zeros([32 * SPLIT], dtype=tl.int32), x_ptr, w_ptr, a_ptr, b_ptr, ws_rows,
             pid - warp, lo, hi, TILES, CHUNKS_PER_ROW, N, int_a, int_b, M, PDL, PTX_WAITS)
    tl.debug_barrier()  # every warp's partial sums stored (CTA-scope ordering)
    rows = tl.arange(0, ROWS)
    W: tl.constexpr = SILU_W if SILU_W else 16  # y's columns a program
    cols = pid * W + tl.arange(0, W)
    ok = (rows < M)[:, None]
    if NORM_OUT:  # in flight with the partial sums' loads
        res = tl.load(res_ptr + rows[:, None] * N + cols[None, :], mask=ok, other=0.0)
    at = ws_ptr + rows[:, None] * N + (pid * 2 * W + tl.arange(0, W) if SILU_W else cols)[None, :]
    # .cg: from L2, where the other warps' stores went (not a stale L1 line)
    acc = tl.load(at, mask=ok, other=0.0, cache_modifier=".cg")
    if SILU_W:
        up = tl.load(at + W, mask=ok, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(at + s * stride_ws, mask=ok, other=0.0, cache_modifier=".cg")
        if SILU_W:
            up += tl.load(at + s * stride_ws + W, mask=ok, other=0.0, cache_modifier=".cg")
    if NORM_IN:
        rstd = rstd_rows(sq_in_ptr, tl.minimum(rows, M - 1), P_IN, features, eps_in,
                         P_BLOCK)[:, None]
        acc *= rstd
        if SILU_W:
            up *= rstd
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    if SILU_W:
        acc = _silu_mul(acc, up, dtype)
    if NORM_OUT:  # the norm kernel's rounding: the product, then the residual stream
        s = (acc.to(dtype).to(tl.float32) + res.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + rows[:, None] * N + cols[None, :], s, mask=ok)
        acc = s.to(tl.float32)
        tl.store(sq_out_ptr + rows * TILES + pid, tl.sum(acc * acc, 1), mask=rows < M)
        acc *= gamma
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(dtype), mask=ok)


def folds_out(n: int, steps: int, fp8: bool = False) -> bool:
    """Whether an [N]-column product of `steps` steps can give a folded norm
    (`launch`'s `norm_out`): its split-K sum is in the program."""
    return cta_fits(pick_config(n, fp8), steps, False)


def cta_fits(cfg: MmaConfig, steps: int, silu_mul: bool) -> bool:
    """Whether `mma_gemv_cta_kernel` takes this launch: `cfg.cta_sum`, K split in a
    power of two of runs (Triton's warps), at most 16, and either one tile a warp
    and no SiLU, or a fused SiLU with `cfg.pair` (a warp's gate and up tiles) or
    `cfg.halves` (one tile a warp, its halves a gate and its up).
    The SiLU with each program's up tiles on warps beside its gate tiles' was
    level for FP8 and 18 % slower for int4 on an H100 (2026-12-06); FP8 in the
    pair form was 10 % slower end to end on an H200 (2026-12-07 18:13), FP8 in
    the halves form 4 % faster than the two launches at gate/up on an H100
    (2026-12-07 22:38)."""
    split = splits(steps, cfg.split)[1]
    if cfg.pair or cfg.halves:
        shape = silu_mul and cfg.nt == (2 if cfg.pair else 1)
    else:
        shape = cfg.nt == 1 and not silu_mul
    return cfg.cta_sum and shape and split & (split - 1) == 0 and split <= 16


def row_runs(m: int, cfg: MmaConfig) -> tuple[int, MmaConfig]:
    """The runs of 8 rows that x [m, K] takes, and `cfg` without the prefetching
    loop where that many runs would spill its registers."""
    runs = -(-m // 8)
    return runs, (cfg._replace(prefetch=False) if runs > PREFETCH_RUNS else cfg)


def rows_fit(x: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether the PTX reads x [M, K] as it is: 1 to `max_rows` (the format's PTX's
    limit) contiguous, 16-byte aligned rows."""
    return 1 <= x.shape[0] <= max_rows and x.is_contiguous() and x.data_ptr() % 16 == 0


def check_rows(x: torch.Tensor, words: torch.Tensor,
               max_rows: int = MAX_ROWS) -> tuple[int, int, int]:
    """(M, N, K) of x [M, K] times the fragment-order `words` [N / 16, K / 64, ...],
    refusing what the PTX cannot read (`rows_fit`)."""
    tiles, chunks_per_row = words.shape[:2]
    m, n, k = x.shape[0], tiles * 16, chunks_per_row * CHUNK
    assert rows_fit(x, max_rows) and x.shape == (m, k) and words.is_contiguous()
    return m, n, k


def launch(ptx: str, cfg: MmaConfig, x: torch.Tensor, words: torch.Tensor, a: torch.Tensor,
           b: torch.Tensor, steps: int, int_a: int, int_b: int, bias: torch.Tensor | None,
           out: torch.Tensor | None, silu_mul: bool,
           grid_shape: tuple[int, int] | None = None, norm_in: FoldedNorm | None = None,
           norm_out: NormTarget | None = None, defer_sum: bool = False
           ) -> torch.Tensor | FoldedNorm | SplitSums:
    """Both launches of a tensor-core GEMV: `ptx` (holding the PDL wait where PDL is
    on: `loop_ptx`'s `pdl`) over `steps` loop steps of K split by `cfg` (the
    format's addresses `a`, `b` and integers `int_a`, `int_b`), then the split-K
    sum into [M, N] (`silu_mul`: [M, N / 2]). `grid_shape`: (tiles, chunks a row)
    where `words` is not the fragment-order [tiles, chunks, ...] tensor.

    A folded norm (`layers/norm_fold.py`): `norm_in`, x is its unscaled `x` (the
    sums are scaled by its rstd); `norm_out` (the sum in the program: `folds_out`),
    returns the FoldedNorm the product added to its residual makes.

    `defer_sum`: where the sum takes a second launch (not in the program, no
    SiLU, no folded norm), return the partial sums as `SplitSums` for the
    consumer to add (`layers/split_sums.py`) instead of launching it."""
    tiles, chunks_per_row = grid_shape or words.shape[:2]
    m, n = x.shape[0], tiles * 16
    per, split = splits(steps, cfg.split)
    ws = torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    y = output(x, n // 2 if silu_mul else n, out)
    if norm_in is not None and norm_in.squares is None:
        norm_in = None  # x is the norm's output already
    sq_in, p_in = ws, 1
    if norm_in is not None:
        sq_in, p_in = norm_in.squares, norm_in.squares.shape[-1]
        assert sq_in.shape == (m, p_in) and sq_in.is_contiguous()
    if cta_fits(cfg, steps, silu_mul):
        fold = _fold_out(norm_out, y, tiles)
        assert not (cfg.pair or cfg.halves) or (bias is None and fold is None)
        programs = tiles // 2 if cfg.pair else tiles  # pair: the gate's tiles
        mma_gemv_cta_kernel[(programs,)](
            x, words, a, b, ws, bias if bias is not None else ws, y, programs, chunks_per_row, n,
            steps, per, int_a, int_b, ws.stride(0), m, y.stride(0), sq_in, p_in,
            x.shape[1], norm_in.eps if norm_in is not None else 0.0,
            *(fold[1:] if fold is not None else (ws,) * 4), SPLIT=split,
            ROWS=triton.next_power_of_2(m), HAS_BIAS=bias is not None,
            NORM_IN=norm_in is not None, P_BLOCK=triton.next_power_of_2(p_in),
            NORM_OUT=fold is not None, SILU_W=16 if cfg.pair else 8 if cfg.halves else 0,
            PTX=ptx, PTX_WAITS=PDL_LINES[0] in ptx,
            num_warps=split, **pdl.launch_args())
        return y if fold is None else fold[0]
    assert norm_out is None, "a folded norm's output needs the split-K sum in the program"
    assert not (cfg.pair or cfg.halves), "the pair and halves forms sum in their program only"
    mma_gemv_kernel[(triton.cdiv(tiles, cfg.warps * cfg.nt), split)](
        x, words, a, b, ws, tiles, chunks_per_row, n, steps, per, int_a, int_b,
        ws.stride(0), m, WARPS=cfg.warps, PTX=ptx, PTX_WAITS=PDL_LINES[0] in ptx,
        num_warps=cfg.warps, **pdl.launch_args())
    if defer_sum and not silu_mul and norm_in is None:
        return SplitSums(ws, bias, y)
    return sum_splits(ws, bias, y, silu_mul, norm_in)


def _fold_out(target: NormTarget | None, y: torch.Tensor, tiles: int
              ) -> tuple[FoldedNorm, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
                         ] | None:
    """The FoldedNorm a product y [M, N] into `target` makes, and the kernel's
    operands for it: residual, gamma, new residual, squares [M, tiles]."""
    if target is None:
        return None
    res = target.residual
    assert res.shape == y.shape and res.is_contiguous() and target.weight.is_contiguous()
    new_res = torch.empty_like(y, memory_format=torch.contiguous_format)
    squares = torch.empty((y.shape[0], tiles), device=y.device, dtype=torch.float32)
    return (FoldedNorm(y, squares, new_res, target.eps), res, target.weight, new_res, squares)


def splits(steps: int, split: int) -> tuple[int, int]:
    """(steps a program, programs along K): `split` runs of whole steps, none empty."""
    per = triton.cdiv(steps, split)
    return per, triton.cdiv(steps, per)


def output(x: torch.Tensor, n_out: int, out: torch.Tensor | None) -> torch.Tensor:
    """The [M, n_out] result for x's M rows: `out` viewed so, or a new tensor."""
    m = x.shape[0]
    if out is None:
        return torch.empty((m, n_out), device=x.device, dtype=x.dtype)
    assert out.is_contiguous() and out.dtype == x.dtype and out.numel() == m * n_out
    return out.view(m, n_out)
