"""The MoE families on CUDA against HF transformers on the same random weights.

GPU-sized versions of `moe_models.MOE_FAMILIES` (hidden 512, 4 layers, 16
experts of 256, top-4; Qwen2-MoE's shared expert, a dense layer in the Qwen
families), prompts of up to 300 tokens, through the whole engine in bfloat16
(CUDA graphs on, the experts on the default backend: our Triton kernels;
one family also on the torch reference, graphs off). The yardstick is HF's
own bfloat16 error against its float32 model on the same sequences: our
prompt logprobs may be at most a little worse, and our greedy tokens agree
with the float32 argmax at least as often, less a margin (a near tie between
two experts flips for either side: MoE outputs are not smooth in bf16).

FP8 experts (`-k fp8`): the GPU-sized Qwen3-MoE with expert intermediate 320
(2.5 blocks of 128: ragged gate / up / down grids), served with `--quantization
fp8` (quantized at load) and as an HF block-FP8 checkpoint written by the test
(`quant_checkpoints.hf_fp8_block`, every projection and expert in 128 x 128
blocks), against HF float32 on the same model with the quantized weights
dequantized. The experts run weight-only in the Triton kernels, but the dense
FP8 layers quantize prefill activations (W8A8), so the bound is
tests/gpu/test_quant_gpu.py's: prompt logprobs within 0.2 nats on average and
the first greedy tokens agreeing. The figures print (`pytest -s`).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu

from family_models import save_random_model  # noqa: E402
from moe_models import MOE_FAMILIES  # noqa: E402
from quant_checkpoints import (  # noqa: E402
    HF_FP8_BLOCK_CONFIG,
    fp8_per_channel,
    hf_fp8_block,
    is_linear,
    write,
    write_pair,
)
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import radixlm  # noqa: E402

SIZES = dict(vocab_size=32000, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=4096, num_experts_per_tok=4)
OVERRIDES = {
    "mixtral": dict(num_local_experts=16, intermediate_size=256, head_dim=64,
                    sliding_window=None),
    "qwen2_moe": dict(num_experts=16, moe_intermediate_size=256, intermediate_size=1024,
                      shared_expert_intermediate_size=512, mlp_only_layers=[1]),
    "qwen3_moe": dict(num_experts=16, moe_intermediate_size=256, intermediate_size=1024,
                      head_dim=128, mlp_only_layers=[0]),
    "olmoe": dict(num_experts=16, intermediate_size=256, clip_qkv=None),
}
LENS = [7, 33, 128, 300, 5]
NEW = 24


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    config = MOE_FAMILIES[name](**{**SIZES, **OVERRIDES[name]})
    path = tmp_path_factory.mktemp(name)
    save_random_model(config, path, std=0.05)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 32000, (n,), generator=g).tolist() for n in LENS]
    return name, str(path), prompts


def _hf(path: str, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                attn_implementation="eager").cuda().eval()


def _logprobs(model, ids: list[int], out_ids: list[int]) -> torch.Tensor:
    full = torch.tensor([ids + out_ids], device="cuda")
    with torch.no_grad():
        return torch.log_softmax(model(full).logits[0].float(), -1)


def _picked(lp: torch.Tensor, ids: list[int]) -> list[float]:
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


CASES = [("auto", False)] + [("torch", True)]


@pytest.mark.parametrize("backend,no_graphs", CASES)
def test_bf16_tracks_hf(family, backend, no_graphs):
    name, path, prompts = family
    if backend == "torch" and name != "qwen2_moe":
        pytest.skip("the reference backend runs on one family")
    with radixlm.Engine(path, dtype="bfloat16", skip_tokenizer_init=True, max_total_tokens=20000,
                        moe_runner_backend=backend, disable_cuda_graph=no_graphs) as e:
        outs = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW,
                                                              "temperature": 0},
                          return_logprob=True, logprob_start_len=0)
        e.scheduler.check_invariants()
    fp32 = _hf(path, torch.float32)
    refs = [_logprobs(fp32, ids, out["output_ids"]) for ids, out in zip(prompts, outs,
                                                                        strict=True)]
    del fp32
    bf16 = _hf(path, torch.bfloat16)
    ours, peer, agree, peer_agree = [], [], 0, 0
    for ids, out, ref in zip(prompts, outs, refs, strict=True):
        want = _picked(ref, ids)
        got = [lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]]
        ours += [abs(a - b) for a, b in zip(got, want, strict=True)]
        lp = _logprobs(bf16, ids, out["output_ids"])
        peer += [abs(a - b) for a, b in zip(_picked(lp, ids), want, strict=True)]
        best = ref[len(ids) - 1:-1].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(best, out["output_ids"], strict=True))
        peer_agree += sum(a == b for a, b in zip(best, lp[len(ids) - 1:-1].argmax(-1).tolist(),
                                                 strict=True))
    total = NEW * len(prompts)
    mean, peer_mean = sum(ours) / len(ours), sum(peer) / len(peer)
    assert mean < 1.25 * peer_mean + 5e-3 and max(ours) < 1.5 * max(peer) + 0.1, (
        f"{name}: ours max {max(ours):.4f} mean {mean:.4f}; "
        f"HF bf16 max {max(peer):.4f} mean {peer_mean:.4f}")
    assert agree >= peer_agree - 0.15 * total, (
        f"{name}: greedy agreement with float32 {agree}/{total}, HF bf16's {peer_agree}")


# ---- FP8 experts ---------------------------------------------------------------------
FP8_EXPERTS = dict(OVERRIDES["qwen3_moe"], moe_intermediate_size=320)  # ragged 128-blocks


def _fp8_model(tmp_path_factory, name: str, **overrides):
    config = MOE_FAMILIES["qwen3_moe"](**{**SIZES, **FP8_EXPERTS, **overrides})
    root = tmp_path_factory.mktemp(name)
    save_random_model(config, root / "float", std=0.05)
    floats = {k: v for f in sorted((root / "float").glob("*.safetensors"))
              for k, v in load_file(str(f)).items()}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 32000, (n,), generator=g).tolist() for n in LENS]
    return root, config, floats, prompts


@pytest.fixture(scope="module")
def qwen3_fp8(tmp_path_factory):
    return _fp8_model(tmp_path_factory, "qwen3-fp8")


@pytest.fixture(scope="module")
def qwen3_fp8_steps(tmp_path_factory):
    """Expert widths in whole 128-feature steps: per-channel FP8 experts then take
    the tensor-core GEMVs at decode (`moe_mma.takes`)."""
    return _fp8_model(tmp_path_factory, "qwen3-fp8-steps", moe_intermediate_size=256)


def _fp8_tracks_hf(path: str, dequantized: str, prompts: list[list[int]], label: str,
                   **engine_args) -> None:
    with radixlm.Engine(path, dtype="bfloat16", skip_tokenizer_init=True, max_total_tokens=20000,
                        **engine_args) as e:
        outs = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW,
                                                              "temperature": 0},
                          return_logprob=True, logprob_start_len=0)
        e.scheduler.check_invariants()
    ref = _hf(dequantized, torch.float32)
    errors, first, agree = [], 0, 0
    for ids, out in zip(prompts, outs, strict=True):
        lp = _logprobs(ref, ids, out["output_ids"])
        got = [x for x, _ in out["meta_info"]["input_token_logprobs"][1:]]
        errors += [abs(a - b) for a, b in zip(got, _picked(lp, ids), strict=True)]
        best = lp[len(ids) - 1:-1].argmax(-1).tolist()
        first += best[0] == out["output_ids"][0]
        agree += sum(a == b for a, b in zip(best, out["output_ids"], strict=True))
    mean = sum(errors) / len(errors)
    print(f"\n{label}: prompt logprobs vs HF float32 on the dequantized model: mean |diff| "
          f"{mean:.4f}, max {max(errors):.3f}; first tokens equal {first}/{len(prompts)}, "
          f"greedy tokens equal {agree}/{NEW * len(prompts)}")
    assert mean < 0.2 and first >= len(prompts) - 1, label


@pytest.mark.parametrize("model", ["qwen3_fp8", "qwen3_fp8_steps"])
def test_fp8_online_experts_track_the_dequantized_hf_model(model, request, monkeypatch):
    """Ragged expert widths (320) take the FMA GEMVs at decode, whole steps (256)
    the tensor cores' (`moe_mma`): each path is counted, so the test fails if the
    engine stops taking the one it names."""
    from radixlm.layers.moe.triton_ops import moe_mma

    root, config, floats, prompts = request.getfixturevalue(model)
    calls = []
    real = moe_mma.moe_mma
    monkeypatch.setattr(moe_mma, "moe_mma", lambda *a, **k: calls.append(1) or real(*a, **k))
    deq = {k: fp8_per_channel(w)[2] if is_linear(k) else w for k, w in floats.items()}
    ref = write(root / "online-deq", config, deq, None)
    _fp8_tracks_hf(str(root / "float"), ref, prompts, f"{model} fp8 online", quantization="fp8")
    assert bool(calls) == (model == "qwen3_fp8_steps"), f"moe_mma calls: {len(calls)}"


def test_fp8_block_checkpoint_experts_track_the_dequantized_hf_model(qwen3_fp8):
    root, config, floats, prompts = qwen3_fp8
    q, ref = write_pair(root, "block", config, floats, hf_fp8_block(), HF_FP8_BLOCK_CONFIG)
    _fp8_tracks_hf(q, ref, prompts, "qwen3_moe fp8 128x128 blocks")
