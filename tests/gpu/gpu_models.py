"""A small random Llama checkpoint for the GPU engine tests (HF-saved, so HF
itself can load the same weights as the reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

BASE_CONFIG: dict[str, Any] = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
    num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
    tie_word_embeddings=False)


def save_random_llama(path: str | Path, seed: int = 0, **config: Any) -> str:
    """Save a random 6-layer Llama (BASE_CONFIG updated by `config`) to `path`."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**BASE_CONFIG, **config}))
    # Larger-than-default init so logits are not flat and greedy paths are decisive.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)
