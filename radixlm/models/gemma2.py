"""Gemma 2: sandwich-normed layers ((1 + w) RMSNorms after attention and around
the MLP as well as before), GeGLU (gelu_pytorch_tanh), embeddings scaled by
sqrt(hidden), queries scaled by query_pre_attn_scalar ** -0.5, sliding and
global layers alternating (`layer_types`), attention and final logits
softcapped (`attn_logit_softcapping`, `final_logit_softcapping`), head_dim
256, tied embeddings."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from radixlm.layers.norm import GemmaRMSNorm
from radixlm.models import hf_config
from radixlm.models.decoder import DecoderForCausalLM, DecoderSpec

GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")


def gemma_spec(config: PretrainedConfig, **kw: Any) -> DecoderSpec:
    """What Gemma 2 and Gemma 3 share."""
    hf_config.require(config, "use_bidirectional_attention", (None, False),
                      "only causal (decoder) attention is served")
    scalar = getattr(config, "query_pre_attn_scalar", None)
    if not isinstance(scalar, int | float) or scalar <= 0:
        raise hf_config.refuse("query_pre_attn_scalar", scalar, "expected a positive number")
    bias = hf_config.flag(config, "attention_bias")
    return DecoderSpec.from_hf(
        config, qkv_bias=bias, o_bias=bias, norm=GemmaRMSNorm, sandwich_norms=True,
        activation=hf_config.activation(config, GEMMA_ACTIVATIONS, "hidden_activation"),
        attn_scale=scalar ** -0.5, embed_scale=config.hidden_size ** 0.5,
        final_logit_softcap=hf_config.softcap(config, "final_logit_softcapping"),
        sliding_windows=hf_config.windows_by_layer_type(config), **kw)


class Gemma2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, config: PretrainedConfig) -> DecoderSpec:
        hf_config.full_rotary(config)
        return gemma_spec(config,
                          attn_logit_softcap=hf_config.softcap(config, "attn_logit_softcapping"))
