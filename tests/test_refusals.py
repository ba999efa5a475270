"""Refuse, never ignore: configs and checkpoints the engine cannot honour fail at
load with an error naming the field (and the value), for every family.

What is honoured instead of refused (windows, softcaps, biases, tied heads,
rope scalings, partial rotary dims on Phi-3) is matched against HF in
test_families.py; the quantization_config refusal and the checkpoint-dtype
ones in test_weight_methods.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from family_models import FAMILIES, ROPE_VARIANTS, save_random_model
from safetensors.torch import load_file, save_file

from radixlm.models import get_model_class
from radixlm.models.loader import load_config, load_model


def _build(config: Any) -> torch.nn.Module:
    with torch.device("meta"):
        return get_model_class(config)(config)


def _with(name: str, **fields: Any) -> Any:
    """The family's test config with `fields` set after construction (as a
    config.json transformers does not validate would carry them)."""
    config = (FAMILIES | ROPE_VARIANTS)[name]()
    for key, value in fields.items():
        setattr(config, key, value)
    return config


REFUSED = {
    # field the message names: (family, fields set)
    "hidden_act='gelu'": ("mistral", {"hidden_act": "gelu"}),
    "hidden_activation='relu'": ("gemma2", {"hidden_activation": "relu"}),
    "use_bidirectional_attention=True": ("gemma3", {"use_bidirectional_attention": True}),
    "attn_logit_softcapping=50.0": ("gemma3", {"attn_logit_softcapping": 50.0}),
    "query_pre_attn_scalar=0": ("gemma2", {"query_pre_attn_scalar": 0}),
    "final_logit_softcapping=-1.0": ("gemma2", {"final_logit_softcapping": -1.0}),
    "layer_types=['chunked_attention']": (
        "qwen3", {"layer_types": ["full_attention", "chunked_attention", "full_attention"]}),
    "layer_types=": ("qwen2", {"layer_types": ["full_attention"]}),  # wrong length
    "sliding_window=0": ("mistral", {"sliding_window": 0}),
    "partial_rotary_factor=0.5": ("yarn", {"rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    "rope_type='proportional'": ("linear", {"rope_parameters": {
        "rope_type": "proportional", "rope_theta": 10000.0}}),
    "rope_parameters.short_factor must list 4": ("phi3", {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
        "short_factor": [1.0, 1.0], "long_factor": [1.0] * 4,
        "original_max_position_embeddings": 32}}),
    "no entry for 'full_attention' layers": ("gemma3", {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": None}}),
}


@pytest.mark.parametrize("message", sorted(REFUSED))
def test_unsupported_config_is_refused_by_name(message: str) -> None:
    family, fields = REFUSED[message]
    with pytest.raises(ValueError) as err:
        _build(_with(family, **fields))
    assert message in str(err.value)


def test_dynamic_rope_past_the_native_context_is_refused(tmp_path: Path) -> None:
    # HF recomputes dynamic NTK frequencies per forward past max_position_embeddings.
    ROPE_VARIANTS["dynamic"]().save_pretrained(tmp_path)
    _build(load_config(str(tmp_path), context_length=256))  # within it: the default rope
    with pytest.raises(ValueError, match="rope_type 'dynamic' over a context of 512 tokens"):
        _build(load_config(str(tmp_path), context_length=512))


def _checkpoint(tmp_path: Path, family: str) -> dict[str, torch.Tensor]:
    save_random_model(FAMILIES[family](), tmp_path)
    return load_file(str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("family", ["gemma3", "qwen3"])
def test_unknown_checkpoint_tensor_is_refused(tmp_path: Path, family: str) -> None:
    tensors = _checkpoint(tmp_path, family)
    tensors["model.layers.0.self_attn.q_scale"] = torch.ones(4)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model.layers.0.self_attn.q_scale has no place"):
        load_model(str(tmp_path), load_config(str(tmp_path)), "safetensors")


@pytest.mark.parametrize("family,dropped", [("gemma3", "self_attn.k_norm.weight"),
                                            ("gemma2", "post_feedforward_layernorm.weight"),
                                            ("phi3", "self_attn.qkv_proj.weight")])
def test_missing_checkpoint_tensor_is_refused(tmp_path: Path, family: str, dropped: str) -> None:
    tensors = _checkpoint(tmp_path, family)
    del tensors[f"model.layers.1.{dropped}"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"lacks 1 parameter.*model.layers.1.{dropped}"):
        load_model(str(tmp_path), load_config(str(tmp_path)), "safetensors")


def test_untied_head_must_be_in_the_checkpoint(tmp_path: Path) -> None:
    tensors = _checkpoint(tmp_path, "phi3")  # untied: lm_head.weight is its own tensor
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(str(tmp_path), load_config(str(tmp_path)), "safetensors")
