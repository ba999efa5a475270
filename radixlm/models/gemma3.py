"""Gemma 3 (text): Gemma 2's layers (`models/gemma2.py`) plus a (1 + w) RMSNorm
of each q and k head, five sliding layers per global one (`layer_types`,
from `sliding_window_pattern`), a rope per layer type (local theta 10k on the
sliding layers; the global layers' own theta and scaling, linear x8 on the
4B-27B models), and no attention softcap."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixlm.models import hf_config
from radixlm.models.decoder import DecoderForCausalLM, DecoderSpec
from radixlm.models.gemma2 import gemma_spec


class Gemma3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        # transformers' Gemma 3 reads attn_logit_softcapping but never applies it.
        hf_config.require(config, "attn_logit_softcapping", (None,),
                          "Gemma 3's HF model does not apply an attention softcap; set null")
        types = hf_config.layer_types(config)
        for kind in set(types):
            hf_config.full_rotary(config, kind)
        return gemma_spec(config, qk_norm=True, rope_layer_types=types)
