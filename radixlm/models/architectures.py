"""Which model class serves which HF `architectures` name, as import paths.

Torch-free on purpose: the API process checks a checkpoint's config.json
against this table before it spawns anything, and `registry.py` imports a
class only when a model is built. A new model is one line here.
"""

from __future__ import annotations

from collections.abc import Sequence

# HF architecture name -> (module, class).
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("radixlm.models.llama", "LlamaForCausalLM"),
    "LLaMAForCausalLM": ("radixlm.models.llama", "LlamaForCausalLM"),  # early Llama spelling
    "MistralForCausalLM": ("radixlm.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("radixlm.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("radixlm.models.qwen3", "Qwen3ForCausalLM"),
    "Gemma2ForCausalLM": ("radixlm.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("radixlm.models.gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": ("radixlm.models.phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("radixlm.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("radixlm.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("radixlm.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "OlmoeForCausalLM": ("radixlm.models.olmoe", "OlmoeForCausalLM"),
    # Draft heads (--speculative-algorithm EAGLE / EAGLE3): loaded beside a target, never served.
    "LlamaForCausalLMEagle": ("radixlm.speculative.eagle_model", "EagleForCausalLM"),
    "LlamaForCausalLMEagle3": ("radixlm.speculative.eagle_model", "Eagle3ForCausalLM"),
}
DRAFT_HEADS = frozenset({"LlamaForCausalLMEagle", "LlamaForCausalLMEagle3"})


def supported_architectures() -> list[str]:
    """The architectures a server can be started on (draft heads are not)."""
    return sorted(set(ARCHITECTURES) - DRAFT_HEADS)


def resolve_architecture(names: Sequence[str] | None) -> str:
    """The first of `names` (a config's `architectures`) that we implement.
    Anything else is refused by name, before a single other field of the
    config is read: an unknown model's fields may not even be where ours
    are (a vision-language config nests them under `text_config`)."""
    names = list(names or [])
    for name in names:
        if name in ARCHITECTURES:
            return name
    named = ", ".join(names) if names else "(config.json names no architectures)"
    raise ValueError(f"unsupported model architecture {named}; "
                     f"supported: {', '.join(supported_architectures())}")
