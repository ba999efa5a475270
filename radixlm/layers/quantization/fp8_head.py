"""The LM head in FP8: `--lm-head-quantization fp8`.

Checkpoints in every format keep the head in bf16/fp16 (AWQ, GPTQ and FP8
tools leave `lm_head` out), yet at one row a decode step reads the whole head:
Llama-3.1-8B's is 1.05 GB in bf16, 13 % of an FP8 step's bytes and 22 % of an
AWQ step's. This option holds it as FP8 codes with one scale per vocabulary
row (the online FP8 scheme of `fp8.py`: max |row| / 448) whatever the other
layers are, so the step reads half of it; its products are those of every
FP8 layer (the tensor-core GEMV at few rows, the W8A8 GEMM above; dequantized
at matmul time on the CPU). Logits move by FP8's rounding of the head, which
`python -m radixlm.bench quant-perplexity --formats none,none:fp8` measures.

- An untied head's table is created in that form (`Fp8HeadTableMethod`): the
  checkpoint's float rows are quantized as they load, no float copy is kept.
- A head tied to the input embedding shares the float table, which lookups
  read, so the FP8 codes are derived from it after every load or update
  (`Fp8TiedHeadMethod`): one byte a weight more memory, the step still reads
  only the codes.

A format that holds the head itself (a .gguf file's blocks, CPU int8) is
refused at load (`check_head_quantized`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from radixlm.layers.quantization.base import EmbeddingMethod, LinearMethod
from radixlm.layers.quantization.fp8 import (
    FP8,
    Fp8OnlineLinearMethod,
    Fp8OnlineSpec,
    Fp8ProductMethod,
    Fp8Weight,
    quantize_rows,
    row_stride,
    with_tensor_cores,
)
from radixlm.layers.quantization.unquantized import UnquantizedConfig

logger = logging.getLogger(__name__)


class Fp8HeadTableMethod(EmbeddingMethod):
    """An untied LM head's table as FP8 codes and a scale per row (`Fp8OnlineSpec`):
    the head multiplies by it and is never looked up."""

    def create_weights(self, layer: Any, embedding_dim: int, num_rows: int,
                       params_dtype: torch.dtype) -> None:
        # Zeros: the padding rows past the vocabulary read as zero codes, zero scale.
        weight = torch.zeros(num_rows, row_stride(embedding_dim), dtype=FP8)
        layer.add_weight("weight", weight, Fp8OnlineSpec())

    def embedding(self, layer: Any, ids: torch.Tensor) -> torch.Tensor:
        raise TypeError(f"{layer.prefix} holds an FP8 LM head, which is not looked up")


class Fp8TiedHeadMethod(Fp8ProductMethod):
    """A tied head's products on FP8 codes derived from the shared float table."""

    def create_weights(self, layer: Any, input_size_per_partition: int,
                       output_partition_sizes: list[int], params_dtype: torch.dtype) -> None:
        raise AssertionError("a tied LM head's table is the input embedding's")

    def process_weights_after_loading(self, layer: Any) -> None:
        codes, scales = quantize_rows(layer.weight.data)
        layer.fp8 = with_tensor_cores(Fp8Weight(codes, scales))


class Fp8HeadConfig(UnquantizedConfig):
    """Float layers with the LM head in FP8: the fallback that every format hands
    its float layers to, the head among them, under --lm-head-quantization fp8."""

    def get_linear_method(self, layer: Any, prefix: str) -> LinearMethod:
        if prefix == "lm_head":
            return head_method(layer)
        return super().get_linear_method(layer, prefix)

    def get_embedding_method(self, layer: Any, prefix: str) -> EmbeddingMethod:
        if prefix == "lm_head":
            return Fp8HeadTableMethod()
        return super().get_embedding_method(layer, prefix)


def head_method(layer: Any) -> LinearMethod:
    """The linear method of LM head `layer` under --lm-head-quantization fp8: the
    online FP8 method where its table was made FP8 (untied), else codes derived
    from the tied float table. Logs what the step reads."""
    tied = layer.weight.dtype != FP8
    rows, dim = layer.weight.shape[0], layer.embedding_dim
    logger.info("LM head in FP8 (--lm-head-quantization fp8), a scale per vocabulary row: "
                "%.1f MB a step instead of %.1f MB%s", rows * dim / 1e6,
                rows * dim * layer.params_dtype.itemsize / 1e6,
                " (codes derived from the tied input embedding)" if tied else "")
    if torch.get_default_device().type == "cpu":
        logger.warning("--lm-head-quantization fp8 on the CPU: the head is dequantized at "
                       "every product (no FP8 kernels there), slower than a float head")
    return Fp8TiedHeadMethod() if tied else Fp8OnlineLinearMethod()


def check_head_quantized(model: Any, lm_head: str) -> None:
    """ValueError where --lm-head-quantization `lm_head` did not reach the model's
    head: a format that quantizes the head itself (a .gguf file's blocks, int8,
    a compressed-tensors checkpoint listing the head). A model without a head of
    its own (an EAGLE draft multiplying by the target's) has nothing to check."""
    head = getattr(model, "lm_head", None)
    if head is None:
        return
    method = head.quant_method
    if not isinstance(method, (Fp8OnlineLinearMethod, Fp8TiedHeadMethod)):
        raise ValueError(f"lm_head_quantization={lm_head!r}: the weight format holds the LM "
                         f"head itself ({type(method).__name__}); use "
                         "--lm-head-quantization none")
