"""Every dense family on CUDA against HF transformers on the same random weights.

GPU-sized versions of `family_models.FAMILIES` (hidden 1024, 4 layers, each
family's head_dim: Qwen3 128 decoupled from hidden / heads, Gemma 256), with
64-token windows under prompts of up to 400 tokens. Through the whole engine
(CUDA graphs on), per attention backend: prompt-token logprobs within the
bf16 tolerance of test_engine_gpu.py (and tight in float32), and greedy
tokens agreeing with HF's argmax on the same prefix.

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


@pytest.mark.parametrize("backend", ["triton", "torch_native"])
@pytest.mark.parametrize("dtype,tol,mean_tol,min_agree", [("float32", 2e-3, 5e-4, 1.0),
                                                          ("bfloat16", 0.5, 0.05, 0.6)])
def test_logprobs_and_greedy_vs_hf(family, backend, dtype, tol, mean_tol, min_agree):
    name, path, prompts = family
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()
    with _engine(path, dtype, backend) as e:
        outs = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW,
                                                              "temperature": 0},
                          return_logprob=True, logprob_start_len=0)
        e.scheduler.check_invariants()
    agree = total = 0
    errors: list[float] = []
    for ids, out in zip(prompts, outs, strict=True):
        full = torch.tensor([ids + out["output_ids"]], device="cuda")
        with torch.no_grad():
            ref = torch.log_softmax(hf(full).logits[0].float(), -1)
        ours = [lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]]
        want = [ref[p - 1, ids[p]].item() for p in range(1, len(ids))]
        errors += [abs(a - b) for a, b in zip(ours, want, strict=True)]
        hf_next = ref[len(ids) - 1:-1].argmax(-1).tolist()
        agree += sum(a == b for a, b in zip(hf_next, out["output_ids"], strict=True))
        total += len(out["output_ids"])
    assert max(errors) < tol and sum(errors) / len(errors) < mean_tol, (
        f"{name}: prompt logprob error max {max(errors)}, mean {sum(errors) / len(errors)}")
    assert agree / total >= min_agree, f"{name}: greedy agreement {agree}/{total}"
