"""The fused-experts reference: what every MoE compute backend must return.

`fused_experts` is the contract the backends share (the Triton kernels, the
CPU path, this one). It computes, for each token t,

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(w13[e, :I] @ x[t]) * (w13[e, I:] @ x[t]))

with e = topk_ids[t, j]; pairs whose id is -1 (an expert held by another
expert-parallel rank) contribute nothing. This version is the oracle: it
visits only the experts that have tokens (tokens grouped by expert, one
matmul pair per expert), computes in float32 whatever the inputs' dtype, and
rounds once at the end. It synchronizes with the host (which experts have
tokens), so it is not CUDA-graph capturable; it is for tests and the
fallback on devices without a faster backend.

Scaled (FP8) weights: w13 / w2 in float8_e4m3fn with float32 `w13_scale` /
`w2_scale`, per expert and output row ([E, N]) or, with `block_shape=(bn, bk)`,
per weight block ([E, cdiv(N, bn), cdiv(K, bk)]), as the Triton kernels take
them; `expert_weight` dequantizes one expert's weight when it has tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# The gated activations an expert may use, by the name the backends take.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def expert_weight(w: torch.Tensor, scale: torch.Tensor | None,
                  block_shape: tuple[int, int] | None, expert: int) -> torch.Tensor:
    """Expert `expert`'s weight [N, K] of the stack `w` as float32: the weight itself,
    or its FP8 codes times `scale` (see the module docstring)."""
    from radixlm.layers.quantization.fp8 import Fp8Weight

    if scale is None:
        return w[expert].float()
    if block_shape is None:
        return Fp8Weight(w[expert], scale[expert]).dequantize()
    bn, bk = block_shape
    return Fp8Weight(w[expert], scale[expert], block_k=bk, scale_rows=bn).dequantize()


def scale_shape(w: torch.Tensor, block_shape: Sequence[int] | None) -> tuple[int, ...]:
    """The shape of the scales of the FP8 stack `w` [E, N, K]: [E, N] per row, or
    [E, cdiv(N, bn), cdiv(K, bk)] per block (the module docstring)."""
    e, n, k = w.shape
    if block_shape is None:
        return (e, n)
    bn, bk = block_shape
    return (e, -(-n // bn), -(-k // bk))


def check_scales(w: torch.Tensor, scale: torch.Tensor | None, name: str,
                 block_shape: tuple[int, int] | None) -> None:
    """ValueError unless `scale` fits the stack `w` (float weights need none)."""
    if scale is None:
        if not w.dtype.is_floating_point or w.dtype.itemsize == 1:
            raise ValueError(f"{name} is {w.dtype}: weights that are not floats need "
                             f"{name}_scale")
        if block_shape is not None:
            raise ValueError(f"block_shape given without {name}_scale")
        return
    want = scale_shape(w, block_shape)
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}_scale of shape {tuple(scale.shape)}: expected {want} for "
                         f"block_shape={block_shape}")


def check_inputs(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                 w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                 block_shape: tuple[int, int] | None = None) -> None:
    """ValueError unless the arguments have the shapes `fused_experts` takes."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {', '.join(ACTIVATIONS)}")
    if hidden_states.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected hidden [T, H], w13 [E, 2I, H], w2 [E, H, I]; got "
                         f"{tuple(hidden_states.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    tokens, hidden = hidden_states.shape
    experts, two_i, h13 = w13.shape
    if h13 != hidden or two_i % 2 or tuple(w2.shape) != (experts, hidden, two_i // 2):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit hidden "
                         f"size {hidden} (expected [E, 2I, {hidden}] and [E, {hidden}, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or \
            topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [{tokens}, k]")
    check_scales(w13, w13_scale, "w13", block_shape)
    check_scales(w2, w2_scale, "w2", block_shape)


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  activation: str = "silu", out: torch.Tensor | None = None,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block_shape: tuple[int, int] | None = None) -> torch.Tensor:
    """The routed experts' weighted sum, [T, H] in hidden_states' dtype (see the
    module docstring). hidden_states [T, H]; w13 [E_local, 2I, H] (gate rows, then
    up rows); w2 [E_local, H, I]; topk_weights [T, k] float32; topk_ids [T, k]
    int32 local ids, -1 to skip. `out`: written and returned when given. The
    scales: FP8 weights' (module docstring)."""
    check_inputs(hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_scale,
                 w2_scale, block_shape)
    act = ACTIVATIONS[activation]
    inter = w2.shape[2]
    acc = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).float()
    k = topk_ids.shape[1]
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids.clamp(min=-1) + 1, minlength=w13.shape[0] + 1).tolist()
    start = counts[0]  # the skipped (-1) pairs sort first
    for expert, count in enumerate(counts[1:]):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // k
        x = hidden_states[tokens].float()
        gate_up = x @ expert_weight(w13, w13_scale, block_shape, expert).t()
        h = act(gate_up[:, :inter]) * gate_up[:, inter:]
        y = (h @ expert_weight(w2, w2_scale, block_shape, expert).t()) * \
            flat_weights[pairs, None]
        acc.index_add_(0, tokens, y)
    result = acc.to(hidden_states.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
