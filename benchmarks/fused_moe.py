"""Our fused MoE (`fused_experts`) vs a per-expert loop of cuBLAS GEMMs, on a GPU.

Per shape (Qwen3-30B-A3B, Mixtral-8x7B, OLMoE-1B-7B: one MoE layer, dummy bf16
weights) and token count: the aligned path's time (align, two grouped GEMMs, sum),
the direct path's (two GEMVs, `moe_gemv.py`; at T <= DIRECT_MAX_T only) and their
ratio, which `fused_experts` auto picks ("auto"), the time of the aligned kernels
with SiLU-and-mul as its own kernel ("unfused"), the peer's time, the ratio
peer / ours (ours: auto's pick), and at every T the bytes of the experts the
tokens selected divided by our time, beside the copy rate measured in the same
run (a decode step is bound by those bytes).

The peer is what a model without fused kernels runs: for each expert that has
tokens, gather them, `x @ w13[e].T` (cuBLAS), SiLU-and-mul in torch, `@ w2[e].T`
(cuBLAS), scale by the routing weights and `index_add_` into the output. Its
token lists are computed before timing (a real loop would also sync the host
once per layer to get them), so both sides are timed as CUDA graphs: GROUP calls
back to back, each on its own routing (different experts at small T, so the L2
holds no weights between calls), replayed REPS times; min / median / max of the
replays, per call.

    python benchmarks/fused_moe.py                        # all shapes, T = 1 2 4 8 16 64 512 4096
    python benchmarks/fused_moe.py --configs tuned.json   # configs from a tuning run

The table is printed and, with --out (default $OUT/fused_moe.txt when $OUT is
set), written to a file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixlm.layers.moe.triton_ops.configs import ConfigTable, get_config
from radixlm.layers.moe.triton_ops.fused_moe import fused_experts, use_direct

SHAPES = {  # name: (experts, hidden, moe intermediate, top_k)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "olmoe-1b-7b": (64, 2048, 1024, 8),
}
TOKENS = (1, 2, 4, 8, 16, 64, 512, 4096)
DIRECT_MAX_T = 16  # the direct path is timed up to here, whatever auto picks
GROUP = 8  # calls per graph, each with its own routing
REPS = 5
NOMINAL_COPY = 4.2e12  # the H200's copy rate, bytes/s, for reference
DEV = torch.device("cuda")
DT = torch.bfloat16


def time_graph(fns: list[Callable[[], object]], reps: int = REPS) -> tuple[float, float, float]:
    """(min, median, max) seconds per call of a CUDA graph running `fns` in order."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile, pick cuBLAS kernels, outside capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for fn in fns:
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / len(fns))
    del graph
    return min(times), statistics.median(times), max(times)


def copy_rate() -> float:
    """(read + write) bytes / s of a 1 GiB device copy."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    _, med, _ = time_graph([lambda: b.copy_(a)] * 4)
    return 2 * a.numel() / med


def make_layer(e: int, h: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.empty(e, 2 * inter, h, dtype=DT, device=DEV).normal_(0, h ** -0.5)
    w2 = torch.empty(e, h, inter, dtype=DT, device=DEV).normal_(0, inter ** -0.5)
    return w13, w2


def make_routings(t: int, e: int, k: int, count: int,
                  gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(count):
        logits = torch.randn(t, e, generator=gen, device=DEV)
        w, ids = logits.softmax(-1).topk(k, dim=-1)
        out.append(((w / w.sum(-1, keepdim=True)).float().contiguous(),
                    ids.to(torch.int32).contiguous()))
    return out


def expert_groups(topk_weights: torch.Tensor, topk_ids: torch.Tensor, e: int):
    """[(expert, token indices, weights)] for the experts with tokens (host side, untimed)."""
    groups = []
    for x in range(e):
        tok, slot = (topk_ids == x).nonzero(as_tuple=True)
        if tok.numel():
            groups.append((x, tok, topk_weights[tok, slot][:, None].to(DT)))
    return groups


def peer_layer(x, w13, w2, groups, out) -> torch.Tensor:
    inter = w2.shape[2]
    out.zero_()
    for e, tok, w in groups:
        h = x.index_select(0, tok) @ w13[e].T
        act = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (act @ w2[e].T) * w)
    return out


def selected_bytes(routings, h: int, inter: int) -> float:
    """Mean bytes of the distinct experts each routing selects (w13 and w2, bf16)."""
    per_expert = 3 * h * inter * DT.itemsize
    return statistics.mean(int(ids.unique().numel()) * per_expert for _, ids in routings)


def bench_case(name: str, t: int, layer, table: ConfigTable | None, gen) -> dict:
    e, h, inter, k = SHAPES[name]
    w13, w2 = layer
    routings = make_routings(t, e, k, GROUP, gen)
    x = torch.randn(t, h, generator=gen, device=DEV).to(DT)
    outs = [torch.empty_like(x) for _ in routings]
    peer_outs = [torch.empty_like(x) for _ in routings]
    groups = [expert_groups(w, ids, e) for w, ids in routings]

    def ours(fuse: bool, direct: bool) -> list[Callable[[], object]]:
        return [lambda r=r, o=o: fused_experts(x, w13, w2, r[0], r[1], out=o, table=table,
                                               fuse_activation=fuse, direct=direct)
                for r, o in zip(routings, outs)]

    peer = peer_layer(x, w13, w2, groups[0], peer_outs[0]).double()
    t_aligned = time_graph(ours(True, False))
    err = {"aligned": rel_err(outs[0], peer)}
    t_direct = None
    if t <= DIRECT_MAX_T:
        t_direct = time_graph(ours(True, True))
        err["direct"] = rel_err(outs[0], peer)
    t_unfused = time_graph(ours(False, False))
    t_peer = time_graph([lambda g=g, o=o: peer_layer(x, w13, w2, g, o)
                         for g, o in zip(groups, peer_outs)])
    cfg = get_config(t, e, h, inter, k, DT, DEV, table)
    auto = "direct" if use_direct(None, t * k, k, e, None, True) else "aligned"
    return dict(aligned=t_aligned, direct=t_direct, unfused=t_unfused, peer=t_peer, auto=auto,
                ours=t_direct if auto == "direct" else t_aligned, err=max(err.values()),
                bytes=selected_bytes(routings, h, inter), block_m=cfg.block_m)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def fmt_times(ts: tuple[float, float, float] | None) -> str:
    return "-" if ts is None else "/".join(f"{v * 1e6:.1f}" for v in ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    ap.add_argument("--configs", help="a config table (JSON) to use instead of the committed one")
    ap.add_argument("--out", default=os.path.join(os.environ["OUT"], "fused_moe.txt")
                    if os.environ.get("OUT") else None)
    args = ap.parse_args()
    table = ConfigTable.load(args.configs) if args.configs else None
    lines: list[str] = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    gen = torch.Generator(device=DEV).manual_seed(0)
    copy = copy_rate()
    emit(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
         f"configs: {args.configs or 'committed table'}; 1 GiB copy {copy / 1e9:.0f} GB/s "
         f"(nominal {NOMINAL_COPY / 1e12:.1f} TB/s)")
    emit(f"times: us per call, min/median/max of {REPS} graph replays of {GROUP} calls")
    emit(f"{'shape':<14} {'T':>5} {'BM':>3} | {'aligned':>20} {'direct':>20} {'al/dir':>6} "
         f"{'auto':>7} | {'unfused':>20} {'peer (cuBLAS loop)':>22} | {'peer/ours':>9} "
         f"{'unf/al':>6} | {'sel. GB':>7} {'GB/s':>6} {'%copy':>6} {'%4.2T':>6} | "
         f"{'rel err':>8}")
    t0 = time.perf_counter()
    for name in args.shapes:
        e, h, inter, _ = SHAPES[name]
        layer = make_layer(e, h, inter)
        for t in args.tokens:
            r = bench_case(name, t, layer, table, gen)
            med = r["ours"][1]
            bw = r["bytes"] / med
            ratio = f"{r['aligned'][1] / r['direct'][1]:.2f}" if r["direct"] else "-"
            emit(f"{name:<14} {t:>5} {r['block_m']:>3} | {fmt_times(r['aligned']):>20} "
                 f"{fmt_times(r['direct']):>20} {ratio:>6} {r['auto']:>7} | "
                 f"{fmt_times(r['unfused']):>20} {fmt_times(r['peer']):>22} | "
                 f"{r['peer'][1] / med:>9.2f} {r['unfused'][1] / r['aligned'][1]:>6.2f} | "
                 f"{r['bytes'] / 1e9:>7.3f} {bw / 1e9:>6.0f} {100 * bw / copy:>5.0f}% "
                 f"{100 * bw / NOMINAL_COPY:>5.0f}% | {r['err']:>8.1e}")
        del layer
        torch.cuda.empty_cache()
    emit(f"({time.perf_counter() - t0:.0f} s)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
