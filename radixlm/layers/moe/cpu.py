"""The experts on the CPU: only the experts that have tokens, one product pair each.

Token-expert pairs are grouped by expert (one sort); each expert with tokens
multiplies its tokens' rows by its gate/up weight and its down weight (torch's
matmuls: oneDNN, in the weights' dtype: bf16 or fp32), and the rows are
weighted and summed into a float32 accumulator. Experts without tokens cost
nothing, so decode reads only the k selected experts' weights per token,
never a dense loop over all of them. Same signature as `torch_ref.fused_experts`;
FP8 weights (with their scales) are dequantized per expert with tokens, to the
activations' dtype, when it is multiplied: the stack stays one byte per weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixlm.layers.activation import GeluAndMul, SiluAndMul
from radixlm.layers.moe.torch_ref import check_inputs, expert_weight

_GATED = {"silu": SiluAndMul(), "gelu": GeluAndMul("none"), "gelu_tanh": GeluAndMul("tanh")}


def group_by_expert(topk_ids: torch.Tensor, num_experts: int
                    ) -> tuple[torch.Tensor, list[int], int]:
    """(pair order sorted by expert, tokens per expert, pairs skipped): pair p is
    token p // k's j-th choice; ids -1 (another rank's experts) sort first and
    are skipped."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat.long() + 1, minlength=num_experts + 1).tolist()
    return order, counts[1:], counts[0]


def routed_sum(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               num_experts: int, expert_mlp: Callable[[int, torch.Tensor], torch.Tensor],
               experts_mlp: Callable[[list[int], torch.Tensor], torch.Tensor] | None = None
               ) -> torch.Tensor:
    """Each token's chosen experts' outputs `expert_mlp(expert, rows)`, weighted
    and summed in float32 [T, H]: one expert call per expert with tokens (one
    per choice for a lone token, which needs no grouping); ids -1 add nothing.
    `experts_mlp(experts, x)`, where given, computes a lone token's chosen
    experts in one call ([len(experts), H]), each row what expert_mlp gives."""
    tokens, k = topk_ids.shape
    if tokens == 1:  # decode at batch 1: no grouping; the chosen rows weighted in one product
        chosen = [(e, w) for e, w in zip(topk_ids[0].tolist(), topk_weights[0].tolist(),
                                         strict=True) if e >= 0]
        if not chosen:
            return torch.zeros(x.shape, dtype=torch.float32)
        ids = [e for e, _ in chosen]
        outs = experts_mlp(ids, x) if experts_mlp is not None else \
            torch.cat([expert_mlp(e, x) for e in ids])
        # [1, k] @ [k, H] in float32: one op where k weighted adds took 2k (a
        # decode step's hundreds of small ops cost milliseconds on two cores).
        return torch.tensor([w for _, w in chosen], dtype=torch.float32)[None] @ outs.float()
    acc = torch.zeros(x.shape, dtype=torch.float32)
    order, counts, start = group_by_expert(topk_ids, num_experts)
    pair_tokens = order // k
    pair_weights = topk_weights.reshape(-1)[order].float()
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = pair_tokens[start:start + count]
        weights = pair_weights[start:start + count, None]
        start += count
        acc.index_add_(0, rows, expert_mlp(expert, x[rows]) * weights)
    return acc


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                  activation: str = "silu", out: torch.Tensor | None = None,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  block_shape: tuple[int, int] | None = None) -> torch.Tensor:
    """See `torch_ref.fused_experts`; products in the weights' dtype (FP8 weights:
    dequantized to the activations'), sums in float32."""
    check_inputs(hidden_states, w13, w2, topk_weights, topk_ids, activation, w13_scale,
                 w2_scale, block_shape)
    act = _GATED[activation]
    if w13_scale is None and w2_scale is None:
        def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
            return F.linear(act(F.linear(rows, w13[e])), w2[e])
    else:
        dtype = hidden_states.dtype

        def mlp(e: int, rows: torch.Tensor) -> torch.Tensor:
            gate_up = expert_weight(w13, w13_scale, block_shape, e).to(dtype)
            down = expert_weight(w2, w2_scale, block_shape, e).to(dtype)
            return F.linear(act(F.linear(rows, gate_up)), down)
    acc = routed_sum(hidden_states, topk_weights, topk_ids, w13.shape[0], mlp)
    return _finish(acc, hidden_states.dtype, out)


def _finish(acc: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return acc.to(dtype)
    out.copy_(acc)
    return out
