"""Rotary position embedding (RoPE), "rotate half" (GPT-NeoX / HF) layout.

Each head's first `rotary_dim` features are split into halves (x1, x2) that
rotate as pairs (x1[i], x2[i]) by angle position * inv_freq[i]. cos and sin
are precomputed for every position up to `max_position`, scaled by the rope
type's attention factor (YaRN, LongRoPE) as HF scales them.

Scaling types, each as transformers computes it (`modeling_rope_utils`):
- default, linear (positions / factor), llama3 (Llama 3.1's smoothed band),
  yarn (NTK-by-parts with its attention factor): fixed tables.
- dynamic (NTK-aware): HF recomputes the base from the longest sequence of
  each forward once it passes max_position_embeddings, so keys cached earlier
  keep older frequencies; within max_position_embeddings it is the default
  rope. We serve it exactly there, and refuse a longer context.
- longrope (Phi-3's "su"): HF rotates with the short factors while a
  sequence fits original_max_position_embeddings; the step it passes that
  length, Phi-3's generate drops the KV cache and recomputes the whole
  sequence with the long factors. A shared KV cache cannot re-rotate what
  it holds, so the factors are chosen by the served context: short when it
  fits the original length (exactly HF's), else long for every position
  (exactly HF's for every step of a sequence longer than the original; a
  shorter one HF still rotates with the short factors, the log says so).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from radixlm.layers import cpu_ops
from radixlm.utils import lazy_import

fused_ops = lazy_import("radixlm.layers.fused_ops")  # Triton: CUDA tensors only

logger = logging.getLogger(__name__)

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """A config's RoPE settings as one dict with `rope_theta`, `rope_type` and
    the type's own keys. transformers >= 5 keeps them in `rope_parameters`
    (per layer type for Gemma 3: {"sliding_attention": {...}, "full_attention":
    {...}}), older configs in `rope_theta` plus `rope_scaling` (whose type key
    was `type`). `layer_type` picks the nested entry (default: full attention)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) or v is None for v in params.values()):
        key = layer_type or "full_attention"
        if params.get(key) is None:
            raise ValueError(f"rope_parameters has no entry for {key!r} layers (layers without "
                             "rotary embedding are not supported)")
        params = params[key]
    params = dict(params)
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] == "su":  # Phi-3's first name for longrope
        params["rope_type"] = "longrope"
    if "original_max_position_embeddings" not in params and \
            getattr(config, "original_max_position_embeddings", None):
        params["original_max_position_embeddings"] = config.original_max_position_embeddings
    params.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)
                      or 1.0)
    return params


def native_context(config: Any) -> int:
    """max_position_embeddings as the checkpoint's config has it, before any
    --context-length override (`loader.load_config` keeps it): the length the
    rope scalings are defined against."""
    return getattr(config, "native_max_position_embeddings", None) or \
        config.max_position_embeddings


def _base_exponents(rotary_dim: int) -> torch.Tensor:
    # On the CPU in float32, as HF computes it, so the tables match it bit for bit.
    return torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rotary_dim: int, p: dict[str, Any], native: int) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies below the correction band interpolated (/ factor), above
    it kept, a linear ramp between; cos/sin scaled by the attention factor."""
    base, dim = p["rope_theta"], rotary_dim
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or native / original
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else _yarn_mscale(factor))
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: no division by zero
    ramp = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((ramp - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    inv_freq = interpolated * (1 - extrapolation) + extrapolated * extrapolation
    return inv_freq, float(attention)


def _longrope_attention(p: dict[str, Any], native: int) -> float:
    original = p["original_max_position_embeddings"]
    factor = p.get("factor") or native / original
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope_inv_freq(rotary_dim: int, p: dict[str, Any], which: str) -> torch.Tensor:
    factors = p.get(f"{which}_factor")
    if not isinstance(factors, list | tuple) or len(factors) != rotary_dim // 2:
        got = len(factors) if isinstance(factors, list | tuple) else repr(factors)
        raise ValueError(f"rope_parameters.{which}_factor must list {rotary_dim // 2} numbers "
                         f"(rotary dim / 2) for rope_type 'longrope', got {got}")
    ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (ext * p["rope_theta"] ** _base_exponents(rotary_dim))


def _check_type(rope_type: str) -> None:
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type={rope_type!r} (rope_parameters / rope_scaling) is not "
                         f"supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def compute_inv_freq(rotary_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """The inverse frequencies of the types with one fixed frequency per pair
    and no attention factor: default, linear, llama3, and dynamic (within
    max_position_embeddings, where it is the default)."""
    rope_type = params["rope_type"]
    _check_type(rope_type)
    if rope_type in ("yarn", "longrope"):
        raise ValueError(f"rope_type {rope_type!r} scales cos/sin too: use rope_cos_sin")
    inv_freq = 1.0 / (params["rope_theta"] ** _base_exponents(rotary_dim))
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    return inv_freq


def rope_cos_sin(rotary_dim: int, params: dict[str, Any], max_position: int,
                 native: int) -> torch.Tensor:
    """[max_position, rotary_dim] float32 = cat(cos, sin) * attention factor, for
    the positions 0..max_position - 1. `native`: the checkpoint's
    max_position_embeddings (what HF's dynamic, YaRN and LongRoPE refer to)."""
    rope_type = params["rope_type"]
    _check_type(rope_type)
    positions = torch.arange(max_position, dtype=torch.float32, device="cpu")
    attention = 1.0
    if rope_type == "longrope":
        attention = _longrope_attention(params, native)
        original = params["original_max_position_embeddings"]
        short = _longrope_inv_freq(rotary_dim, params, "short")
        long = _longrope_inv_freq(rotary_dim, params, "long")
        inv_freq = long if max_position > original else short
        angles = torch.outer(positions, inv_freq)
        if max_position > original:
            logger.warning(
                "longrope: a context of %d tokens (> original_max_position_embeddings=%d) "
                "rotates every position with the long factors; HF's generate uses the short "
                "ones for sequences of at most %d tokens (set --context-length %d for that)",
                max_position, original, original, original)
    else:
        if rope_type == "dynamic" and max_position > native:
            raise ValueError(
                f"rope_type 'dynamic' over a context of {max_position} tokens: HF recomputes "
                f"its frequencies from each forward's longest sequence past "
                f"max_position_embeddings={native}, which a server with a shared KV cache "
                f"cannot reproduce; serve at most {native} tokens (--context-length)")
        if rope_type == "yarn":
            inv_freq, attention = _yarn(rotary_dim, params, native)
        else:
            inv_freq = compute_inv_freq(rotary_dim, params)
        angles = torch.outer(positions, inv_freq)
    return torch.cat((angles.cos() * attention, angles.sin() * attention), dim=-1)


class RotaryEmbedding(nn.Module):
    # (wq, wk, eps) of a per-head QK norm applied with the rotation (`QKNormRotary`).
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int,
                 params: dict[str, Any], dtype: torch.dtype | None = None,
                 native_max_position: int | None = None) -> None:
        """`native_max_position`: the checkpoint's max_position_embeddings
        (default: `max_position`)."""
        super().__init__()
        assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, (rotary_dim, head_dim)
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        cache = rope_cos_sin(rotary_dim, params, max_position, native_max_position or max_position)
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
        if cpu_ops.use_fused(q, self.cos_sin_cache) and q.stride(-1) == 1 and k.stride(-1) == 1:
            cpu_ops.rope_(positions, q, self.cos_sin_cache, self.head_dim, self.rotary_dim)
            cpu_ops.rope_(positions, k, self.cos_sin_cache, self.head_dim, self.rotary_dim)
            return q, k
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(q.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [num_tokens, 1, rotary_dim / 2]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)


class QKNormRotary:
    """A layer's per-head RMSNorm of q and k (Qwen3, Gemma 3) followed by the shared
    rotary embedding, called as the rotary is (`rope` of RadixAttention). On
    CUDA with rotary over the whole head both run in the rotation's kernel (two
    launches less per layer); elsewhere the norms run first, as HF orders them.
    A plain object, not a module: the norms and the rotary stay where the model
    registers them."""

    def __init__(self, rotary: RotaryEmbedding, q_norm: nn.Module, k_norm: nn.Module) -> None:
        self.rotary, self.q_norm, self.k_norm = rotary, q_norm, k_norm
        self.head_dim, self.rotary_dim = rotary.head_dim, rotary.rotary_dim

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        return self.rotary.cos_sin_cache

    @property
    def qk_norm(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """What the fused kernel takes, or None where it cannot run."""
        if self.rotary_dim != self.head_dim:
            return None
        return self.q_norm.scale, self.k_norm.scale, self.q_norm.eps

    def __call__(self, positions: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        fused = self.qk_norm
        if q.is_cuda and fused is not None:
            return fused_ops.apply_rope_(positions, q, k, self.head_dim, self.cos_sin_cache,
                                         qk_norm=fused)
        return self.rotary(positions, self._norm(self.q_norm, q), self._norm(self.k_norm, k))

    def _norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm(x.reshape(-1, self.head_dim)).view(x.shape[0], -1)


def get_rope(config: Any, head_dim: int, dtype: torch.dtype | None = None,
             layer_type: str | None = None) -> RotaryEmbedding:
    """The rotary embedding an HF config describes (for `layer_type`'s layers
    where the config has rope parameters per layer type)."""
    params = rope_parameters(config, layer_type)
    rotary_dim = int(head_dim * params["partial_rotary_factor"])
    return RotaryEmbedding(head_dim, rotary_dim, config.max_position_embeddings, params, dtype,
                           native_context(config))
