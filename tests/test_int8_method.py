"""`--quantization int8`: per-channel int8 of a float checkpoint (layers/quantization/int8.py).

Each layer's int8 values are within half a scale of the float weight, its
product with exactly quantizable activations is the product with those int8
values up to float32 summation, a tensor-parallel rank's piece uses the
scales of the whole rows, and the model tracks the float model.
"""

from __future__ import annotations

import pytest
import torch
from gguf_blocks import exact_activations
from test_gguf_method import all_logits, check_product
from test_models import TINY_CONFIGS, save_random_hf_model

from radixlm import distributed
from radixlm.config import ServerArgs
from radixlm.layers.cpu_ops import qgemm
from radixlm.layers.linear import QKVParallelLinear, RowParallelLinear
from radixlm.layers.quantization import get_quantization_config, process_weights_after_loading
from radixlm.layers.quantization.int8 import Int8Config, Int8LinearMethod
from radixlm.layers.quantization.packed import PackedEmbeddingMethod
from radixlm.models.loader import load_config, load_model
from radixlm.models.weight_map import WeightMap
from radixlm.runtime.weight_updater import WeightUpdater


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    if not qgemm.load():
        pytest.skip("no C++ compiler: the quantized kernels are unavailable")


@pytest.fixture(scope="module", params=["llama-linear-rope-biases", "llama3-rope-tied"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("int8")
    save_random_hf_model(TINY_CONFIGS[request.param](), path)
    path = str(path)
    config = load_config(path)
    quant = get_quantization_config(config, "int8")
    return (path, load_model(path, config, "safetensors", torch.float32, "cpu",
                             quant_config=quant),
            load_model(path, config, "safetensors", torch.float32, "cpu"), quant)


def test_every_layer_the_embedding_and_the_head_are_int8(tiny):
    _, ours, _, quant = tiny
    methods = {name: type(m.quant_method) for name, m in ours.named_modules()
               if hasattr(m, "quant_method")}
    assert methods.pop("model.embed_tokens") is PackedEmbeddingMethod
    assert set(methods.values()) == {Int8LinearMethod} and len(methods) == 9
    assert not quant.floats and "10 weights quantized per channel" in quant.describe()
    assert ours.model.embed_tokens.weight.dtype == torch.uint8


def test_int8_values_and_products(tiny):
    _, ours, ref, _ = tiny
    weights = WeightMap(ours)
    for name, module in ours.named_modules():
        if not isinstance(getattr(module, "quant_method", None), Int8LinearMethod):
            continue
        floats = ref.get_submodule(name).weight.detach()
        values = weights.resolve(f"{name}.weight").gather()  # the int8 values times scales
        scale = floats.abs().amax(1, keepdim=True) / 127
        assert values.shape == floats.shape
        assert ((values - floats).abs() <= scale / 2 * (1 + 1e-6)).all(), name
        x = exact_activations(3, module.input_size, seed=1)
        y = module.quant_method.apply(module, x)
        check_product(y, x, values)


def test_model_tracks_the_float_model(tiny):
    _, ours, ref, _ = tiny
    ids = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    a, b = all_logits(ours, ids), all_logits(ref, ids)
    # int8 weights and activations (measured: ~1-2% of the largest logit).
    assert (a - b).abs().max() / b.abs().max() < 0.06
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9


def test_an_update_passes_floats_and_is_quantized(tiny):
    path, ours, ref, _ = tiny
    updater = WeightUpdater(ours, load_config(path), torch.device("cpu"), path)
    name = "model.layers.0.mlp.down_proj.weight"
    old = ref.get_submodule("model.layers.0.mlp.down_proj").weight.detach().clone()
    new = torch.randn_like(old) * 0.05
    down = ours.model.layers[0].mlp.down_proj
    x = torch.randn(2, down.input_size)
    try:
        updater.update_from_tensors([(name, new)])
        back = updater.slot(name).gather()
        assert (back - new).abs().max() <= new.abs().max() / 127
        torch.testing.assert_close(down.quant_method.apply(down, x), x @ back.T,
                                   rtol=0.03, atol=0.03)
    finally:
        updater.update_from_tensors([(name, old)])


def test_a_rank_quantizes_its_piece_with_the_whole_rows_scales(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen)
    w[:, 100] = 9.0  # the rows' largest values are in rank 1's columns
    quant = Int8Config()

    def build() -> RowParallelLinear:
        layer = RowParallelLinear(128, 48, quant_config=quant, prefix="down")
        assert isinstance(layer.quant_method, Int8LinearMethod)
        layer.weight.weight_loader(layer.weight, w)
        process_weights_after_loading(layer)
        return layer

    full = build()
    x = exact_activations(2, 128, seed=3)
    pieces = []
    for rank in range(2):
        monkeypatch.setattr(distributed, "get_tp_rank", lambda r=rank: r)
        monkeypatch.setattr(distributed, "get_tp_size", lambda: 2)
        layer = build()
        pieces.append(layer.quant_method.apply(layer, x[:, 64 * rank:64 * (rank + 1)]))
    monkeypatch.undo()
    # The same int8 values (whole-row scales) summed in two halves: float32 rounding only.
    torch.testing.assert_close(pieces[0] + pieces[1], full.quant_method.apply(full, x),
                               rtol=0, atol=1e-6 * 9 * 127 * 128)


def test_odd_input_features_are_padded_and_fused_parts_load_whole():
    quant = Int8Config()
    qkv = QKVParallelLinear(40, 8, 4, 2, quant_config=quant, prefix="qkv")
    w = torch.randn(64, 40, generator=torch.Generator().manual_seed(5))
    qkv.weight.weight_loader(qkv.weight, w)  # the fused tensor whole (shard None)
    process_weights_after_loading(qkv)
    x = exact_activations(3, 64, seed=6)[:, :40]  # 127 at column 32: the padded block is exact
    back = qkv.weight.weight_spec.gather(qkv, qkv.weight, None)
    assert back.shape == (64, 40)
    check_product(qkv.quant_method.apply(qkv, x), x, back)


def test_int8_is_refused_for_gguf_files_and_off_the_cpu(tiny):
    from radixlm.models import gguf_packed
    from radixlm.models.loader import default_model_path

    with pytest.raises(ValueError, match="quantizes a float checkpoint"):
        gguf_packed.quant_config(tiny[1].config, default_model_path(), "int8",
                                 torch.device("cpu"))
    with torch.device("meta"), pytest.raises(ValueError, match="runs on the CPU only"):
        RowParallelLinear(64, 64, quant_config=Int8Config(), prefix="x")
    assert ServerArgs(quantization="int8").quantization == "int8"
