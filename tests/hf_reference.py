"""HF transformers as the reference: the same checkpoint loaded in fp32, and its
greedy continuations (`generate`, one prompt at a time, so no padding)."""

from __future__ import annotations

from typing import Any

import torch


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
