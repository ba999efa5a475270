"""A projection's split-K sum left to the kernel that reads its output (decode on CUDA).

The tensor-core GEMVs split K across programs (`quantization/triton_ops/mma_gemv.py`):
at one row the weight must be read by every SM, and a row tile's whole K in one
warp would leave most of them idle. Where the sum of the partial sums is not
added inside the GEMV's program, it is a second launch of its own, on the chain
of the step's kernels: on an H100, leaving the qkv projection's second launch
out of an AWQ Llama-8B decode step gained ~2.5 % (`benchmarks/decode_ablation.py`,
`ABLATE=ksum ABLATE_KSUM_N=6144`).

The qkv projection's output is read once, by the RoPE kernel that also stores
K and V into the pool. That kernel can add the partial sums itself
(`fused_ops.apply_rope_`'s `sums`) with the second launch's arithmetic: the
sums in split order, the bias, one rounding to the activation dtype; so the
same bits as the two launches (with a per-head QK norm, up to the norm's
summation order), and one launch less a layer.

`LinearMethod.apply_unsummed` returns `SplitSums` where its kernel leaves the
sum; a consumer that cannot take them calls `finish()` (the second launch).

The int4 and FP8 gate/up products' sums, with their SiLU, went the other way:
into the product's own program (`int4_mma.pairs`: each warp the gate and up
tiles of the same features; `fp8_mma.halves`: each tile 8 gate rows and their
8 up rows). $RADIXLM_SPLIT_SUMS=launch keeps the second launch of all of them
(`deferred`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def deferred() -> bool:
    """Whether products whose split-K sums took a second launch may leave them to
    the consumer or sum them in their program (the default; $RADIXLM_SPLIT_SUMS=
    launch: never, for comparisons)."""
    mode = os.environ.get("RADIXLM_SPLIT_SUMS", "consumer")
    if mode not in ("consumer", "launch"):
        raise ValueError(f"RADIXLM_SPLIT_SUMS={mode!r}: expected 'consumer' or 'launch'")
    return mode == "consumer"


@dataclass(frozen=True)
class SplitSums:
    """A product y = x W^T (+ bias) whose split-K sum has not run.

    partials [split, M, N] fp32: each K run's sums; bias [N] or None; out [M, N]
    (the activation dtype): where the sum goes, not written yet."""

    partials: torch.Tensor
    bias: torch.Tensor | None
    out: torch.Tensor

    def finish(self) -> torch.Tensor:
        """out = the partial sums added in split order, + bias (the GEMV's second launch)."""
        from radixlm.layers.quantization.triton_ops.int4 import sum_splits

        return sum_splits(self.partials, self.bias, self.out, silu_mul=False)
