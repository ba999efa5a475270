"""Embeddings and sessions on CUDA (Triton attention, overlap scheduler, CUDA
graphs): pooled hidden states against HF with the same random weights, and a
session's turns against the same contexts sent whole."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu

from gpu_models import save_random_llama  # noqa: E402
from transformers import LlamaForCausalLM  # noqa: E402

import radixlm  # noqa: E402

PROMPT_LENS = [7, 33, 128, 300, 5]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_llama(tmp_path_factory.mktemp("tiny-llama-embed"))


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, 32000, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def hf_hidden(model_dir, prompts):
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out = [hf.model(torch.tensor([p], device="cuda")).last_hidden_state[0].cpu()
               for p in prompts]
    del hf
    torch.cuda.empty_cache()
    return out


@pytest.mark.parametrize("dtype,pooling,min_cos", [
    ("float32", "last", 0.999), ("float32", "mean", 0.999), ("bfloat16", "last", 0.99),
])
def test_embeddings_match_hf(model_dir, prompts, hf_hidden, dtype, pooling, min_cos):
    with radixlm.Engine(model_dir, dtype=dtype, skip_tokenizer_init=True, is_embedding=True,
                        embedding_pooling=pooling, chunked_prefill_size=64,
                        max_total_tokens=8192) as e:
        outs = e.encode(input_ids=prompts)
        e.scheduler.check_invariants()
    for out, h in zip(outs, hf_hidden, strict=True):
        ref = torch.nn.functional.normalize(h[-1] if pooling == "last" else h.mean(0), dim=0)
        assert float(torch.dot(torch.tensor(out["embedding"]), ref)) >= min_cos


def test_session_turns_equal_full_context(model_dir, prompts):
    sp = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    with radixlm.Engine(model_dir, dtype="float32", skip_tokenizer_init=True,
                        max_total_tokens=8192) as e:
        sid = e.open_session(0)
        outs, contexts, context, prev = [], [], [], None
        for turn in prompts[:3]:
            params = {"id": sid} if prev is None else {"id": sid, "rid": prev["meta_info"]["id"]}
            out = e.generate(input_ids=turn, sampling_params=sp, session_params=params)
            contexts.append(context + turn)
            context = contexts[-1] + out["output_ids"]
            outs.append(out)
            prev = out
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs[1:])
        e.close_session(sid)
        for out, ctx in zip(outs, contexts, strict=True):
            assert e.flush_cache()[0]
            full = e.generate(input_ids=ctx, sampling_params=sp)
            assert full["output_ids"] == out["output_ids"]
        e.scheduler.check_invariants()
