"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v
biases per `qkv_bias`, windows on the layers `layer_types` marks sliding) and
MoE MLPs whose routed experts (`moe_intermediate_size`, top-k weights
renormalized when `norm_topk_prob`) are joined by a shared expert every token
takes (`shared_expert_intermediate_size`), scaled by sigmoid(x w^T) of its
own gate. Layers follow Qwen's `decoder_sparse_step` / `mlp_only_layers`."""

from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig

from radixlm.models import hf_config
from radixlm.models.decoder import (
    HF_MOE_PROJECTIONS,
    DecoderForCausalLM,
    DecoderSpec,
    moe_mlp,
    moe_shared_mlp,
    num_experts,
)
from radixlm.models.qwen3_moe import qwen_moe_layers, qwen_moe_spec
from radixlm.models.weight_map import WeightMapping


def _windows(config: PretrainedConfig) -> tuple[int | None, ...]:
    # HF's config sets sliding_window to 0 when use_sliding_window is off.
    if "sliding_attention" not in hf_config.layer_types(config):
        return ()
    return hf_config.windows_by_layer_type(config)


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    weight_mapping: ClassVar[WeightMapping] = HF_MOE_PROJECTIONS

    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        hf_config.full_rotary(config)
        shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
        moe = qwen_moe_spec(config, shared_expert_intermediate_size=shared,
                            shared_expert_gate=True) if num_experts(config) else None
        return DecoderSpec.from_hf(
            config, qkv_bias=getattr(config, "qkv_bias", True),
            activation=hf_config.activation(config, ("silu",)), sliding_windows=_windows(config),
            mlp_layers=qwen_moe_layers(config, moe_shared_mlp if shared else moe_mlp), moe=moe)
