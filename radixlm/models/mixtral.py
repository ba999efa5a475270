"""Mixtral: Mistral's decoder with every MLP a mixture of experts (8 experts,
top-2 in Mixtral-8x7B; weights always renormalized over the chosen ones,
kept in float32). Its checkpoints name the MoE block `block_sparse_moe` and
each expert's projections w1 (gate), w3 (up), w2 (down).

Config fields that only train (`output_router_logits`, `router_aux_loss_coef`,
`router_jitter_noise`, `attention_dropout`) change nothing at inference, as in
HF's model."""

from __future__ import annotations

from typing import ClassVar

from transformers import PretrainedConfig

from radixlm.models import hf_config
from radixlm.models.decoder import (
    HF_MOE_PROJECTIONS,
    DecoderForCausalLM,
    DecoderSpec,
    MoeSpec,
    num_experts,
    sparse_layers,
)
from radixlm.models.weight_map import WeightMapping

MIXTRAL_WEIGHTS = WeightMapping(fused=HF_MOE_PROJECTIONS.fused,
                                skipped=HF_MOE_PROJECTIONS.skipped,
                                experts=HF_MOE_PROJECTIONS.experts,
                                renamed={"block_sparse_moe": "mlp"})


class MixtralForCausalLM(DecoderForCausalLM):
    weight_mapping: ClassVar[WeightMapping] = MIXTRAL_WEIGHTS

    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        hf_config.full_rotary(config)
        moe = MoeSpec(num_experts=num_experts(config), top_k=config.num_experts_per_tok,
                      intermediate_size=config.intermediate_size, renormalize=True)
        return DecoderSpec.from_hf(config, activation=hf_config.activation(config, ("silu",)),
                                   sliding_windows=hf_config.windows_on_every_layer(config),
                                   mlp_layers=sparse_layers(config.num_hidden_layers), moe=moe)
