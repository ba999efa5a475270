"""The server's front end on CUDA (overlap scheduler, CUDA graphs): the first
streamed event is the first token, the per-hop timing stamps come back in
order, and `priority` passes every route of a server that schedules by it.
No timed assertion: the figures are `python -m radixlm.bench ttft`'s."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]

from gpu_models import save_tiny_bpe_tokenizer  # noqa: E402
from server_utils import ServerProcess  # noqa: E402

STAGES = ["received", "tokenized", "sent", "sched_recv", "step_start", "first_token",
          "sched_send", "detok_recv", "detok_send", "api_recv", "first_write"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # A tokenizer trained here (the embedded model is not on GPU machines), a two-layer
    # config with head_dim 64 (the Triton kernels' common case), dummy weights.
    tiny = tmp_path_factory.mktemp("tiny-gpu")
    tok = save_tiny_bpe_tokenizer(tiny, ["The quick brown fox jumps over the lazy dog.",
                                         "Answer: yes, no, 0123456789"])
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": len(tok), "hidden_size": 128, "intermediate_size": 256,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 64, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
              "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    (tiny / "config.json").write_text(json.dumps(config))
    with ServerProcess(["--model-path", tiny, "--load-format", "dummy", "--dtype", "bfloat16",
                        "--enable-priority-scheduling",
                        "--max-total-tokens", "65536"]) as s:
        yield s


def _events(server: ServerProcess, body: dict[str, Any]) -> list[dict[str, Any]]:
    with server.client() as c, c.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("max_new_tokens", [1, 6])
def test_first_event_is_the_first_token_and_stamps_are_ordered(server: ServerProcess,
                                                               max_new_tokens: int) -> None:
    for i in range(3):  # the first after start-up, and two more
        events = _events(server, {
            "input_ids": [100 + i + j for j in range(24)], "stream": True,
            "return_timing": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True,
                                "temperature": 0.0}})
        assert len(events[0]["output_ids"]) == 1
        assert len(events[-1]["output_ids"]) == max_new_tokens
        timing = events[-1]["meta_info"]["timing"]
        present = [s for s in STAGES if s in timing]
        # A one-token stream's only event is rendered before its first write.
        assert present == (STAGES if max_new_tokens > 1 else STAGES[:-1]), timing
        values = [timing[s] for s in present]
        assert values == sorted(values), timing


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"input_ids": [[101, 102], [103]], "priority": [1, -1],
                   "sampling_params": {"max_new_tokens": 2}}),
    ("/v1/completions", {"prompt": [101, 102], "max_tokens": 2, "priority": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 2, "priority": 0}),
])
def test_priority_passes(server: ServerProcess, path: str, body: dict[str, Any]) -> None:
    with server.client() as c:
        r = c.post(path, json=body)
        bad = c.post(path, json={**body, "priority": 1.5})
    assert r.status_code == 200, r.text
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
