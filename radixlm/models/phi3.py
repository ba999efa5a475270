"""Phi-3 / Phi-3.5 / Phi-4 (Phi3ForCausalLM): Llama's decoder, with q/k/v and
gate/up already fused in the checkpoint (`qkv_proj`, `gate_up_proj`: our own
names, loaded whole and split per rank), LongRoPE scaling with short and
long factors (Phi-3-128k, Phi-3.5, Phi-4-mini), a partial rotary factor
(Phi-4-mini: 0.75) and `sliding_window` on every layer when set."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixlm.models import hf_config
from radixlm.models.decoder import DecoderForCausalLM, DecoderSpec


class Phi3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        return DecoderSpec.from_hf(config, activation=hf_config.activation(config, ("silu",)),
                                   sliding_windows=hf_config.windows_on_every_layer(config))
