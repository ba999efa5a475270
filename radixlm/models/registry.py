"""Which model class serves which HF `architectures` name."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from radixlm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "LLaMAForCausalLM": LlamaForCausalLM,  # early Llama checkpoints spell it so
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config: PretrainedConfig) -> type[nn.Module]:
    """The class for the first of `config.architectures` we implement."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    named = ", ".join(archs) if archs else "(config.json names no architectures)"
    raise ValueError(f"unsupported model architecture {named}; "
                     f"supported: {', '.join(supported_architectures())}")
