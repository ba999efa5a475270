"""The small kernels of one MoE decode layer, each beside the rate its bytes allow:
the router (`fused_topk`) under candidate logits tiles, the direct path's down
kernel looped vs one-block (`GemvTiles.hoist`), and the one-row bf16 GEMV tiles
on the layer's attention projections. Batch 1, dummy bf16 weights of a
`fused_moe.SHAPES` entry with the attention dims of `moe_decode.SHAPES`.

    python benchmarks/moe_decode_kernels.py                  # Qwen3-30B-A3B's shape
    python benchmarks/moe_decode_kernels.py --shape mixtral-8x7b   # K > BK: no one-block down
    python benchmarks/moe_decode_kernels.py --pdl            # launched as the engine does
    python benchmarks/moe_decode_kernels.py --pdl --fp8      # the direct path on FP8 experts
    python benchmarks/moe_decode_kernels.py --pdl --mma      # FP8 experts on the tensor cores

Why: a single-stream profile of Qwen3-30B-A3B's shape (`decode_profile.py
--disable-pdl`, 2026-12-03) put the router's logits kernel at 11.3 us a call for
1 MiB of fp32 weights and the direct down kernel at 14.1 us for 25 MB, both far
below the copy rate; this names the tile that fixes each, in one run (its first
run moved the router's logits from a dot to the FMA tile now in `topk.py`).

Each variant: GROUP calls in one CUDA graph, each on other weights (so none sits
in L2), REPS replays; min / median / max microseconds per call. "roofline" is
the bytes the call must read at the copy rate measured in the same run. Every
variant is also checked against the first (the current default): router ids
equal and weights within 1e-5, a token's result bit for bit the same alone and
inside a 4096-token batch (batch invariance); down and GEMV outputs within 1 %.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
import triton
from fused_moe import DEV, DT, SHAPES, copy_rate, time_graph
from moe_decode import SHAPES as MODEL_SHAPES

from radixlm.layers import gemv as GV
from radixlm.layers import pdl
from radixlm.layers.moe.triton_ops import moe_gemv as MG
from radixlm.layers.moe.triton_ops import topk as TK

GROUP = 16
LOGITS_TILES = TK.logits_tiles  # the rule the router candidates vary (patched while timed)
# (BLOCK_T, BLOCK_E, programs aimed at for one token, BLOCK_K, warps); the first is
# `topk.logits_tiles` today (128 programs of 8 tokens x 16 experts x 128 features).
ROUTER_TILES = [(8, 16, 128, 32, 4), (16, 16, 128, 16, 4), (8, 16, 128, 32, 2), (8, 8, 256, 32, 4),
                (4, 16, 128, 32, 4), (8, 16, 64, 32, 4), (8, 32, 128, 32, 4)]
# Down (BN, BK, warps, hoist); the first is `pick_gemv_tiles` today (one block where
# K <= BK), the second the BN it replaced, the third the looped form before that.
DOWN_TILES = [(1, 1024, 4, True), (2, 1024, 4, True), (2, 1024, 4, False), (1, 1024, 4, False),
              (2, 1024, 8, True), (1, 1024, 8, True), (1, 1024, 2, True)]
# Gate/up (BN, BK, warps); the first is `pick_gemv_tiles` today. BK = H (2048 for
# Qwen3-30B-A3B) makes the loop one step: every load of a program in flight at once.
GATE_UP_TILES = [(2, 1024, 4), (1, 2048, 4), (2, 2048, 4), (2, 2048, 8), (4, 2048, 8),
                 (1, 2048, 2), (1, 1024, 2), (4, 1024, 4)]
# With FP8 experts (per-channel scales: online FP8) a tile holds half the bytes of
# bf16's: the candidates double BN or BK against the bf16 tiles; the first is
# `pick_gemv_tiles` today for FP8.
FP8_DOWN_TILES = [(8, 1024, 8, True), (1, 1024, 4, True), (2, 1024, 4, True),
                  (4, 1024, 4, True), (4, 1024, 8, True), (8, 1024, 4, True),
                  (16, 1024, 8, True)]
FP8_GATE_UP_TILES = [(4, 1024, 4), (2, 1024, 4), (2, 2048, 4), (4, 2048, 8), (8, 1024, 8),
                     (4, 1024, 8), (8, 1024, 4)]
GEMV_TILES = [(4, 1024, 4), (2, 1024, 4), (2, 2048, 4), (8, 512, 4), (4, 512, 4), (2, 512, 2),
              (1, 2048, 4), (4, 2048, 4), (8, 1024, 4), (2, 1024, 2)]


def fmt(ts: tuple[float, float, float], nbytes: float, rate: float) -> str:
    lo, med, hi = (t * 1e6 for t in ts)
    return (f"{lo:6.1f} / {med:6.1f} / {hi:6.1f} us  {nbytes / (med * 1e-6) / 1e12:5.2f} TB/s"
            f"  ({nbytes / rate * 1e6:5.1f} us at the copy rate)")


def router_tiles(e: int, h: int, bt: int, be: int, programs: int, bk: int,
                 warps: int) -> TK.LogitsTiles:
    """`topk.logits_tiles` (the unpatched one) with a candidate's knobs."""
    return LOGITS_TILES(e, h, block_t=bt, block_e=be, programs=programs, block_k=bk,
                        warps=warps)


def bench_router(e: int, h: int, k: int, rate: float) -> None:
    print(f"\nrouter, E {e}, H {h}, top-{k}: fused_topk (2 launches) at 1 token, then the "
          f"same call at 4096 tokens (prefill)")
    xs = torch.randn(4096, h, device=DEV).to(DT)
    ws = [torch.randn(e, h, device=DEV) * 0.02 for _ in range(GROUP)]
    base = None
    for cand in ROUTER_TILES:
        tiles = router_tiles(e, h, *cand)
        label = f"{tiles.block_t:>2} tok x {tiles.block_e:>2} experts x {tiles.chunk_k:>4}"
        programs = triton.cdiv(e, tiles.block_e) * triton.cdiv(h, tiles.chunk_k)
        label += f" ({programs:>3} programs), BK {tiles.block_k}, {tiles.warps}w"
        TK.logits_tiles = lambda e_, h_, tiles=tiles: tiles
        try:
            ts = time_graph([functools.partial(TK.fused_topk, xs[:1], w, k, True, DT) for w in ws])
            big = time_graph([functools.partial(TK.fused_topk, xs, ws[0], k, True, DT)] * 2)
            w1, i1 = TK.fused_topk(xs[:1], ws[0], k, True, DT)
            wb, ib = TK.fused_topk(xs, ws[0], k, True, DT)
        except Exception as err:  # noqa: BLE001 - a tile the compiler refuses
            print(f"  {label}: failed: {str(err).splitlines()[0][:100]}")
            continue
        finally:
            TK.logits_tiles = LOGITS_TILES
        base = base or (wb, ib)
        ok = (torch.equal(w1, wb[:1]) and torch.equal(i1, ib[:1]),
              (ib == base[1]).float().mean().item(), (wb - base[0]).abs().max().item())
        print(f"  {label}: {fmt(ts, e * h * 4, rate)}; 4096 tokens {big[1] * 1e6:7.1f} us;"
              f"  invariant {ok[0]}, ids same {ok[1]:.4f}, max |dw| {ok[2]:.1e}")


def _one_token(e: int, h: int, k: int):
    """x [1, H], GROUP routings of k distinct experts (one a layer's call), routing
    weights and the output row."""
    x = torch.randn(1, h, device=DEV).to(DT)
    gen = torch.Generator(device=DEV).manual_seed(0)
    ids = [torch.randperm(e, device=DEV, generator=gen)[:k].view(1, k).int() for _ in range(GROUP)]
    tw = torch.softmax(torch.randn(1, k, device=DEV), -1)
    return x, ids, tw, torch.empty(1, h, device=DEV, dtype=DT)


def _experts(e: int, h: int, inter: int, k: int, fp8: bool):
    """Two layers' experts (so a graph of GROUP calls alternates them and none sits in
    L2), their per-channel scales (FP8; None, None for bf16) and the bytes one
    token's k experts read."""
    wdt = torch.float8_e4m3fn if fp8 else DT
    std = 1.0 if fp8 else 0.02  # FP8 codes of N(0, 1); the 0.02 rides on the scales
    layers = [(torch.randn(e, 2 * inter, h, device=DEV).mul(std).to(wdt),
               torch.randn(e, h, inter, device=DEV).mul(std).to(wdt)) for _ in range(2)]
    scales = ((torch.full((e, 2 * inter), 0.02, device=DEV), torch.full((e, h), 0.02, device=DEV))
              if fp8 else (None, None))
    nbytes = k * (3 * h * inter * wdt.itemsize + (4 * (2 * inter + h) if fp8 else 0))
    return layers, scales, nbytes


def bench_down(e: int, h: int, inter: int, k: int, rate: float, fp8: bool = False) -> None:
    kind = "FP8 experts, per-channel scales" if fp8 else "bf16 experts"
    print(f"\ndirect path, E {e}, H {h}, I {inter}, top-{k}, 1 token, {kind}: gate/up + down, "
          f"one kernel's tiles varied, the other's the default")
    x, ids, tw, out = _one_token(e, h, k)
    layers, scales, nbytes = _experts(e, h, inter, k, fp8)
    default, ref = MG.pick_gemv_tiles, None
    down, gate_up = (FP8_DOWN_TILES, FP8_GATE_UP_TILES) if fp8 else (DOWN_TILES, GATE_UP_TILES)
    variants = ([("down", inter, MG.GemvTiles(bn, bk, w, hoist)) for bn, bk, w, hoist in down]
                + [("gate/up", h, MG.GemvTiles(bn, bk, w)) for bn, bk, w in gate_up])
    # GROUP layers' calls; each looks up `MG.pick_gemv_tiles` when it runs.
    calls = [lambda i=i: MG.moe_gemv(x, *layers[i % 2], tw, ids[i], out, "silu", *scales)
             for i in range(GROUP)]
    # The first graph timed in a process runs slow (clocks still rising): one
    # untimed pass of the defaults first, so the first variant's row is comparable.
    time_graph(calls)
    try:
        for name, k_varied, tiles in variants:
            def pick(p, n, kk, down=False, fp8=False, tiles=tiles, k_varied=k_varied):
                return tiles if kk == k_varied else default(p, n, kk, down, fp8)
            MG.pick_gemv_tiles = pick
            form = (" one-block" if tiles.hoist else " looped   ") if name == "down" else ""
            label = f"{name} BN {tiles.block_n} BK {tiles.block_k} {tiles.num_warps}w{form}"
            try:
                ts = time_graph(calls)
                y = MG.moe_gemv(x, *layers[0], tw, ids[0], out.clone(), "silu", *scales)
            except Exception as err:  # noqa: BLE001
                print(f"  {label}: failed: {str(err).splitlines()[0][:100]}")
                continue
            ref = y if ref is None else ref
            diff = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            print(f"  {label}: {fmt(ts, nbytes, rate)}  rel diff {diff:.1e}")
    finally:
        MG.pick_gemv_tiles = default


# (gate/up split, down split) of the FP8 experts' tensor-core path; the first is
# `moe_mma.pick_splits` at Qwen3-30B-A3B's shape.
MMA_SPLITS = [(2, 2), (4, 1), (1, 2), (2, 1), (1, 1), (4, 2)]


def bench_mma(e: int, h: int, inter: int, k: int, rate: float) -> None:
    """One token through the direct path: bf16 experts and FP8 experts on the FMA
    kernels at their default tiles, then FP8 on the tensor cores (`moe_mma`) at
    each split of MMA_SPLITS; rel diff against the FP8 FMA kernels."""
    from radixlm.layers.moe.triton_ops import moe_mma as MM

    print(f"\ndirect path, E {e}, H {h}, I {inter}, top-{k}, 1 token: gate/up + down; "
          f"default splits {tuple(MM.pick_splits(h, inter, k))}")
    x, ids, tw, out = _one_token(e, h, k)
    bf16, _, b16_bytes = _experts(e, h, inter, k, fp8=False)
    q8, scales, fp8_bytes = _experts(e, h, inter, k, fp8=True)

    def graph_of(fn):
        return [lambda i=i: fn(i) for i in range(GROUP)]

    time_graph(graph_of(lambda i: MG.moe_gemv(x, *bf16[i % 2], tw, ids[i], out, "silu",
                                              None, None)))  # clocks up, untimed
    ts = time_graph(graph_of(lambda i: MG.moe_gemv(x, *bf16[i % 2], tw, ids[i], out, "silu",
                                                   None, None)))
    print(f"  bf16, FMA kernels   : {fmt(ts, b16_bytes, rate)}")
    os.environ[MM.ENV] = "fma"
    try:
        ts = time_graph(graph_of(lambda i: MG.moe_gemv(x, *q8[i % 2], tw, ids[i], out, "silu",
                                                       *scales)))
        ref = MG.moe_gemv(x, *q8[0], tw, ids[0], out.clone(), "silu", *scales)
    finally:
        del os.environ[MM.ENV]
    print(f"  FP8, FMA kernels    : {fmt(ts, fp8_bytes, rate)}")
    for split in MMA_SPLITS:
        sp = MM.MmaSplits(*split)
        ts = time_graph(graph_of(lambda i, sp=sp: MM.moe_mma(x, *q8[i % 2], tw, ids[i], out,
                                                             "silu", *scales, split=sp)))
        y = MM.moe_mma(x, *q8[0], tw, ids[0], out.clone(), "silu", *scales, split=sp)
        diff = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        print(f"  FP8, MMA split {split[0]:2d}/{split[1]}: {fmt(ts, fp8_bytes, rate)}  "
              f"rel diff {diff:.1e}")


def bench_gemv(shapes: list[tuple[str, int, int]], rate: float) -> None:
    for name, n, k in shapes:
        print(f"\nbf16 GEMV, one row, {name} {k} -> {n}; default {GV.pick_config(1, n, k)}")
        ws = [torch.randn(n, k, device=DEV).to(DT) for _ in range(GROUP)]
        x = torch.randn(1, k, device=DEV).to(DT)
        ref = None
        for bn, bk, warps in GEMV_TILES:
            cfg = GV.GemvConfig("fma", bn, bk, warps, 1)
            ts = time_graph([lambda w=w, cfg=cfg, x=x: GV.gemv(x, w, config=cfg) for w in ws])
            y = GV.gemv(x, ws[0], config=cfg)
            ref = y if ref is None else ref
            diff = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            print(f"  {bn} x {bk} {warps}w: {fmt(ts, n * k * 2, rate)}  rel diff {diff:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b",
                    choices=sorted(set(SHAPES) & set(MODEL_SHAPES)))
    ap.add_argument("--pdl", action="store_true",
                    help="launch with programmatic dependent launch, as the engine does")
    ap.add_argument("--fp8", action="store_true",
                    help="only the direct path's tiles, bf16 then FP8 experts")
    ap.add_argument("--mma", action="store_true",
                    help="only FP8 experts on the tensor cores (moe_mma) beside the FMA kernels")
    args = ap.parse_args()
    pdl.set_pdl(args.pdl)
    e, h, inter, k = SHAPES[args.shape]
    cfg = MODEL_SHAPES[args.shape]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    rate = copy_rate()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__};"
          f" {args.shape}; copy rate {rate / 1e12:.2f} TB/s; PDL {pdl.pdl_on()}")
    if args.mma:
        bench_mma(e, h, inter, k, rate)
        return
    if args.fp8:  # the FMA kernels' tiles (FP8 experts would otherwise take moe_mma)
        os.environ["RADIXLM_MOE_GEMV"] = "fma"
        bench_down(e, h, inter, k, rate)
        bench_down(e, h, inter, k, rate, fp8=True)
        return
    bench_router(e, h, k, rate)
    bench_down(e, h, inter, k, rate)
    bench_gemv([("qkv", q + 2 * kv, h), ("o", h, q)], rate)


if __name__ == "__main__":
    main()
