"""What each GGUF architecture is in HF terms, as llama.cpp's converter
(convert_hf_to_gguf.py) wrote it: the transformers config class and
architecture, the tensor names, the metadata a family adds, and what the
converter did to the tensors (q/k rows permuted for Llama, Gemma's norms
stored as 1 + w). `models/loader.py` converts a GGUF file with it.

MoE files stack each layer's experts in one tensor per projection
(`blk.N.ffn_gate_exps.weight`, [E, I, H] in HF's order of dims), with the
router `ffn_gate_inp` and a shared expert's `ffn_*_shexp`; a stacked tensor
is the hub checkpoint's E per-expert tensors (`hf_tensors` splits it), so
the conversion is an ordinary HF checkpoint of the family. llama.cpp writes
Mixtral as a `llama` file with stacked experts (`GgufArch.moe`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
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
# Stacked experts: one HF tensor per expert, EXPERT standing for its index.
EXPERT = "{expert}"
_MOE_NAMES = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
              "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
              "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj"}
_SHARED_EXPERT_NAMES = {"ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                        "ffn_up_shexp": "mlp.shared_expert.up_proj",
                        "ffn_down_shexp": "mlp.shared_expert.down_proj",
                        "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_MIXTRAL_NAMES = {"ffn_gate_inp": "block_sparse_moe.gate",
                  "ffn_gate_exps": f"block_sparse_moe.experts.{EXPERT}.w1",
                  "ffn_up_exps": f"block_sparse_moe.experts.{EXPERT}.w3",
                  "ffn_down_exps": f"block_sparse_moe.experts.{EXPERT}.w2"}
# HF [1, hidden] tensors llama.cpp stores as vectors.
_ROW_VECTORS = ("ffn_gate_inp_shexp",)
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


def _expert_fields(meta: Meta, tensors: dict[str, Any], count_field: str) -> dict[str, Any]:
    """The router's fields, and the layers without stacked experts (dense MLPs)."""
    moe_layers = {int(n.split(".")[1]) for n in tensors if n.endswith(".ffn_gate_exps.weight")}
    return {count_field: meta("expert_count"), "num_experts_per_tok": meta("expert_used_count"),
            "mlp_only_layers": sorted(set(range(meta("block_count"))) - moe_layers)}


# llama.cpp's graphs fix whether the top-k weights are renormalized per
# architecture (Qwen3-MoE and Mixtral yes, Qwen2-MoE and OLMoE no) unless the
# file says (expert_weights_norm).
def _qwen3moe_fields(meta: Meta, tensors: dict[str, Any]) -> dict[str, Any]:
    return dict(_expert_fields(meta, tensors, "num_experts"), decoder_sparse_step=1,
                moe_intermediate_size=meta("expert_feed_forward_length"),
                norm_topk_prob=bool(meta("expert_weights_norm", True)))


def _qwen2moe_fields(meta: Meta, tensors: dict[str, Any]) -> dict[str, Any]:
    return dict(_expert_fields(meta, tensors, "num_experts"), decoder_sparse_step=1,
                moe_intermediate_size=meta("expert_feed_forward_length"),
                shared_expert_intermediate_size=meta("expert_shared_feed_forward_length", 0),
                norm_topk_prob=bool(meta("expert_weights_norm", False)),
                qkv_bias="blk.0.attn_q.bias" in tensors)


def _olmoe_fields(meta: Meta, tensors: dict[str, Any]) -> dict[str, Any]:
    fields = _expert_fields(meta, tensors, "num_experts")
    if fields.pop("mlp_only_layers"):
        raise ValueError("an OLMoE GGUF file has a layer without stacked experts")
    return dict(fields, intermediate_size=meta("expert_feed_forward_length",
                                               meta("feed_forward_length")),
                norm_topk_prob=bool(meta("expert_weights_norm", False)), clip_qkv=None,
                attention_bias="blk.0.attn_q.bias" in tensors)


def _mixtral_fields(meta: Meta, tensors: dict[str, Any]) -> dict[str, Any]:
    fields = _expert_fields(meta, tensors, "num_local_experts")
    if fields.pop("mlp_only_layers"):
        raise ValueError("a Mixtral GGUF file has a layer without stacked experts")
    return dict(fields, intermediate_size=meta("expert_feed_forward_length",
                                               meta("feed_forward_length")),
                sliding_window=None)


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
    moe: GgufArch | None = None  # what a file of this architecture with stacked experts is

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF checkpoint name of GGUF tensor `gguf_name` (None: not a weight)."""
        stem, _, kind = gguf_name.rpartition(".")
        if stem.startswith("blk."):
            _, layer, part = stem.split(".", 2)
            mapped = self.block_names.get(part) or BLOCK_NAMES.get(part)
            return f"model.layers.{layer}.{mapped}.{kind}" if mapped else None
        mapped = GLOBAL_NAMES.get(stem)
        return f"{mapped}.{kind}" if mapped else None

    def hf_tensors(self, gguf_name: str, tensor: Any) -> Iterator[tuple[str, Any]]:
        """(HF name, tensor) of GGUF tensor `gguf_name`, given its values in HF's
        order of dims (a numpy array or a torch tensor): itself, or one copy per
        expert of a stacked expert tensor (along its first dim)."""
        name = self.hf_name(gguf_name)
        if name is None:
            raise ValueError(f"GGUF tensor {gguf_name} has no HF name")
        if EXPERT not in name:
            part = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
            yield name, tensor.reshape(1, -1) if part in _ROW_VECTORS else tensor
            return
        for e in range(tensor.shape[0]):
            one = tensor[e]
            yield name.replace(EXPERT, str(e)), one.clone() if hasattr(one, "clone") else \
                one.copy()


GGUF_ARCHS: dict[str, GgufArch] = {
    "llama": GgufArch("LlamaConfig", "LlamaForCausalLM", permuted_qk=True,
                      config_tensors=frozenset({"rope_freqs.weight"}),
                      moe=GgufArch("MixtralConfig", "MixtralForCausalLM", permuted_qk=True,
                                   block_names=_MIXTRAL_NAMES,
                                   config_tensors=frozenset({"rope_freqs.weight"}),
                                   config_fields=_mixtral_fields)),
    "qwen2": GgufArch("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": GgufArch("Qwen3Config", "Qwen3ForCausalLM", block_names=_QK_NORMS),
    "gemma2": GgufArch("Gemma2Config", "Gemma2ForCausalLM", block_names=_GEMMA_NORMS,
                       norm_offset=1.0, config_fields=_gemma2_fields),
    "gemma3": GgufArch("Gemma3TextConfig", "Gemma3ForCausalLM",
                       block_names={**_GEMMA_NORMS, **_QK_NORMS}, norm_offset=1.0,
                       config_fields=_gemma3_fields),
    "qwen3moe": GgufArch("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                         block_names={**_QK_NORMS, **_MOE_NAMES},
                         config_fields=_qwen3moe_fields),
    "qwen2moe": GgufArch("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                         block_names={**_MOE_NAMES, **_SHARED_EXPERT_NAMES},
                         config_fields=_qwen2moe_fields),
    "olmoe": GgufArch("OlmoeConfig", "OlmoeForCausalLM", block_names={**_QK_NORMS, **_MOE_NAMES},
                      config_fields=_olmoe_fields),
    "phi3": GgufArch("Phi3Config", "Phi3ForCausalLM",
                     block_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                     config_tensors=frozenset({"rope_factors_long.weight",
                                               "rope_factors_short.weight"}),
                     config_fields=_phi3_fields),
}


def arch_spec(arch: str, tensor_names: Iterable[str] = ()) -> GgufArch:
    """The spec of GGUF architecture `arch` (its MoE variant when `tensor_names`,
    the file's, include stacked experts); ValueError naming the supported ones."""
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(GGUF_ARCHS)})")
    spec = GGUF_ARCHS[arch]
    if spec.moe is not None and any(n.endswith("_exps.weight") for n in tensor_names):
        return spec.moe
    return spec
