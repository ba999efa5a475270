"""`input_embeds` (SGLang's native field): a prompt given as one vector per position
instead of token ids, through the offline Engine and `/generate`, against HF's
`generate(inputs_embeds=...)` on CPU fp32; such prompts bypass the prefix cache;
bad shapes and values are refused by name."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from family_models import FAMILIES, save_random_model
from server_utils import default_server

import radixlm
from radixlm.tokenizer import get_tokenizer

PROMPTS = ["The capital of France is", "Write a haiku about the sea:"]
NEW = 10
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0}
EXACT = {"dtype": "float32", "quantization": "none", "max_total_tokens": 2048}


def hf_generate(hf: Any, embeds: torch.Tensor, new: int = NEW, **kw: Any) -> list[int]:
    with torch.no_grad():
        out = hf.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(1, len(embeds),
                                                                                dtype=torch.long),
                          max_new_tokens=new, do_sample=False, **kw)
    return out[0, -new:].tolist()


@pytest.fixture(scope="module")
def embedded(model_dir: str, hf_model: Any) -> dict[str, Any]:
    tok = get_tokenizer(model_dir)
    ids = [tok.encode(p) for p in PROMPTS]
    with torch.no_grad():
        embeds = [hf_model.get_input_embeddings()(torch.tensor(i)) for i in ids]
    return {"ids": ids, "embeds": embeds, "hf": [hf_generate(hf_model, e) for e in embeds]}


def test_engine_input_embeds_match_hf(embedded: dict[str, Any]) -> None:
    ids, embeds, ref = embedded["ids"], embedded["embeds"], embedded["hf"]
    with radixlm.Engine(**EXACT) as e:
        cached_before = e.scheduler.cache.total_size()
        one = e.generate(input_embeds=embeds[0], sampling_params=GREEDY)
        assert one["output_ids"] == ref[0]
        assert one["meta_info"]["prompt_tokens"] == len(ids[0])
        both = e.generate(input_embeds=[x.tolist() for x in embeds], sampling_params=GREEDY)
        assert [o["output_ids"] for o in both] == ref
        streamed = [t for c in e.generate(input_embeds=embeds[1], sampling_params=GREEDY,
                                          stream=True) for t in c["output_ids"]]
        assert streamed == ref[1]
        # Placeholder ids key nothing: no KV of these prompts was cached or shared.
        assert e.scheduler.cache.total_size() == cached_before
        assert e.scheduler.stats.num_cached_tokens == 0
        assert e.generate(input_ids=ids[0], sampling_params=GREEDY)["output_ids"] == ref[0]
        e.scheduler.check_invariants()


def test_engine_refuses_bad_input_embeds(embedded: dict[str, Any]) -> None:
    x = embedded["embeds"][0]
    cases = [
        ({"input_embeds": x[:, :-1]}, "input_embeds\\[0\\] must be a list of 576 floats"),
        ({"input_embeds": x.clone().index_fill_(0, torch.tensor([2]), float("nan"))},
         "input_embeds\\[2\\] holds a value that is not a finite number"),
        ({"input_embeds": x, "input_ids": [1, 2]}, "exactly one of prompt, input_ids"),
        ({"input_embeds": torch.zeros(3000, 576)}, "input_embeds has 3000 positions"),
        ({"input_embeds": [], }, "non-empty list of vectors"),
        ({"input_embeds": x, "return_logprob": True, "logprob_start_len": 0},
         "logprob_start_len must be -1"),
    ]
    with radixlm.Engine(**EXACT) as e:
        for kwargs, message in cases:
            with pytest.raises(ValueError, match=message):
                e.generate(sampling_params=GREEDY, **kwargs)
        assert not e.scheduler.has_work


def test_input_embeds_of_a_scaled_embedding_family(tmp_path: Path) -> None:
    """Gemma 2 scales its token embeddings: HF's inputs_embeds are the scaled ones
    (what `get_input_embeddings()` returns), and so are ours."""
    config = FAMILIES["gemma2"]()
    hf = save_random_model(config, tmp_path)
    ids = list(range(3, 20))
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(torch.tensor(ids))
    ref = hf_generate(hf, embeds, 8)
    with radixlm.Engine(model_path=str(tmp_path), skip_tokenizer_init=True, **EXACT) as e:
        out = e.generate(input_embeds=embeds, sampling_params={**GREEDY, "max_new_tokens": 8,
                                                               "ignore_eos": True})
        assert out["output_ids"] == ref
        assert e.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 8,
                                                          "ignore_eos": True}
                          )["output_ids"] == ref


@pytest.fixture(scope="module")
def server() -> Any:
    return default_server()


def test_generate_route_takes_input_embeds(server: Any, embedded: dict[str, Any]) -> None:
    body = {"input_embeds": embedded["embeds"][0].tolist(), "sampling_params": GREEDY}
    r = httpx.post(server.url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == embedded["hf"][0]
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True},
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[-1]["output_ids"] == embedded["hf"][0]  # cumulative ids
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_generate_route_refuses_bad_input_embeds(server: Any,
                                                 embedded: dict[str, Any]) -> None:
    """(Too many positions is the Engine test's: as JSON that many vectors exceed the
    server's 8 MiB body limit, a 413 before any parsing.)"""
    x = embedded["embeds"][0].tolist()
    nan_body = json.dumps({"input_embeds": x, "sampling_params": GREEDY})
    nan_body = nan_body.replace(str(x[1][3]), "NaN", 1)
    cases = [
        ({"input_embeds": [row[:10] for row in x]}, "must be a list of 576 floats"),
        ({"input_embeds": x, "text": "hi"}, "exactly one of text, input_ids or input_embeds"),
        ({"input_embeds": "not a list"}, "input_embeds must be a non-empty list"),
    ]
    for body, message in cases:
        r = httpx.post(server.url + "/generate", json={**body, "sampling_params": GREEDY},
                       timeout=60)
        assert r.status_code == 400, (body.keys(), r.text)
        err = r.json()["error"]
        assert message in err["message"] and err["param"] == "input_embeds", err
    r = httpx.post(server.url + "/generate", content=nan_body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "not a finite number" in r.json()["error"]["message"]
    ok = httpx.post(server.url + "/generate", json={"text": PROMPTS[0],
                                                    "sampling_params": GREEDY}, timeout=60)
    assert ok.status_code == 200 and ok.json()["output_ids"] == embedded["hf"][0]
