"""Checkpoints for the speculative-decoding tests, built here (no trained heads exist).

- `save_tiny_target`: a tiny random Llama (HF `save_pretrained`), weights ~8x HF's
  init so logits are peaked; greedy continuations of such models soon repeat.
- `save_eagle_head`: an EAGLE or EAGLE-3 draft head for a target, in the layout
  SafeAILab publishes (tensor names, shapes, config fields). `identity=True` makes
  the head pass the target's state through (fc selects it; attention and MLP
  outputs are zero): it then drafts the token the target predicted at the
  position before (EAGLE-3's: from the state before the last layer, nearly
  that), which is right exactly while the output repeats one token,
  so verify steps accept whole drafts. `identity=False`: random weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
            pad_token_id=None, architectures=["LlamaForCausalLM"])


def save_tiny_target(path: str | Path, seed: int = 0, std: float = 0.16, **config: Any) -> str:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **config}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, std)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _target_tensors(target_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():  # noqa: SIM118
                out[name] = h.get_tensor(name).float()
    return out


def save_eagle_head(path: str | Path, target_dir: str, kind: str = "EAGLE",
                    identity: bool = True, seed: int = 0, std: float = 0.1,
                    permute_vocab: bool = True, dtype: torch.dtype = torch.float32) -> str:
    """An EAGLE (`kind` "EAGLE") or EAGLE-3 ("EAGLE3") head for the target in
    `target_dir`, saved to `path` as config.json + model.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    target = _target_tensors(target_dir)
    g = torch.Generator().manual_seed(seed)
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg[
        "num_attention_heads"]
    d = cfg.get("head_dim") or h // heads
    n_layers = cfg["num_hidden_layers"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    fields = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "rms_norm_eps", "vocab_size",
                                  "max_position_embeddings", "hidden_act") if k in cfg}
    fields.update(head_dim=d, num_hidden_layers=1, model_type="llama",
                  rope_theta=(cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
                  tie_word_embeddings=False)
    prefix = "layers.0" if kind == "EAGLE" else "midlayer"
    qkv_in = h if kind == "EAGLE" else 2 * h
    zero_or_rand = (lambda *s: torch.zeros(*s)) if identity else rand
    t: dict[str, torch.Tensor] = {
        f"{prefix}.self_attn.q_proj.weight": rand(heads * d, qkv_in),
        f"{prefix}.self_attn.k_proj.weight": rand(kv * d, qkv_in),
        f"{prefix}.self_attn.v_proj.weight": rand(kv * d, qkv_in),
        f"{prefix}.self_attn.o_proj.weight": zero_or_rand(h, heads * d),
        f"{prefix}.post_attention_layernorm.weight": torch.ones(h),
        f"{prefix}.mlp.gate_proj.weight": rand(inter, h),
        f"{prefix}.mlp.up_proj.weight": rand(inter, h),
        f"{prefix}.mlp.down_proj.weight": zero_or_rand(h, inter),
    }
    eye = torch.eye(h)
    if kind == "EAGLE":
        fields["architectures"] = ["LlamaForCausalLMEagle"]
        fc = torch.cat([torch.zeros(h, h), eye], dim=1) if identity else rand(h, 2 * h)
        t.update({"fc.weight": fc, "fc.bias": torch.zeros(h) if identity else rand(h)})
    else:
        vocab = cfg["vocab_size"]
        hot = torch.randperm(vocab, generator=g) if permute_vocab else torch.arange(vocab)
        head = target.get("lm_head.weight", target["model.embed_tokens.weight"])
        fields.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=vocab,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": [0, n_layers // 2 - 1,
                                                                         n_layers - 2]})
        fc = torch.cat([torch.zeros(h, 2 * h), eye], dim=1) if identity else rand(h, 3 * h)
        t.update({
            "fc.weight": fc,
            f"{prefix}.input_layernorm.weight": torch.ones(h),
            f"{prefix}.hidden_norm.weight": torch.ones(h),
            "norm.weight": target["model.norm.weight"] if identity else torch.ones(h),
            "lm_head.weight": head[hot] if identity else rand(vocab, h),
            "d2t": hot - torch.arange(vocab),
            "t2d": torch.ones(vocab, dtype=torch.bool),
        })
    save_file({k: v.to(dtype).contiguous() if v.is_floating_point() else v.contiguous()
               for k, v in t.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(fields, indent=1))
    return str(path)
