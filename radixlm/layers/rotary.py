"""Rotary position embedding (RoPE), "rotate half" (GPT-NeoX / HF) layout.

Each head's first `rotary_dim` features are split into halves (x1, x2) that
rotate as pairs (x1[i], x2[i]) by angle position * inv_freq[i]. cos and sin
are precomputed for every position up to `max_position`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from radixlm.layers import cpu_ops, fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(config: Any) -> dict[str, Any]:
    """A config's RoPE settings as one dict with `rope_theta`, `rope_type` and
    the type's own keys. transformers >= 5 keeps them in `rope_parameters`,
    older configs in `rope_theta` plus `rope_scaling` (whose type key was `type`)."""
    params = dict(getattr(config, "rope_parameters", None)
                  or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's long-context scaling: slow frequencies (wavelength above the
    original context / low_freq_factor) are divided by `factor`, fast ones
    kept, and the band between interpolated smoothly."""
    factor, old_ctx = p["factor"], p["original_max_position_embeddings"]
    low, high = p.get("low_freq_factor", 1.0), p.get("high_freq_factor", 4.0)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)


def compute_inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    # On the CPU in float32, as HF computes it, so the tables match it bit for bit.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device="cpu") / rotary_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    return inv_freq


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int,
                 params: dict[str, Any], dtype: torch.dtype | None = None) -> None:
        super().__init__()
        assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, (rotary_dim, head_dim)
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        inv_freq = compute_inv_freq(rotary_dim, params)
        positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
        angles = torch.outer(positions, inv_freq)
        cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [max_position, rotary_dim]
        # Stored in the model dtype: HF also rounds its float32 cos/sin to it before use.
        dtype = dtype or torch.get_default_dtype()
        cache = cache.to(device=torch.get_default_device(), dtype=dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_dim)
        x1, x2 = x[..., :self.rotary_dim].chunk(2, dim=-1)
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if self.rotary_dim < self.head_dim:
            parts.append(x[..., self.rotary_dim:])
        return torch.cat(parts, dim=-1).view(shape)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, heads * head_dim], k: [num_tokens, kv_heads * head_dim];
        returns rotated tensors of the same shapes (in place on CUDA)."""
        if q.is_cuda:
            return fused_ops.apply_rope_(positions, q, k, self.head_dim, self.cos_sin_cache)
        if (cpu_ops.use_fused(q) and self.cos_sin_cache.dtype == q.dtype
                and q.stride(-1) == 1 and k.stride(-1) == 1):
            cpu_ops.rope_(positions, q, self.cos_sin_cache, self.head_dim, self.rotary_dim)
            cpu_ops.rope_(positions, k, self.cos_sin_cache, self.head_dim, self.rotary_dim)
            return q, k
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(q.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, rotary_dim / 2]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


def get_rope(config: Any, head_dim: int, dtype: torch.dtype | None = None) -> RotaryEmbedding:
    """The rotary embedding an HF config describes."""
    params = rope_parameters(config)
    rotary_dim = int(head_dim * params.get("partial_rotary_factor",
                                           getattr(config, "partial_rotary_factor", 1.0)))
    return RotaryEmbedding(head_dim, rotary_dim, config.max_position_embeddings, params, dtype)
