"""Which model class serves which HF `architectures` name."""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig

from radixlm.models.gemma2 import Gemma2ForCausalLM
from radixlm.models.gemma3 import Gemma3ForCausalLM
from radixlm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from radixlm.models.phi3 import Phi3ForCausalLM
from radixlm.models.qwen3 import Qwen3ForCausalLM
from radixlm.speculative.eagle_model import Eagle3ForCausalLM, EagleForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "LLaMAForCausalLM": LlamaForCausalLM,  # early Llama checkpoints spell it so
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    # Draft heads (--speculative-algorithm EAGLE / EAGLE3), never a target.
    "LlamaForCausalLMEagle": EagleForCausalLM,
    "LlamaForCausalLMEagle3": Eagle3ForCausalLM,
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
