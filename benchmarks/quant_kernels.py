"""Our FP8 and int4 kernels beside torch._scaled_mm and bf16 cuBLAS, on the
Llama-3.1-8B projection shapes (tp 1), at 1, 8, 64 and 4096 rows.

    python benchmarks/quant_kernels.py                 # the table (~1 min on an H200)
    python benchmarks/quant_kernels.py --rows 1,8      # fewer rows
    python benchmarks/quant_kernels.py --sweep         # GEMV configs at one row (~2 min)
    python benchmarks/quant_kernels.py --sweep --int4-only   # (--fp8-only) one format
    python benchmarks/quant_kernels.py --gemm-sweep    # W8A8 GEMM tiles, 256 and 4096 rows
    python benchmarks/quant_kernels.py --accum-sweep   # FP8 sums promoted vs fast, 4096 rows
    python benchmarks/quant_kernels.py --mma-launch --pdl   # tensor-core GEMVs' launch forms
    python benchmarks/quant_kernels.py --int4-gemm-sweep  # int4 GEMM tiles, 16-256 rows
    python benchmarks/quant_kernels.py --w8a8-sweep --pdl  # W8A8 GEMV tiles at 1 row
    python benchmarks/quant_kernels.py --split-sweep --pdl  # tensor-core GEMVs: split, sum form
    python benchmarks/quant_kernels.py --head-sweep --pdl  # the LM head: bf16 GEMV vs FP8 GEMV
    python benchmarks/quant_kernels.py --act-quant     # per-token activation quantization

Each variant runs 64 back-to-back calls in one CUDA graph, replayed 10 times
(median, time / 64), with weights rotating through copies of >= 256 MiB so
every call reads them from HBM, not L2, as a decode step does; `--pdl` launches
them as the engine does on Hopper (`radixlm/layers/pdl.py`: a call may start
while the one before drains). Columns:
microseconds per call, weight bytes read / time (TB/s), 2MNK / time (TFLOP/s).

- bf16 cuBLAS: F.linear on bf16 weights; bf16 GEMV: ours (`layers/gemv.py`, 1-8 rows).
- scaled_mm: torch._scaled_mm with FP8 activations and row-wise scales (the
  activations quantized beforehand, outside the timing: the peer's best case).
- fp8 chan / fp8 block: ours (`triton_ops/fp8.py`) per-channel and 128x128
  block scales, end to end as `fp8_linear` routes them (given no tensor-core
  words: the FMA GEMV at 1-8 rows, above the activation quantization kernel
  plus the W8A8 GEMM, both timed).
- int4: ours (`triton_ops/int4.py`), group 128.
- fp8 chan MMA / int4 g128 MMA (1-64 rows, one launch): the tensor-core GEMVs
  (`fp8_mma.py`, `int4_mma.py`; the engine's CUDA default, FP8 to 32 rows);
  fp8 MMA plain: the FP8 one reading the weight as it lies (no fragment-order
  copy, the engine's form); fp8 block MMA: the same with 128x128 block scales.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixlm.layers import pdl
from radixlm.layers.fused_ops import silu_and_mul
from radixlm.layers.gemv import gemv
from radixlm.layers.quantization import int4 as I
from radixlm.layers.quantization.fp8 import block_table, quantize_rows
from radixlm.layers.quantization.triton_ops import fp8 as F8
from radixlm.layers.quantization.triton_ops import fp8_mma as F8M
from radixlm.layers.quantization.triton_ops import fp8_w8a8_gemv as W8
from radixlm.layers.quantization.triton_ops import int4 as T4
from radixlm.layers.quantization.triton_ops import int4_mma as M4
from radixlm.layers.quantization.triton_ops import mma_gemv as MG

SHAPES = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
          ("down", 14336, 4096)]
DEV = torch.device("cuda")
FP8 = torch.float8_e4m3fn
Call = Callable[[torch.Tensor, object], torch.Tensor]


def copies(make: Callable[[], object], nbytes: int) -> list[object]:
    return [make() for _ in range(max(2, math.ceil((256 << 20) / nbytes)))]


def time_graph(fn: Call, x: torch.Tensor, ws: list[object], calls: int = 64,
               reps: int = 10) -> float:
    fn(x, ws[0])  # compile / pick the cuBLAS kernel outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(x, ws[i % len(ws)])
    seconds = replay_seconds(graph, reps) / calls
    del graph
    return seconds


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int = 10) -> float:
    """Median seconds of one replay of `graph` (after a warm-up replay)."""
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def fp8_weights(n: int, k: int, block: bool) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    w = torch.randn(n, k, device=DEV) * 0.02
    q, s = quantize_rows(w)
    if not block:
        return q, s, 0, 1
    grid = torch.rand(n // 128, k // 128, device=DEV) * 1e-3 + 1e-4
    table, rows = block_table(grid, [n], 128)
    return q, table, 128, rows


def fp8_row_weights(n: int, k: int) -> tuple[torch.Tensor, ...]:
    """Per-row-scaled FP8 codes, their scales, and the codes in `fp8_mma.mma_layout`."""
    q, s, _, _ = fp8_weights(n, k, False)
    return q, s, F8M.mma_layout(q)


def int4_weights(n: int, k: int) -> tuple[torch.Tensor, ...]:
    q = torch.randint(0, 16, (k, n), device=DEV, dtype=torch.int32)
    zeros = torch.randint(6, 10, (k // 128, n), device=DEV, dtype=torch.uint8)
    scales = (torch.rand(k // 128, n, device=DEV) * 1e-3 + 1e-4).half()
    return I.pack_rows(q), zeros, scales, M4.mma_layout(q)


def int4_bytes(n: int, k: int) -> int:
    """What an int4 g128 product reads: the nibbles, a zero byte and an fp16 scale a group."""
    return n * k // 2 + 3 * n * k // 128


def variants(m: int, n: int, k: int) -> dict[str, tuple[Call, Callable[[], object], int]]:
    """name -> (call, weight maker, weight bytes read per call)."""
    out: dict[str, tuple[Call, Callable[[], object], int]] = {}
    out["bf16 cuBLAS"] = (lambda x, w: F.linear(x, w),
                          lambda: (torch.randn(n, k, device=DEV) * 0.02).bfloat16(), 2 * n * k)
    if m <= 8:
        out["bf16 GEMV"] = (lambda x, w: gemv(x, w), out["bf16 cuBLAS"][1], 2 * n * k)

    def scaled_mm(x, w):
        xq, xs, wq, ws = w[0], w[1], w[2], w[3]
        return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)

    def make_scaled():
        q, s = quantize_rows(torch.randn(n, k, device=DEV) * 0.02)
        xq, xs = F8.quantize_activations(torch.randn(m, k, device=DEV).bfloat16())
        return xq, xs, q, s.view(1, n)
    out["scaled_mm"] = (scaled_mm, make_scaled, n * k)
    for block in (False, True):
        def call(x, w, block=block):
            q, s, bk, rows = w
            return F8.fp8_linear(x, q, s, bk, rows, None)
        out["fp8 block" if block else "fp8 chan"] = (
            call, lambda block=block: fp8_weights(n, k, block), n * k)

    if m <= MG.MAX_ROWS:
        out["fp8 chan MMA"] = (lambda x, w: F8M.fp8_gemv_mma(x, w[2], w[1]),
                               lambda: fp8_row_weights(n, k), n * k)
        out["fp8 MMA plain"] = (lambda x, w: F8M.fp8_gemv_mma_plain(x, w[0], w[1]),
                                out["fp8 chan MMA"][1], n * k)
        out["fp8 block MMA"] = (  # 128 x 128 block scales, the weight where it lies
            lambda x, w: F8M.fp8_gemv_mma_plain(x, w[0], w[1], scale_rows=w[3]),
            out["fp8 block"][1], n * k)

    def int4(x, w):
        return T4.int4_linear(x, w[0], w[1], w[2], 128, None)
    out["int4 g128"] = (int4, lambda: int4_weights(n, k), int4_bytes(n, k))
    if m <= M4.MAX_ROWS:
        out["int4 g128 MMA"] = (lambda x, w: M4.int4_gemv_mma(x, w[3], w[1], w[2], 128),
                                out["int4 g128"][1], out["int4 g128"][2])
    return out


def table(rows: list[int]) -> None:
    print(f"\n{'shape':<8}{'M':>6}  {'variant':<12}{'us':>8}{'TB/s':>7}{'TF/s':>7}"
          f"{'vs bf16':>9}{'vs scaled_mm':>14}")
    for name, k, n in SHAPES:
        for m in rows:
            x = torch.randn(m, k, device=DEV).bfloat16()
            times = {}
            for label, (fn, make, nbytes) in variants(m, n, k).items():
                try:
                    times[label] = (time_graph(fn, x, copies(make, nbytes)), nbytes)
                except (RuntimeError, ValueError) as e:  # a peer that cannot take the shape
                    print(f"{name:<8}{m:>6}  {label:<12} n/a ({str(e).splitlines()[0][:60]})")
                torch.cuda.empty_cache()
            base = times.get("bf16 cuBLAS", (None,))[0]
            peer = times.get("scaled_mm", (None,))[0]
            for label, (t, nbytes) in times.items():
                vs_bf16 = f"{base / t:.2f}x" if base else "-"
                vs_peer = f"{peer / t:.2f}x" if peer else "-"
                print(f"{name:<8}{m:>6}  {label:<12}{t * 1e6:>8.1f}{nbytes / t / 1e12:>7.2f}"
                      f"{2 * m * n * k / t / 1e12:>7.0f}{vs_bf16:>9}{vs_peer:>14}")


FP8_MMA_CANDIDATES = [F8M.MmaConfig(w, nt, sp, pf) for w, nt, sp, pf in  # tensor cores
                      [(4, 1, 8, False), (4, 1, 4, False), (4, 2, 4, False), (4, 1, 8, True),
                       (4, 1, 4, True), (4, 2, 2, True), (8, 1, 4, True), (2, 1, 8, True)]]
MMA_CANDIDATES = [M4.MmaConfig(w, nt, sp, pf) for w, nt, sp, pf in  # the tensor-core GEMV
                  [(4, 1, 8, False), (4, 1, 16, False), (4, 2, 8, False), (4, 2, 4, False),
                   (8, 1, 8, False), (4, 4, 4, False), (4, 1, 8, True), (4, 1, 4, True),
                   (4, 2, 4, True), (8, 1, 4, True), (2, 1, 8, True)]]


def sweep(fp8: bool = True, int4: bool = True) -> None:
    """Graph time of GEMV configs at one row, per shape: what pick_*_config should say."""
    fp8_cands = [F8.GemvConfig("fma", bn, bk, w, st) for bn, bk, w, st in  # st 2: tile pairs
                 [(8, 1024, 4, 1), (4, 2048, 4, 1), (8, 1024, 4, 2), (4, 2048, 4, 2),
                  (8, 512, 4, 2), (16, 512, 4, 2), (4, 1024, 4, 2), (8, 1024, 8, 2),
                  (16, 1024, 8, 2), (2, 2048, 2, 2)]]
    fp8_cands += [F8.GemvConfig("fma", bn, bk, w, 1, vec8=True) for bn, bk, w in  # 8-byte loads
                  [(8, 1024, 4), (4, 2048, 4), (4, 1024, 4), (16, 1024, 4), (8, 2048, 8),
                   (4, 512, 2), (8, 512, 2)]]
    int4_cands = [T4.Int4Config(1, bn, bk, w, st, sp, pk) for bn, bk, w, st, sp, pk in
                  [(64, 256, 4, 3, 8, False), (64, 256, 4, 3, 8, True), (64, 512, 4, 3, 8, True),
                   (64, 256, 4, 3, 16, True), (128, 256, 4, 3, 8, True)]]
    int4_cands += [T4.Int4Config(1, bn, bk, w, 3, sp, True, lean=True) for bn, bk, w, sp in
                   [(64, 256, 4, 8), (64, 256, 4, 16), (64, 512, 4, 8), (32, 256, 2, 8),
                    (128, 256, 4, 8), (128, 256, 4, 16), (128, 256, 8, 8), (128, 512, 4, 8),
                    (256, 256, 4, 8), (256, 256, 8, 16)]]
    for name, k, n in SHAPES:
        x = torch.randn(1, k, device=DEV).bfloat16()
        if fp8:
            calls = [(lambda x, w, c=c: F8.fp8_gemv(x, w[0], w[1], 0, 1, config=c), c)
                     for c in fp8_cands]
            calls += [(lambda x, w, c=c: F8M.fp8_gemv_mma(x, w[2], w[1], config=c), c)
                      for c in FP8_MMA_CANDIDATES]
            calls += [(lambda x, w, c=c: F8M.fp8_gemv_mma_plain(x, w[0], w[1], config=c),
                       f"plain {c}") for c in FP8_MMA_CANDIDATES if c.prefetch]
            _time_configs(f"fp8  {name}", x, lambda n=n, k=k: fp8_row_weights(n, k), n * k,
                          calls, F8.pick_gemv_config(1, n, k, 0))
        if int4:
            calls = [(lambda x, w, c=c: T4.int4_gemv(x, w[0], w[1], w[2], 128, None, config=c),
                      c) for c in int4_cands]
            calls += [(lambda x, w, c=c: M4.int4_gemv_mma(x, w[3], w[1], w[2], 128, config=c),
                       c) for c in MMA_CANDIDATES]
            _time_configs(f"int4 {name}", x, lambda n=n, k=k: int4_weights(n, k), n * k // 2,
                          calls, T4.pick_gemv_config(n, k, 128))
        torch.cuda.empty_cache()


def split_sweep(rows: int = 1) -> None:
    """The tensor-core GEMVs (int4 g128, FP8 plain) at `rows` rows as the engine runs
    them (gate_up with its SiLU), K split in 2-16 with the split-K sum in a second
    launch or in the program (`MmaConfig.cta_sum`; with the SiLU, int4's pair form
    and FP8's halves form): what `pick_config`'s split and sum form should be on
    this card. "*": the pick."""
    print(f"{'shape':<9}{'format':<6}{'split':>6}{'sum':>9}{'us':>8}{'TB/s':>7}")
    for name, k, n in SHAPES:
        x = torch.randn(rows, k, device=DEV).bfloat16()
        silu = name == "gate_up"
        for fmt in ("int4", "fp8"):
            int4 = fmt == "int4"
            pair = int4 and M4.pairs(rows, n, silu, None, k // 128)
            if int4:
                pick = M4.pick_config(n, pair=pair)
            else:
                pick = F8M.pick_config(n, fp8=True)
                pick = pick._replace(cta_sum=F8M.halves(n, k // 128, True, None, 0)
                                     if silu else pick.cta_sum)
            nbytes = int4_bytes(n, k) if int4 else n * k
            ws = copies(functools.partial(int4_weights if int4 else fp8_row_weights, n, k),
                        nbytes)
            for split in (2, 4, 8, 16):
                for cta in (False, True):
                    row = _split_row(int4, split, cta, silu, pick, x, ws, nbytes)
                    print(f"{name:<9}{fmt:<6}{row}", flush=True)
            del ws
            torch.cuda.empty_cache()


def head_sweep(n: int = 128256, k: int = 4096) -> None:
    """The LM head at one row (Llama-3.1-8B's: 128256 x 4096): the bf16 GEMV the
    engine runs for a float head beside the FP8 tensor-core GEMV of
    `--lm-head-quantization fp8`, K split in 1-8 with the sum in a second launch or
    in the program. "*": `pick_config`'s."""
    x = torch.randn(1, k, device=DEV).bfloat16()
    ws = copies(lambda: torch.randn(n, k, device=DEV).bfloat16() * 0.02, 2 * n * k)
    t = time_graph(lambda x, w: gemv(x, w), x, ws)
    print(f"bf16 GEMV: {t * 1e6:.1f} us, {2 * n * k / t / 1e12:.2f} TB/s")
    del ws
    torch.cuda.empty_cache()
    pick = F8M.pick_config(n, fp8=True)
    ws = copies(functools.partial(fp8_row_weights, n, k), n * k)
    print(f"{'split':>6}{'sum':>9}{'us':>8}{'TB/s':>7}")
    for split in (1, 2, 4, 8):
        for cta in (False, True):
            print(_split_row(False, split, cta, False, pick, x, ws, n * k), flush=True)


def _split_row(int4: bool, split: int, cta: bool, silu: bool, pick: MG.MmaConfig,
               x: torch.Tensor, ws: list[object], nbytes: int) -> str:
    """One form of the tensor-core GEMV timed: split, where the sum runs, us, TB/s,
    and "*" where it is `pick`'s. The sum in the program with the SiLU: int4's pair
    form (a warp's gate and up tiles), FP8's halves form (a tile's halves)."""
    cfg = MG.MmaConfig(4, 1, split, True, cta)
    if cta and silu:
        cfg = (MG.MmaConfig(split, 2, split, True, True, pair=True) if int4
               else cfg._replace(halves=True))
    t = time_graph(_mma_call(int4, cfg, silu), x, ws)
    mark = "*" if (split, cta) == (pick.split, pick.cta_sum) else ""
    return (f"{split:>6}{'program' if cta else 'launch':>9}{t * 1e6:>8.2f}"
            f"{nbytes / t / 1e12:>7.2f} {mark}")


def _mma_call(int4: bool, cfg: MG.MmaConfig, silu: bool) -> Call:
    """The tensor-core GEMV on `int4_weights` / `fp8_row_weights` under `cfg`."""
    if int4:
        return lambda x, w: M4.int4_gemv_mma(x, w[3], w[1], w[2], 128, config=cfg,
                                             silu_mul=silu)
    return lambda x, w: F8M.fp8_gemv_mma_plain(x, w[0], w[1], config=cfg, silu_mul=silu)


def mma_launch() -> None:
    """The tensor-core GEMVs at one row (gate_up with its SiLU-and-mul, as the engine
    runs it) with the PDL wait before the PTX or inside it (after the first step's
    weight loads), and FP8 reading its weight where it lies; the CUDA-core default
    beside them. Run with --pdl: without it the two waits are the same code."""
    print(f"{'shape':<9}{'format':<6}{'form':<16}{'us':>7}{'TB/s':>7}")
    for name, k, n in SHAPES:
        x = torch.randn(1, k, device=DEV).bfloat16()
        for fmt in ("int4", "fp8"):
            nbytes, make, forms = _launch_forms(fmt, n, k, silu=name == "gate_up")
            ws = copies(make, nbytes)
            for form, call in forms:
                t = time_graph(call, x, ws)
                print(f"{name:<9}{fmt:<6}{form:<16}{t * 1e6:>7.1f}{nbytes / t / 1e12:>7.2f}")
            del ws
            torch.cuda.empty_cache()


def _launch_forms(fmt: str, n: int, k: int, silu: bool
                  ) -> tuple[int, Callable[[], object], list[tuple[str, Call]]]:
    """(weight bytes, weight maker, [(form, call)]) of `mma_launch`'s rows."""
    int4 = fmt == "int4"
    cfg = M4.pick_config(n) if int4 else F8M.pick_config(n)

    def default(x, w):
        if int4:
            return T4.int4_linear(x, w[0], w[1], w[2], 128, None, silu_mul=silu)
        return F8.fp8_linear(x, w[0], w[1], 0, 1, None, silu_mul=silu)

    def form(inside: bool, plain: bool = False) -> Call:
        if int4:
            ptx = M4.gemv_ptx(cfg.nt, 2, True, cfg.prefetch, False, inside)
        else:
            ptx = F8M.gemv_ptx(cfg.nt, cfg.prefetch, False, inside, plain)

        def call(x, w):
            if int4:
                return MG.launch(ptx, cfg, x, w[3], w[1], w[2], k // 128, w[1].stride(0),
                                 w[2].stride(0), None, None, silu)
            steps = k // (F8M.STEP_CHUNKS * F8M.CHUNK)
            if plain:
                return MG.launch(ptx, cfg, x, w[0], w[1], w[1], steps, k, 0, None, None, silu,
                                 grid_shape=(n // 16, k // F8M.CHUNK))
            return MG.launch(ptx, cfg, x, w[2], w[1], w[1], steps, 0, 0, None, None, silu)
        return call

    forms = [("default", default), ("wait before", form(False)), ("wait inside", form(True))]
    if int4:
        return n * k // 2, lambda: int4_weights(n, k), forms
    forms.append(("plain, inside", form(True, plain=True)))
    return n * k, lambda: fp8_row_weights(n, k), forms


def _time_configs(label: str, x: torch.Tensor, make: Callable[[], object], nbytes: int,
                  calls: list[tuple[Call, object]], default: object) -> None:
    """Graph time of each (call, config) on rotating weights, fastest first, with the
    weight bytes (`nbytes` a call) read per second."""
    ws = copies(make, nbytes)
    res = sorted(((time_graph(call, x, ws), config) for call, config in calls),
                 key=lambda r: r[0])
    print(f"{label:<13} best {res[0][1]} {nbytes / res[0][0] / 1e12:.2f} TB/s; "
          f"default {default}")
    for t, c in res:
        print(f"    {c}: {t * 1e6:.1f} us, {nbytes / t / 1e12:.2f} TB/s")
    del ws


GEMM_CANDIDATES = [F8.GemmConfig(*c) for c in
                   [(128, 128, 128, 8, 4), (256, 128, 128, 8, 3), (64, 128, 128, 4, 4),
                    (64, 128, 128, 4, 4, 8, True), (128, 128, 128, 8, 4, 8, True),
                    (256, 128, 128, 8, 3, 8, True), (128, 256, 128, 8, 3, 8, True),
                    (128, 128, 128, 8, 4, 8, True, True), (256, 128, 128, 8, 3, 8, True, True),
                    (128, 256, 128, 8, 3, 8, True, True)]]


def gemm_sweep(rows: list[int]) -> None:
    """Graph time of W8A8 GEMM tiles (per-channel and 128x128 block scales,
    activations quantized beforehand, as the scaled_mm peer's are) beside
    torch._scaled_mm and bf16 cuBLAS: what pick_gemm_config should say at
    prefill sizes. `picked` is the heuristic's tile."""
    for block in (False, True):
        for name, k, n in SHAPES:
            for m in rows:
                x16 = torch.randn(m, k, device=DEV).bfloat16()
                xqs = F8.quantize_activations(x16, 128 if block else 0)
                ws = copies(lambda n=n, k=k, block=block: fp8_weights(n, k, block), n * k)
                flop = 2 * m * n * k
                cells = []
                if not block:
                    peer = time_graph(lambda x, w: torch._scaled_mm(
                        x[0], w[0].t(), scale_a=x[1], scale_b=w[1].view(1, -1),
                        out_dtype=torch.bfloat16), xqs, ws)
                    bf16 = time_graph(lambda x, w: F.linear(x, w),
                                      x16, copies(lambda n=n, k=k: torch.randn(
                                          n, k, device=DEV).bfloat16(), 2 * n * k))
                    cells = [f"scaled_mm {flop / peer / 1e12:.0f}",
                             f"bf16 {flop / bf16 / 1e12:.0f}"]
                picked = F8.pick_gemm_config(m, n, 128 if block else 0)
                for c in GEMM_CANDIDATES:
                    try:
                        t = time_graph(lambda x, w, c=c: F8.fp8_gemm(
                            x[0], x[1], w[0], w[1], w[2], w[3], None, torch.bfloat16,
                            config=c), xqs, ws)
                        cell = f"{flop / t / 1e12:.0f}"
                    except Exception as e:  # a tile that does not compile: say so, go on
                        cell = f"failed ({type(e).__name__})"
                        torch.cuda.synchronize()
                    mark = "*" if c == picked else ""
                    cells.append(f"{c.label()}{mark} {cell}")
                label = "block" if block else "chan"
                print(f"{label:<6}{name:<8}{m:>6} TFLOP/s: " + " | ".join(cells), flush=True)
                del ws
                torch.cuda.empty_cache()


ACCUM_TILES = [F8.GemmConfig(*c) for c in
               [(256, 128, 128, 8, 3, 8, True, True), (128, 256, 128, 8, 3, 8, True, True),
                (128, 256, 128, 8, 4, 8, True, True), (128, 128, 128, 8, 4, 8, True, True),
                (128, 128, 128, 4, 4, 8, True, True), (128, 256, 128, 8, 3, 8, True)]]


def accum_sweep(rows: list[int]) -> None:
    """Per-channel W8A8: the FP8 MMA's sums promoted every 128 terms (ours today)
    against Hopper's fast accumulation (one accumulator over the whole K), each
    tile both ways, beside torch._scaled_mm with use_fast_accum off and on:
    TFLOP/s and the error against a float64 product of the same FP8 operands
    (max |err| / max |ref| and rms err / rms ref)."""
    def err(y: torch.Tensor, ref: torch.Tensor) -> str:
        d = y.double() - ref
        return (f"{(d.abs().max() / ref.abs().max()).item():.1e}/"
                f"{(d.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item():.1e}")

    for name, k, n in SHAPES:
        for m in rows:
            x16 = torch.randn(m, k, device=DEV).bfloat16()
            xq, xs = F8.quantize_activations(x16, 0)
            ws = copies(lambda n=n, k=k: fp8_weights(n, k, False), n * k)
            w = ws[0]
            ref = (xq.double() * xs.double().view(-1, 1)) @ (
                w[0].double() * w[1].double().view(-1, 1)).t()
            flop = 2 * m * n * k
            cells = []
            for fast in (False, True):
                def mm(x, w, fast=fast):
                    return torch._scaled_mm(x[0], w[0].t(), scale_a=x[1],
                                            scale_b=w[1].view(1, -1),
                                            out_dtype=torch.bfloat16, use_fast_accum=fast)
                t = time_graph(mm, (xq, xs), ws, calls=16)
                cells.append(f"scaled_mm{'-fast' if fast else ''} {flop / t / 1e12:.0f} "
                             f"({err(mm((xq, xs), w), ref)})")
            for c in ACCUM_TILES:
                for promote in (True, False):
                    cfg = c._replace(promote=promote)

                    def ours(x, w, cfg=cfg):
                        return F8.fp8_gemm(x[0], x[1], w[0], w[1], w[2], w[3], None,
                                           torch.bfloat16, config=cfg)
                    try:
                        t = time_graph(ours, (xq, xs), ws, calls=16)
                        cells.append(f"{cfg.label()} {flop / t / 1e12:.0f} "
                                     f"({err(ours((xq, xs), w), ref)})")
                    except Exception as e:  # a tile that does not compile: say so, go on
                        cells.append(f"{cfg.label()} failed ({type(e).__name__})")
                        torch.cuda.synchronize()
            print(f"{name:<8}{m:>6} TFLOP/s (err max/rms):\n    " + "\n    ".join(cells),
                  flush=True)
            del ws, ref
            torch.cuda.empty_cache()


INT4_GEMM_CANDIDATES = [T4.Int4Config(bm, bn, 128, w, 3, sp) for bm, bn, w, sp in
                        [(16, 64, 4, 1), (16, 64, 4, 4), (16, 128, 4, 4), (32, 64, 4, 2),
                         (32, 64, 4, 4), (64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 4),
                         (64, 128, 4, 2), (128, 64, 4, 1), (128, 64, 4, 2), (128, 128, 8, 2)]]


def int4_gemm_sweep(rows: list[int]) -> None:
    """Graph time of the int4 GEMM's forms above 8 rows, group 128: the folded GEMM's
    tiles (`Int4Config.split`: K split), the per-tile dequantizing GEMM
    (`fold=False`, the act-order path), the weight dequantized whole + cuBLAS
    (what fragment-order words take above `int4_mma.GEMV_ROWS`), the
    tensor-core GEMV (up to its MAX_ROWS; above, one launch per MAX_ROWS rows, up
    to 4); bf16 cuBLAS the peer. What pick_gemm_config, DEQUANT_ABOVE and
    int4_mma.GEMV_ROWS should say."""
    for name, k, n in SHAPES:
        ws = copies(lambda n=n, k=k: int4_weights(n, k), n * k // 2)
        dense = copies(lambda n=n, k=k: (torch.randn(n, k, device=DEV) * 0.02).bfloat16(),
                       2 * n * k)
        for m in rows:
            x = torch.randn(m, k, device=DEV).bfloat16()
            flop = 2 * m * n * k
            bf16 = time_graph(lambda x, w: F.linear(x, w), x, dense)
            cells = {"bf16": bf16}

            def gemm(cfg):
                return lambda a, w: T4.int4_gemm(a, w[0], w[1], w[2], 128, None, config=cfg)
            cells["tile dequant"] = time_graph(gemm(T4.pick_gemm_config(m, n, 128)._replace(
                fold=False)), x, ws)
            cells["whole dequant"] = time_graph(lambda x, w: torch.mm(x, T4.int4_dequantize(
                w[0], w[1], w[2], 128, None, x.dtype)), x, ws)
            if m <= M4.MAX_ROWS:  # the tensor-core GEMV, a B operand per 8 rows
                cells["MMA GEMV"] = time_graph(
                    lambda x, w: M4.int4_gemv_mma(x, w[3], w[1], w[2], 128), x, ws)
            elif m <= 4 * M4.MAX_ROWS:  # the same GEMV a launch per MAX_ROWS rows
                cells["MMA GEMV chunks"] = time_graph(
                    lambda x, w: M4.int4_gemv_mma_rows(x, w[3], w[1], w[2], 128), x, ws)
            picked = T4.pick_gemm_config(m, n, 128)
            for c in INT4_GEMM_CANDIDATES:
                if c.bm > max(16, m):
                    continue
                label = f"{c.bm}x{c.bn}x{c.bk}/{c.warps}w{c.stages}s/{c.split}"
                try:
                    cells[label + ("*" if c == picked else "")] = time_graph(gemm(c), x, ws)
                except Exception as e:  # a tile that does not compile: say so, go on
                    print(f"  {label} failed ({type(e).__name__}: {str(e)[:80]})")
                    torch.cuda.synchronize()
            best = min((t, lab) for lab, t in cells.items() if lab != "bf16")
            print(f"{name:<8}{m:>6} best {best[1]} {best[0] * 1e6:.1f} us = "
                  f"{bf16 / best[0]:.2f}x bf16 ({flop / best[0] / 1e12:.0f} TF/s); " +
                  " | ".join(f"{lab} {t * 1e6:.1f}" for lab, t in cells.items()), flush=True)
        del ws, dense
        torch.cuda.empty_cache()


W8A8_CANDIDATES = [W8.W8A8Config(*c) for c in
                   [(64, 4, 4, 1), (64, 4, 4, 2), (64, 4, 4, 4), (64, 4, 6, 4),
                    (128, 4, 4, 1), (128, 4, 4, 2), (128, 4, 4, 4), (128, 4, 4, 8),
                    (128, 8, 4, 1), (128, 8, 4, 4), (256, 8, 4, 4)]]


def gemm_route(x: torch.Tensor, w: tuple[torch.Tensor, torch.Tensor],
               silu: bool) -> torch.Tensor:
    """The engine's FP8 product past the GEMVs' rows: the W8A8 GEMM, which fuses
    no SiLU-and-mul, so the activation's own kernel follows."""
    y = F8.fp8_linear(x, w[0], w[1], 0, 1, None)
    return silu_and_mul(y) if silu else y


def w8a8_sweep(rows: list[int], out_json: str | None) -> None:
    """The W8A8 GEMV's tiles at each row count (gate_up with its SiLU-and-mul, as
    the engine runs it) beside the engine's route with x in bf16 (the tensor-core
    GEMV reading the weight where it lies, up to its GEMV_ROWS; past them the W8A8
    GEMM, then the activation's own kernel) and the bf16 GEMV on bf16 weights,
    same run; the best tile per shape and row count into `out_json`."""
    import json

    best = {}
    for m in rows:
        for name, k, n in SHAPES:
            silu = name == "gate_up"
            x = torch.randn(m, k, device=DEV).bfloat16()
            ws = copies(lambda n=n, k=k: fp8_weights(n, k, False)[:2], n * k)
            if m <= F8M.GEMV_ROWS:
                base = [("route, x bf16", lambda x, w, s=silu: F8.fp8_linear(
                    x, w[0], w[1], 0, 1, None, silu_mul=s, mma=w[0]))]
            else:
                base = [("route, W8A8 GEMM", lambda x, w, s=silu: gemm_route(x, w, s))]
            calls = [(c.label(), lambda x, w, c=c, s=silu: W8.fp8_gemv_w8a8(
                x, w[0], w[1], config=c, silu_mul=s)) for c in W8A8_CANDIDATES]
            res = []
            for label, call in base + calls:
                try:
                    res.append((time_graph(call, x, ws), label))
                except Exception as e:  # a tile that does not compile: say so, go on
                    print(f"    {label}: failed ({type(e).__name__}: {str(e)[:120]})")
            del ws
            bf = copies(lambda n=n, k=k: (torch.randn(n, k, device=DEV) * 0.02).bfloat16(),
                        2 * n * k)
            t_bf = time_graph(lambda x, w: gemv(x, w), x, bf) if m <= 8 else float("nan")
            del bf
            torch.cuda.empty_cache()
            t_route = res[0][0]
            ranked = sorted(res[1:])
            print(f"{name} rows {m}: bf16 GEMV {t_bf * 1e6:.1f} us ({2 * n * k / t_bf / 1e12:.2f}"
                  f" TB/s); route {t_route * 1e6:.1f} us ({n * k / t_route / 1e12:.2f} TB/s)")
            for t, label in ranked:
                print(f"    {label}: {t * 1e6:.1f} us, {n * k / t / 1e12:.2f} TB/s, "
                      f"{t_route / t:.2f}x route")
            if ranked:
                best[f"{m},{n},{k}"] = ranked[0][1]
            if out_json:  # after each shape: a cut-off run keeps what it measured
                with open(out_json, "w") as f:
                    json.dump(best, f)


def act_quant(rows: list[int]) -> None:
    """Per-token FP8 activation quantization (what the W8A8 GEMM's input goes
    through) at the projections' input widths, beside torch's quantization
    (amax, divide, cast) and torch's bare cast to FP8 (the same bytes read and
    written, no scale: the floor an elementwise kernel reaches). The input
    stays in L2 between calls, as the norm's output does in a step. us a call."""
    forms: dict[str, Call] = {
        "ours": lambda x, _: F8.quantize_activations(x),
        "torch": lambda x, _: quantize_rows(x),
        "torch cast": lambda x, _: x.to(FP8),
    }
    print(f"{'K':>6}{'rows':>6} | " + " | ".join(f"{f:>12}" for f in forms))
    for k in (4096, 14336):
        for m in rows:
            x = torch.randn(m, k, device=DEV).bfloat16()
            cells = [f"{time_graph(fn, x, [None]) * 1e6:12.2f}" for fn in forms.values()]
            print(f"{k:>6}{m:>6} | " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=None,
                        help="comma-separated (default 1,8,64,4096; --gemm-sweep 256,4096)")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--fp8-only", action="store_true", help="--sweep: no int4 tiles")
    parser.add_argument("--int4-only", action="store_true", help="--sweep: no FP8 tiles")
    parser.add_argument("--gemm-sweep", action="store_true")
    parser.add_argument("--accum-sweep", action="store_true",
                        help="per-channel W8A8: promoted vs fast accumulation, time and error")
    parser.add_argument("--mma-launch", action="store_true")
    parser.add_argument("--int4-gemm-sweep", action="store_true")
    parser.add_argument("--pdl", action="store_true", help="launch with PDL, as the engine does")
    parser.add_argument("--w8a8-sweep", action="store_true")
    parser.add_argument("--split-sweep", action="store_true")
    parser.add_argument("--head-sweep", action="store_true",
                        help="the LM head at one row: bf16 GEMV vs the FP8 GEMV's forms")
    parser.add_argument("--json", default=None, help="--w8a8-sweep: best tiles to this file")
    parser.add_argument("--act-quant", action="store_true",
                        help="per-token activation quantization: ours, torch, the bare cast")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"PDL {pdl.set_pdl(args.pdl, DEV)}")
    if args.mma_launch:
        mma_launch()
    elif args.act_quant:
        act_quant([int(r) for r in (args.rows or "64,256,1024,4096").split(",")])
    elif args.split_sweep:
        split_sweep(int(args.rows or 1))
    elif args.head_sweep:
        head_sweep()
    elif args.w8a8_sweep:
        w8a8_sweep([int(r) for r in (args.rows or "1").split(",")], args.json)
    elif args.sweep:
        sweep(fp8=not args.int4_only, int4=not args.fp8_only)
    elif args.int4_gemm_sweep:
        int4_gemm_sweep([int(r) for r in (args.rows or "16,32,64,128,256").split(",")])
    elif args.accum_sweep:
        accum_sweep([int(r) for r in (args.rows or "4096").split(",")])
    elif args.gemm_sweep:
        gemm_sweep([int(r) for r in (args.rows or "256,4096").split(",")])
    else:
        table([int(r) for r in (args.rows or "1,8,64,4096").split(",")])


if __name__ == "__main__":
    main()
