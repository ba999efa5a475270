"""What a decode step would gain if some of its small kernels cost nothing: each chosen
kind of kernel is left out of the decode CUDA graphs, then a benchmark runs as usual.

    ABLATE=router python benchmarks/decode_ablation.py benchmarks/moe_decode.py --skip-hf
    ABLATE=norm,s2 python benchmarks/decode_ablation.py -m radixlm.bench quant \\
        --quantizations fp8 $M --cuda-graph-max-bs 8 --output-len 128
    python benchmarks/decode_ablation.py benchmarks/moe_decode.py --skip-hf   # nothing left out

TIMING ONLY: the outputs are wrong, by design. The figure it gives is a ceiling: no
fusion or rewrite of those kernels can gain more than leaving them out does (the
bytes the step must read stay; only the launches, their memory round trips and
their place in the chain of dependent kernels go). Kinds (`ABLATE`, comma-separated):

- `norm`: every RMSNorm kernel (fused residual add included: the residual stream
  then stops being updated);
- `s2`: decode attention's second stage (the merge of the splits);
- `rope`: the RoPE kernel, with the K/V store it carries (and the int4 qkv
  product's split-K sum, which it adds: `layers/split_sums.py`);
- `router`: the MoE router, both launches: a fixed table of distinct expert ids
  (`ABLATE_EXPERTS`, "128,8" by default: experts, top-k) with equal weights, so
  the experts still read k experts' weights a token;
- `topk`: the router's top-k launch only (its logits launch stays);
- `norm2`: the decoder layers' post-attention norm only;
- `logits`: the router's logits launch only (the top-k sums fixed random logits).
- `ksum`: the split-K sums of the tensor-core GEMVs that still take a second
  launch (`mma_gemv.launch`: FP8 gate/up's with the fused SiLU; int4 gate/up's
  above 8 rows; int4 qkv's and gate/up's at 1-8 rows only under
  $RADIXLM_SPLIT_SUMS=launch, else the RoPE kernel adds qkv's and gate/up's
  program its own; the others add theirs in the program, `MmaConfig.cta_sum`);
  `ABLATE_KSUM_N` (comma-separated output widths) limits it to those products.

`norm2` and `logits` measure the layout before the norm was folded into the
router's logits kernel (`fused_norm_topk`): with either, MoE layers run the norm
and the two-launch router apart, as they did when the fold was chosen.

Only calls made while a CUDA graph is being captured are left out (prefill runs
eagerly and stays whole), so what is timed is the decode step of the graphs.
"""

from __future__ import annotations

import os
import runpy
import sys

import torch

from radixlm.layers import fused_ops
from radixlm.layers.attention import triton_backend
from radixlm.layers.attention.triton_ops import decode_attention
from radixlm.layers.moe.router import TopKRouter
from radixlm.layers.moe.triton_ops import topk as topk_ops
from radixlm.layers.norm import RMSNorm
from radixlm.models.decoder import DecoderLayer

KINDS = ("norm", "s2", "rope", "router", "topk", "norm2", "logits", "ksum")
capturing = torch.cuda.is_current_stream_capturing


def skip_norms() -> None:
    real = fused_ops.rms_norm

    def rms_norm(x, weight, eps, residual=None, *, pre_weight=None, use_triton=None):
        if x.is_cuda and capturing():
            return x if residual is None else (x, residual)
        return real(x, weight, eps, residual, pre_weight=pre_weight, use_triton=use_triton)
    fused_ops.rms_norm = rms_norm


def skip_stage2() -> None:
    real = decode_attention._decode_stage2_kernel

    class Launcher:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                if not capturing():
                    real[grid](*args, **kwargs)
            return launch
    decode_attention._decode_stage2_kernel = Launcher()


def skip_rope() -> None:
    real = fused_ops.apply_rope_

    def apply_rope_(positions, q, k, *args, **kwargs):
        if q.is_cuda and capturing():
            return q, k
        return real(positions, q, k, *args, **kwargs)
    fused_ops.apply_rope_ = apply_rope_
    triton_backend.apply_rope_ = apply_rope_  # imported by name there


def fix_routing(keep_logits: bool) -> None:
    experts, top_k = map(int, os.environ.get("ABLATE_EXPERTS", "128,8").split(","))
    # Made here, before any capture (a copy to the GPU cannot be captured): distinct
    # ids a row, a different draw for each row.
    ids = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(r))[:top_k]
                       for r in range(512)]).int().cuda()
    weights = torch.full((512, top_k), 1.0 / top_k, device="cuda")
    real = topk_ops.fused_topk

    def fused_topk(x, weight, k, renormalize, round_dtype=None):
        if not (x.is_cuda and capturing()) or (weight.shape[0], k) != (experts, top_k):
            return real(x, weight, k, renormalize, round_dtype)
        if keep_logits:
            topk_ops._logits(x, weight, topk_ops.logits_tiles(weight.shape[0], x.shape[1]))
        return weights[:x.shape[0]], ids[:x.shape[0]]
    topk_ops.fused_topk = fused_topk  # router.py imports it at each call


def unfold_norm() -> None:
    """MoE layers norm, then route in two launches (no `fused_norm_topk`)."""
    TopKRouter.route_after_norm = lambda self, x, residual, norm: None


def skip_post_attention_norms() -> None:
    real_init, real_forward = DecoderLayer.__init__, RMSNorm.forward

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.post_attention_layernorm.ablated = True

    def forward(self, x, residual=None, *args, **kwargs):
        if getattr(self, "ablated", False) and x.is_cuda and capturing():
            return x if residual is None else (x, residual)
        return real_forward(self, x, residual, *args, **kwargs)
    DecoderLayer.__init__, RMSNorm.forward = init, forward


def fix_logits() -> None:
    # Made before any capture: fixed random partial logits, as many rows as a graph has.
    partials = torch.randn(64, 512, 512, generator=torch.Generator().manual_seed(1)).cuda()
    real = topk_ops._logits

    def logits(x, weight, tiles):
        if not (x.is_cuda and capturing()):
            return real(x, weight, tiles)
        splits = -(-x.shape[1] // tiles.chunk_k)
        return partials[:splits, :x.shape[0], :weight.shape[0]]
    topk_ops._logits = logits


def skip_split_sums() -> None:
    from radixlm.layers.quantization.triton_ops import mma_gemv
    widths = {int(w) for w in os.environ.get("ABLATE_KSUM_N", "").split(",") if w}
    real = mma_gemv.sum_splits

    def sum_splits(ws, bias, y, silu_mul, *rest):
        if ws.is_cuda and capturing() and (not widths or y.shape[-1] in widths):
            return y
        return real(ws, bias, y, silu_mul, *rest)
    mma_gemv.sum_splits = sum_splits  # imported by name there


def main() -> None:
    chosen = [k for k in os.environ.get("ABLATE", "").split(",") if k]
    unknown = set(chosen) - set(KINDS)
    if unknown or len(sys.argv) < 2:
        sys.exit(f"ABLATE must name kinds among {KINDS} (got {sorted(unknown)}); "
                 "usage: decode_ablation.py SCRIPT|-m MODULE [ARGS...]")
    if "norm" in chosen:
        skip_norms()
    if "s2" in chosen:
        skip_stage2()
    if "rope" in chosen:
        skip_rope()
    if "router" in chosen or "topk" in chosen:
        fix_routing(keep_logits="router" not in chosen)
    if "norm2" in chosen or "logits" in chosen:
        unfold_norm()
    if "norm2" in chosen:
        skip_post_attention_norms()
    if "logits" in chosen:
        fix_logits()
    if "ksum" in chosen:
        skip_split_sums()
    print(f"decode_ablation: left out of the decode graphs: {chosen or 'nothing'}", flush=True)
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
