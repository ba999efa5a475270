"""Tiny random checkpoints of the MoE families, built with transformers and saved
with `save_pretrained` (the hub's per-expert tensor names), so HF loads the
very weights we load: `family_models.save_random_model` fills them.

Each config exercises what its family has: Mixtral's renormalized top-2 and
its window on every layer; Qwen2-MoE's shared expert and sigmoid gate, a
dense layer (`mlp_only_layers`), no renormalization; Qwen3-MoE's QK norms,
renormalized top-k and a dense layer; OLMoE's whole-projection QK norms and
`clip_qkv`. 8 experts of hidden 64, 3 layers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from family_models import WINDOW, tiny
from transformers import (
    MixtralConfig,
    OlmoeConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

EXPERTS = 8

MOE_FAMILIES: dict[str, Callable[..., PretrainedConfig]] = {
    "mixtral": partial(tiny, MixtralConfig, num_local_experts=EXPERTS, num_experts_per_tok=2,
                       intermediate_size=48, sliding_window=WINDOW, head_dim=32),
    "qwen2_moe": partial(tiny, Qwen2MoeConfig, num_experts=EXPERTS, num_experts_per_tok=3,
                         moe_intermediate_size=32, shared_expert_intermediate_size=48,
                         norm_topk_prob=False, mlp_only_layers=[1]),
    "qwen3_moe": partial(tiny, Qwen3MoeConfig, num_experts=EXPERTS, num_experts_per_tok=4,
                         moe_intermediate_size=32, norm_topk_prob=True, head_dim=32,
                         mlp_only_layers=[0]),
    "olmoe": partial(tiny, OlmoeConfig, num_experts=EXPERTS, num_experts_per_tok=2,
                     intermediate_size=32, norm_topk_prob=False, clip_qkv=2.5),
}
