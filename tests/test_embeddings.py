"""Embeddings (--is-embedding): a generation model's pooled final hidden state,
checked against HF transformers on the same weights; the offline
`Engine.encode`, /v1/embeddings through the `openai` client, and /encode.

No encoder (BERT-style) model is tested: none ships inside an installable
package here, and nothing may be downloaded from a model hub."""

from __future__ import annotations

import base64
import struct
from typing import Any

import httpx
import openai
import pytest
import torch
from hf_reference import EXACT
from server_utils import ServerProcess, default_server

import radixlm

pytestmark = pytest.mark.timeout(900)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Once upon a time, in a land far away, there lived a king who had three daughters.",
    "Hi",
]
CHUNK = 8  # smaller than most prompts: the pooled rows span several prefill chunks
HIDDEN = 576


def reference(hf_model: Any, ids: list[int], pooling: str) -> torch.Tensor:
    """HF's final-normed hidden states, pooled and L2-normalized."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    vec = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vec, dim=0)


def assert_matches(vec: list[float], ref: torch.Tensor) -> None:
    ours = torch.tensor(vec)
    assert ours.shape == ref.shape
    assert abs(float(ours.norm()) - 1.0) < 1e-4
    assert float(torch.dot(ours, ref)) >= 0.999


@pytest.fixture(scope="module", params=["last", "mean"])
def embed_engine(request):
    with radixlm.Engine(**EXACT, is_embedding=True, embedding_pooling=request.param,
                        chunked_prefill_size=CHUNK, max_total_tokens=2048,
                        num_threads=1) as e:
        yield e


def test_batched_embeddings_match_hf(embed_engine, hf_model):
    pooling = embed_engine.server_args.embedding_pooling
    outs = embed_engine.encode(PROMPTS)
    assert len(outs) == len(PROMPTS)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = embed_engine.tokenizer.encode(prompt)
        assert_matches(out["embedding"], reference(hf_model, ids, pooling))
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 0
        assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert max(len(embed_engine.tokenizer.encode(p)) for p in PROMPTS) > 2 * CHUNK
    embed_engine.scheduler.check_invariants()


def test_repeated_prompt_is_recomputed_not_cached(embed_engine):
    ids = embed_engine.tokenizer.encode(PROMPTS[2])
    first = embed_engine.encode(input_ids=ids)
    second = embed_engine.encode(input_ids=ids)
    assert second["meta_info"]["cached_tokens"] == 0
    assert torch.allclose(torch.tensor(first["embedding"]), torch.tensor(second["embedding"]),
                          atol=1e-5)
    s = embed_engine.scheduler
    assert s.worker.kv_pool.available_size() == s.max_total_tokens  # nothing kept


def test_engine_api_errors(embed_engine):
    with pytest.raises(ValueError, match="use encode"):
        embed_engine.generate("Hello", {"max_new_tokens": 4})
    with pytest.raises(ValueError, match="empty"):
        embed_engine.encode(input_ids=[])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        embed_engine.encode(input_ids=[10 ** 6])


def test_encode_needs_an_embedding_engine():
    with radixlm.Engine(**EXACT, max_total_tokens=256, num_threads=1) as e, \
            pytest.raises(ValueError, match="is_embedding=True"):
        e.encode("Hello")


# ---- over HTTP ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess(["--is-embedding", "--max-total-tokens", "2048", "--context-length",
                        "256", "--num-threads", "1", "--chunked-prefill-size",
                        str(CHUNK)]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_openai_embeddings_float_and_base64(client, model_name, hf_model, server):
    with server.client() as c:
        ids = [c.post("/tokenize", json={"text": p}).json()["tokens"] for p in PROMPTS]
    refs = [reference(hf_model, x, "last") for x in ids]
    floats = client.embeddings.create(input=PROMPTS, model=model_name, encoding_format="float")
    assert [d.index for d in floats.data] == list(range(len(PROMPTS)))
    for d, ref in zip(floats.data, refs, strict=True):
        assert_matches(d.embedding, ref)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    assert floats.model == model_name
    # The client's default is base64 (it decodes the float32 bytes itself).
    b64 = client.embeddings.create(input=PROMPTS, model=model_name, dimensions=HIDDEN)
    for d, f in zip(b64.data, floats.data, strict=True):
        assert torch.allclose(torch.tensor(d.embedding), torch.tensor(f.embedding), atol=1e-6)
    one = client.embeddings.create(input=PROMPTS[0], model=model_name)
    assert len(one.data) == 1
    tokens = client.embeddings.create(input=ids[1], model=model_name, encoding_format="float")
    assert_matches(tokens.data[0].embedding, refs[1])
    lists = client.embeddings.create(input=ids[:2], model=model_name, encoding_format="float")
    assert_matches(lists.data[1].embedding, refs[1])


def test_base64_is_little_endian_float32(server, model_name):
    with server.client() as c:
        body = {"input": "Hello", "model": model_name}
        f = c.post("/v1/embeddings", json={**body, "encoding_format": "float"}).json()
        b = c.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
    raw = base64.b64decode(b["data"][0]["embedding"])
    decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert len(decoded) == HIDDEN
    assert torch.allclose(torch.tensor(decoded), torch.tensor(f["data"][0]["embedding"]))


@pytest.mark.parametrize("body,status,fragment", [
    ({"input": []}, 400, "must not be empty"),
    ({"input": ""}, 400, "empty"),
    ({"input": [10 ** 6]}, 400, "outside the vocabulary"),
    ({"input": "x", "dimensions": 64}, 400, "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": [["a"]]}, 400, "input"),
    ({"input": "x", "model": "no-such-model"}, 404, "does not exist"),
    ({}, 400, "input"),
])
def test_bad_embedding_requests(server, body, status, fragment):
    with server.client() as c:
        r = c.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"] and err["code"] == status


def test_openai_client_errors(client, model_name):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        client.embeddings.create(input="x", model=model_name, dimensions=10)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(input="x", model="gpt-nothing")


def test_native_encode(server, hf_model):
    with server.client() as c:
        one = c.post("/encode", json={"text": PROMPTS[0], "rid": "enc-1"}).json()
        ids = c.post("/tokenize", json={"text": PROMPTS[0]}).json()["tokens"]
        assert_matches(one["embedding"], reference(hf_model, ids, "last"))
        assert one["meta_info"]["id"] == "enc-1"
        assert one["meta_info"]["prompt_tokens"] == len(ids)
        batch = c.post("/encode", json={"input_ids": [ids, ids[:2]]}).json()
        assert len(batch) == 2 and batch[0]["embedding"] == pytest.approx(one["embedding"],
                                                                         abs=1e-5)
        assert c.post("/encode", json={}).status_code == 400


def test_generation_routes_refused_on_embedding_server(server, model_name):
    with server.client() as c:
        for path, body in [
            ("/generate", {"text": "Hi"}),
            ("/v1/completions", {"model": model_name, "prompt": "Hi"}),
            ("/v1/chat/completions", {"model": model_name,
                                      "messages": [{"role": "user", "content": "Hi"}]}),
        ]:
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert "--is-embedding" in r.json()["error"]["message"]
        assert c.get("/get_model_info").json()["is_generation"] is False
        assert c.get("/health_generate").status_code == 200  # a probe through the scheduler
    info = server.wait_idle()
    assert info["kv_tokens_in_use"] == 0 and info["kv_tokens_free"] == 2048


def test_embeddings_refused_on_generation_server():
    gen = default_server()
    r = httpx.post(gen.url + "/v1/embeddings", json={"input": "Hi"}, headers=gen.headers)
    assert r.status_code == 400
    assert "--is-embedding" in r.json()["error"]["message"]
    assert httpx.post(gen.url + "/encode", json={"text": "Hi"}).status_code == 400
