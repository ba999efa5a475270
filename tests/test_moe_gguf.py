"""GGUF MoE files, written by the test from tiny random checkpoints as llama.cpp's
converter writes them: each layer's experts stacked into `ffn_{gate,up,down}_exps`
([E, I, H] in HF's order of dims), the router `ffn_gate_inp`, Qwen2-MoE's shared
expert `ffn_*_shexp` with its gate `ffn_gate_inp_shexp`, dense layers as
`ffn_{gate,up,down}`, Mixtral as a `llama` file (q/k rows permuted).
Matrices are Q8_0 (attention, embedding, head, dense MLPs) and Q4_0 (experts).

- The dequantized conversion is an HF checkpoint of the family: HF's model on it
  and ours agree (logits within 1e-4), and its config is the original's.
- Kept as blocks (`--quantization gguf`), every expert weight runs in our
  kernels: logits close to the dequantized model's (only the activations'
  int8 rounding differs), and greedy tokens through the engine, against the
  dequantized model's, agree (the agreement is printed).
- Read-back of an expert weight gives its packed bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from family_models import random_prompts, save_random_model
from gguf_blocks import add_hparams
from hf_reference import load_hf
from kv_runner import KVRunner, check_close, hf_logits
from moe_models import MOE_FAMILIES

import radixlm
from radixlm.layers.cpu_ops import qgemm
from radixlm.layers.quantization.gguf import GGUFFusedMoEMethod
from radixlm.models import gguf_packed
from radixlm.models.loader import load_config, load_model, prepare_model_dir
from radixlm.models.weight_map import WeightMap

ARCHS = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "mixtral": "llama"}
# llama.cpp's Mixtral has no sliding window; Q4_0's 32-wide blocks need the
# experts' intermediate size a multiple of 32.
OVERRIDES = {"mixtral": {"sliding_window": None, "intermediate_size": 64},
             "qwen2_moe": {"shared_expert_intermediate_size": 64}}
NEW_TOKENS = 12


def _llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert-time q/k row order (what our loader undoes)."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _gguf_tensors(name: str, config: Any, hf: torch.nn.Module) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array (HF's order of dims) of the whole model."""
    out: dict[str, np.ndarray] = {}
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}
    block = {"input_layernorm.weight": "attn_norm.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight",
             "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
             "mlp.experts.down_proj": "ffn_down_exps.weight"}
    for proj, short in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")):
        for kind in ("weight", "bias"):
            block[f"self_attn.{proj}_proj.{kind}"] = f"attn_{short}.{kind}"
    for proj in ("gate", "up", "down"):
        block[f"mlp.{proj}_proj.weight"] = f"ffn_{proj}.weight"
        block[f"mlp.shared_expert.{proj}_proj.weight"] = f"ffn_{proj}_shexp.weight"
    for hf_name, tensor in hf.state_dict().items():
        arr = tensor.float().numpy()
        if hf_name in glob:
            if not (hf_name == "lm_head.weight" and config.tie_word_embeddings):
                out[glob[hf_name]] = arr
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":
            inter = arr.shape[1] // 2
            out[f"blk.{layer}.ffn_gate_exps.weight"] = arr[:, :inter]
            out[f"blk.{layer}.ffn_up_exps.weight"] = arr[:, inter:]
            continue
        if rest == "mlp.shared_expert_gate.weight":
            arr = arr.reshape(-1)  # llama.cpp's is a vector
        if name == "mixtral" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            heads = config.num_attention_heads if "q_proj" in rest else \
                config.num_key_value_heads
            arr = _llama_permute(arr, heads)
        out[f"blk.{layer}.{block[rest]}"] = arr
    return out


def _qtype(gguf_name: str, arr: np.ndarray) -> gguf.GGMLQuantizationType:
    if arr.ndim == 1 or "ffn_gate_inp" in gguf_name:
        return gguf.GGMLQuantizationType.F32
    return gguf.GGMLQuantizationType.Q4_0 if "_exps" in gguf_name else \
        gguf.GGMLQuantizationType.Q8_0


def write_moe_gguf(path: Path, name: str, config: Any, hf: torch.nn.Module) -> None:
    arch = ARCHS[name]
    w = gguf.GGUFWriter(str(path), arch)
    add_hparams(w, config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // \
        config.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_expert_feed_forward_length(getattr(config, "moe_intermediate_size", None)
                                     or config.intermediate_size)
    if name == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    for gguf_name, arr in _gguf_tensors(name, config, hf).items():
        qtype = _qtype(gguf_name, arr)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, np.ascontiguousarray(arr))
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(arr), qtype),
                         raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def moe_gguf(request, tmp_path_factory):
    name = request.param
    root = tmp_path_factory.mktemp(f"gguf-{name}")
    config = MOE_FAMILIES[name](**OVERRIDES.get(name, {}))
    hf = save_random_model(config, root / "hf")
    path = root / f"tiny-{name}.gguf"
    write_moe_gguf(path, name, config, hf)
    from radixlm.layers import cpu_ops

    cpu_ops.load()  # built under the real cache root, before it moves
    qgemm.load()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RADIXLM_CACHE_DIR", str(root / "cache"))
        yield name, config, path, prepare_model_dir(str(path))


def test_conversion_is_an_hf_checkpoint_of_the_family(moe_gguf):
    name, config, path, model_dir = moe_gguf
    converted = load_config(model_dir)
    assert converted.architectures == config.architectures
    for field in ("num_experts", "num_local_experts", "num_experts_per_tok",
                  "moe_intermediate_size", "shared_expert_intermediate_size", "norm_topk_prob",
                  "mlp_only_layers", "qkv_bias", "head_dim"):
        if field in config.to_dict():
            assert converted.to_dict().get(field) == config.to_dict()[field], field
    hf = load_hf(model_dir)  # transformers' own model on the dequantized tensors
    ours = load_model(model_dir, converted, "safetensors", torch.float32, "cpu")
    seqs = random_prompts(config, [30, 7], seed=3)
    runner = KVRunner(ours)
    logits = runner.extend([(runner.new_request(), ids) for ids in seqs], all_rows=True)
    check_close(logits, torch.cat([hf_logits(hf, ids) for ids in seqs]))


def _kept(path: Path, model_dir: str):
    config = load_config(model_dir)
    quant = gguf_packed.quant_config(config, path, "gguf", torch.device("cpu"), torch.float32)
    return load_model(model_dir, config, "safetensors", torch.float32, "cpu",
                      quant_config=quant), quant


def test_kept_experts_track_the_dequantized_model(moe_gguf):
    if not qgemm.load():
        pytest.skip("no C++ compiler: the quantized kernels are unavailable")
    name, config, path, model_dir = moe_gguf
    kept, quant = _kept(path, model_dir)
    floats = load_model(model_dir, load_config(model_dir), "safetensors", torch.float32, "cpu")
    moe = [m for m in kept.modules() if type(m).__name__ == "FusedMoE"]
    assert moe and all(isinstance(m.quant_method, GGUFFusedMoEMethod) for m in moe)
    assert "experts kept as GGUF blocks" in moe[0].describe()
    assert not quant.floats, quant.floats  # every matrix kept
    ids = random_prompts(config, [40], seed=5)[0]
    logits = []
    for model in (kept, floats):
        runner = KVRunner(model)
        logits.append(runner.extend([(runner.new_request(), ids)], all_rows=True))
    # Only the activations' int8 rounding separates them (a misplaced block: ~100%),
    # but where the router's k-th and (k+1)-th experts nearly tie it flips the
    # choice for a token and that row jumps (measured: rows 1-3% of the largest
    # logit, a few of 40 at 6-20%).
    err = (logits[0] - logits[1]).abs().max(-1).values / logits[1].abs().max()
    assert err.median() < 0.05 and (err < 0.1).float().mean() >= 0.9, err
    agree = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean()
    assert agree >= 0.85, agree
    # Read-back of an expert gives its packed bytes, as the file's blocks pack.
    layer = max(i for i in range(config.num_hidden_layers)
                if i not in (getattr(config, "mlp_only_layers", None) or []))
    mlp = "block_sparse_moe" if name == "mixtral" else "mlp"
    down = "w2" if name == "mixtral" else "down_proj"
    expert_name = f"model.layers.{layer}.{mlp}.experts.3.{down}.weight"
    (data,) = [d for _, _, d in gguf_packed.iter_packed(path, frozenset({expert_name}))]
    assert torch.equal(WeightMap(kept).resolve(expert_name).gather(), data)


def test_a_lone_tokens_grouped_experts_equal_the_per_expert_path(moe_gguf):
    """Decode at batch 1 takes one grouped product per part (`_one_token`): the
    same bits as one product pair per expert (`routed_sum`), in fp32 and bf16,
    with a slot of another rank's expert (-1) among the choices."""
    if not qgemm.load():
        pytest.skip("no C++ compiler: the quantized kernels are unavailable")
    from radixlm.layers.moe.cpu import routed_sum
    from radixlm.layers.quantization.gguf import _product

    name, config, path, model_dir = moe_gguf
    kept, _ = _kept(path, model_dir)
    moe = next(m for m in kept.modules() if type(m).__name__ == "FusedMoE")
    method, experts = moe.quant_method, moe.packed_experts
    assert moe.grouped_experts
    k = config.num_experts_per_tok
    g = torch.Generator().manual_seed(11)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(1, config.hidden_size, generator=g).to(dtype)
        ids = torch.randperm(len(experts), generator=g)[:k].view(1, k)
        ids[0, -1] = -1
        weights = torch.rand(1, k, generator=g)

        def per_expert(e, rows):
            gate_up, down = experts[e]
            return _product(method.act(_product(rows, gate_up)), down)

        old = routed_sum(x, weights, ids, len(experts), per_expert).to(dtype)
        assert torch.equal(method.apply(moe, x, weights, ids), old), (name, dtype)


def test_greedy_tokens_agree_with_the_dequantized_model(moe_gguf, capsys):
    if not qgemm.load():
        pytest.skip("no C++ compiler: the quantized kernels are unavailable")
    name, config, path, _ = moe_gguf
    prompts = random_prompts(config, [20, 33, 9, 41], seed=7)
    sp = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for quantization in ("gguf", "none"):
        with radixlm.Engine(model_path=str(path), skip_tokenizer_init=True, dtype="float32",
                            quantization=quantization, max_total_tokens=1024) as e:
            outs[quantization] = [o["output_ids"] for o in e.generate(input_ids=prompts,
                                                                     sampling_params=sp)]
    agree = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), NEW_TOKENS)
             for x, y in zip(outs["gguf"], outs["none"], strict=True)]
    with capsys.disabled():
        print(f"\n{name}: greedy tokens equal to the dequantized model's before the first "
              f"divergence: {agree} of {NEW_TOKENS}")
    assert sum(agree) >= 0.5 * NEW_TOKENS * len(prompts), agree


def test_benchmark_file_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench moe-gguf` (the CPU benchmark's random OLMoE-shaped file), at a tiny
    size: it converts, keeps its expert blocks and generates."""
    if not qgemm.load():
        pytest.skip("no C++ compiler: the quantized kernels are unavailable")
    from radixlm.bench import moe_gguf
    from radixlm.layers import cpu_ops

    cpu_ops.load()
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "bench.gguf"
    # No tokenizer here (rebuilding the 49k-token one takes most of a minute on CI).
    moe_gguf.write(path, 2, "Q8_0", "Q4_0", hidden=64, heads=4, experts=8, top_k=2, inter=32,
                   vocab=160)
    with radixlm.Engine(model_path=str(path), max_total_tokens=512, dtype="float32",
                        skip_tokenizer_init=True) as e:
        layer = e.scheduler.worker.runner.model.model.layers[1]
        assert isinstance(layer.mlp.experts.quant_method, GGUFFusedMoEMethod)
        out = e.generate(input_ids=[5, 7, 9, 11], sampling_params={
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert len(out["output_ids"]) == 8


def test_benchmark_file_has_llamacpps_olmoe_layout(tmp_path: Path) -> None:
    """`bench moe-gguf`'s file holds what llama.cpp's `olmoe` loader creates: gguf-py's
    tensor names for the arch, ggml dims (fastest first) as its loader asks
    (token_embd {n_embd, n_vocab}, ffn_gate_exps {n_embd, n_ff_exp, n_expert}, ...)
    and the MoE hparams."""
    from radixlm.bench import moe_gguf

    path = tmp_path / "bench.gguf"
    hidden, heads, experts, top_k, inter, vocab, layers = 64, 4, 8, 2, 32, 160, 2
    moe_gguf.write(path, layers, "Q8_0", "Q4_0", hidden=hidden, heads=heads, experts=experts,
                   top_k=top_k, inter=inter, vocab=vocab)
    r = gguf.GGUFReader(str(path))
    arch = gguf.MODEL_ARCH.OLMOE
    name = gguf.MODEL_ARCH_NAMES[arch]
    assert r.fields["general.architecture"].contents() == name
    known = {gguf.TENSOR_NAMES[t].format(bid=i) + ".weight"
             for t in gguf.MODEL_TENSORS[arch] for i in range(layers)}
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in r.tensors}
    assert set(shapes) <= known, set(shapes) - known
    want = {"token_embd.weight": (hidden, vocab), "output_norm.weight": (hidden,),
            "output.weight": (hidden, vocab)}
    for i in range(layers):
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            want[f"blk.{i}.{part}.weight"] = (hidden, hidden)
        for part in ("attn_norm", "attn_q_norm", "attn_k_norm", "ffn_norm"):
            want[f"blk.{i}.{part}.weight"] = (hidden,)
        want[f"blk.{i}.ffn_gate_inp.weight"] = (hidden, experts)
        want[f"blk.{i}.ffn_gate_exps.weight"] = (hidden, inter, experts)
        want[f"blk.{i}.ffn_up_exps.weight"] = (hidden, inter, experts)
        want[f"blk.{i}.ffn_down_exps.weight"] = (inter, hidden, experts)
    assert shapes == want
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == gguf.GGMLQuantizationType.Q4_0
    assert types["blk.0.ffn_gate_inp.weight"] == gguf.GGMLQuantizationType.F32
    hp = {"block_count": layers, "embedding_length": hidden, "expert_count": experts,
          "expert_used_count": top_k, "expert_feed_forward_length": inter,
          "attention.head_count": heads, "attention.head_count_kv": heads,
          "vocab_size": vocab}
    assert {k: r.fields[f"{name}.{k}"].contents() for k in hp} == hp
