"""GGUF files of the new families convert to checkpoints HF's models agree with.

Each tiny random HF model is written as llama.cpp's converter writes it: tensor
names from the gguf package's own map (`gguf.get_tensor_name_map`, not ours),
Gemma's norms stored as 1 + w, Phi-3's LongRoPE factors as tensors, the
family's metadata keys. Converted back by our loader, the model's logits
must match HF's on the original weights (float32 tensors: exactly the same
model).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from family_models import FAMILIES, WINDOW, save_random_model, tiny
from gguf_blocks import add_hparams
from kv_runner import KVRunner, check_close, hf_logits
from transformers import Gemma3TextConfig, Qwen3Config

from radixlm.models.loader import load_config, load_model, prepare_model_dir

ARCHS = {"qwen3": gguf.MODEL_ARCH.QWEN3, "gemma2": gguf.MODEL_ARCH.GEMMA2,
         "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}


def _config(name: str) -> Any:
    if name == "gemma3":
        # What llama.cpp assumes of Gemma 3: five sliding layers (theta 10k) per
        # global one, queries scaled by head_dim ** -0.5.
        return tiny(Gemma3TextConfig, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32,
                    sliding_window=WINDOW, final_logit_softcapping=15.0,
                    rope_parameters={
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                           "rope_theta": 1000000.0}})
    if name == "qwen3":  # llama.cpp's Qwen3 has no windows (no Qwen3 release uses one)
        return tiny(Qwen3Config, head_dim=32, tie_word_embeddings=True)
    config = FAMILIES[name]()
    if name == "gemma2":
        config.query_pre_attn_scalar = config.head_dim
    return config


def _metadata(w: gguf.GGUFWriter, name: str, config: Any) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // \
        config.num_attention_heads
    add_hparams(w, config)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = config.rope_parameters
    if name == "gemma3":
        rope = rope["full_attention"]
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_freq_base(rope["rope_theta"])
    if name in ("gemma2", "gemma3", "phi3"):
        w.add_sliding_window(config.sliding_window)
    if name == "gemma2":
        w.add_attn_logit_softcapping(config.attn_logit_softcapping)
    if name in ("gemma2", "gemma3"):
        w.add_final_logit_softcapping(config.final_logit_softcapping)
    if name == "phi3":
        w.add_rope_dimension_count(int(head_dim * rope["partial_rotary_factor"]))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_tensor("rope_factors_long.weight",
                     torch.tensor(rope["long_factor"], dtype=torch.float32).numpy())
        w.add_tensor("rope_factors_short.weight",
                     torch.tensor(rope["short_factor"], dtype=torch.float32).numpy())


def _write_gguf(path: Path, name: str, config: Any, hf: torch.nn.Module) -> None:
    names = gguf.get_tensor_name_map(ARCHS[name], config.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[ARCHS[name]])
    _metadata(w, name, config)
    tied = config.tie_word_embeddings
    for hf_name, tensor in hf.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue  # llama.cpp drops a tied head
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"gguf has no name for {hf_name}"
        arr = tensor.float()
        if name.startswith("gemma") and hf_name.endswith("norm.weight"):
            arr = arr + 1  # llama.cpp stores Gemma's norms as 1 + w
        w.add_tensor(gguf_name, arr.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_family_gguf_converts_to_hf_exact_model(name: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    config = _config(name)
    hf = save_random_model(config, tmp_path / "hf")
    path = tmp_path / f"tiny-{name}.gguf"
    _write_gguf(path, name, config, hf)
    model_dir = prepare_model_dir(str(path))
    converted = load_config(model_dir)
    assert converted.architectures == config.architectures
    for field in ("sliding_window", "layer_types", "query_pre_attn_scalar",
                  "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings"):
        assert getattr(converted, field, None) == getattr(config, field, None), field
    ours = load_model(model_dir, converted, "safetensors", torch.float32, "cpu")
    gen = torch.Generator().manual_seed(3)
    lengths = (40, 36) if name == "phi3" else (40, 5)  # Phi-3: past its LongRoPE switch
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    runner = KVRunner(ours)
    logits = runner.extend([(runner.new_request(), ids) for ids in seqs], all_rows=True)
    check_close(logits, torch.cat([hf_logits(hf, ids) for ids in seqs]))


def test_unknown_gguf_tensor_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    config = _config("qwen3")
    hf = save_random_model(config, tmp_path / "hf")
    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    _metadata(w, "qwen3", config)
    for hf_name, tensor in hf.state_dict().items():
        if hf_name != "lm_head.weight":
            w.add_tensor(gguf.get_tensor_name_map(ARCHS["qwen3"], 3).get_name(
                hf_name, try_suffixes=(".weight",)), tensor.numpy())
    w.add_tensor("blk.0.attn_sinks.weight", torch.zeros(4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF tensor blk.0.attn_sinks.weight has no place"):
        prepare_model_dir(str(path))
