"""The one-row int4 GEMV on the tensor cores (opt-in until GPU-tested): the weights
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
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from radixlm.layers import pdl
from radixlm.layers.pdl import pdl_trigger, pdl_wait
from radixlm.layers.quantization.triton_ops.int4 import _int4_split_sum_kernel

CHUNK = 64  # features a lane's 4 words cover (4 MMA blocks of 16)
GROUPS = (64, 128)  # group sizes the kernel takes (whole chunks, <= 2 chunks unrolled)


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


def takes(n: int, k: int, group: int, g_idx: torch.Tensor | None, split: int) -> bool:
    """Whether the MMA GEMV takes this layer: whole tiles and chunks, a group of 64
    or 128 (or one per column when K is 64 or 128), no act-order, K splits into whole
    groups."""
    return (g_idx is None and group in GROUPS and n % 16 == 0 and k % group == 0
            and split >= 1)


# ---- the PTX --------------------------------------------------------------------------
def _regs(prefix: str, n: int) -> str:
    return ", ".join(f"{prefix}{i}" for i in range(n))


@functools.cache
def gemv_ptx(nt: int, chunks: int, bf16: bool, prefetch: bool = False) -> str:
    """The PTX of one thread's work: `nt` column tiles, `chunks` chunks a group;
    with `prefetch` the next group's loads are issued before this group's MMAs
    (two register buffers, the loop unrolled twice), so a warp keeps a group in
    flight while it computes. Operands: $0 a dummy output; $1 x, $2 words, $3
    zeros, $4 scales, $5 this program's partial-sum row (64-bit addresses); $6
    the program's first warp index, $7 / $8 its first / past-last group, $9
    column tiles in all, $10 chunks a row of tiles (K / 64), $11 N, $12 / $13 the
    zeros' / scales' row strides (in elements)."""
    g = _PtxGroup(nt, chunks, bf16)
    lines = ["{", *g.declarations(("A", "B") if prefetch else ("A",)), *g.setup()]
    if not prefetch:
        lines += ["L_int4_mma_group:", *g.loads("A", ahead=False), *g.compute("A"),
                  *g.advance(), "setp.lt.u32 more, grp, $8;",
                  "@more bra.uni L_int4_mma_group;"]
    else:
        lines += [*g.loads("A", ahead=False), "L_int4_mma_group:"]
        for cur, nxt, last in (("A", "B", False), ("B", "A", True)):
            lines += ["add.u32 tmp, grp, 1;", "setp.lt.u32 more, tmp, $8;",
                      *g.loads(nxt, ahead=True, pred="@more "), *g.compute(cur), *g.advance()]
            lines.append("@more bra.uni L_int4_mma_group;" if last else
                         "@!more bra.uni L_int4_mma_end;")
        lines.append("L_int4_mma_end:")
    lines += [*g.epilogue(), "L_int4_mma_done:", "mov.u32 $0, 0;", "}"]
    return "\n".join(lines)


class _PtxGroup:
    """The pieces of `gemv_ptx`: per register buffer (A, B) the words `w`, x `x` and
    the raw zero points `zr` / scales `sr` of one group."""

    def __init__(self, nt: int, chunks: int, bf16: bool) -> None:
        self.nt, self.chunks, self.t = nt, chunks, "bf16" if bf16 else "f16"
        self.magic = "0x43004300" if bf16 else "0x64006400"  # 128.0 / 1024.0, both halves
        self.offset = "0f43000000" if bf16 else "0f44800000"  # the same, one fp32
        self.one = "0x3F803F80" if bf16 else "0x3C003C00"  # 1.0 in both halves

    def declarations(self, bufs: tuple[str, ...]) -> list[str]:
        nt, chunks = self.nt, self.chunks
        out = [".reg .pred skip, more, writer;",
               ".reg .b32 tid, lane, warp, g, t, tile, grp, tmp, q0, q1, q2, q3, ones;",
               f".reg .f32 {_regs('s', 2 * nt)}, {_regs('sz', 2 * nt)}, zf, e0, e1, e2, e3;",
               f".reg .f32 {_regs('acc', 2 * nt)}, {_regs('d', 4 * nt)};",
               f".reg .b64 {_regs('wa', nt)}, xa, za, sa, zn, sn, ya, off;"]
        for b in bufs:
            out += [f".reg .b32 {_regs(f'w{b}', nt * chunks * 4)};",
                    f".reg .b32 {_regs(f'x{b}', chunks * 8)}, {_regs(f'zr{b}', 2 * nt)};",
                    f".reg .b16 {_regs(f'sr{b}', 2 * nt)};"]
        return out

    def setup(self) -> list[str]:
        """Lane and warp; this warp's tile (past the last: straight to the end); the
        addresses of its first group's words, x, zero points and scales and of its
        partial sums; the sums zeroed."""
        nt, chunks = self.nt, self.chunks
        return [
            "mov.u32 tid, %tid.x;",
            "and.b32 lane, tid, 31;",
            "shr.u32 warp, tid, 5;",
            "shr.u32 g, lane, 2;",
            "and.b32 t, lane, 3;",
            "add.u32 tile, $6, warp;",
            f"mul.lo.u32 tile, tile, {nt};",
            "setp.ge.u32 skip, tile, $9;",
            "@skip bra.uni L_int4_mma_done;",
            # words: ((tile * chunks_per_row + grp * chunks) * 32 + lane) * 16 bytes
            f"mul.lo.u32 tmp, $7, {chunks};",
            "mad.lo.u32 tmp, tile, $10, tmp;",
            "mad.lo.u32 tmp, tmp, 32, lane;",
            "mul.wide.u32 off, tmp, 16;",
            "add.u64 wa0, $2, off;",
            "mul.wide.u32 off, $10, 512;",  # the next tile's stream: K / 64 chunks on
            *[f"add.u64 wa{i}, wa{i - 1}, off;" for i in range(1, nt)],
            # x: (grp * chunks * 64 + 16 t) * 2 bytes
            f"mul.lo.u32 tmp, $7, {chunks * CHUNK};",
            "mad.lo.u32 tmp, t, 16, tmp;",
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
            # partial sums of column tile * 16 + g (4 bytes each)
            "mul.wide.u32 off, tmp, 4;",
            "add.u64 ya, $5, off;",
            *[f"mov.f32 acc{i}, 0f00000000;" for i in range(2 * nt)],
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
            for h in range(2):
                r = c * 8 + h * 4
                out.append(f"{pred}ld.global.v4.u32 {{x{b}{r}, x{b}{r + 1}, x{b}{r + 2}, "
                           f"x{b}{r + 3}}}, [xa+{skip_x + c * 128 + h * 16}];")
        if ahead:
            out += ["cvt.u64.u32 off, $12;", "add.u64 zn, za, off;",
                    "mul.wide.u32 off, $13, 2;", "add.u64 sn, sa, off;"]
        zbase, sbase = ("zn", "sn") if ahead else ("za", "sa")
        for i in range(nt):
            for half in range(2):
                col, r = 16 * i + 8 * half, 2 * i + half
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
        out += [f"mov.f32 d{i}, 0f00000000;" for i in range(4 * nt)]
        out += [f"mov.f32 e{i}, 0f00000000;" for i in range(4)]
        mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32"
        for c in range(chunks):
            for k in range(4):  # MMA block k of the chunk
                xb = f"x{b}{c * 8 + 2 * k}, x{b}{c * 8 + 2 * k + 1}"
                for i in range(nt):
                    w = f"w{b}{(c * nt + i) * 4 + k}"
                    d = f"d{4 * i}, d{4 * i + 1}, d{4 * i + 2}, d{4 * i + 3}"
                    out += [f"lop3.b32 q0, {w}, 0x000F000F, {magic}, 0xEA;",
                            f"shr.u32 tmp, {w}, 4;",
                            f"lop3.b32 q1, tmp, 0x000F000F, {magic}, 0xEA;",
                            f"shr.u32 tmp, {w}, 8;",
                            f"lop3.b32 q2, tmp, 0x000F000F, {magic}, 0xEA;",
                            f"shr.u32 tmp, {w}, 12;",
                            f"lop3.b32 q3, tmp, 0x000F000F, {magic}, 0xEA;",
                            f"{mma} {{{d}}}, {{q0, q1, q2, q3}}, {{{xb}}}, {{{d}}};"]
                out.append(f"{mma} {{e0, e1, e2, e3}}, {{ones, ones, ones, ones}}, {{{xb}}}, "
                           "{e0, e1, e2, e3};")
        for i in range(nt):  # D rows g (d0) and g + 8 (d2)
            for half in range(2):
                r = 2 * i + half
                out += [f"fma.rn.f32 acc{r}, s{r}, d{4 * i + 2 * half}, acc{r};",
                        f"fma.rn.f32 acc{r}, sz{r}, e0, acc{r};"]
        return out

    def advance(self) -> list[str]:
        return ["add.u32 grp, grp, 1;",
                *[f"add.u64 wa{i}, wa{i}, {self.chunks * 512};" for i in range(self.nt)],
                f"add.u64 xa, xa, {self.chunks * CHUNK * 2};",
                "cvt.u64.u32 off, $12;", "add.u64 za, za, off;",
                "mul.wide.u32 off, $13, 2;", "add.u64 sa, sa, off;"]

    def epilogue(self) -> list[str]:
        """Lanes t = 0 write rows g and g + 8 of each tile (every column of D is
        the same y, so any t would do)."""
        out = ["setp.eq.u32 writer, t, 0;"]
        for i in range(self.nt):
            for half in range(2):
                out.append(f"@writer st.global.f32 [ya+{4 * (16 * i + 8 * half)}], "
                           f"acc{2 * i + half};")
        return out


# ---- the launch ----------------------------------------------------------------------------
@triton.jit
def _int4_gemv_mma_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, ws_ptr, TILES, CHUNKS_PER_ROW, N,
                          NUM_GROUPS, G_SPLIT, stride_z, stride_s, stride_ws,
                          WARPS: tl.constexpr, NT: tl.constexpr, PTX: tl.constexpr,
                          PDL: tl.constexpr):
    """Program (column block of WARPS * NT tiles, K split): the groups
    [g_lo, g_hi) of its columns, as fp32 partial sums into row `split` of `ws`."""
    one = tl.zeros([32 * WARPS], dtype=tl.int32)  # one element a thread: the PTX's lanes
    g_lo = tl.program_id(1) * G_SPLIT
    g_hi = tl.minimum(NUM_GROUPS, g_lo + G_SPLIT)
    ws_row = ws_ptr + tl.program_id(1).to(tl.int64) * stride_ws
    pdl_wait(PDL)
    pdl_trigger(PDL)
    tl.inline_asm_elementwise(
        PTX, "=r,l,l,l,l,l,r,r,r,r,r,r,r,r",
        [x_ptr.to(tl.int64, bitcast=True) + one, qw_ptr.to(tl.int64, bitcast=True) + one,
         z_ptr.to(tl.int64, bitcast=True) + one, s_ptr.to(tl.int64, bitcast=True) + one,
         ws_row.to(tl.int64, bitcast=True) + one, tl.program_id(0) * WARPS + one,
         g_lo + one, g_hi + one, TILES + one, CHUNKS_PER_ROW + one, N + one,
         stride_z + one, stride_s + one],
        dtype=tl.int32, is_pure=False, pack=1)


class MmaConfig(NamedTuple):
    warps: int = 4
    nt: int = 1  # column tiles (16 columns) a warp
    split: int = 8  # programs along K (whole groups each)
    prefetch: bool = False  # the next group's loads before this group's MMAs


def pick_config(n: int, k: int) -> MmaConfig:
    """Untimed (the kernel has not met a GPU yet): the CUDA-core path's split."""
    return MmaConfig(4, 1, 16 if k >= 8192 else 8)


def int4_gemv_mma(x: torch.Tensor, words: torch.Tensor, zeros: torch.Tensor,
                  scales: torch.Tensor, group: int, bias: torch.Tensor | None = None,
                  config: MmaConfig | None = None, out: torch.Tensor | None = None,
                  silu_mul: bool = False) -> torch.Tensor:
    """One row: x [1, K] (bf16 / fp16, 16-byte aligned) times the int4 weight in
    `mma_layout` `words`, [1, N] (`silu_mul`: silu(gate) * up, [1, N / 2])."""
    tiles, chunks_per_row = words.shape[:2]
    n, k = tiles * 16, chunks_per_row * CHUNK
    assert x.shape == (1, k) and x.stride(1) == 1 and x.data_ptr() % 16 == 0
    assert x.dtype in (torch.bfloat16, torch.float16) and words.is_contiguous()
    assert group in GROUPS and k % group == 0 and zeros.stride(1) == scales.stride(1) == 1
    cfg = config or pick_config(n, k)
    num_groups = k // group
    g_split = triton.cdiv(num_groups, cfg.split)
    split = triton.cdiv(num_groups, g_split)
    ws = torch.empty((split, n), device=x.device, dtype=torch.float32)
    n_out = n // 2 if silu_mul else n
    if out is None:
        y = torch.empty((1, n_out), device=x.device, dtype=x.dtype)
    else:
        assert out.is_contiguous() and out.dtype == x.dtype and out.numel() == n_out
        y = out.view(1, n_out)
    ptx = gemv_ptx(cfg.nt, group // CHUNK, x.dtype == torch.bfloat16, cfg.prefetch)
    _int4_gemv_mma_kernel[(triton.cdiv(tiles, cfg.warps * cfg.nt), split)](
        x, words, zeros, scales, ws, tiles, chunks_per_row, n, num_groups, g_split,
        zeros.stride(0), scales.stride(0), ws.stride(0), WARPS=cfg.warps, NT=cfg.nt,
        PTX=ptx, num_warps=cfg.warps, **pdl.launch_args())
    dummy = scales
    _int4_split_sum_kernel[(triton.cdiv(n_out, 256),)](
        ws, bias if bias is not None else dummy, y, n_out, ws.stride(0), SPLIT=split,
        BLOCK=256, HAS_BIAS=bias is not None, SILU_MUL=silu_mul, num_warps=2,
        **pdl.launch_args())
    return y
