"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head QK norms,
decoupled head_dim, optional biases) and MoE MLPs of `num_experts` experts
(128, top-8) of `moe_intermediate_size`; the top-k weights renormalized when
`norm_topk_prob`. Layers are MoE every `decoder_sparse_step`-th layer except
those in `mlp_only_layers`, which are dense MLPs of `intermediate_size`. A
sliding window, when `use_sliding_window`, is on every layer (HF's model)."""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import PretrainedConfig

from radixlm.models import hf_config
from radixlm.models.decoder import (
    HF_MOE_PROJECTIONS,
    DecoderForCausalLM,
    DecoderSpec,
    MlpFactory,
    MoeSpec,
    moe_mlp,
    num_experts,
    sparse_layers,
)
from radixlm.models.weight_map import WeightMapping


def qwen_moe_layers(config: PretrainedConfig, factory: MlpFactory) -> tuple[MlpFactory, ...]:
    """Qwen's layout: `factory` every `decoder_sparse_step`-th layer but the
    `mlp_only_layers`; dense everywhere when `num_experts` is 0."""
    layers = config.num_hidden_layers
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    bad = [i for i in dense if not isinstance(i, int) or not 0 <= i < layers]
    if bad:
        raise hf_config.refuse("mlp_only_layers", dense, f"entries {bad} are not layer "
                               f"indices of the {layers} layers")
    if not num_experts(config):
        return sparse_layers(layers, factory, dense_layers=range(layers))
    step = getattr(config, "decoder_sparse_step", 1) or 1
    if not isinstance(step, int) or step < 1:
        raise hf_config.refuse("decoder_sparse_step", step, "expected a positive integer")
    return sparse_layers(layers, factory, step=step, dense_layers=dense)


def qwen_moe_spec(config: PretrainedConfig, **kw: Any) -> MoeSpec:
    return MoeSpec(num_experts=num_experts(config), top_k=config.num_experts_per_tok,
                   intermediate_size=config.moe_intermediate_size,
                   renormalize=hf_config.flag(config, "norm_topk_prob"), round_weights=True,
                   **kw)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    weight_mapping: ClassVar[WeightMapping] = HF_MOE_PROJECTIONS

    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        hf_config.full_rotary(config)
        bias = hf_config.flag(config, "attention_bias")
        return DecoderSpec.from_hf(config, qkv_bias=bias, o_bias=bias, qk_norm=True,
                                   activation=hf_config.activation(config, ("silu",)),
                                   sliding_windows=hf_config.windows_on_every_layer(config),
                                   mlp_layers=qwen_moe_layers(config, moe_mlp),
                                   moe=qwen_moe_spec(config) if num_experts(config) else None)
