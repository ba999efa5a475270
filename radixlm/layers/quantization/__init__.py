"""Weight methods of linear layers, and the config that picks one per layer.

`base.py` is the contract; `unquantized.py` the float methods. A quantized
format adds a module with its QuantizationConfig and LinearMethod, an entry
in `QUANTIZATION_METHODS` below, and its name in `config.QUANTIZATIONS`
(the --quantization choices; a test checks that the two agree).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from radixlm.config import LM_HEAD_QUANTIZATIONS
from radixlm.layers.quantization.base import (
    EmbeddingMethod,
    FusedMoEMethod,
    LinearMethod,
    QuantizationConfig,
)
from radixlm.layers.quantization.compressed_tensors import CompressedTensorsConfig
from radixlm.layers.quantization.fp8 import Fp8Config
from radixlm.layers.quantization.fp8_head import Fp8HeadConfig
from radixlm.layers.quantization.gguf import GGUFConfig
from radixlm.layers.quantization.int4 import AWQConfig, GPTQConfig, default_format
from radixlm.layers.quantization.int8 import Int8Config
from radixlm.layers.quantization.selection import fused_projections
from radixlm.layers.quantization.unquantized import UnquantizedConfig

# --quantization name (= the checkpoint's quantization_config "quant_method") -> config.
# Besides these, "auto" (what the checkpoint is) and "none" (float weights: a .gguf
# file dequantized at load).
QUANTIZATION_METHODS: dict[str, type[QuantizationConfig]] = {
    "gguf": GGUFConfig, "int8": Int8Config, "fp8": Fp8Config, "awq": AWQConfig,
    "gptq": GPTQConfig, "compressed-tensors": CompressedTensorsConfig}
# Methods that quantize a float checkpoint (the others only read what a checkpoint holds).
_FROM_FLOATS = {"int8": lambda floats: Int8Config(fallback=floats),
                "fp8": lambda floats: Fp8Config(fallback=floats)}
# Methods that only serve --load-format dummy on a float config (random quantized weights).
_DUMMY_ONLY = {"awq": AWQConfig, "gptq": GPTQConfig}
# A checkpoint in the key format may be confirmed by these --quantization names too.
_CONFIRMS = {"compressed-tensors": {"fp8"}}

__all__ = ["QUANTIZATION_METHODS", "EmbeddingMethod", "FusedMoEMethod", "LinearMethod",
           "QuantizationConfig",
           "UnquantizedConfig",
           "drop_derived_weights", "float_config", "get_quantization_config",
           "process_weights_after_loading"]


def get_quantization_config(hf_config: Any, quantization: str | None = None, *,
                            prepack: bool = True, gemv: bool = True,
                            moe_backend: str = "auto",
                            deterministic: bool = False,
                            lm_head: str = "none") -> QuantizationConfig:
    """The config for a model from a checkpoint directory: `quantization`
    (None or 'auto': what the checkpoint's config.json declares, unquantized
    when it declares nothing; 'none': unquantized). ValueError for a method we
    lack, or one that contradicts the checkpoint. `prepack` / `gemv`: the
    unquantized fast paths (--disable-weight-prepack, --disable-gemv);
    `moe_backend`: where float experts run (--moe-runner-backend);
    `deterministic`: batch-invariant float products instead
    (--enable-deterministic-inference); `lm_head`: the LM head's format
    (--lm-head-quantization, `fp8_head.py`). A .gguf
    file's config comes from `models/gguf_packed.quant_config`."""
    declared = getattr(hf_config, "quantization_config", None)
    if quantization not in (None, "auto", "none") and quantization not in QUANTIZATION_METHODS:
        known = ", ".join(["auto", "none", *QUANTIZATION_METHODS])
        raise ValueError(f"quantization={quantization!r}: expected one of {known}")
    floats = float_config(lm_head, prepack=prepack, gemv=gemv, moe_backend=moe_backend,
                          deterministic=deterministic)
    if declared is None:
        return _for_floats(quantization, floats)
    declared = declared if isinstance(declared, dict) else declared.to_dict()
    method = declared.get("quant_method")
    if method not in QUANTIZATION_METHODS or method in ("gguf", "int8"):
        have = ", ".join(m for m in QUANTIZATION_METHODS if m not in ("gguf", "int8"))
        raise ValueError(f"the checkpoint's config.json has a quantization_config "
                         f"(quant_method={method!r}), a quantized format radixlm cannot load "
                         f"(checkpoint formats: {have}); use an unquantized checkpoint")
    if quantization not in (None, "auto", method, *_CONFIRMS.get(method, ())):
        raise ValueError(f"quantization={quantization!r} contradicts the checkpoint's "
                         f"quantization_config (quant_method={method!r}): --quantization may "
                         f"only confirm what the checkpoint is (auto or {method!r})")
    return QUANTIZATION_METHODS[method].from_hf_config(
        declared, fused=fused_projections(hf_config), fallback=floats)


def float_config(lm_head: str = "none", **fast: Any) -> UnquantizedConfig:
    """The config of float layers, the fallback of every format: `fast` the
    unquantized fast paths (`UnquantizedConfig`'s arguments); `lm_head` the LM
    head's format (--lm-head-quantization: "fp8" holds it in FP8, `fp8_head.py`)."""
    if lm_head not in LM_HEAD_QUANTIZATIONS:
        raise ValueError(f"lm_head_quantization={lm_head!r}: expected one of "
                         f"{', '.join(LM_HEAD_QUANTIZATIONS)}")
    return (Fp8HeadConfig if lm_head == "fp8" else UnquantizedConfig)(**fast)


def _for_floats(quantization: str | None, floats: UnquantizedConfig) -> QuantizationConfig:
    """The config of a checkpoint that declares no quantization."""
    if quantization in (None, "auto", "none"):
        return floats
    if quantization in _FROM_FLOATS:
        return _FROM_FLOATS[quantization](floats)
    if quantization in _DUMMY_ONLY:
        return _DUMMY_ONLY[quantization](default_format(quantization), fallback=floats,
                                         from_checkpoint=False)
    if quantization == GGUFConfig.name:
        raise ValueError("quantization='gguf' keeps the blocks of a .gguf model file; "
                         "this model is an HF checkpoint directory (use int8 or fp8 to "
                         "quantize its float weights)")
    raise ValueError(f"quantization={quantization!r} reads checkpoints in that format; this "
                     "checkpoint is unquantized (--quantization fp8 quantizes it at load)")


def process_weights_after_loading(model: nn.Module) -> None:
    """Every layer's method derives from the weights as they are now, and so
    does every other module that keeps something derived (a
    `process_weights_after_loading()` method of its own: Gemma's norm). Call
    it after any write to the weights: the initial load, an update, a
    rollback, a resume."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
        elif callable(getattr(module, "process_weights_after_loading", None)):
            module.process_weights_after_loading()


def derived_addresses(model: nn.Module) -> list[int]:
    """The storage address of every tensor the model's modules keep beside their
    parameters, buffers and submodules (what `process_weights_after_loading`
    derived: plain attributes, and the tensors of dataclasses, tuples and lists
    held in them). A CUDA graph captured those addresses: when a call of
    `process_weights_after_loading` changes this list, the graphs must be
    captured again."""
    found: list[int] = []

    def visit(value: object, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            # A tensor without plain storage (oneDNN's packed layout): its identity.
            found.append(value.data_ptr() if value.layout == torch.strided else id(value))
        elif depth < 3 and isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)
        elif depth < 3 and dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name), depth + 1)

    for module in model.modules():
        for name, value in vars(module).items():
            if not name.startswith("_"):  # _parameters, _buffers, _modules, hooks
                visit(value, 0)
    return found


def drop_derived_weights(model: nn.Module) -> None:
    """Every layer's method forgets what it derived (the weights are about to go)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.drop_derived(module)
