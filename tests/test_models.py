"""Our Llama-family models against HF transformers on the same weights (CPU, fp32).

The models run through the torch_native attention backend over a real KV pool,
driven the way the model runner drives them: one req_to_token row per
request, KV slots from the pool's allocator, a hand-built ForwardBatch.
"""

from __future__ import annotations

import pytest
import torch
from kv_runner import KVRunner, check_close, hf_logits
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from radixlm import distributed
from radixlm.forward_batch import ForwardBatch, ForwardMode
from radixlm.layers.embedding import ParallelLMHead
from radixlm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixlm.models import get_model_class, supported_architectures
from radixlm.models.loader import iter_safetensors, load_config, load_model
from radixlm.tokenizer import get_tokenizer

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a land far away, there lived a princess who loved to read "
    "books about the stars and the sea.",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,",
    "Hi",
]


# ---- the embedded SmolLM2 --------------------------------------------------------
@pytest.fixture(scope="module")
def smol(model_dir):
    return load_model(model_dir, load_config(model_dir), "auto", torch.float32, "cpu")


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    tok = get_tokenizer(model_dir)
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def refs(hf_model, prompts) -> list[torch.Tensor]:
    return [hf_logits(hf_model, ids) for ids in prompts]


def test_prefill_ragged_batch_matches_hf(smol, prompts, refs):
    runner = KVRunner(smol)
    slots = [runner.new_request() for _ in prompts]
    logits = runner.extend(list(zip(slots, prompts, strict=True)), all_rows=True)
    assert len({len(p) for p in prompts}) == len(prompts)  # really ragged
    check_close(logits, torch.cat(refs))


def test_default_logit_rows_are_last_tokens(smol, prompts, refs):
    runner = KVRunner(smol)
    logits = runner.extend([(runner.new_request(), ids) for ids in prompts])
    check_close(logits, torch.stack([r[-1] for r in refs]))


def test_extend_attends_cached_prefix(smol, prompts, refs):
    runner = KVRunner(smol)
    a, b, c = (runner.new_request() for _ in range(3))
    pa, pb, pc = prompts[2], prompts[3], prompts[1]
    runner.extend([(a, pa[:10]), (b, pb[:25])])
    # Mixed batch: two requests extend their cached prefixes (one by a single
    # token), a third starts fresh.
    logits = runner.extend([(a, pa[10:]), (b, pb[25:26]), (c, pc)], all_rows=True)
    check_close(logits, torch.cat([refs[2][10:], refs[3][25:26], refs[1]]))


def test_decode_steps_match_hf(smol, prompts, refs):
    runner = KVRunner(smol)
    seqs = prompts[:4]
    starts = [1, 9, 12, 30]  # requests of different lengths decode side by side
    slots = [runner.new_request() for _ in seqs]
    runner.extend([(s, ids[:n]) for s, ids, n in zip(slots, seqs, starts, strict=True)])
    for step in range(4):
        logits = runner.decode([(s, ids[n + step]) for s, ids, n in zip(slots, seqs, starts,
                                                                         strict=True)])
        ref = torch.stack([r[n + step] for r, n in zip(refs, starts, strict=False)])
        check_close(logits, ref)


def test_forward_hidden_matches_hf(smol, hf_model, prompts):
    runner = KVRunner(smol)
    ids, slot, loc = prompts[2], runner.new_request(), runner.kv_pool.alloc(len(prompts[2]))
    runner.req_pool.req_to_token[slot, :len(ids)] = loc.to(torch.int32)
    fb = ForwardBatch.build(ForwardMode.EXTEND, ids, [slot], [0], [len(ids)], loc,
                            runner.req_pool, runner.kv_pool, runner.backend, torch.device("cpu"))
    runner.backend.init_forward_metadata(fb)
    with torch.inference_mode():
        ours = smol.forward_hidden(fb.input_ids, fb.positions, fb)
        ref = hf_model.model(torch.tensor([ids])).last_hidden_state[0]
    check_close(ours, ref)


def test_greedy_generation_matches_hf_generate(smol, hf_model, prompts):
    new_tokens = 32
    seqs = [prompts[0], prompts[1], prompts[3]]
    runner = KVRunner(smol)
    slots = [runner.new_request() for _ in seqs]
    nxt = runner.extend(list(zip(slots, seqs, strict=True))).argmax(-1).tolist()
    ours = [[t] for t in nxt]
    for _ in range(new_tokens - 1):  # the whole batch decodes together
        nxt = runner.decode(list(zip(slots, nxt, strict=True))).argmax(-1).tolist()
        for out, t in zip(ours, nxt, strict=True):
            out.append(t)
    for ids, out in zip(seqs, ours, strict=True):
        x = torch.tensor([ids])
        ref = hf_model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                max_new_tokens=new_tokens)[0, len(ids):].tolist()
        assert out[:len(ref)] == ref  # HF stops early at EOS; we decode on


# ---- small random models of each family ------------------------------------------
def _tiny(cls, **kw):
    base = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                architectures=[cls.__name__.replace("Config", "ForCausalLM")])
    return cls(**{**base, **kw})


TINY_CONFIGS = {
    "llama3-rope-tied": lambda: _tiny(
        LlamaConfig, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "llama-linear-rope-biases": lambda: _tiny(
        LlamaConfig, attention_bias=True, mlp_bias=True, num_key_value_heads=4,
        rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-qkv-bias-untied": lambda: _tiny(Qwen2Config, tie_word_embeddings=False,
                                           rope_theta=1000000.0, rms_norm_eps=1e-6),
    "mistral-head-dim": lambda: _tiny(MistralConfig, head_dim=24, num_key_value_heads=1,
                                      sliding_window=None),
}


def save_random_hf_model(config, path, seed: int = 0, **save_kw) -> torch.nn.Module:
    """An HF model with every weight random (HF's init zeroes biases and sets
    norms to one, which would hide a mis-loaded bias or norm), saved to `path`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name
                    else 0.08 * torch.randn_like(p))
    model.save_pretrained(path, **save_kw)
    return model


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_model_matches_hf(name, tmp_path):
    config = TINY_CONFIGS[name]()
    shards = {"max_shard_size": "100KB"} if name.startswith("mistral") else {}
    hf = save_random_hf_model(config, tmp_path, **shards)
    if shards:
        assert len(list(tmp_path.glob("*.safetensors"))) >= 2
    ours = load_model(str(tmp_path), load_config(str(tmp_path)), "safetensors", torch.float32,
                      "cpu")
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (7, 90, 1)]
    refs = [hf_logits(hf, ids) for ids in seqs]
    runner = KVRunner(ours)
    slots = [runner.new_request() for _ in seqs]
    # Prefill all but the last 3 tokens (positions up to ~90 cross the llama3
    # config's original context of 64), then decode those 3.
    heads = [ids[:-3] or ids for ids in seqs]
    logits = runner.extend(list(zip(slots, heads, strict=True)), all_rows=True)
    check_close(logits, torch.cat([r[:len(h)] for r, h in zip(refs, heads, strict=True)]))
    decoding = [(s, ids, r) for s, ids, r in zip(slots, seqs, refs, strict=True) if len(ids) > 3]
    for k in (-3, -2, -1):
        logits = runner.decode([(s, ids[k]) for s, ids, _ in decoding])
        check_close(logits, torch.stack([r[k] for _, _, r in decoding]))


def test_registry_covers_the_llama_family():
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"} <= set(
        supported_architectures())


def test_unsupported_architecture_is_named():
    config = LlamaConfig(architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM") as err:
        get_model_class(config)
    assert "LlamaForCausalLM" in str(err.value) and "Qwen2ForCausalLM" in str(err.value)


def test_builds_under_a_default_device_context():
    # The loader builds models inside `with torch.device(...)`; tables computed
    # at construction (RoPE) must not mix that device with CPU tensors.
    config = TINY_CONFIGS["llama3-rope-tied"]()
    with torch.device("meta"):
        model = get_model_class(config)(config)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"meta"}


def test_dummy_weights_are_seeded_and_sane(tmp_path):
    config = TINY_CONFIGS["qwen2-qkv-bias-untied"]()
    config.save_pretrained(tmp_path)  # the directory holds a config and nothing else
    cfg = load_config(str(tmp_path))
    a, b = (load_model(str(tmp_path), cfg, "dummy", torch.float32, "cpu", seed=3) for _ in "ab")
    c = load_model(str(tmp_path), cfg, "dummy", torch.float32, "cpu", seed=4)
    sa, sb, sc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.self_attn.qkv_proj.weight"],
                           sc["model.layers.0.self_attn.qkv_proj.weight"])
    assert torch.equal(sa["model.norm.weight"], torch.ones_like(sa["model.norm.weight"]))
    runner = KVRunner(a)
    logits = runner.extend([(runner.new_request(), list(range(20)))])
    assert torch.isfinite(logits).all() and logits.abs().max() < 20


def test_load_reports_missing_weights(tmp_path):
    config = TINY_CONFIGS["qwen2-qkv-bias-untied"]()
    save_random_hf_model(config, tmp_path)
    model = get_model_class(config)(config)
    partial = [(n, t) for n, t in iter_safetensors(str(tmp_path)) if "k_proj.bias" not in n]
    loaded = model.load_weights(partial)
    assert "model.layers.0.self_attn.qkv_proj.bias" in loaded  # q and v did load
    from safetensors.torch import save_file
    (tmp_path / "model.safetensors").unlink()
    save_file({n: t.contiguous() for n, t in partial if "lm_head" not in n},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_model(str(tmp_path), config, "safetensors", torch.float32, "cpu")


# ---- tensor-parallel sharding, simulated on one process ---------------------------
def _as_rank(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(distributed, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(distributed, "get_tp_size", lambda: size)


@pytest.mark.parametrize("tp_size,kv_heads", [(2, 4), (4, 2), (4, 1)])
def test_qkv_shards_recombine(monkeypatch, tp_size, kv_heads):
    heads, head_dim, hidden = 8, 4, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n * head_dim, hidden, generator=gen)
               for n in (heads, kv_heads, kv_heads))
    x = torch.randn(3, hidden, generator=gen)
    replicas = max(1, tp_size // kv_heads)
    for rank in range(tp_size):
        _as_rank(monkeypatch, rank, tp_size)
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads)
        for sid, w in zip("qkv", (q, k, v), strict=True):
            layer.weight.weight_loader(layer.weight, w, sid)
        oq, ok, ov = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], -1)
        qh = heads // tp_size
        kv_first = rank // replicas * layer.num_kv_heads
        kv_rows = slice(kv_first * head_dim, (kv_first + layer.num_kv_heads) * head_dim)
        torch.testing.assert_close(oq, x @ q[rank * qh * head_dim:(rank + 1) * qh * head_dim].T)
        torch.testing.assert_close(ok, x @ k[kv_rows].T)
        torch.testing.assert_close(ov, x @ v[kv_rows].T)


def test_column_row_merged_and_vocab_shards_recombine(monkeypatch):
    tp_size, hidden, inter, vocab = 2, 8, 12, 11
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(inter, hidden, generator=gen), torch.randn(inter, hidden, generator=gen)
    down = torch.randn(hidden, inter, generator=gen)
    emb = torch.randn(vocab, hidden, generator=gen)
    x = torch.randn(3, hidden, generator=gen)
    cols, partials, logits = [], [], []
    for rank in range(tp_size):
        _as_rank(monkeypatch, rank, tp_size)
        mine = slice(rank * inter // tp_size, (rank + 1) * inter // tp_size)
        merged = MergedColumnParallelLinear(hidden, [inter, inter])
        merged.weight.weight_loader(merged.weight, gate, 0)
        merged.weight.weight_loader(merged.weight, up, 1)
        g, u = merged(x).chunk(2, -1)
        torch.testing.assert_close(g, x @ gate[mine].T)
        torch.testing.assert_close(u, x @ up[mine].T)
        col = ColumnParallelLinear(hidden, inter)
        col.weight.weight_loader(col.weight, up)
        cols.append(col(x))
        # No process group here, so no all-reduce: the partial sums add up below.
        row = RowParallelLinear(inter, hidden)
        row.weight.weight_loader(row.weight, down)
        partials.append(cols[-1] @ row.weight.T)
        head = ParallelLMHead(vocab, hidden)  # 11 rows over 2 ranks: 6 each, one padding
        head.weight.weight_loader(head.weight, emb)
        logits.append(x @ head.weight.T)
    torch.testing.assert_close(torch.cat(cols, -1), x @ up.T)
    torch.testing.assert_close(sum(partials), x @ up.T @ down.T)
    torch.testing.assert_close(torch.cat(logits, -1)[:, :vocab], x @ emb.T)


# ---- tensor parallelism for real: two gloo ranks on the CPU -------------------------
def _tp_worker(rank: int, init_file: str, jobs: list[tuple[str, list[list[int]], str]]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    distributed.set_tp_group(dist.group.WORLD)
    assert (distributed.get_tp_rank(), distributed.get_tp_size()) == (rank, 2)
    try:
        for model_dir, seqs, out in jobs:
            model = load_model(model_dir, load_config(model_dir), "safetensors", torch.float32,
                               "cpu")
            runner = KVRunner(model)
            slots = [runner.new_request() for _ in seqs]
            logits = [runner.extend([(s, ids[:-1]) for s, ids in zip(slots, seqs, strict=True)],
                                    all_rows=True),
                      runner.decode([(s, ids[-1]) for s, ids in zip(slots, seqs, strict=True)])]
            if rank == 0:
                torch.save(logits, out)
    finally:
        distributed.set_tp_group(None)
        dist.destroy_process_group()


def test_two_tensor_parallel_ranks_match_hf(tmp_path):
    jobs, refs = [], []
    gen = torch.Generator().manual_seed(2)
    # Llama: 2 KV heads, one per rank; tied embeddings over an odd vocabulary
    # (each rank's half is padded). Mistral: 1 KV head, replicated on both ranks.
    # Biases: o_proj's and down_proj's go into one rank's partial sum only.
    for name in ("llama3-rope-tied", "mistral-head-dim", "llama-linear-rope-biases"):
        config = TINY_CONFIGS[name]()
        config.vocab_size = 157
        hf = save_random_hf_model(config, tmp_path / name)
        seqs = [torch.randint(0, 157, (n,), generator=gen).tolist() for n in (9, 4)]
        full = [hf_logits(hf, ids) for ids in seqs]
        refs.append([torch.cat([r[:-1] for r in full]), torch.stack([r[-1] for r in full])])
        jobs.append((str(tmp_path / name), seqs, str(tmp_path / f"{name}.pt")))
    torch.multiprocessing.spawn(_tp_worker, args=(str(tmp_path / "store"), jobs), nprocs=2)
    for (_, _, out), expected in zip(jobs, refs, strict=True):
        for ours, ref in zip(torch.load(out), expected, strict=True):
            check_close(ours, ref)
