"""`fused_experts`: a MoE layer's routed experts on the GPU, in four launches (the
aligned path) or, at a few tokens, two (the direct path).

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t)),
    e = topk_ids[t, j], act = SiLU (default), GELU (erf) or GELU-tanh

The aligned path:
1. `moe_align_block_size`: the (token, expert) pairs sorted by expert, each group
   padded to BLOCK_M rows (`moe_align.py`).
2. Grouped GEMM gate/up with act-and-mul fused: each row block reads only its
   expert's weights, so a decode step reads just the selected experts.
3. Grouped GEMM down, each row multiplied by its routing weight, written per pair.
4. The sum over top-k (`moe_sum.py`), which also drops pairs with id -1.

The direct path (`moe_gemv.py`), taken when T * k <= DIRECT_MAX_PAIRS and <= E / 4
(or T = 1: with few experts tokens share them, and each pair reads its own): a GEMV
per pair for gate/up with act-and-mul fused, then a GEMV per token for down that sums
its k weighted rows itself; no alignment (which pads one token to BLOCK_M rows per
expert), no sum kernel. Same rounding points, so both paths agree closely (not
bitwise: the K sums run in another order). Block scales run on the aligned path.

Contract:
- hidden_states [T, H] contiguous, bf16 / fp16 / fp32; w13 [E, 2I, H] (gate rows
  then up rows per expert) and w2 [E, H, I], contiguous along the last dim (rows
  and experts may be strided), hidden's dtype (or any
  dtype with scales: FP8 experts, below); topk_weights [T, k] float32 (already
  renormalised); topk_ids [T, k] int32 local expert ids, an id outside [0, E)
  (-1: an expert on another rank) contributes nothing. All on one device.
- Returns [T, H] in hidden's dtype: `out` if given ([T, H], that dtype, last dim
  contiguous), written in full. fp32 accumulation; the gate and up products and
  each pair's weighted row are rounded to hidden's dtype, as an unfused bf16 layer
  rounds them; the top-k sum is fp32 with one rounding.
- No host synchronisation and no data-dependent shapes: every buffer is sized
  from shapes, so the call can be captured in a CUDA graph (after one eager call
  per token count, which compiles the kernels). Configs come from the committed
  table or the heuristic (`configs.py`), keyed by shapes only.
- FP8 experts (weight-only): w13 / w2 in another dtype (float8_e4m3fn) with float32
  `w13_scale` / `w2_scale`: per expert and output channel ([E, 2I] / [E, H]), or,
  with `block_shape=(bn, bk)`, per [bn, bk] weight block ([E, cdiv(2I, bn),
  cdiv(H, bk)] / [E, cdiv(H, bn), cdiv(I, bk)]). Tiles are converted to the
  activations' dtype in registers; activations are not quantized.
- Runs on CUDA, or on CPU tensors under the Triton interpreter (`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace

import torch
import triton

from radixlm.layers.moe.torch_ref import scale_shape
from radixlm.layers.moe.triton_ops.configs import (
    ConfigTable,
    GemmTile,
    MoEConfig,
    fit_tile,
    get_config,
)
from radixlm.layers.moe.triton_ops.grouped_gemm import ACT_CODES, moe_gemm_kernel
from radixlm.layers.moe.triton_ops.moe_align import AlignedPairs, moe_align_block_size
from radixlm.layers.moe.triton_ops.moe_gemv import moe_gemv
from radixlm.layers.moe.triton_ops.moe_sum import moe_sum

ACTIVATIONS = tuple(ACT_CODES)  # silu, gelu (erf), gelu_tanh: act(gate) * up
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Tokens per pass: bounds the workspaces ([rows, I] and [T * k, H]) at long prefills.
CHUNK_TOKENS = 16384
# Auto picks the direct path up to this many (token, expert) pairs (and E / 4):
# Qwen3-30B-A3B's and OLMoE's decode at 1-2 tokens (top-8), Mixtral's at 1, where
# an H200 measured direct at 1.00-1.12x aligned; from 4 tokens on aligned wins
# (0.43-0.96x), as it shares each expert's weights between its tokens.
DIRECT_MAX_PAIRS = 16


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  activation: str = "silu", out: torch.Tensor | None = None,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block_shape: Sequence[int] | None = None, config: MoEConfig | None = None,
                  table: ConfigTable | None = None,
                  fuse_activation: bool = True, direct: bool | None = None) -> torch.Tensor:
    """The routed experts' sum for every token (see the module docstring).

    `direct`: None picks the direct path where T * k <= min(DIRECT_MAX_PAIRS,
    max(k, E // 4)) and it can compute the call (no block scales, fused
    activation); True forces it (refusing what it cannot compute); False forces
    the aligned path. On the aligned path
    `config` (else `table`, else the committed table, else the heuristic) picks the
    tiles; `fuse_activation=False` runs gate/up as a plain grouped GEMM into
    [rows, 2I] and act-and-mul as its own kernel (the benchmark's comparison)."""
    _check_inputs(hidden_states, w13, w2, topk_weights, topk_ids, activation, out,
                  w13_scale, w2_scale, block_shape)
    t, h = hidden_states.shape
    if out is None:
        out = torch.empty_like(hidden_states)
    if use_direct(direct, topk_ids.numel(), topk_ids.shape[1], w13.shape[0], block_shape,
                   fuse_activation):
        if t:
            moe_gemv(hidden_states, w13, w2, topk_weights, topk_ids, out, activation,
                     w13_scale, w2_scale)
        return out
    for lo in range(0, t, CHUNK_TOKENS):
        hi = min(t, lo + CHUNK_TOKENS)
        cfg = config or get_config(hi - lo, w13.shape[0], h, w2.shape[2], topk_ids.shape[1],
                                   hidden_states.dtype, hidden_states.device, table)
        _fused_chunk(hidden_states[lo:hi], w13, w2, topk_weights[lo:hi], topk_ids[lo:hi],
                     out[lo:hi], w13_scale, w2_scale, block_shape, cfg, activation,
                     fuse_activation)
    return out


def use_direct(direct: bool | None, pairs: int, top_k: int, num_experts: int,
                block_shape: Sequence[int] | None, fuse_activation: bool) -> bool:
    """Whether the call takes the direct path; `direct=True` refuses, by name, what
    that path does not compute."""
    if direct is False:
        return False
    unsupported = []
    if block_shape is not None:
        unsupported.append(f"block_shape={tuple(block_shape)} (block scales)")
    if not fuse_activation:
        unsupported.append("fuse_activation=False")
    if direct and unsupported:
        raise ValueError(f"fused_experts: direct=True does not support "
                         f"{' or '.join(unsupported)}: pass direct=None or False")
    # Each pair reads its expert's weights itself, where the aligned path reads an
    # expert once for all its tokens: with few experts (Mixtral's 8) tokens share
    # them and the direct path lost on an H200 (T = 4, top-2: 505 vs 473 us).
    few_pairs = pairs <= min(DIRECT_MAX_PAIRS, max(top_k, num_experts // 4))
    return bool(direct) or (not unsupported and few_pairs)


def _check_inputs(x, w13, w2, topk_weights, topk_ids, activation, out, w13_scale, w2_scale,
                  block_shape) -> None:
    """Refuse, by name, any input the kernels cannot compute as the contract says."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_experts: activation={activation!r} is not implemented "
                         f"(supported: {', '.join(ACTIVATIONS)})")
    _check_hidden(x, out)
    _check_weights(x, w13, w2)
    _check_routing(x, topk_weights, topk_ids)
    _check_scales(w13, w13_scale, "w13", x.dtype, block_shape)
    _check_scales(w2, w2_scale, "w2", x.dtype, block_shape)
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("fused_experts runs Triton kernels: CUDA tensors, or "
                         "TRITON_INTERPRET=1 for CPU tensors")
    for name, tensor in (("w13", w13), ("w2", w2), ("topk_weights", topk_weights),
                         ("topk_ids", topk_ids)):
        if tensor.device != x.device:
            raise ValueError(f"fused_experts: {name} is on {tensor.device}, hidden_states on "
                             f"{x.device}")


def _check_hidden(x: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dtype not in DTYPES:
        raise ValueError(f"fused_experts: hidden_states dtype {x.dtype} is not one of "
                         f"bfloat16, float16, float32")
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"fused_experts: hidden_states must be a contiguous [T, H], "
                         f"got shape {tuple(x.shape)}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"fused_experts: out must be {list(x.shape)} {x.dtype} with a "
                         f"contiguous last dim, got {out.dtype} {tuple(out.shape)}")


def _check_weights(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    h = x.shape[1]
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"fused_experts: w13 must be [E, 2I, H={h}] and w2 [E, H, I], got "
                         f"{tuple(w13.shape)} and {tuple(w2.shape)}")
    e, inter = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (e, h, inter):
        raise ValueError(f"fused_experts: w2 must be [E={e}, H={h}, I={inter}] to match w13, "
                         f"got {tuple(w2.shape)}")
    # Rows may be strided (online FP8 stacks keep each row's scale after its codes):
    # the kernel reads the expert and row strides, and K contiguous.
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("fused_experts: w13 and w2 must be contiguous along their last dim")


def _check_routing(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    t = x.shape[0]
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"fused_experts: topk_ids must be int32 [T={t}, k], got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)} (cast once after the top-k)")
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"fused_experts: topk_weights must be float32 {tuple(topk_ids.shape)}, "
                         f"got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("fused_experts: topk_ids and topk_weights must be contiguous")


def _check_scales(w: torch.Tensor, scale: torch.Tensor | None, name: str, act: torch.dtype,
                  block_shape: Sequence[int] | None) -> None:
    if scale is None:
        if w.dtype != act:
            raise ValueError(f"fused_experts: {name} is {w.dtype} but hidden_states {act}: "
                             f"other weight dtypes need {name}_scale")
        if block_shape is not None:
            raise ValueError(f"fused_experts: block_shape given without {name}_scale")
        return
    want = scale_shape(w, block_shape)
    if (scale.dtype != torch.float32 or tuple(scale.shape) != want
            or not scale.is_contiguous()):
        raise ValueError(f"fused_experts: {name}_scale must be a contiguous float32 {want} for "
                         f"block_shape={block_shape}, got {scale.dtype} {tuple(scale.shape)}")
    if w.dtype.itemsize > act.itemsize:
        raise ValueError(f"fused_experts: {name} ({w.dtype}) is wider than the activations "
                         f"({act}); scaled weights are narrower (FP8)")


def _fused_chunk(x, w13, w2, topk_weights, topk_ids, out, w13_scale, w2_scale, block_shape,
                 cfg: MoEConfig, activation: str, fuse_activation: bool) -> None:
    t, h = x.shape
    if t == 0:
        return
    e, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    aligned = moe_align_block_size(topk_ids, e, cfg.block_m)
    rows = aligned.sorted_ids.numel()
    if fuse_activation:
        act = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
        _grouped_gemm(x, w13, act, aligned, w13_scale, block_shape, cfg.gate_up, topk_weights,
                      n=inter, k=h, top_k=top_k, activation=activation)
    else:
        gate_up = torch.empty((rows, 2 * inter), dtype=x.dtype, device=x.device)
        # Twice the columns of one weight tile: the fused tile's gate + up, same registers.
        wide = replace(cfg.gate_up, block_n=2 * cfg.gate_up.block_n)
        _grouped_gemm(x, w13, gate_up, aligned, w13_scale, block_shape, wide, topk_weights,
                      n=2 * inter, k=h, top_k=top_k)
        act = _act_and_mul(gate_up, activation)
    per_pair = torch.empty((t * top_k, h), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, per_pair, aligned, w2_scale, block_shape, cfg.down, topk_weights,
                  n=h, k=inter, top_k=1, a_sorted=True, c_by_pair=True, mul_weight=True)
    moe_sum(per_pair, topk_ids, e, out)


def _act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """The unfused variant's activation kernel: [rows, 2I] -> [rows, I]."""
    from radixlm.layers.fused_ops import gelu_tanh_and_mul, silu_and_mul

    if activation == "silu":
        return silu_and_mul(gate_up)
    if activation == "gelu_tanh":
        return gelu_tanh_and_mul(gate_up)
    inter = gate_up.shape[1] // 2
    return (torch.nn.functional.gelu(gate_up[:, :inter].float())
            * gate_up[:, inter:].float()).to(gate_up.dtype)


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, aligned: AlignedPairs,
                  b_scale: torch.Tensor | None, block_shape: Sequence[int] | None,
                  tile: GemmTile, topk_weights: torch.Tensor, *, n: int, k: int, top_k: int,
                  activation: str | None = None, a_sorted: bool = False,
                  c_by_pair: bool = False, mul_weight: bool = False) -> None:
    """One launch of `moe_gemm_kernel` over the aligned rows; n is the output width
    (I for the fused gate/up with `activation`, whose B holds 2I rows)."""
    if b_scale is None:
        scale_mode, sbn, sbk, scale = 0, 1, 1, topk_weights  # any pointer: never read
        strides = (0, 0, 0)
    elif block_shape is None:
        scale_mode, sbn, sbk, scale = 1, 1, 1, b_scale
        strides = (b_scale.stride(0), b_scale.stride(1), 0)
    else:
        scale_mode, (sbn, sbk), scale = 2, block_shape, b_scale
        strides = (b_scale.stride(0), b_scale.stride(1), b_scale.stride(2))
    tile = fit_tile(tile, n, k, aligned.block_m, a.element_size(), b.element_size(),
                    2 if activation else 1, sbk if scale_mode == 2 else None)
    blocks_m = aligned.expert_ids.numel()
    grid = (blocks_m * triton.cdiv(n, tile.block_n),)
    moe_gemm_kernel[grid](
        a, b, c, scale, topk_weights, aligned.sorted_ids, aligned.expert_ids,
        aligned.num_post_padded, n, k, topk_weights.numel(), blocks_m,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0), *strides,
        TOP_K=top_k, A_SORTED=a_sorted, C_BY_PAIR=c_by_pair, ACT_MUL=activation is not None,
        ACT=ACT_CODES.get(activation, 0), MUL_WEIGHT=mul_weight, SCALE=scale_mode,
        SCALE_BN=sbn, SCALE_BK=sbk,
        EVEN_K=k % tile.block_k == 0, DOT_PREC="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=aligned.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        GROUP_M=tile.group_m, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )
