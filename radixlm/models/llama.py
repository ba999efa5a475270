"""The Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5.

The plain pre-norm decoder of `models/decoder.py` with SwiGLU. They differ in
their biases (Llama's `attention_bias` / `mlp_bias`, Qwen2's fixed q/k/v
biases) and windows (Mistral's `sliding_window` on every layer, Qwen2's on
the layers `layer_types` marks).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from radixlm.models import hf_config
from radixlm.models.decoder import DecoderForCausalLM, DecoderSpec


class LlamaForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        hf_config.full_rotary(config)
        bias = hf_config.flag(config, "attention_bias")
        return DecoderSpec.from_hf(config, qkv_bias=bias, o_bias=bias,
                                   mlp_bias=hf_config.flag(config, "mlp_bias"),
                                   activation=hf_config.activation(config, ("silu",)))


class MistralForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        hf_config.full_rotary(config)
        return DecoderSpec.from_hf(config, activation=hf_config.activation(config, ("silu",)),
                                   sliding_windows=hf_config.windows_on_every_layer(config))


class Qwen2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        hf_config.full_rotary(config)
        # q/k/v always have biases (whatever `attention_bias` says), o_proj none.
        return DecoderSpec.from_hf(config, qkv_bias=True,
                                   activation=hf_config.activation(config, ("silu",)),
                                   sliding_windows=hf_config.windows_by_layer_type(config))
