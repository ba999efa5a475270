"""Kernel benchmark: `python -m radixlm.bench.kernels [--sweep | --fused-ops]` (CUDA).

Measures, in one run, the device's two ceilings (device-to-device copy
bandwidth, counting bytes read + written; bf16 8192^3 matmul rate on random
data) and then:
- decode attention (Llama-3.1-8B shape: 32 q heads, 8 KV heads, head_dim 128,
  bf16) over a pool with shuffled token slots: achieved GB/s of the bytes it
  must read (K and V of every token once, plus slot indices), against copy
  bandwidth, and torch SDPA (flash) on contiguous K/V of the same shape;
- extend attention (causal, ragged): achieved TFLOP/s of the useful FLOPs
  (4 * head_dim per visible (query, key, head)), against matmul TFLOP/s and SDPA;
- K/V store (one Triton launch vs two index_put);
- the fused ops against their torch paths (the norm and SiLU-and-mul writing
  FP8 rows against the op and then the activation quantization).
`--sweep` adds tile-config and split-count sweeps (how the defaults were chosen).
Timings are medians of `triton.testing.do_bench`, which flushes L2 between
repetitions (every layer's decode reads a different KV buffer, so cold L2 is
the honest case).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from radixlm.layers import fused_ops
from radixlm.layers.attention.triton_backend import TritonAttentionBackend
from radixlm.layers.attention.triton_ops.decode_attention import (
    alloc_decode_scratch,
    decode_attention_fwd,
)
from radixlm.layers.attention.triton_ops.extend_attention import (
    build_extend_block_table,
    extend_attention_fwd,
    extend_config,
)
from radixlm.layers.attention.triton_ops.kv_store import store_kv
from radixlm.layers.quantization.triton_ops import fp8 as fp8_ops

H, KVH, D = 32, 8, 128
DT = torch.bfloat16
DEV = torch.device("cuda")


def bench_ms(fn: Callable[[], object], rep: int = 100) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def measure_copy_gbs() -> float:
    n = 2 << 30  # 2 GiB, far past the 60 MB L2
    x = torch.empty(n, dtype=torch.uint8, device=DEV).random_()
    y = torch.empty_like(x)
    ms = bench_ms(functools.partial(y.copy_, x))
    return 2 * n / ms / 1e6


def measure_matmul_tflops() -> float:
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=DT)
    b = torch.randn(n, n, device=DEV, dtype=DT)
    ms = bench_ms(lambda: a @ b)
    return 2 * n ** 3 / ms / 1e9


def _sdpa(backends: list[str]) -> contextlib.AbstractContextManager:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, b) for b in backends])


def _try_sdpa(fn_by_backend: list[tuple[str, Callable[[], object]]]) -> tuple[str, float]:
    """First SDPA backend that runs: (name, median ms)."""
    for name, fn in fn_by_backend:
        try:
            with _sdpa([name]):
                fn()
                torch.cuda.synchronize()
                return name, bench_ms(fn)
        except Exception:  # no kernel of that backend for these inputs
            continue
    return "none", float("nan")


# ---------------------------------------------------------------- decode

def graph_ms(step: Callable[[], object], calls: int) -> float:
    """Median time of one `step` when `calls` of them are replayed as one CUDA graph.

    This is how decode runs in serving: no host launch gaps between kernels.
    """
    step()  # compile / pick kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            step()
    return bench_ms(graph.replay) / calls


class DecodeCase:
    """One decode batch; small cases get several "layers" (distinct K/V buffers)
    so one graph replay reads >= 1 GB and L2 cannot serve repeats."""

    def __init__(self, bs: int, seq: int) -> None:
        self.bs, self.seq = bs, seq
        n = bs * seq
        self.bytes = 2 * n * KVH * D * DT.itemsize + 4 * n + 2 * bs * H * D * DT.itemsize
        self.layers = max(1, min(64, -(-(256 << 20) // self.bytes)))
        self.reps = max(1, -(-(1 << 30) // (self.layers * self.bytes)))
        self.k_bufs = [torch.randn((n + 1, KVH, D), device=DEV, dtype=DT)
                       for _ in range(self.layers)]
        self.v_bufs = [torch.randn((n + 1, KVH, D), device=DEV, dtype=DT)
                       for _ in range(self.layers)]
        # Shuffled slots: the radix cache hands out scattered tokens.
        self.r2t = (torch.randperm(n, device=DEV) + 1).int().view(bs, seq)
        self.rows = torch.arange(bs, device=DEV)
        self.seq_lens = torch.full((bs,), seq, device=DEV)
        self.q = torch.randn((bs, H, D), device=DEV, dtype=DT)
        self.o = torch.empty_like(self.q)

    def _step(self, splits: int, **cfg: int) -> Callable[[], None]:
        mid_o, mid_lse = alloc_decode_scratch(self.bs, H, splits, D, DEV)
        it = iter(range(1 << 62))

        def fn() -> None:
            i = next(it) % self.layers
            decode_attention_fwd(self.q, self.k_bufs[i], self.v_bufs[i], self.o, self.r2t,
                                 self.rows, self.seq_lens, mid_o, mid_lse, splits, D ** -0.5,
                                 **cfg)
        return fn

    def eager_ms(self, splits: int, **cfg: int) -> float:
        return bench_ms(self._step(splits, **cfg))

    def graph_ms(self, splits: int, **cfg: int) -> float:
        return graph_ms(self._step(splits, **cfg), self.layers * self.reps)

    def check(self, splits: int) -> float:
        """Relative error of request 0 vs a float64 reference (sanity for the bench)."""
        self.o.fill_(float("nan"))
        self._step(splits)()
        sl = self.r2t[0].long()
        k = self.k_bufs[0][sl].double().repeat_interleave(H // KVH, 1)
        v = self.v_bufs[0][sl].double().repeat_interleave(H // KVH, 1)
        p = (torch.einsum("hd,nhd->hn", self.q[0].double(), k) * D ** -0.5).softmax(-1)
        ref = torch.einsum("hn,nhd->hd", p, v)
        return ((self.o[0].double() - ref).norm() / ref.norm()).item()

    def sdpa(self) -> tuple[str, float, float]:
        """(backend, eager ms, graph ms) of torch SDPA on contiguous K/V of the same shape."""
        ks = [torch.randn((self.bs, KVH, self.seq, D), device=DEV, dtype=DT)
              for _ in range(self.layers)]
        vs = [torch.randn_like(k) for k in ks]
        q = self.q.view(self.bs, H, 1, D)
        it = iter(range(1 << 62))

        def fn() -> torch.Tensor:
            i = next(it) % self.layers
            return F.scaled_dot_product_attention(q, ks[i], vs[i], enable_gqa=True)
        name, ms = _try_sdpa([("FLASH_ATTENTION", fn), ("EFFICIENT_ATTENTION", fn)])
        if name == "none":
            return name, ms, ms
        with _sdpa([name]):
            gms = graph_ms(fn, self.layers * self.reps)
        return name, ms, gms


# ---------------------------------------------------------------- extend

class ExtendCase:
    def __init__(self, reqs: list[tuple[int, int]], d: int = D) -> None:
        self.reqs, self.d = reqs, d
        self.prefix = [p for p, _ in reqs]
        self.ext = [e for _, e in reqs]
        total = sum(p + e for p, e in reqs)
        self.k_buf = torch.randn((total + 1, KVH, d), device=DEV, dtype=DT)
        self.v_buf = torch.randn((total + 1, KVH, d), device=DEV, dtype=DT)
        width = max(p + e for p, e in reqs)
        self.r2t = torch.zeros((len(reqs), width), dtype=torch.int32, device=DEV)
        perm = torch.randperm(total, device=DEV) + 1
        off = 0
        for i, (p, e) in enumerate(reqs):
            self.r2t[i, :p + e] = perm[off:off + p + e].int()
            off += p + e
        n = sum(self.ext)
        self.q = torch.randn((n, H, d), device=DEV, dtype=DT)
        self.o = torch.empty_like(self.q)
        self.rows = torch.arange(len(reqs), device=DEV)
        self.t_prefix = torch.tensor(self.prefix, device=DEV)
        self.t_ext = torch.tensor(self.ext, device=DEV)
        self.t_start = torch.tensor([sum(self.ext[:i]) for i in range(len(reqs))], device=DEV)
        # Useful FLOPs: QK^T and PV over each query's visible keys.
        visible = sum(e * p + e * (e + 1) // 2 for p, e in reqs)
        self.flops = 4 * d * H * visible

    def run_ms(self, **cfg: int) -> float:
        table = build_extend_block_table(self.prefix, self.ext, cfg["block_m"], DEV)

        def fn() -> None:
            extend_attention_fwd(self.q, self.o, self.k_buf, self.v_buf, self.r2t, self.rows,
                                 self.t_prefix, self.t_ext, self.t_start, table, self.d ** -0.5,
                                 **cfg)
        return bench_ms(fn)

    def sdpa_ms(self) -> tuple[str, float]:
        # Same-shape requests assumed (the cases below are uniform).
        p, e = self.reqs[0]
        bs = len(self.reqs)
        q = torch.randn((bs, H, e, self.d), device=DEV, dtype=DT)
        k = torch.randn((bs, KVH, p + e, self.d), device=DEV, dtype=DT)
        v = torch.randn_like(k)
        if p == 0:
            def fn() -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return _try_sdpa([("FLASH_ATTENTION", fn), ("EFFICIENT_ATTENTION", fn)])
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(e, p + e)
        # Lower-right causal bias has no GQA path in some versions: expand K/V there
        # (compute-bound, so the extra K/V bytes barely matter).
        ke = k.repeat_interleave(H // KVH, 1)
        ve = v.repeat_interleave(H // KVH, 1)

        def fn_gqa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)

        def fn_exp() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, ke, ve, attn_mask=bias)
        name, ms = _try_sdpa([("FLASH_ATTENTION", fn_gqa), ("EFFICIENT_ATTENTION", fn_gqa)])
        if ms != ms:
            name, ms = _try_sdpa([("FLASH_ATTENTION", fn_exp), ("EFFICIENT_ATTENTION", fn_exp)])
            name += "(kv expanded)"
        return name, ms


# ---------------------------------------------------------------- store, fused ops

def _index_put_store(k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                     loc: torch.Tensor) -> None:
    k_buf[loc] = k.view(-1, KVH, D)
    v_buf[loc] = v.view(-1, KVH, D)


def bench_kv_store() -> list[str]:
    rows = []
    pool_k = torch.randn((1 << 20, KVH, D), device=DEV, dtype=DT)
    pool_v = torch.randn_like(pool_k)
    for n in (32, 256, 16384):
        loc = torch.randperm((1 << 20) - 1, device=DEV)[:n] + 1
        k = torch.randn((n, KVH * D), device=DEV, dtype=DT)
        v = torch.randn_like(k)
        ip = functools.partial(_index_put_store, k, v, pool_k, pool_v, loc)
        tr = functools.partial(store_kv, k, v, pool_k, pool_v, loc)
        t_ip, t_tr = bench_ms(ip), bench_ms(tr)
        g_ip, g_tr = graph_ms(ip, 20), graph_ms(tr, 20)
        line = (f"kv-store n={n:<6} index_put x2 {t_ip * 1e3:6.1f} us (graph {g_ip * 1e3:6.1f})"
                f" | triton {t_tr * 1e3:6.1f} us (graph {g_tr * 1e3:6.1f}) | speed "
                f"{t_ip / t_tr:4.2f}x (graph {g_ip / g_tr:4.2f}x)")
        print(line, flush=True)
        rows.append(line)
    return rows


def bench_fused_ops() -> list[str]:
    rows = []
    part = functools.partial
    for n in (32, 8192):
        x = torch.randn((n, 4096), device=DEV, dtype=DT)
        r = torch.randn_like(x)
        w = torch.randn(4096, device=DEV, dtype=DT)
        gu = torch.randn((n, 2 * 14336), device=DEV, dtype=DT)
        qkv = torch.randn((n, (H + 2 * KVH) * D), device=DEV, dtype=DT)
        q, kk = qkv[:, :H * D], qkv[:, H * D:(H + KVH) * D]
        pos = torch.randint(0, 8192, (n,), device=DEV)
        cache = fused_ops.rope_cos_sin_cache(D, 8192, 500000.0, device=DEV)
        for label, tri, ref, peer in [
            ("add+rmsnorm 4096", part(fused_ops.rms_norm, x, w, 1e-5, r),
             part(fused_ops.rms_norm, x, w, 1e-5, r, use_triton=False), "torch"),
            ("silu_and_mul 14336", part(fused_ops.silu_and_mul, gu),
             part(fused_ops.silu_and_mul, gu, use_triton=False), "torch"),
            ("rope 32q+8k heads", part(fused_ops.apply_rope_, pos, q, kk, D, cache),
             part(fused_ops.apply_rope_, pos, q, kk, D, cache, use_triton=False), "torch"),
            # The FP8 rows for a W8A8 product written by the op itself (`Fp8Rows`)
            # against the op and then `quantize_activations`.
            ("add+rmsnorm->fp8", part(fused_ops.rms_norm, x, w, 1e-5, r, fp8_out=True),
             lambda x=x, w=w, r=r: fp8_ops.quantize_activations(
                 fused_ops.rms_norm(x, w, 1e-5, r)[0]), "2 launches"),
            ("silu_and_mul->fp8", part(fused_ops.silu_and_mul, gu, fp8_out=True),
             lambda gu=gu: fp8_ops.quantize_activations(fused_ops.silu_and_mul(gu)),
             "2 launches"),
        ]:
            t_tr, t_ref = bench_ms(tri), bench_ms(ref)
            g_tr, g_ref = graph_ms(tri, 20), graph_ms(ref, 20)
            line = (f"{label:<20} n={n:<5} triton {t_tr * 1e3:6.1f} us (graph {g_tr * 1e3:6.1f})"
                    f" | {peer} {t_ref * 1e3:6.1f} us (graph {g_ref * 1e3:6.1f}) | speed "
                    f"{t_ref / t_tr:5.2f}x (graph {g_ref / g_tr:5.2f}x)")
            print(line, flush=True)
            rows.append(line)
    return rows


def _sweep_extend(case: ExtendCase, cfgs: list[tuple[int, int, int, int]]) -> None:
    for bm, bn, nw, ns in cfgs:
        try:
            t = case.run_ms(block_m=bm, block_n=bn, num_warps=nw, num_stages=ns)
            print(f"   sweep m={bm} n={bn} warps={nw} stages={ns} {t * 1e3:8.1f} us "
                  f"{case.flops / t / 1e9:5.0f} TFLOP/s", flush=True)
        except Exception as e:  # out of shared memory and the like
            print(f"   sweep m={bm} n={bn} warps={nw} stages={ns} failed: {type(e).__name__}",
                  flush=True)


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also sweep tile configs and splits")
    ap.add_argument("--fused-ops", action="store_true", help="only the fused ops")
    args = ap.parse_args()
    if args.fused_ops:
        bench_fused_ops()
        return
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEV)
    print(f"device: {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}")
    copy_gbs = measure_copy_gbs()
    mm_tflops = measure_matmul_tflops()
    print(f"ceilings: copy {copy_gbs:.0f} GB/s (read+write), bf16 matmul {mm_tflops:.0f} TFLOP/s")
    backend = TritonAttentionBackend(H, KVH, D, DEV)
    rows: list[str] = []

    print("\n== decode attention (32 q / 8 kv heads, d128, bf16, shuffled slots) ==")
    print("   (eager: do_bench of one call, host launch gaps included; graph: per call inside"
          " a CUDA graph, as decode runs when serving)")
    for seq in (1024, 8192):
        for bs in (1, 32, 256):
            case = DecodeCase(bs, seq)
            splits = backend.num_kv_splits(bs)
            err = case.check(splits)
            ems, gms = case.eager_ms(splits), case.graph_ms(splits)
            gbs = case.bytes / gms / 1e6
            peer, pems, pgms = case.sdpa()
            pgbs = case.bytes / pgms / 1e6
            line = (f"decode bs={bs:<3} seq={seq:<5} splits={splits:<2} graph {gms * 1e3:7.1f} us "
                    f"{gbs:5.0f} GB/s = {gbs / copy_gbs:5.1%} of copy (eager {ems * 1e3:6.1f} us)"
                    f" | SDPA {peer[:5]} graph {pgms * 1e3:7.1f} us {pgbs:5.0f} GB/s (eager "
                    f"{pems * 1e3:6.1f} us) | speed vs SDPA {pgms / gms:4.2f}x | err {err:.1e}")
            print(line, flush=True)
            rows.append(line)
            if args.sweep and seq == 8192:
                s_opts = {1: [16, 32, 48, 64], 32: [1, 2, 3, 4, 6, 8], 256: [1, 2]}[bs]
                for s in s_opts:
                    t = case.graph_ms(s)
                    print(f"   sweep splits={s:<2} graph {t * 1e3:7.1f} us "
                          f"{case.bytes / t / 1e9:.2f} TB/s", flush=True)
                if bs == 32:
                    for bn, nw, ns in [(32, 2, 2), (32, 2, 4), (64, 2, 3), (32, 4, 3),
                                       (64, 4, 2)]:
                        t = case.graph_ms(splits, block_n=bn, num_warps=nw, num_stages=ns)
                        print(f"   sweep block_n={bn} warps={nw} stages={ns} graph "
                              f"{t * 1e3:7.1f} us {case.bytes / t / 1e9:.2f} TB/s", flush=True)
            del case
            torch.cuda.empty_cache()

    print("\n== extend attention (causal, 32 q / 8 kv heads, d128, bf16) ==")
    for name, reqs in [("8 x 2048 new, no prefix", [(0, 2048)] * 8),
                       ("8 x 512 new after 1536 prefix", [(1536, 512)] * 8)]:
        case = ExtendCase(reqs)
        cfg = extend_config(D, DT)
        ms = case.run_ms(**cfg)
        tf = case.flops / ms / 1e9
        peer, pms = case.sdpa_ms()
        ptf = case.flops / pms / 1e9
        line = (f"extend {name:<30} {ms * 1e3:8.1f} us {tf:5.0f} TFLOP/s = "
                f"{tf / mm_tflops:5.1%} of matmul | SDPA {peer} {pms * 1e3:8.1f} us "
                f"{ptf:5.0f} TFLOP/s | speed vs SDPA {pms / ms:4.2f}x")
        print(line, flush=True)
        rows.append(line)
        if args.sweep:
            _sweep_extend(case, [(64, 32, 4, 3), (64, 64, 4, 4), (128, 32, 4, 4),
                                 (64, 64, 4, 2), (128, 64, 4, 3)])
        del case
        torch.cuda.empty_cache()
    if args.sweep:
        case = ExtendCase([(0, 2048)] * 8, d=64)
        print("   head_dim 64, 8 x 2048 new, no prefix:")
        _sweep_extend(case, [(128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 3),
                             (128, 128, 8, 3)])
        del case

    print("\n== K/V store (8 kv heads x 128, bf16) ==")
    rows += bench_kv_store()
    print("\n== fused ops vs torch paths (bf16) ==")
    rows += bench_fused_ops()

    print("\n== summary ==")
    print(f"copy {copy_gbs:.0f} GB/s, bf16 matmul {mm_tflops:.0f} TFLOP/s")
    for line in rows:
        print(line)


if __name__ == "__main__":
    main()
