"""FP8 experts (`layers/quantization/fp8_moe.py`) on the CPU, fp32, against HF
transformers running the same model with every quantized weight replaced by its
dequantized values.

On the CPU the experts (and the dense FP8 layers) multiply with their weights
dequantized at matmul time, so our logits must be HF's on the dequantized
model up to float32 rounding (`kv_runner.check_through_kv`: 1e-4 of the
largest logit, through prefill, an extended prefix and decode) and our greedy
tokens equal to its `generate`'s: a misread scale, a gate/up grid concatenated
at the wrong block row, or a ragged edge shows. Greedy agreement with the
original float model is printed for the report (`pytest -s`), not asserted:
these random models (weights ~8x HF's init, so logits are peaked) amplify e4m3's
3-bit mantissa layer after layer, and their float and dequantized greedy paths
part early (from 0% to 100% of the tokens, by model), which says nothing of
radixlm; the bound that does is the dequantized model's, asserted above.

- Online `--quantization fp8` (Qwen3-MoE, Mixtral): per-row scales at load;
  read-back gives the dequantized floats; an update re-quantizes.
- FP8 checkpoints written by the tests (`quant_checkpoints.py`): HF block FP8
  with 32 x 32 blocks on Qwen3-MoE (hidden 80, expert intermediate 48: ragged
  gate, up and down grids) and 128 x 128 on Mixtral (hidden 200, intermediate
  192), AutoFP8 per-tensor scales with static activations, compressed-tensors
  per-channel; auto-detected from config.json, read back as stored.
- Expert parallelism: an ep=2 rank loads its experts only; a tensor-parallel
  cut inside a block and int8 experts are refused by name.
"""

from __future__ import annotations

from pathlib import Path

import hf_reference
import pytest
import torch
from family_models import random_prompts, save_random_model
from kv_runner import (
    KVRunner,
    check_through_kv,
    greedy_through_kv,
    hf_logits,
    logits_through_kv,
    token_agreement,
)
from moe_models import MOE_FAMILIES
from quant_checkpoints import (
    HF_FP8_BLOCK_CONFIG,
    autofp8,
    compressed_tensors,
    ct_args,
    ct_config,
    fp8_per_channel,
    hf_fp8_block,
    is_linear,
    write,
    write_pair,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from radixlm import distributed
from radixlm.layers.quantization import get_quantization_config, process_weights_after_loading
from radixlm.layers.quantization.fp8_moe import Fp8FusedMoEMethod
from radixlm.models.loader import load_config, load_model
from radixlm.models.weight_map import WeightMap

NEW_TOKENS = 8
FP8 = torch.float8_e4m3fn


# ---- helpers ---------------------------------------------------------------------------
def load(path: str, quantization: str | None = None) -> torch.nn.Module:
    config = load_config(path)
    return load_model(path, config, "safetensors", torch.float32, "cpu",
                      quant_config=get_quantization_config(config, quantization))


def hf_model(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def experts_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "FusedMoE"]


def check_against_hf(model: torch.nn.Module, dequantized: str, original: torch.nn.Module,
                     prompts: list[list[int]], label: str) -> None:
    """Logits through the KV pool within 1e-4 of HF's on the dequantized model, greedy
    tokens equal to its; agreement with the original float model printed."""
    ref = hf_model(dequantized)
    seqs = prompts[:3]
    check_through_kv([hf_logits(ref, ids) for ids in seqs],
                     logits_through_kv(KVRunner(model), seqs))
    tokens = greedy_through_kv(model, prompts, NEW_TOKENS)
    assert tokens == hf_reference.hf_greedy(ref, prompts, NEW_TOKENS), label
    ids = max(prompts, key=len)
    ours, floats = KVRunner(model), hf_logits(original, ids)
    logits = ours.extend([(ours.new_request(), ids)], all_rows=True)
    error = ((logits - floats).abs().max() / floats.abs().max()).item()
    same = token_agreement(tokens, hf_reference.hf_greedy(original, prompts, NEW_TOKENS))
    print(f"\n{label}: greedy agreement with the float model {same:.0%} of "
          f"{NEW_TOKENS * len(prompts)} tokens; logits within {error:.1%} of its largest")


# ---- models ----------------------------------------------------------------------------
# Qwen3-MoE and Mixtral at the test's sizes; `ragged`: sizes whose block grids have
# ragged edges for the block formats (blocks of 32 on Qwen3, of 128 on Mixtral).
CONFIGS = {
    "qwen3_moe": {},
    "mixtral": {},
    "qwen3_moe-ragged": dict(hidden_size=80, moe_intermediate_size=48, intermediate_size=96),
    "mixtral-ragged": dict(hidden_size=200, intermediate_size=192),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp8-moe")


@pytest.fixture(scope="module")
def saved(root):
    """name -> (config, float tensors, path, HF model, prompts), built on first use."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            family, _, _ = name.partition("-")
            config = MOE_FAMILIES[family](**CONFIGS[name])
            path = root / name
            hf = save_random_model(config, path)
            prompts = random_prompts(config, [21, 30, 9], shared=6)
            cache[name] = (config, load_file(str(path / "model.safetensors")), str(path), hf,
                           prompts)
        return cache[name]
    return get


# ---- online ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_online_fp8_experts_match_the_dequantized_hf_model(name, saved, root):
    config, floats, path, hf, prompts = saved(name)
    deq = {k: fp8_per_channel(w)[2] if is_linear(k) else w for k, w in floats.items()}
    ref = write(root / f"{name}-online-deq", config, deq, None)
    model = load(path, "fp8")
    layers = experts_of(model)
    assert layers and all(isinstance(m.quant_method, Fp8FusedMoEMethod) for m in layers)
    assert layers[0].gate_up_proj.dtype == FP8
    assert "FP8 e4m3 experts (quantized at load" in layers[0].describe()
    check_against_hf(model, ref, hf, prompts, f"fp8 online ({name})")


def test_online_expert_reads_back_as_floats_and_updates(saved):
    config, floats, path, _, prompts = saved("qwen3_moe")
    model = load(path, "fp8")
    name = "model.layers.1.mlp.experts.5.up_proj.weight"
    slot = WeightMap(model).resolve(name)
    assert slot.gather().dtype == torch.float32
    assert torch.equal(slot.gather(), fp8_per_channel(floats[name])[2])
    def last_logits() -> torch.Tensor:
        runner = KVRunner(model)
        return runner.extend([(runner.new_request(), prompts[0])])

    before = last_logits()
    new = floats[name] * -2.0
    slot.load(new)
    process_weights_after_loading(model)
    assert torch.equal(slot.gather(), fp8_per_channel(new)[2])
    after = last_logits()
    assert (after - before).abs().max() > 1e-3, "the update must reach the products"


# ---- checkpoints -----------------------------------------------------------------------
def _block(bn: int, bk: int):
    return hf_fp8_block(bn, bk), {**HF_FP8_BLOCK_CONFIG, "weight_block_size": [bn, bk]}


FORMATS = {
    "block32": ("qwen3_moe-ragged", *_block(32, 32)),
    "block128": ("mixtral-ragged", *_block(128, 128)),
    "autofp8-static": ("qwen3_moe", autofp8(0.05),
                       {"quant_method": "fp8", "activation_scheme": "static",
                        "ignored_layers": ["lm_head"]}),
    "ct-channel": ("qwen3_moe", compressed_tensors("channel"),
                   ct_config(ct_args("channel"), ct_args("token", dynamic=True))),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_fp8_checkpoint_experts_match_the_dequantized_hf_model(fmt, saved, root):
    name, quantize, qconfig = FORMATS[fmt]
    config, floats, path, hf, prompts = saved(name)
    q, ref = write_pair(root, fmt, config, floats, quantize, qconfig)
    model = load(q)  # auto-detected from config.json
    layers = experts_of(model)
    assert layers and all(isinstance(m.quant_method, Fp8FusedMoEMethod) for m in layers)
    check_against_hf(model, ref, hf, prompts, f"fp8 experts, {fmt}")


def test_ragged_block_grids_stack_per_part(saved, root):
    """Expert intermediate 48 in blocks of 32: gate's grid and up's grid are 2 block
    rows each (the last one ragged), 4 in all where one [96, 80] grid would have 3;
    the kernels' table then has a row per 16 weight rows (gcd of 32, 48 and 80)."""
    name, quantize, qconfig = FORMATS["block32"]
    config, floats, _, _, _ = saved(name)
    q, _ = write_pair(root, "block32", config, floats, quantize, qconfig)
    model = load(q)
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj_weight_scale_inv.shape == (8, 4, 3)
    assert experts.down_proj_weight_scale_inv.shape == (8, 3, 2)
    derived = experts.fp8_experts
    assert derived.block_shape == (16, 32)
    assert derived.w13_scale.shape == (8, 6, 3) and derived.w2_scale.shape == (8, 5, 2)
    stored = load_file(str(Path(q) / "model.safetensors"))
    # Up's rows 32..47 (its ragged block row) take up's second grid row, not gate's.
    want = stored["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"][1]
    torch.testing.assert_close(derived.w13_scale[3, 5], want)
    # Read-back: the checkpoint's own codes and scales.
    wm = WeightMap(model)
    for suffix in ("weight", "weight_scale_inv"):
        key = f"model.layers.1.mlp.experts.6.up_proj.{suffix}"
        got, want = wm.resolve(key).gather(), stored[key]
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8) if got.dtype == FP8
                                                       else got,
                                                       want.view(torch.uint8) if got.dtype == FP8
                                                       else want)


def test_an_expert_parallel_rank_loads_its_fp8_experts(saved, root, monkeypatch):
    """Rank 1 of ep=2: experts 4-7 of the block checkpoint, codes and grids as stored."""
    name, quantize, qconfig = FORMATS["block32"]
    config, floats, _, _, _ = saved(name)
    q, _ = write_pair(root, "block32", config, floats, quantize, qconfig)
    monkeypatch.setattr(distributed, "_MOE", distributed.MoeParallel(2, 1, 1, 0))
    model = load(q)
    experts = model.model.layers[1].mlp.experts
    assert experts.num_local_experts == 4 and experts.expert_start == 4
    stored = load_file(str(Path(q) / "model.safetensors"))
    prefix = "model.layers.1.mlp.experts"
    for local in range(4):
        e = 4 + local
        gate = stored[f"{prefix}.{e}.gate_proj.weight"].view(torch.uint8)
        assert torch.equal(experts.gate_up_proj.data[local, :48].view(torch.uint8), gate)
        grids = torch.cat([stored[f"{prefix}.{e}.{p}_proj.weight_scale_inv"]
                           for p in ("gate", "up")])
        torch.testing.assert_close(experts.gate_up_proj_weight_scale_inv.data[local], grids)


# ---- refusals --------------------------------------------------------------------------
def test_a_tensor_parallel_cut_inside_a_block_is_refused(saved, root, monkeypatch):
    """tp=2 cuts the experts' 48 intermediate rows at 24, inside a 32-row block."""
    from radixlm.layers.moe.fused_moe import FusedMoE

    name, quantize, qconfig = FORMATS["block32"]
    config, floats, _, _, _ = saved(name)
    q, _ = write_pair(root, "block32", config, floats, quantize, qconfig)
    quant = get_quantization_config(load_config(q))
    monkeypatch.setattr(distributed, "_MOE", distributed.MoeParallel(1, 0, 2, 1))
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.gate_up_proj: the experts' "
                                         r"intermediate size 48 split into pieces of 24 cuts a "
                                         r"weight_block_size \[32, 32\]"):
        FusedMoE(8, 80, 48, quant_config=quant, prefix="model.layers.1.mlp.experts")


def test_int8_experts_are_still_refused(saved):
    _, _, path, _, _ = saved("qwen3_moe")
    with pytest.raises(ValueError, match=r"quantization 'int8': the mixture-of-experts layer "
                                         r"model\.layers\.1\.mlp\.experts has no int8"):
        load(path, "int8")
