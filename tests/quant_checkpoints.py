"""Quantized checkpoints written the way the tools write them, for the tests.

Each writer takes a float HF checkpoint (a tiny random model built with
transformers) and writes the same model in one format, byte for byte as the
tool lays it out, plus the same model with the dequantized weights as an
ordinary float checkpoint (the reference: what the quantized model must
compute). The packing here follows the tools' own loops (AutoAWQ's
`WQLinear_GEMM.from_linear`, AutoGPTQ's `QuantLinear.pack`, DeepSeek-V3's and
transformers' FP8 block quantization, compressed-tensors' FP8 compressor),
written out independently of radixlm's packers so that a misread layout
fails rather than agreeing with itself.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

FP8 = torch.float8_e4m3fn
# The projections a writer quantizes (an expert's too: `experts.<e>.gate_proj`), with
# Mixtral's expert names w1 / w3 / w2; routers (`mlp.gate`) and the LM head stay float.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "w1", "w2", "w3")


def tiny_llama(**kw: Any) -> LlamaConfig:
    base = dict(vocab_size=160, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                max_position_embeddings=256, architectures=["LlamaForCausalLM"],
                tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
                pad_token_id=None)
    return LlamaConfig(**{**base, **kw})


# The GPU-sized random Llama of tests/gpu/test_quant_gpu.py (and
# benchmarks/fp8_sums_agreement.py), its projections scaled by GPU_TAME (that
# test's docstring says why).
GPU_LLAMA = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                 max_position_embeddings=4096)
GPU_TAME = 0.05


# hidden 200 (a block of 128 and a ragged 72), q 5 x 40 rows, one KV head of 40 rows,
# intermediate 320 (2.5 blocks): every 128 x 128 grid has ragged edges.
RAGGED = dict(hidden_size=200, intermediate_size=320, num_attention_heads=5,
              num_key_value_heads=1, head_dim=40)


def save_float_model(config: LlamaConfig, path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random model (linear weights and the LM head ~8x HF's init, so logits are
    peaked) saved with `save_pretrained`; returns its tensors."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.16)
    model.save_pretrained(path)
    return load_file(str(path / "model.safetensors"))


def save_tame_model(config: LlamaConfig, path: Path, tame: float = GPU_TAME
                    ) -> dict[str, torch.Tensor]:
    """`save_float_model` with every projection's weight scaled by `tame` (so that a
    bf16 residual stream through a few layers stays tame), saved at `path` as a
    float checkpoint; returns its tensors."""
    floats = save_float_model(config, path)
    floats = {k: v * tame if k.endswith("proj.weight") else v for k, v in floats.items()}
    write(path, config, floats, None)
    return floats


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in LINEARS


def write(path: Path, config: LlamaConfig, tensors: dict[str, torch.Tensor],
          quantization_config: dict[str, Any] | None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    data = config.to_dict()
    if quantization_config is not None:
        data["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(data))
    return str(path)


def write_pair(root: Path, name: str, config: LlamaConfig, floats: dict[str, torch.Tensor],
               quantize: Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor],
                                                             torch.Tensor]],
               quantization_config: dict[str, Any], extra: dict[str, torch.Tensor] | None = None
               ) -> tuple[str, str]:
    """(the quantized checkpoint, the dequantized float checkpoint): every linear
    weight through `quantize(name, w) -> (its tensors by suffix, dequantized w)`."""
    quantized, dequantized = dict(extra or {}), {}
    for key, w in floats.items():
        if not is_linear(key):
            quantized[key] = dequantized[key] = w
            continue
        module = key.removesuffix(".weight")
        parts, deq = quantize(key, w)
        quantized.update({f"{module}.{suffix}": t for suffix, t in parts.items()})
        dequantized[key] = deq
    return (write(root / name, config, quantized, quantization_config),
            write(root / f"{name}-dequantized", config, dequantized, None))


# ---- FP8 -------------------------------------------------------------------------------------
def fp8_codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-448.0, 448.0).to(FP8)


def fp8_block(w: torch.Tensor, bn: int = 128, bk: int = 128
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block quantization, ceil blocks at ragged edges: (codes,
    scale_inv [cdiv(n, bn), cdiv(k, bk)], dequantized)."""
    n, k = w.shape
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    q = torch.empty(n, k, dtype=FP8)
    s = torch.empty(rows, cols)
    deq = torch.empty(n, k)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s[i, j] = blk.abs().max() / 448.0
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = fp8_codes(blk, s[i, j])
            deq[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = \
                q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float() * s[i, j]
    return q, s, deq


def fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = w.abs().amax(1, keepdim=True) / 448.0
    q = fp8_codes(w, s)
    return q, s, q.float() * s


def write_online_fp8_dequantized(root: Path, config: LlamaConfig,
                                 floats: dict[str, torch.Tensor]) -> str:
    """The float model with each projection replaced by what `--quantization fp8`
    makes of it (per-channel codes times their scales), saved: its path."""
    deq = {k: fp8_per_channel(w)[2] if k.endswith("proj.weight") else w
           for k, w in floats.items()}
    return write(root / "fp8-online-deq", config, deq, None)


def fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s = w.abs().max() / 448.0
    q = fp8_codes(w, s)
    return q, s, q.float() * s


def hf_fp8_block(bn: int = 128, bk: int = 128) -> Callable:
    def quantize(name: str, w: torch.Tensor):
        q, s, deq = fp8_block(w, bn, bk)
        return {"weight": q, "weight_scale_inv": s}, deq
    return quantize


HF_FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [128, 128]}


def autofp8(static_input: float | None) -> Callable:
    """AutoFP8's per-tensor layout: `weight_scale` () and, static, `input_scale` ()."""
    def quantize(name: str, w: torch.Tensor):
        q, s, deq = fp8_per_tensor(w)
        parts = {"weight": q, "weight_scale": s.reshape(())}
        if static_input is not None:
            parts["input_scale"] = torch.tensor(static_input)
        return parts, deq
    return quantize


# ---- compressed-tensors FP8 --------------------------------------------------------------
def ct_args(strategy: str, dynamic: bool = False, **kw: Any) -> dict[str, Any]:
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy,
            "dynamic": dynamic, "group_size": None, "block_structure": None,
            "observer": None if dynamic else "minmax", "observer_kwargs": {},
            "actorder": None, **kw}


def ct_config(weights: dict[str, Any], acts: dict[str, Any] | None,
              kv: bool = False) -> dict[str, Any]:
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "global_compression_ratio": None,
            "ignore": ["lm_head"], "sparsity_config": {},
            "kv_cache_scheme": ct_args("tensor") if kv else None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts,
                                          "output_activations": None}}}


def compressed_tensors(strategy: str, static_input: float | None = None,
                       scale_dtype: torch.dtype = torch.bfloat16) -> Callable:
    """compressed-tensors' FP8 tensors: `weight_scale` [1] / [out, 1] / block grid in
    the model's dtype (bf16 here, so the scales are rounded to bf16 first)."""
    def quantize(name: str, w: torch.Tensor):
        if strategy == "block":
            n, k = w.shape
            _, s, _ = fp8_block(w)
            s = s.to(scale_dtype).float()
            full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
            q = fp8_codes(w, full)
            deq = q.float() * full
        else:
            s = (w.abs().amax(1, keepdim=True) if strategy == "channel"
                 else w.abs().max().reshape(1)) / 448.0
            s = s.to(scale_dtype).float()
            q = fp8_codes(w, s)
            deq = q.float() * s
        parts = {"weight": q, "weight_scale": s.to(scale_dtype)}
        if static_input is not None:
            parts["input_scale"] = torch.tensor([static_input], dtype=scale_dtype)
        return parts, deq
    return quantize


# ---- int4: AutoAWQ (GEMM) and AutoGPTQ ------------------------------------------------------
def int4_groups(w: torch.Tensor, group: int, sym: bool, order: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group of input features (in `order`, act-order): fp16 scales and int zeros
    [n, groups] and the dequantized weight [n, k]; AutoAWQ's asymmetric min/max
    (zero point in 0..15), or GPTQ's symmetric one (zero 8)."""
    n, k = w.shape
    order = torch.arange(k) if order is None else order
    groups = k // group
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups)
    deq = torch.empty(n, k)
    for g in range(groups):
        cols = order[g * group:(g + 1) * group]
        blk = w[:, cols]
        if sym:
            s = (2 * blk.abs().amax(1) / 15).clamp(min=1e-5)
            z = torch.full((n,), 8.0)
        else:
            hi, lo = blk.amax(1), blk.amin(1)
            s = ((hi - lo).clamp(min=1e-5) / 15)
        s = s.half().float()
        if not sym:
            z = (-torch.round(lo / s)).clamp(0, 15)
        q = (torch.round(blk / s[:, None]) + z[:, None]).clamp(0, 15)
        scales[:, g], zeros[:, g] = s, z
        deq[:, cols] = (q - z[:, None]) * s[:, None]
    return scales, zeros, deq


def awq(group: int) -> Callable:
    """AutoAWQ's `WQLinear_GEMM.from_linear`, loop for loop."""
    def quantize(name: str, w: torch.Tensor):
        scales, zeros, deq = int4_groups(w, group, sym=False)
        n, k = w.shape
        scale_zeros = (zeros * scales).T  # [groups, n]
        s = scales.T.half()
        intweight = torch.stack([torch.round((deq[:, i] + scale_zeros[i // group])
                                             / s[i // group].float()) for i in range(k)], 1)
        intweight = intweight.T.contiguous().to(torch.int64)  # [k, n]
        order_map = [0, 2, 4, 6, 1, 3, 5, 7]
        qweight = torch.zeros(k, n // 8, dtype=torch.int64)
        for col in range(n // 8):
            for i in range(8):
                qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)
        z = zeros.T.to(torch.int64)
        qzeros = torch.zeros(k // group, n // 8, dtype=torch.int64)
        for col in range(n // 8):
            for i in range(8):
                qzeros[:, col] |= z[:, col * 8 + order_map[i]] << (i * 4)
        return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros), "scales": s}, deq
    return quantize


def awq_config(group: int) -> dict[str, Any]:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


def gptq(group: int, sym: bool = True, desc_act: bool = False, v1: bool = True,
         seed: int = 0) -> Callable:
    """AutoGPTQ's `QuantLinear.pack` (v1: zeros stored minus one); with `desc_act`
    the features quantized in a random order, g_idx[i] its group."""
    def quantize(name: str, w: torch.Tensor):
        n, k = w.shape
        order = None
        if desc_act:  # projections of one input share its Hessian, hence its order
            order = torch.randperm(k, generator=torch.Generator().manual_seed(
                seed + 7 * _layer_index(name) + _INPUT_GROUP[name.split(".")[-2]]))
        scales, zeros, deq = int4_groups(w, group, sym, order)
        if v1:
            zeros = zeros.clamp(min=1)  # v1 cannot store a zero point of 0
            deq = dequant_from(w, scales, zeros, group, order)
        g_idx = torch.arange(k) // group
        if order is not None:
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[order] = torch.arange(k) // group
        s = scales.T.half()  # [groups, n]
        scale_zeros = (zeros * scales).T
        intweight = torch.stack([torch.round((deq[:, i] + scale_zeros[g_idx[i]])
                                             / s[g_idx[i]].float()) for i in range(k)], 1)
        intweight = intweight.T.contiguous().to(torch.int64)  # [k, n]
        qweight = torch.zeros(k // 8, n, dtype=torch.int64)
        for row in range(k // 8):
            for j in range(8):
                qweight[row] |= intweight[row * 8 + j] << (4 * j)
        z = (zeros.T - (1 if v1 else 0)).to(torch.int64)
        qzeros = torch.zeros(k // group, n // 8, dtype=torch.int64)
        for col in range(n // 8):
            for j in range(8):
                qzeros[:, col] |= z[:, col * 8 + j] << (4 * j)
        return {"qweight": as_int32(qweight), "qzeros": as_int32(qzeros), "scales": s,
                "g_idx": g_idx.to(torch.int32)}, deq
    return quantize


_INPUT_GROUP = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 1, "up_proj": 1,
                "o_proj": 2, "down_proj": 3}


def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else 0


def dequant_from(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 order: torch.Tensor | None) -> torch.Tensor:
    n, k = w.shape
    order = torch.arange(k) if order is None else order
    deq = torch.empty(n, k)
    for g in range(k // group):
        cols = order[g * group:(g + 1) * group]
        s, z = scales[:, g:g + 1], zeros[:, g:g + 1]
        deq[:, cols] = ((torch.round(w[:, cols] / s) + z).clamp(0, 15) - z) * s
    return deq


def gptq_config(group: int, sym: bool = True, desc_act: bool = False,
                v1: bool = True) -> dict[str, Any]:
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
            "sym": sym, "damp_percent": 0.01, "true_sequential": True,
            "checkpoint_format": "gptq" if v1 else "gptq_v2", "static_groups": False,
            "lm_head": False}


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits -> int32 (numpy's uint32 -> int32 view, as the tools do)."""
    return ((words + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)
