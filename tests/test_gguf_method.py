"""`--quantization gguf`: GGUF blocks kept in the layers (layers/quantization/gguf.py).

A small random Llama whose every weight is in a GGUF type, several formats in
one fused layer, with the types our kernels do not run (F16, Q5_0) on two
layers; its dequantized weights are the reference model. With activations
whose int8 quantization is exact, each kept layer's product is the
dequantized weight's product up to float32 summation (the kernels' bound,
tests/test_gguf_kernels.py), so any misplaced block, tile or part shows.
The embedded SmolLM2 Q4_1 file is checked against its dequantized
conversion token by token (teacher-forced top-1 and perplexity).
"""

from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf_blocks import exact_activations, random_blocks
from safetensors.torch import load_file, save_file
from test_models import TEXTS, KVRunner, save_random_hf_model
from transformers import LlamaConfig

from radixlm import distributed
from radixlm.layers.cpu_ops import qgemm, qpack
from radixlm.layers.embedding import VocabParallelEmbedding
from radixlm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixlm.layers.quantization import get_quantization_config, process_weights_after_loading
from radixlm.layers.quantization.gguf import GGUFConfig, GGUFLinearMethod
from radixlm.layers.quantization.packed import packed_bytes
from radixlm.models import gguf_packed
from radixlm.models.loader import default_model_path, iter_safetensors, load_config, load_model
from radixlm.models.weight_map import WeightMap
from radixlm.runtime.weight_updater import WeightUpdateError, WeightUpdater
from radixlm.tokenizer import get_tokenizer

FP32_SLACK = 8 * 2.0**-24
# HF name (within a layer) -> GGUF type, per layer: mixed formats in one fused
# layer (q/k/v: three runs; gate/up: fp16 and fp32 scales), one run of three
# parts, and types kept as floats (F16, Q5_0).
LAYER_TYPES = [
    {"self_attn.q_proj": "Q4_K", "self_attn.k_proj": "Q5_K", "self_attn.v_proj": "Q6_K",
     "self_attn.o_proj": "Q8_0", "mlp.gate_proj": "Q4_0", "mlp.up_proj": "Q4_1",
     "mlp.down_proj": "Q6_K"},
    {"self_attn.q_proj": "Q4_1", "self_attn.k_proj": "Q4_1", "self_attn.v_proj": "Q4_1",
     "self_attn.o_proj": "F16", "mlp.gate_proj": "Q8_0", "mlp.up_proj": "Q8_0",
     "mlp.down_proj": "Q5_0"},
]
FLOAT_LAYERS = {"model.layers.1.self_attn.o_proj", "model.layers.1.mlp.down_proj"}


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if not qgemm.load():
        pytest.skip("no C++ compiler: the quantized kernels are unavailable")


def tiny_config(tied: bool) -> LlamaConfig:
    # K-quants need 256-wide rows: hidden 256, intermediate 512.
    return LlamaConfig(vocab_size=160, hidden_size=256, intermediate_size=512,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=256, tie_word_embeddings=tied,
                       architectures=["LlamaForCausalLM"])


def to_gguf(kind: str, w: torch.Tensor, seed: int) -> tuple[np.ndarray | None, torch.Tensor]:
    """(GGUF blocks or None for F16, the dequantized weight): gguf's quantizer
    where it has one, random blocks for the K-quants (it has none)."""
    n, k = w.shape
    qtype = gguf.GGMLQuantizationType[kind]
    if kind == "F16":
        return None, w.half().float()
    if kind in ("Q4_K", "Q5_K", "Q6_K"):
        raw = random_blocks(kind.lower(), n, k, seed, scale=0.1)  # weights of ~0.1
    else:
        raw = gguf.quants.quantize(w.numpy(), qtype)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).copy())


def types_of(config: LlamaConfig) -> dict[str, str]:
    types = {f"model.layers.{i}.{part}.weight": kind
             for i, layer in enumerate(LAYER_TYPES) for part, kind in layer.items()}
    types["model.embed_tokens.weight"] = "Q8_0"
    if not config.tie_word_embeddings:
        types["lm_head.weight"] = "Q6_K"
    return types


class TinyGGUF:
    """The model's dequantized checkpoint (as the GGUF conversion writes it) and
    the packed bytes of every kept tensor."""

    def __init__(self, path, tied: bool) -> None:
        self.config = tiny_config(tied)
        save_random_hf_model(self.config, path)
        tensors = load_file(f"{path}/model.safetensors")
        self.types = types_of(self.config)
        self.packed: dict[str, torch.Tensor] = {}
        for i, (name, kind) in enumerate(sorted(self.types.items())):
            raw, tensors[name] = to_gguf(kind, tensors[name], seed=i)
            if kind in qpack.GGUF_FORMATS:
                n, k = tensors[name].shape
                self.packed[name] = packed_bytes(qpack.pack_gguf(raw, kind, n, k))
        save_file(tensors, f"{path}/model.safetensors")
        self.dir = str(path)

    def weights(self, model_dir: str, packed: frozenset[str]):
        yield from iter_safetensors(model_dir, skip=packed)
        for name in sorted(packed):
            yield name, self.packed[name]

    def quant_config(self) -> GGUFConfig:
        return GGUFConfig(gguf_packed.fold_types(self.types, self.config), self.weights)

    def load(self, quant: GGUFConfig | None = None, dtype: torch.dtype = torch.float32):
        return load_model(self.dir, self.config, "safetensors", dtype, "cpu",
                          quant_config=quant)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny(request, tmp_path_factory) -> TinyGGUF:
    return TinyGGUF(tmp_path_factory.mktemp("gguf"), request.param)


@pytest.fixture(scope="module")
def models(tiny):
    quant = tiny.quant_config()
    return tiny.load(quant), tiny.load(), quant


def all_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    runner = KVRunner(model)
    return runner.extend([(runner.new_request(), ids)], all_rows=True)


def check_product(ours: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """ours == x W^T up to float32 summation, for exactly quantizable x."""
    exact = x.double() @ weight.double().T
    bound = FP32_SLACK * (x.shape[-1] // 32 + 2) * (x.double().abs() @ weight.double().abs().T)
    assert ((ours.double() - exact).abs() <= bound + 1e-30).all(), \
        f"max excess {((ours.double() - exact).abs() - bound).max().item():.3g}"


# ---- which layers keep blocks -----------------------------------------------------------
def test_each_layer_keeps_its_blocks_or_says_why_not(models):
    ours, _, quant = models
    methods = {name: type(m.quant_method).__name__ for name, m in ours.named_modules()
               if hasattr(m, "quant_method")}
    floats = {name for name, kind in methods.items() if kind != "GGUFLinearMethod"
              and kind != "PackedEmbeddingMethod"}
    assert floats == FLOAT_LAYERS
    assert set(quant.floats) == FLOAT_LAYERS
    line = quant.describe()
    assert "GGUF type F16" in line and "GGUF type Q5_0" in line and "Q6_K x" in line
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert [w.format for w, _, _ in qkv.packed_runs] == ["q4_k", "q5_k", "q6_k"]
    assert len(ours.model.layers[1].self_attn.qkv_proj.packed_runs) == 1  # one Q4_1 run
    assert ours.model.embed_tokens.weight.dtype == torch.uint8
    if ours.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


def test_kept_products_are_the_dequantized_products(models):
    ours, ref, _ = models
    for name, module in ours.named_modules():
        if not isinstance(getattr(module, "quant_method", None), GGUFLinearMethod):
            continue
        x = exact_activations(5, module.input_size, seed=len(name))
        y = module.quant_method.apply(module, x, module.bias)
        check_product(y, x, ref.get_submodule(name).weight.detach())


def test_embedding_rows_are_the_dequantized_rows(models):
    ours, ref, _ = models
    ids = torch.tensor([[0, 5, 159], [17, 17, 100]])
    assert torch.equal(ours.model.embed_tokens(ids), ref.model.embed_tokens(ids))


def test_bf16_activations(tiny):
    ours = tiny.load(tiny.quant_config(), torch.bfloat16)
    ref = tiny.load()
    layer = ours.model.layers[0].mlp.gate_up_proj
    x = exact_activations(3, 256, seed=4)
    y = layer.quant_method.apply(layer, x.bfloat16())
    assert y.dtype == torch.bfloat16
    exact = x @ ref.model.layers[0].mlp.gate_up_proj.weight.T
    torch.testing.assert_close(y.float(), exact, rtol=2**-8, atol=1e-3)
    assert ours.model.embed_tokens(torch.tensor([3])).dtype == torch.bfloat16


def test_model_tracks_the_dequantized_model(models):
    ours, ref, _ = models
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 160, (40,), generator=gen).tolist()
    logits = [all_logits(m, ids) for m in (ours, ref)]
    # Only the activations' int8 rounding separates them (measured: 2-4% of the
    # largest logit, 92-100% top-1 agreement over seeds; a misplaced block is ~100%).
    err = (logits[0] - logits[1]).abs().max() / logits[1].abs().max()
    assert err < 0.1, err
    agree = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean()
    assert agree >= 0.85, agree


# ---- checkpoint tensors: read-back, updates ---------------------------------------------
def test_read_back_gives_the_packed_bytes_and_updates_take_bytes(tiny, models):
    ours, _, quant = models
    updater = WeightUpdater(ours, tiny.config, torch.device("cpu"), tiny.dir)
    name = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(WeightMap(ours).resolve(name).gather(), tiny.packed[name])
    qkv = ours.model.layers[0].self_attn.qkv_proj
    x = exact_activations(2, 256, seed=1)
    before = qkv.quant_method.apply(qkv, x)
    raw = random_blocks("q5_k", 128, 256, seed=99, scale=0.1)
    new = packed_bytes(qpack.pack_gguf(raw, "Q5_K", 128, 256))
    try:
        updater.update_from_tensors([(name, new)])
        after = qkv.quant_method.apply(qkv, x)
        assert torch.equal(after[:, :256], before[:, :256])  # q untouched
        assert torch.equal(after[:, 384:], before[:, 384:])  # v untouched
        deq = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K)
                               .reshape(128, 256).copy())
        check_product(after[:, 256:384], x, deq)
    finally:
        updater.update_from_tensors([(name, tiny.packed[name])])
    assert torch.equal(qkv.quant_method.apply(qkv, x), before)
    with pytest.raises(WeightUpdateError, match="has dtype float32, .*expected one of uint8"):
        updater.update_from_tensors([(name, torch.zeros(128, 256))])
    with pytest.raises(WeightUpdateError, match="has shape"):
        updater.update_from_tensors([(name, new[:-1])])


# ---- tensor parallelism: each rank's tiles and blocks -----------------------------------
def _as_rank(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(distributed, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(distributed, "get_tp_size", lambda: size)


def _layers(quant: GGUFConfig) -> dict[str, torch.nn.Module]:
    return {
        "qkv": QKVParallelLinear(256, 64, 4, 2, quant_config=quant,
                                 prefix="model.layers.0.self_attn.qkv_proj"),
        "gate_up": MergedColumnParallelLinear(256, [512, 512], quant_config=quant,
                                              prefix="model.layers.0.mlp.gate_up_proj"),
        "down": RowParallelLinear(512, 256, quant_config=quant,
                                  prefix="model.layers.0.mlp.down_proj"),
        "embed": VocabParallelEmbedding(160, 256, quant_config=quant,
                                        prefix="model.embed_tokens"),
    }


_SHARDS = {"qkv": {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj"},
           "gate_up": {0: "mlp.gate_proj", 1: "mlp.up_proj"}, "down": {None: "mlp.down_proj"}}


def _loaded(quant: GGUFConfig, tiny: TinyGGUF) -> dict[str, torch.nn.Module]:
    layers = _layers(quant)
    for key, layer in layers.items():
        names = ({None: "model.embed_tokens.weight"} if key == "embed" else
                 {s: f"model.layers.0.{n}.weight" for s, n in _SHARDS[key].items()})
        for shard, name in names.items():
            layer.weight.weight_loader(layer.weight, tiny.packed[name], shard)
        process_weights_after_loading(layer)
    return layers


def test_each_rank_holds_its_tiles_and_blocks(tiny, monkeypatch):
    whole = _loaded(tiny.quant_config(), tiny)
    x = exact_activations(3, 512, seed=5)
    ranks = []
    for rank in range(2):
        _as_rank(monkeypatch, rank, 2)
        ranks.append(_loaded(tiny.quant_config(), tiny))
    qkv = [r["qkv"] for r in ranks]
    out = [layer.quant_method.apply(layer, x[:, :256]) for layer in qkv]
    full = whole["qkv"].quant_method.apply(whole["qkv"], x[:, :256])
    # rank r: query heads 2r, 2r+1 and KV head r, each part's columns exactly
    q, k, v = full.split([256, 128, 128], -1)
    for r, o in enumerate(out):
        oq, ok, ov = o.split([128, 64, 64], -1)
        assert torch.equal(oq, q[:, 128 * r:128 * (r + 1)])
        assert torch.equal(ok, k[:, 64 * r:64 * (r + 1)])
        assert torch.equal(ov, v[:, 64 * r:64 * (r + 1)])
    gate_up = [r["gate_up"].quant_method.apply(r["gate_up"], x[:, :256]) for r in ranks]
    g, u = whole["gate_up"].quant_method.apply(whole["gate_up"], x[:, :256]).chunk(2, -1)
    assert torch.equal(torch.cat([gu.chunk(2, -1)[0] for gu in gate_up], -1), g)
    assert torch.equal(torch.cat([gu.chunk(2, -1)[1] for gu in gate_up], -1), u)
    partial = [r["down"].quant_method.apply(r["down"], x[:, 256 * i:256 * (i + 1)])
               for i, r in enumerate(ranks)]
    down = whole["down"].quant_method.apply(whole["down"], x)
    # The same products, summed in two halves: float32 rounding only.
    torch.testing.assert_close(partial[0] + partial[1], down, rtol=0,
                               atol=1e-6 * down.abs().max().item())
    ids = torch.tensor([0, 79, 80, 159])
    rows = torch.cat([ranks[0]["embed"].quant_method.embedding(ranks[0]["embed"], ids[:2]),
                      ranks[1]["embed"].quant_method.embedding(ranks[1]["embed"], ids[2:] - 80)])
    assert torch.equal(rows, whole["embed"].quant_method.embedding(whole["embed"], ids))


def test_a_piece_off_the_tiles_holds_floats(tiny, monkeypatch):
    _as_rank(monkeypatch, 1, 3)  # 160 / 3 -> 54-row vocabulary pieces: not whole tiles
    quant = tiny.quant_config()
    embed = VocabParallelEmbedding(160, 256, quant_config=quant, prefix="model.embed_tokens")
    assert embed.weight.is_floating_point()
    assert "whole tiles" in quant.floats["model.embed_tokens"]


# ---- refusals ---------------------------------------------------------------------------
def test_refusals(tiny, tmp_path):
    quant = tiny.quant_config()
    with torch.device("meta"), pytest.raises(ValueError, match="runs on the CPU only"):
        RowParallelLinear(512, 256, quant_config=quant, prefix="model.layers.0.mlp.down_proj")
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        tiny.load(tiny.quant_config(), torch.float16)
    with pytest.raises(ValueError, match="keeps the blocks of a .gguf model file"):
        get_quantization_config(tiny.config, "gguf")
    path = default_model_path()
    with pytest.raises(ValueError, match="quantizes a float checkpoint"):
        gguf_packed.quant_config(tiny.config, path, "int8", torch.device("cpu"))
    floats = gguf_packed.quant_config(tiny.config, path, "auto", torch.device("cuda"))
    assert not isinstance(floats, GGUFConfig)
    with pytest.raises(ValueError, match="expected one of auto, none, gguf, int8"):
        get_quantization_config(tiny.config, "marlin")


def test_an_update_from_floats_is_refused_naming_the_dtype(tiny, models):
    ours = models[0]
    updater = WeightUpdater(ours, tiny.config, torch.device("cpu"), tiny.dir)
    refused = r"weight has dtype float32, .*\(expected one of uint8"
    with pytest.raises(WeightUpdateError, match=refused):
        updater.update_from_disk(tiny.dir, "safetensors")


# ---- the embedded model -----------------------------------------------------------------
@pytest.fixture(scope="module")
def smol_pair(model_dir):
    config = load_config(model_dir)
    quant = gguf_packed.quant_config(config, default_model_path(), "gguf", torch.device("cpu"))
    return (load_model(model_dir, config, "auto", torch.float32, "cpu", quant_config=quant),
            load_model(model_dir, config, "auto", torch.float32, "cpu"))


def test_embedded_model_tracks_its_dequantized_conversion(smol_pair, model_dir):
    """Teacher-forced over fixed texts: the next token agrees at most positions
    and the perplexity is within 3% (measured: 0.99 and +0.2%; the blocks are
    the same weights, only the activations' int8 rounding differs)."""
    tok = get_tokenizer(model_dir)
    ids = tok.encode(" ".join(TEXTS) * 2)[:200]
    logits = [all_logits(m, ids) for m in smol_pair]
    target = torch.tensor(ids[1:])
    nll = [F.cross_entropy(lg[:-1], target).item() for lg in logits]
    agree = (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
    assert agree >= 0.85, agree
    assert abs(math.exp(nll[0]) / math.exp(nll[1]) - 1) < 0.03, nll
