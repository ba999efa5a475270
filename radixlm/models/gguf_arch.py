"""What each GGUF architecture is in HF terms, as llama.cpp's converter
(convert_hf_to_gguf.py) wrote it: the transformers config class and
architecture, the tensor names, the metadata a family adds, and what the
converter did to the tensors (q/k rows permuted for Llama, Gemma's norms
stored as 1 + w). `models/loader.py` converts a GGUF file with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# meta(key, default) reads "<arch>.<key>" from the file's metadata.
Meta = Callable[..., Any]

GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                "output": "lm_head"}
# Llama's block tensors; an architecture overrides or adds names.
BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma's sandwich: llama.cpp's ffn_norm is the MLP's input norm there.
_GEMMA_NORMS = {"post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}


def _float(value: Any) -> float:
    # GGUF stores float32: 1e-5 reads back as 9.999999747378752e-06. The shortest
    # float32 repr recovers the value the original config.json had.
    return float(str(np.float32(value)))


def _optional_float(value: Any) -> float | None:
    return None if value is None else _float(value)


def _gemma_attention_scalar(meta: Meta) -> float:
    """query_pre_attn_scalar, which llama.cpp does not store: it scales queries by
    head_dim ** -0.5, except for the 27B models (Gemma 2: 46 layers, Gemma 3: 62),
    whose configs say hidden / heads; so do we."""
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length", hidden // heads)
    return hidden // heads if meta("block_count") in (46, 62) else head_dim


def _gemma2_fields(meta: Meta, tensors: dict[str, Any]) -> dict[str, Any]:
    return dict(sliding_window=meta("attention.sliding_window"),
                query_pre_attn_scalar=_gemma_attention_scalar(meta),
                attn_logit_softcapping=_optional_float(meta("attn_logit_softcapping", None)),
                final_logit_softcapping=_optional_float(meta("final_logit_softcapping", None)))


def _gemma3_fields(meta: Meta, tensors: dict[str, Any]) -> dict[str, Any]:
    fields = dict(sliding_window=meta("attention.sliding_window"),
                  query_pre_attn_scalar=_gemma_attention_scalar(meta),
                  final_logit_softcapping=_optional_float(meta("final_logit_softcapping", None)),
                  # rope.freq_base is the global layers' theta; llama.cpp fixes the
                  # sliding layers' at 10k, and five sliding layers per global one
                  # unless the file says which layers slide.
                  rope_local_base_freq=10000.0)
    pattern = meta("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer, True: sliding
        fields["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        fields["sliding_window_pattern"] = int(pattern)
    return fields


def _phi3_fields(meta: Meta, tensors: dict[str, Any]) -> dict[str, Any]:
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    head_dim = meta("attention.key_length", hidden // heads)
    fields: dict[str, Any] = dict(
        sliding_window=meta("attention.sliding_window", None),
        partial_rotary_factor=meta("rope.dimension_count", head_dim) / head_dim)
    if "rope_factors_long.weight" in tensors:  # LongRoPE: its factors are tensors here
        original = meta("rope.scaling.original_context_length")
        fields.update(original_max_position_embeddings=original, rope_scaling={
            "rope_type": "longrope", "original_max_position_embeddings": original,
            "short_factor": _floats(tensors["rope_factors_short.weight"]),
            "long_factor": _floats(tensors["rope_factors_long.weight"])})
    return fields


def _floats(tensor: Any) -> list[float]:
    return [_float(x) for x in np.asarray(tensor.data, dtype=np.float32)]


def _no_fields(meta: Meta, tensors: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GgufArch:
    config_class: str  # a transformers config class
    architecture: str  # the HF architecture (our model class)
    permuted_qk: bool = False  # llama.cpp permuted the q/k rows for its rope kernel
    block_names: Mapping[str, str] = field(default_factory=dict)  # over BLOCK_NAMES
    norm_offset: float = 0.0  # llama.cpp stored each norm weight + this
    # Tensors the converter made from config values (they go back into the config).
    config_tensors: frozenset[str] = frozenset()
    config_fields: Callable[[Meta, dict[str, Any]], dict[str, Any]] = _no_fields

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF checkpoint name of GGUF tensor `gguf_name` (None: not a weight)."""
        stem, _, kind = gguf_name.rpartition(".")
        if stem.startswith("blk."):
            _, layer, part = stem.split(".", 2)
            mapped = self.block_names.get(part) or BLOCK_NAMES.get(part)
            return f"model.layers.{layer}.{mapped}.{kind}" if mapped else None
        mapped = GLOBAL_NAMES.get(stem)
        return f"{mapped}.{kind}" if mapped else None


GGUF_ARCHS: dict[str, GgufArch] = {
    "llama": GgufArch("LlamaConfig", "LlamaForCausalLM", permuted_qk=True,
                      config_tensors=frozenset({"rope_freqs.weight"})),
    "qwen2": GgufArch("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": GgufArch("Qwen3Config", "Qwen3ForCausalLM", block_names=_QK_NORMS),
    "gemma2": GgufArch("Gemma2Config", "Gemma2ForCausalLM", block_names=_GEMMA_NORMS,
                       norm_offset=1.0, config_fields=_gemma2_fields),
    "gemma3": GgufArch("Gemma3TextConfig", "Gemma3ForCausalLM",
                       block_names={**_GEMMA_NORMS, **_QK_NORMS}, norm_offset=1.0,
                       config_fields=_gemma3_fields),
    "phi3": GgufArch("Phi3Config", "Phi3ForCausalLM",
                     block_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                     config_tensors=frozenset({"rope_factors_long.weight",
                                               "rope_factors_short.weight"}),
                     config_fields=_phi3_fields),
}


def arch_spec(arch: str) -> GgufArch:
    """The spec of GGUF architecture `arch`; ValueError naming the supported ones."""
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(GGUF_ARCHS)})")
    return GGUF_ARCHS[arch]
