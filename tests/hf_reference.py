"""HF transformers as the reference: the same checkpoint loaded in fp32, and its
greedy continuations (`generate`, one prompt at a time, so no padding)."""

from __future__ import annotations

from typing import Any

import torch

# The embedded model's defaults are its GGUF blocks in bf16 on CPUs that compute bf16
# natively; tests that compare with HF's fp32 (or that need float weights) pin these.
EXACT = {"dtype": "float32", "quantization": "none"}
EXACT_ARGS = ["--dtype", "float32", "--quantization", "none"]


def load_hf(model_dir: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               do_sample=False)
            outs.append(y[0, len(ids):].tolist())
    return outs
