"""Grammar-constrained decoding on CUDA: the token bitmask is applied on the GPU,
under CUDA graphs and the overlap scheduler, next to unconstrained requests.

The model is a small random Llama with a byte-level BPE tokenizer trained here
(no hub access), so the outputs are nonsense but must match their grammar."""

from __future__ import annotations

import json
import re

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = pytest.mark.gpu

from gpu_models import save_tiny_bpe_tokenizer  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import radixlm  # noqa: E402

TEXT = ['{"name": "Ada", "age": 36, "tags": ["math", "code"]}', "yes no maybe 0123456789",
        "The quick brown fox jumps over the lazy dog.", "abc-def ghi_jkl [1, 2, 3] true false"]
SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string", "enum": ["yes", "no"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"], "additionalProperties": False}
REGEX = r"[0-9]{3}-[a-z]{2}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-bpe-llama")
    tok = save_tiny_bpe_tokenizer(d, TEXT)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=512,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return str(d)


@pytest.mark.parametrize("overlap", [True, False])
def test_constrained_outputs_on_gpu(model_dir, overlap):
    prompts = ["Answer:", "Code:", "The quick", "Data"]
    free = {"max_new_tokens": 16, "temperature": 1.0, "seed": 3}
    params = [{"max_new_tokens": 64, "temperature": 0.0, "json_schema": json.dumps(SCHEMA)},
              {"max_new_tokens": 32, "temperature": 0.8, "seed": 1, "regex": REGEX},
              free, {"max_new_tokens": 64, "temperature": 1.0, "seed": 2,
                     "json_schema": json.dumps(SCHEMA)}]
    with radixlm.Engine(model_dir, max_total_tokens=4096,
                        disable_overlap_schedule=not overlap) as e:
        assert e.scheduler.device.type == "cuda"
        assert e.scheduler.worker.runner.graph_runner is not None
        outs = e.generate(prompts, params)
    for out in (outs[0], outs[3]):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        value = json.loads(out["text"])
        assert value["answer"] in ("yes", "no") and 0 <= value["score"] <= 9
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(REGEX, outs[1]["text"]), outs[1]["text"]
    assert outs[2]["meta_info"]["completion_tokens"] == 16 or \
        outs[2]["meta_info"]["finish_reason"]["type"] == "stop"
