"""A KV pool in FP8 (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`): half the bytes of a
bf16 cache, so the same memory holds about twice the tokens.

Each layer has a key scale and a value scale (fp32): the pool stores K / k_scale
and V / v_scale in FP8, and readers multiply back (`layer_scales`). Where they
come from, first found: the checkpoint's `*.k_scale` / `*.v_scale` tensors
(calibrated FP8 checkpoints carry them; they land on the attention layers),
a `--quantization-param-path` JSON (vLLM's and SGLang's `kv_cache.scaling_factor`
layout: per tensor-parallel rank, per layer, one scale for K and V), else 1.0
with a warning: e4m3 then holds values up to 448 exactly as stored, which
unscaled K/V of most models fit, at 3 bits of mantissa.

Readers: the torch / CPU backends cast what they gather; the Triton backend's
kernels read the FP8 codes themselves (store: `triton_ops/kv_store.py`, the
same codes as `set_kv_buffer`; attention: k_scale folded into the score scale,
v_scale on the output; docs/kernels.md).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from radixlm.cache.kv_spec import MHA, KVSpec
from radixlm.cache.memory_pool import KVPool, MHATokenToKVPool, PoolOptions

logger = logging.getLogger(__name__)

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class FP8TokenToKVPool(MHATokenToKVPool):
    """MHA layout in an FP8 dtype with per-layer K and V scales."""

    def __init__(self, size: int, dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                 num_layers: int, device: torch.device | str,
                 v_head_dim: int | None = None) -> None:
        if dtype not in FP8_DTYPES:
            raise ValueError(f"FP8TokenToKVPool needs an FP8 dtype, got {dtype}")
        super().__init__(size, dtype, num_kv_heads, head_dim, num_layers, device, v_head_dim)
        self.max_value = torch.finfo(dtype).max
        self.k_scales = torch.ones(num_layers, dtype=torch.float32, device=self.device)
        self.v_scales = torch.ones(num_layers, dtype=torch.float32, device=self.device)
        # One-element views per layer, made once: kernels read them by pointer (so
        # CUDA graphs see `set_scales`' in-place updates) and the hot path makes none.
        self._layer_scales = [(self.k_scales[i:i + 1], self.v_scales[i:i + 1])
                              for i in range(num_layers)]

    @classmethod
    def accepts(cls, spec: KVSpec, dtype: torch.dtype) -> bool:
        return spec.kind == MHA and not spec.windows and dtype in FP8_DTYPES

    @classmethod
    def create(cls, spec: KVSpec, dtype: torch.dtype, size: int, device: torch.device,
               options: PoolOptions) -> KVPool:
        return cls(size, dtype, spec.num_kv_heads, spec.k_head_dim, spec.num_layers, device,
                   v_head_dim=spec.v_head_dim)

    def set_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        if not len(k_scales) == len(v_scales) == self.num_layers:
            raise ValueError(f"{len(k_scales)} key and {len(v_scales)} value scales for "
                             f"{self.num_layers} layers")
        if min(k_scales + v_scales) <= 0:
            raise ValueError("KV cache scales must be > 0")
        self.k_scales.copy_(torch.tensor(k_scales, dtype=torch.float32))
        self.v_scales.copy_(torch.tensor(v_scales, dtype=torch.float32))

    def layer_scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._layer_scales[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor) -> None:
        k_scale, v_scale = self.layer_scales(layer_id)
        m = self.max_value
        k = (k.view(-1, self.num_kv_heads, self.head_dim).float() / k_scale).clamp(-m, m)
        v = (v.view(-1, self.num_kv_heads, self.v_head_dim).float() / v_scale).clamp(-m, m)
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)


def kv_scales(layers: list, tp_rank: int, param_path: str | None
              ) -> tuple[list[float], list[float], str]:
    """(key scales, value scales, where they came from) for an FP8 pool, one per
    layer: the checkpoint's (layers' `k_scale` / `v_scale` other than 1.0), else
    `param_path`'s, else all 1.0."""
    ks = [float(getattr(a, "k_scale", torch.ones(1)).item()) for a in layers]
    vs = [float(getattr(a, "v_scale", torch.ones(1)).item()) for a in layers]
    if any(s != 1.0 for s in ks + vs):
        return ks, vs, "the checkpoint's k_scale / v_scale tensors"
    if param_path is not None:
        per_layer = _scales_file(param_path, tp_rank, len(layers))
        return per_layer, list(per_layer), param_path
    return ks, vs, "none given (1.0)"


def _scales_file(path: str, tp_rank: int, num_layers: int) -> list[float]:
    """vLLM's / SGLang's KV-scales JSON: {"kv_cache": {"dtype": ..., "scaling_factor":
    {tp rank: {layer: scale}}}}."""
    data = json.loads(Path(path).read_text())
    try:
        factors = data["kv_cache"]["scaling_factor"][str(tp_rank)]
    except (KeyError, TypeError):
        raise ValueError(f"quantization_param_path={path!r} has no kv_cache.scaling_factor "
                         f"for tensor-parallel rank {tp_rank}") from None
    missing = [i for i in range(num_layers) if str(i) not in factors]
    if missing:
        raise ValueError(f"quantization_param_path={path!r} has no KV scale for layers "
                         f"{missing[:8]}")
    return [float(factors[str(i)]) for i in range(num_layers)]
