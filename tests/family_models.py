"""Tiny random checkpoints of every dense family, built with transformers and saved
with `save_pretrained`, so HF loads the very weights we load (the reference).

Each config exercises what its family has: windows shorter than the prompts
(8 tokens), softcaps small enough to bind, decoupled head dims, QK norms,
per-layer-type ropes, LongRoPE, partial rotary dims. Weights are random (HF's
init zeroes biases and sets norms to one or zero, which would hide a
mis-loaded bias or norm) and large (std 0.16, ~8x HF's 0.02), so logits are
peaked and greedy paths decisive.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

WINDOW = 8
# Phi-3's LongRoPE switches to its long factors past this many positions.
PHI3_ORIGINAL_CONTEXT = 32


def tiny(cls: type[PretrainedConfig], **kw: Any) -> PretrainedConfig:
    base = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                architectures=[cls.__name__.replace("TextConfig", "Config")
                               .replace("Config", "ForCausalLM")],
                # No EOS: HF's generate and ours both run the full length.
                eos_token_id=None, bos_token_id=None, pad_token_id=None)
    return cls(**{**base, **kw})


# name -> config factory; keywords override the fields (`FAMILIES["qwen3"](hidden_size=...)`).
FAMILIES: dict[str, Callable[..., PretrainedConfig]] = {
    # Decoupled head_dim (4 x 32 != 64), QK norms, tied, windows on layers 1-2.
    "qwen3": partial(tiny, Qwen3Config, head_dim=32, tie_word_embeddings=True,
                     use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    # Alternating sliding / global layers, both softcaps, query_pre_attn_scalar.
    "gemma2": partial(tiny, Gemma2Config, head_dim=32, query_pre_attn_scalar=24,
                      sliding_window=WINDOW, attn_logit_softcapping=5.0,
                      final_logit_softcapping=10.0),
    # A rope per layer type (the global one linearly scaled), QK (1 + w) norms.
    "gemma3": partial(
        tiny, Gemma3TextConfig, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1000000.0}},
        final_logit_softcapping=15.0),
    # LongRoPE with short/long factors over half of each head (Phi-4-mini rotates
    # 0.75), a window on every layer (Phi-3-mini-4k).
    "phi3": partial(
        tiny, Phi3Config, sliding_window=WINDOW, tie_word_embeddings=False,
        original_max_position_embeddings=PHI3_ORIGINAL_CONTEXT,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5, "short_factor": [1.0, 1.1, 1.2, 1.5],
                         "long_factor": [1.0, 2.0, 4.0, 8.0]}),
    "mistral": partial(tiny, MistralConfig, sliding_window=WINDOW),
    "qwen2": partial(tiny, Qwen2Config, use_sliding_window=True, sliding_window=WINDOW,
                     max_window_layers=1),
}

# Llama's rope scalings (each as transformers computes it), at positions past
# the scaled original context.
ROPE_VARIANTS: dict[str, Callable[[], PretrainedConfig]] = {
    "yarn": lambda: tiny(LlamaConfig, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64}),
    "yarn-mscale": lambda: tiny(LlamaConfig, rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 16,
        "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
        "original_max_position_embeddings": 32}),
    # Within max_position_embeddings dynamic NTK is the default rope (HF's too).
    "dynamic": lambda: tiny(LlamaConfig, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
    "linear": lambda: tiny(LlamaConfig, rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 3.0}),
    "llama3": lambda: tiny(LlamaConfig, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


# Other fields the families honour.
OTHER_VARIANTS: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3-attention-bias": lambda: tiny(Qwen3Config, head_dim=32, attention_bias=True),
    "gemma2-attention-bias-gelu": lambda: tiny(
        Gemma2Config, head_dim=32, query_pre_attn_scalar=32, attention_bias=True,
        hidden_activation="gelu", sliding_window=WINDOW),
    "gemma3-untied-yarn-global": lambda: tiny(
        Gemma3TextConfig, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
        tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32,
                                            "rope_theta": 1000000.0}}),
}


def is_gemma(config: PretrainedConfig) -> bool:
    return config.model_type.startswith("gemma")


def save_random_model(config: PretrainedConfig, path: str | Path, seed: int = 0,
                      std: float = 0.16) -> torch.nn.Module:
    """A random HF model of `config` saved to `path`; returns it (fp32, eval)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Gemma's norms scale by (1 + w): random around 0 there, around 1 elsewhere.
    norm_center = 0.0 if is_gemma(config) else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(norm_center + 0.1 * torch.randn_like(p) if "norm" in name
                    else std * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def random_prompts(config: PretrainedConfig, lengths: list[int], seed: int = 1,
                   shared: int = 0) -> list[list[int]]:
    """Random token ids; the first `shared` tokens common to all (radix cache hits)."""
    gen = torch.Generator().manual_seed(seed)
    common = torch.randint(0, config.vocab_size, (shared,), generator=gen).tolist()
    return [common + torch.randint(0, config.vocab_size, (n - shared,), generator=gen).tolist()
            for n in lengths]
