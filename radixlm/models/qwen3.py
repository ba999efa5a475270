"""Qwen3 (dense): Llama's decoder with a per-head RMSNorm of q and k before the
rotary embedding, head_dim decoupled from hidden / heads (Qwen3-4B: 128 vs
2560 / 32), optional biases (`attention_bias`) and windows on the layers
`layer_types` marks sliding (`use_sliding_window`, `max_window_layers`)."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixlm.models import hf_config
from radixlm.models.decoder import DecoderForCausalLM, DecoderSpec


class Qwen3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        hf_config.full_rotary(config)
        bias = hf_config.flag(config, "attention_bias")
        return DecoderSpec.from_hf(config, qkv_bias=bias, o_bias=bias, qk_norm=True,
                                   activation=hf_config.activation(config, ("silu",)),
                                   sliding_windows=hf_config.windows_by_layer_type(config))
