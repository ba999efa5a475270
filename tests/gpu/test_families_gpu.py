"""Every dense family on CUDA against HF transformers on the same random weights.

GPU-sized versions of `family_models.FAMILIES` (hidden 1024, 4 layers, each
family's head_dim: Qwen3 128 decoupled from hidden / heads, Gemma 256), with
64-token windows under prompts of up to 400 tokens. Through the whole engine
(CUDA graphs on), per attention backend: prompt-token logprobs within the
bf16 tolerance of test_engine_gpu.py (and tight in float32), and greedy
tokens agreeing with HF's argmax on the same prefix.

HF runs its eager attention, the reference implementation: some transformers
releases dispatch Gemma 2 to SDPA, which drops the attention softcap.

The Triton backend reads the window layers through the window KV pool
(`cache/swa_memory_pool.py`, on by default); the torch-native backend computes
windows and softcaps on CUDA too, over a plain pool. A backend that refuses a
layer at start-up (check_layer) skips its case, saying why.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu

from family_models import FAMILIES, save_random_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import radixlm  # noqa: E402

WINDOW = 64
SIZES = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096)
OVERRIDES = {
    "qwen3": dict(head_dim=128, sliding_window=WINDOW, max_window_layers=2),
    "gemma2": dict(num_attention_heads=8, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=WINDOW, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "gemma3": dict(num_attention_heads=8, head_dim=256, query_pre_attn_scalar=256,
                   sliding_window=WINDOW, final_logit_softcapping=None,
                   layer_types=["sliding_attention"] * 3 + ["full_attention"],
                   rope_parameters={
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                       "full_attention": {"rope_type": "linear", "factor": 8.0,
                                          "rope_theta": 1000000.0}}),
    "phi3": dict(sliding_window=WINDOW, original_max_position_embeddings=256,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5,
                                  "short_factor": [1.0 + 0.05 * i for i in range(16)],
                                  "long_factor": [1.0 + 0.5 * i for i in range(16)]}),
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(sliding_window=WINDOW, max_window_layers=2),
}
# Phi-3's prompts pass its LongRoPE original context (256), past which HF's
# generate rotates with the long factors as we do at a context of 4096.
PROMPT_LENS = {"phi3": [300, 270, 400, 257]}
DEFAULT_LENS = [7, 33, 128, 300, 5, 400]
NEW = 24


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    name = request.param
    config = FAMILIES[name](**{**SIZES, **OVERRIDES[name]})
    path = tmp_path_factory.mktemp(name)
    save_random_model(config, path, std=0.05)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 32000, (n,), generator=g).tolist()
               for n in PROMPT_LENS.get(name, DEFAULT_LENS)]
    return name, str(path), prompts


def _engine(path: str, dtype: str, backend: str):
    try:
        return radixlm.Engine(path, dtype=dtype, skip_tokenizer_init=True,
                              max_total_tokens=20000, attention_backend=backend)
    except ValueError as e:
        if "does not implement" in str(e):  # check_layer: see the module docstring
            pytest.skip(f"{backend}: {e}")
        raise


def _hf(path: str, dtype: torch.dtype):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                attn_implementation="eager").cuda().eval()


def _prompt_logprobs(model, ids: list[int], out_ids: list[int]) -> torch.Tensor:
    """log_softmax of `model`'s float32 logits over prompt + output, [len, vocab]."""
    full = torch.tensor([ids + out_ids], device="cuda")
    with torch.no_grad():
        return torch.log_softmax(model(full).logits[0].float(), -1)


def _errors(logprobs: list[float], ref: torch.Tensor, ids: list[int]) -> list[float]:
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    return [abs(a - b) for a, b in zip(logprobs, want, strict=True)]


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_and_greedy_vs_hf(family, backend, dtype):
    """Prompt logprobs against HF in float32. In bfloat16 the yardstick is HF's own
    bfloat16 error against that float32 reference on the same sequences: ours may
    be at most a little worse (rounding of a different summation order), and the
    greedy tokens agree with the float32 argmax at least as often, less a margin."""
    name, path, prompts = family
    ref_model = _hf(path, torch.float32)
    with _engine(path, dtype, backend) as e:
        outs = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW,
                                                              "temperature": 0},
                          return_logprob=True, logprob_start_len=0)
        e.scheduler.check_invariants()
    refs = [_prompt_logprobs(ref_model, ids, out["output_ids"])
            for ids, out in zip(prompts, outs, strict=True)]
    ours = [e for ids, out, ref in zip(prompts, outs, refs, strict=True)
            for e in _errors([lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]],
                             ref, ids)]
    agree = sum(a == b for ids, out, ref in zip(prompts, outs, refs, strict=True)
                for a, b in zip(ref[len(ids) - 1:-1].argmax(-1).tolist(), out["output_ids"],
                                strict=True))
    total = NEW * len(prompts)
    mean = sum(ours) / len(ours)
    if dtype == "float32":
        assert max(ours) < 2e-3 and mean < 5e-4, f"{name}: max {max(ours)}, mean {mean}"
        assert agree == total, f"{name}: greedy agreement {agree}/{total}"
        return
    del ref_model
    peer_model = _hf(path, torch.bfloat16)
    peer, peer_agree = [], 0
    for ids, out, ref in zip(prompts, outs, refs, strict=True):
        lp = _prompt_logprobs(peer_model, ids, out["output_ids"])
        peer += _errors(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist(), ref, ids)
        peer_agree += sum(a == b for a, b in zip(ref[len(ids) - 1:-1].argmax(-1).tolist(),
                                                 lp[len(ids) - 1:-1].argmax(-1).tolist(),
                                                 strict=True))
    peer_mean = sum(peer) / len(peer)
    assert mean < 1.25 * peer_mean + 5e-3 and max(ours) < 1.5 * max(peer) + 0.05, (
        f"{name}: ours max {max(ours):.4f} mean {mean:.4f}; "
        f"HF bf16 max {max(peer):.4f} mean {peer_mean:.4f}")
    assert agree >= peer_agree - 0.1 * total, (
        f"{name}: greedy agreement with float32 {agree}/{total}, HF bf16's {peer_agree}")
