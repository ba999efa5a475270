"""A residual RMSNorm folded into the projections around it (decode on CUDA).

Each layer adds a block's output h to the residual stream r and normalizes the
sum: r' = h + r, x = r' * rstd * w with rstd = rsqrt(mean(r'^2) + eps). At a
few rows the norm is a launch of its own that reads and writes a few KB, twice
a layer: on an H100 the 64 norms of a Llama-8B step took ~63 us of an int4
step's ~2,150 (leaving them out, `benchmarks/decode_ablation.py`).

The fold splits the norm around its two neighbours. rstd is one scalar a row,
so it commutes with the next product: W x = rstd (W (r' * w)). The projection
before the norm (o_proj, down_proj: `NormTarget`) adds r in its epilogue,
writes r', the unscaled x' = r' * w and per tile of its columns the partial
sums of r'^2; the projection after it (qkv, gate_up) reads x' as its input and
multiplies its sums by rstd, computed from those partials, before the bias and
the activation (`FoldedNorm`). The norm's arithmetic is then in epilogues that
run anyway. Only the rounding moves: x' is rounded to the activation dtype
before the product is scaled by rstd, where the norm rounds x * rstd * w.

`LinearMethod.apply_normed` and `apply_into_norm` compute these with torch on
any method (what the CPU tests pin); a method whose kernels fold them says so
in `folds_norm`, and only then does the decoder fold (`DecoderModel.forward`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NormTarget:
    """The norm a projection's output goes into: residual [M, H] is added to
    the product; `weight` [H] and `eps` are the norm's."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class FoldedNorm:
    """RMSNorm(h + residual) held unscaled, as a projection's epilogue leaves it.

    x [M, H]: (h + residual) * weight in the activation dtype, the next
    projection's input; squares [M, P] fp32: the sums of (h + residual)^2 over P
    disjoint sets of columns (the epilogue's tiles), to be added, or None where
    x is the norm's output already (the first layer's, from the norm kernel);
    residual [M, H]: h + residual, the next residual stream (rounded to the
    activation dtype, as the norm kernel rounds it)."""

    x: torch.Tensor
    squares: torch.Tensor | None
    residual: torch.Tensor
    eps: float

    def rstd(self) -> torch.Tensor:
        """[M, 1] fp32: rsqrt(mean((h + residual)^2) + eps)."""
        assert self.squares is not None
        mean = self.squares.float().sum(-1, keepdim=True) / self.x.shape[-1]
        return torch.rsqrt(mean + self.eps)

    def normalized(self) -> torch.Tensor:
        """The norm's output, x * rstd, in x's dtype: what a projection that does
        not fold multiplies."""
        if self.squares is None:
            return self.x
        return (self.x.float() * self.rstd()).to(self.x.dtype)


def fold_into(h: torch.Tensor, target: NormTarget) -> FoldedNorm:
    """The epilogue's arithmetic in torch: h [M, H] (the product, in the
    activation dtype) added to the target's residual and prepared for the next
    projection (one set of columns: squares [M, 1])."""
    s = (h.float() + target.residual.float()).to(h.dtype)
    sf = s.float()
    return FoldedNorm((sf * target.weight.float()).to(h.dtype),
                      (sf * sf).sum(-1, keepdim=True), s, target.eps)
