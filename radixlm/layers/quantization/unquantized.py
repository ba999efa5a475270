"""Unquantized weights: the checkpoint's float tensor, multiplied three ways.

Which way is decided per layer when the model is built, from where and in
what dtype the layer's weight lives:
- `PrepackedLinearMethod`: on the CPU in bf16 (oneDNN with bf16 support),
  the weight is also held reordered into oneDNN's blocked layout (what
  torch.compile's CPU freezing does). Given the plain [out, in] weight every
  call pays that layout work again: the copy makes this machine's decode
  step 8-15 ms faster (of ~140 ms at 64 requests of SmolLM2) and single-row
  products twice as fast, bitwise the same results. It costs the weight's
  memory once more (`--disable-weight-prepack` does without it).
- `GemvLinearMethod`: on CUDA in bf16/fp16, 1-8 rows (decode at small batch)
  go through our Triton GEMV (`layers/gemv.py`) on the shapes where
  `use_gemv` measured it faster than cuBLAS; everything else through cuBLAS
  (`--disable-gemv`: always cuBLAS).
- `UnquantizedLinearMethod`: F.linear, everywhere else (fp32, meta, the flags).
- `BatchInvariantLinearMethod`: with --enable-deterministic-inference, every
  float layer: products whose result for a row does not depend on how many
  rows are multiplied with it (oneDNN, MKL and cuBLAS pick their kernels and
  reduction orders by the row count; the GEMV above serves 1-8 rows, cuBLAS
  the rest). On the CPU our kernel (`cpu_ops.dense_linear`), on CUDA our
  Triton GEMM (`layers/invariant_gemm.py`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixlm.layers import cpu_ops
from radixlm.layers.quantization.base import (
    EmbeddingMethod,
    FusedMoEMethod,
    LinearMethod,
    QuantizationConfig,
)
from radixlm.layers.sharding import AxisSpec
from radixlm.utils import lazy_import, triton_installed

if TYPE_CHECKING:
    from radixlm.layers.linear import LinearBase
    from radixlm.layers.moe.fused_moe import FusedMoE

_gemv = lazy_import("radixlm.layers.gemv")  # Triton: CUDA only
_invariant_gemm = lazy_import("radixlm.layers.invariant_gemm")  # Triton: CUDA only


@functools.cache
def onednn_bf16() -> bool:
    """Whether this CPU and torch build run oneDNN in bf16 (asked once per process)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or torch.mm / addmm into `out` (same cuBLAS kernels)."""
    if out is None:
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    y = out.view(x2.shape[0], weight.shape[0])
    if bias is None:
        torch.mm(x2, weight.t(), out=y)
    else:
        torch.addmm(bias, x2, weight.t(), out=y)
    return out


class UnquantizedLinearMethod(LinearMethod):
    """One `weight` [out_local, in_local] in the model's dtype, as the checkpoint has it."""

    def create_weights(self, layer: LinearBase, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype) -> None:
        weight = torch.empty(sum(output_partition_sizes), input_size_per_partition,
                             dtype=params_dtype)
        layer.add_weight("weight", weight, AxisSpec(output_dim=0, input_dim=1))

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        return plain_linear(x, layer.weight, bias, out)


class GemvLinearMethod(UnquantizedLinearMethod):
    """CUDA: our GEMV where `use_gemv` says it beats cuBLAS, cuBLAS otherwise."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        if _gemv.use_gemv(x, layer.weight):
            return _gemv.gemv(x, layer.weight, bias, out=out)
        return plain_linear(x, layer.weight, bias, out)

    def apply_silu_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        # Matching gate and up columns in one program, the activation in registers:
        # one launch instead of two per MLP, the same bits.
        if _gemv.use_gemv(x, layer.weight):
            return _gemv.gemv(x, layer.weight, silu_mul=True)
        return None


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


class PrepackedLinearMethod(UnquantizedLinearMethod):
    """CPU bf16: products from a copy of the weight in oneDNN's blocked layout.

    A gate/up layer whose forward fuses silu(gate) * up (`layer.fused_silu_mul`)
    packs its two halves instead of the whole: oneDNN applies silu to the gate
    product and the multiply to the up product as they are written
    (post-ops), so the [tokens, 2 * d] intermediate is never stored and
    re-read: ~14 of ~99 ms per MLP of 8192 prefill tokens (SmolLM2), same
    speed in decode. silu(gate) is rounded to bf16 before the multiply, one
    rounding more than the unfused kernel. Only what the forward reads is
    packed, so the copy costs the weight's memory once, not twice."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        weight = layer.weight.detach()
        if _packs_halves(layer):
            layer.packed_weight = None
            layer.packed_halves = tuple(_pack(half) for half in weight.chunk(2, dim=0))
        else:
            layer.packed_weight = _pack(weight)
            layer.packed_halves = None

    def drop_derived(self, layer: LinearBase) -> None:
        layer.packed_weight = layer.packed_halves = None

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        packed = getattr(layer, "packed_weight", None)
        if out is not None:
            return plain_linear(x, layer.weight, bias, out)
        assert packed is not None, "process_weights_after_loading has not run on this layer"
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")

    def apply_silu_mul(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        halves = getattr(layer, "packed_halves", None)
        assert halves is not None, "process_weights_after_loading has not run on this layer"
        x = x.contiguous()
        g = torch.ops.mkldnn._linear_pointwise(x, halves[0], None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, g, halves[1], None, "mul")


def _packs_halves(layer: LinearBase) -> bool:
    return getattr(layer, "fused_silu_mul", False) and layer.bias is None


class BatchInvariantLinearMethod(UnquantizedLinearMethod):
    """Products whose row results are the same bits at any row count.

    CPU: from a copy of the weight packed for `cpu_ops.dense_linear` (one
    multiply-add chain per output over the input features in order; the copy
    costs the weight's memory once more). CUDA: the weight as it is, through
    `invariant_gemm.matmul` (fixed K blocks, never split-K)."""

    batch_invariant = True

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        weight = layer.weight.detach()
        layer.dense_packed = cpu_ops.dense_pack(weight) if weight.device.type == "cpu" else None

    def drop_derived(self, layer: LinearBase) -> None:
        layer.dense_packed = None

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        if x.is_cuda:
            return _invariant_gemm.matmul(x, layer.weight, bias, out=out)
        packed = getattr(layer, "dense_packed", None)
        assert packed is not None, "process_weights_after_loading has not run on this layer"
        return cpu_ops.dense_linear(x, packed, layer.weight.shape[0], bias, out)


class UnquantizedEmbeddingMethod(EmbeddingMethod):
    """A float table [rows, dim] in the model's dtype, looked up with F.embedding."""

    def create_weights(self, layer: nn.Module, embedding_dim: int, num_rows: int,
                       params_dtype: torch.dtype) -> None:
        # Zeros, not empty: the padding rows past the vocabulary are never loaded.
        layer.add_weight("weight", torch.zeros(num_rows, embedding_dim, dtype=params_dtype),
                         AxisSpec(output_dim=0, input_dim=1))

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)


class UnquantizedConfig(QuantizationConfig):
    """Float weights; per layer the fastest of the methods above that applies.

    The choice reads torch's default device and the layer's dtype at
    construction: what the layer's weight is created with (the loader builds
    the model under `with torch.device(...)` and the model's default dtype)."""

    def __init__(self, prepack: bool = True, gemv: bool = True, moe_backend: str = "auto",
                 deterministic: bool = False) -> None:
        self.prepack = prepack
        self.gemv = gemv
        self.moe_backend = moe_backend  # --moe-runner-backend (layers/moe/backends.py)
        self.deterministic = deterministic

    def get_moe_method(self, layer: FusedMoE, prefix: str) -> FusedMoEMethod:
        from radixlm.layers.moe.method import UnquantizedFusedMoEMethod

        return UnquantizedFusedMoEMethod(self.moe_backend)

    def get_linear_method(self, layer: LinearBase, prefix: str) -> LinearMethod:
        device, dtype = torch.get_default_device(), layer.params_dtype
        if self.deterministic and device.type in ("cpu", "cuda"):
            if device.type == "cpu" and not cpu_ops.load():
                raise ValueError("enable_deterministic_inference on the CPU needs radixlm's C++ "
                                 "kernels (a C++ compiler; see the warning above)")
            return BatchInvariantLinearMethod()
        if (self.prepack and device.type == "cpu" and dtype == torch.bfloat16
                and onednn_bf16()):
            return PrepackedLinearMethod()
        if (self.gemv and device.type == "cuda" and triton_installed()
                and dtype in (torch.bfloat16, torch.float16)):
            return GemvLinearMethod()
        return UnquantizedLinearMethod()
