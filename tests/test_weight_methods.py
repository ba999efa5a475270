"""Per-layer weight methods, layers' partitions and checkpoint names (CPU).

Which method each layer of a model gets; that every write to the weights (an
update, a rollback, a release and resume) reaches what the methods derive;
reading tensors back; the whole shape, required shards and TP gather each
layer answers; and the refusals of checkpoints the engine cannot honour.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from test_models import TINY_CONFIGS, save_random_hf_model
from torch import nn

from radixlm import distributed
from radixlm.config import QUANTIZATIONS, ServerArgs
from radixlm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from radixlm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixlm.layers.quantization import (
    QUANTIZATION_METHODS,
    LinearMethod,
    QuantizationConfig,
    UnquantizedConfig,
    get_quantization_config,
)
from radixlm.layers.quantization.unquantized import (
    PrepackedLinearMethod,
    UnquantizedLinearMethod,
    onednn_bf16,
)
from radixlm.layers.sharding import AxisSpec, weight_spec
from radixlm.models.loader import load_config, load_model
from radixlm.models.weight_map import WeightMap
from radixlm.runtime.memory_occupation import MemoryOccupation
from radixlm.runtime.weight_updater import WeightUpdateError, WeightUpdater

needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16(),
                                       reason="oneDNN bf16 is not supported on this CPU")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random untied Llama with every bias (q/k/v, o, MLP), saved as HF does."""
    path = tmp_path_factory.mktemp("tiny")
    save_random_hf_model(TINY_CONFIGS["llama-linear-rope-biases"](), path)
    return str(path)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied")
    save_random_hf_model(TINY_CONFIGS["llama3-rope-tied"](), path)
    return str(path)


def _load(path: str, dtype: torch.dtype = torch.float32, **kw) -> nn.Module:
    return load_model(path, load_config(path), "safetensors", dtype, "cpu", **kw)


def _methods(model: nn.Module) -> dict[str, type]:
    """Each linear layer's (and the LM head's) method; the embedding's is an EmbeddingMethod."""
    return {name: type(m.quant_method) for name, m in model.named_modules()
            if isinstance(getattr(m, "quant_method", None), LinearMethod)}


def _rewrite(path: str, out, change) -> str:
    """A copy of checkpoint `path` at `out`, its tensors passed through `change(dict)`."""
    out.mkdir()
    tensors = load_file(f"{path}/model.safetensors")
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(Path(path, "config.json").read_text())
    return str(out)


# ---- which method each layer gets -------------------------------------------------------
@needs_onednn_bf16
def test_bf16_cpu_model_prepacks_every_linear_layer_and_the_head(tiny_dir):
    methods = _methods(_load(tiny_dir, torch.bfloat16))
    # 2 layers x (qkv, o, gate_up, down) + the LM head
    assert len(methods) == 9 and set(methods.values()) == {PrepackedLinearMethod}


def test_fp32_and_the_flag_off_keep_f_linear(tiny_dir):
    assert set(_methods(_load(tiny_dir)).values()) == {UnquantizedLinearMethod}
    off = _load(tiny_dir, torch.bfloat16, quant_config=UnquantizedConfig(prepack=False))
    assert set(_methods(off).values()) == {UnquantizedLinearMethod}
    assert not any(hasattr(m, "packed_weight") for m in off.modules())


def test_server_args_reach_the_quant_config():
    config = TINY_CONFIGS["llama3-rope-tied"]()
    args = ServerArgs(disable_weight_prepack=True, quantization="none")
    from radixlm.runtime.model_runner import ModelRunner

    runner = SimpleNamespace(args=args, config=config, device=torch.device("cpu"),
                             dtype=torch.float32)
    built = ModelRunner._quant_config(runner)
    assert isinstance(built, UnquantizedConfig) and not built.prepack and built.gemv


# ---- every write reaches what the methods derived ----------------------------------------
def _updater(model: nn.Module, path: str) -> WeightUpdater:
    return WeightUpdater(model, load_config(path), torch.device("cpu"), path)


@needs_onednn_bf16
def test_an_update_changes_the_prepacked_output_and_a_rollback_restores_it(tiny_dir):
    model = _load(tiny_dir, torch.bfloat16)
    qkv = model.model.layers[1].self_attn.qkv_proj
    x = torch.randn(5, 64).bfloat16()
    before = qkv(x)
    new_q = torch.randn(64, 64)
    _updater(model, tiny_dir).update_from_tensors(
        [("model.layers.1.self_attn.q_proj.weight", new_q)])
    after = qkv(x)
    assert torch.equal(qkv.weight[:64], new_q.bfloat16())
    assert not torch.equal(after, before)
    assert torch.equal(after, F.linear(x, qkv.weight, qkv.bias))  # repacked: bitwise

    def half_then_fail():
        yield "model.layers.1.self_attn.q_proj.weight", torch.zeros(64, 64)
        raise OSError("disk went away")

    with pytest.raises(WeightUpdateError, match="disk went away"):
        _updater(model, tiny_dir)._load(half_then_fail())
    assert torch.equal(qkv(x), after)  # restored weights, derived again


@needs_onednn_bf16
def test_release_drops_the_packed_copies_and_resume_rebuilds_them(tiny_dir):
    model = _load(tiny_dir, torch.bfloat16)
    runner = SimpleNamespace(model=model, device=torch.device("cpu"), graph_runner=None)
    down = model.model.layers[0].mlp.down_proj
    gate_up = model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(3, 96).bfloat16()
    before = down(x)
    memory = MemoryOccupation(runner)
    memory.release(["weights"])
    # MLP biases: gate_up runs unfused and packs its whole weight.
    assert down.packed_weight is None and gate_up.packed_weight is None
    assert down.weight.numel() == 0
    memory.resume(["weights"])
    assert down.packed_weight is not None and gate_up.packed_weight is not None
    assert torch.equal(down(x), before)


# ---- reading back -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_checkpoint_tensor_reads_back(tiny_dir, dtype):
    model = _load(tiny_dir, dtype)
    weight_map = WeightMap(model)
    tensors = load_file(f"{tiny_dir}/model.safetensors")
    assert any("q_proj.bias" in n for n in tensors) and "lm_head.weight" in tensors
    for name, tensor in tensors.items():
        slot = weight_map.resolve(name)
        assert slot.hf_shape() == tuple(tensor.shape), name
        assert torch.equal(slot.gather(), tensor.to(dtype)), name


def test_tied_head_reads_back_as_the_embedding_and_is_not_updated_under_its_name(tied_dir):
    model = _load(tied_dir)
    slot = WeightMap(model).resolve("lm_head.weight")
    assert slot.alias and slot.param_name == "model.embed_tokens.weight"
    emb = load_file(f"{tied_dir}/model.safetensors")["model.embed_tokens.weight"]
    assert torch.equal(slot.gather(), emb)
    with pytest.raises(WeightUpdateError, match="model.embed_tokens.weight"):
        _updater(model, tied_dir).update_from_tensors([("lm_head.weight", emb)])


# ---- refusals ---------------------------------------------------------------------------
def test_a_tensor_with_no_place_is_a_load_error_naming_it(tiny_dir, tmp_path):
    def extra(t):
        t["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)

    path = _rewrite(tiny_dir, tmp_path / "extra", extra)
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra_proj.weight has no place "
                                         "in LlamaForCausalLM"):
        _load(path)
    model = _load(tiny_dir)
    with pytest.raises(WeightUpdateError, match="extra_proj.weight has no place"):
        _updater(model, tiny_dir).update_from_disk(path)


def test_known_buffers_and_the_tied_head_are_skipped(tied_dir, tmp_path):
    def buffers(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()

    model = _load(_rewrite(tied_dir, tmp_path / "buffers", buffers))
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


@pytest.mark.parametrize(("dtype", "phrase"), [
    (torch.float8_e4m3fn, "has dtype float8_e4m3fn, which its parameter does not take"),
    (torch.int8, "has dtype int8, not a floating-point type"),
])
def test_quantized_tensors_are_refused_where_a_float_weight_is_expected(tiny_dir, tmp_path,
                                                                         dtype, phrase):
    name = "model.layers.1.mlp.down_proj.weight"

    def quantize(t):
        t[name] = t[name].to(dtype)

    path = _rewrite(tiny_dir, tmp_path / "quantized", quantize)
    with pytest.raises(ValueError, match=f"{name} {phrase}"):
        _load(path)
    with pytest.raises(WeightUpdateError, match=phrase):
        _updater(_load(tiny_dir), tiny_dir).update_from_disk(path)


def test_quantization_config_is_refused(tiny_dir, tmp_path):
    config = load_config(tiny_dir)
    config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match=r"quantization_config \(quant_method='bitsandbytes'\)"):
        load_model(tiny_dir, config, "safetensors", torch.float32, "cpu")
    model = _load(tiny_dir)
    with pytest.raises(WeightUpdateError, match="quantization_config"):
        _updater(model, tiny_dir)._check_config(config)


def test_unknown_quantization_names_are_refused():
    with pytest.raises(ValueError, match="quantization='marlin': expected one of auto"):
        ServerArgs(quantization="marlin")
    assert ServerArgs().quantization is None and ServerArgs(quantization="auto")
    with pytest.raises(ValueError, match="quantization='marlin'"):
        get_quantization_config(TINY_CONFIGS["llama3-rope-tied"](), "marlin")
    # The CLI choices and the registry name the same methods.
    assert set(QUANTIZATIONS) == {"auto", "none", *QUANTIZATION_METHODS}


class _HalfMethod(UnquantizedLinearMethod):
    """A stand-in quantized method: registers its weight like the float one."""


class _FakeConfig(QuantizationConfig):
    name = "fake"

    def __init__(self, bits: int = 16) -> None:
        self.bits = bits

    @classmethod
    def from_hf_config(cls, hf_quant_config, **options):
        return cls(hf_quant_config["bits"])

    def get_linear_method(self, layer, prefix):
        return _HalfMethod() if prefix != "lm_head" else UnquantizedLinearMethod()


def test_a_registered_method_is_built_from_the_checkpoint_and_reaches_each_layer(
        monkeypatch, tiny_dir):
    monkeypatch.setitem(QUANTIZATION_METHODS, "fake", _FakeConfig)
    config = load_config(tiny_dir)
    config.quantization_config = {"quant_method": "fake", "bits": 4}
    quant = get_quantization_config(config)
    assert isinstance(quant, _FakeConfig) and quant.bits == 4
    monkeypatch.setitem(QUANTIZATION_METHODS, "other", _FakeConfig)
    with pytest.raises(ValueError, match="contradicts"):
        get_quantization_config(config, "other")
    methods = _methods(load_model(tiny_dir, config, "safetensors", torch.float32, "cpu"))
    assert methods.pop("lm_head") is UnquantizedLinearMethod
    assert set(methods.values()) == {_HalfMethod}


# ---- what each layer answers about its partition -----------------------------------------
def _as_rank(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(distributed, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(distributed, "get_tp_size", lambda: size)


def _layers() -> dict[str, nn.Module]:
    """Built for the current (simulated) rank: SmolLM2's uneven 9 / 3 heads,
    one replicated KV head, an odd vocabulary, biases everywhere."""
    qkv = QKVParallelLinear(16, 4, 9, 3, bias=True)
    return {
        "qkv": qkv,
        "qkv1": QKVParallelLinear(16, 4, 4, 1),
        "gate_up": MergedColumnParallelLinear(16, [6, 6], bias=True, fused_silu_mul=True),
        "col": ColumnParallelLinear(16, 6, bias=True),
        # o_proj's uneven columns: the query heads of this rank
        "row": RowParallelLinear(36, 16, bias=True, input_partition=(qkv.q_start * 4, qkv.q_size)),
        "emb": VocabParallelEmbedding(11, 16),
        "head": ParallelLMHead(11, 16),
    }


def _whole_tensors() -> dict[tuple[str, str, object], torch.Tensor]:
    """(layer, param, shard id) -> the whole checkpoint tensor."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return {
        ("qkv", "weight", "q"): r(36, 16), ("qkv", "weight", "k"): r(12, 16),
        ("qkv", "weight", "v"): r(12, 16), ("qkv", "bias", "q"): r(36),
        ("qkv", "bias", "k"): r(12), ("qkv", "bias", "v"): r(12),
        ("qkv1", "weight", "q"): r(16, 16), ("qkv1", "weight", "k"): r(4, 16),
        ("qkv1", "weight", "v"): r(4, 16),
        ("gate_up", "weight", 0): r(6, 16), ("gate_up", "weight", 1): r(6, 16),
        ("gate_up", "bias", 0): r(6), ("gate_up", "bias", 1): r(6),
        ("col", "weight", None): r(6, 16), ("col", "bias", None): r(6),
        ("row", "weight", None): r(16, 36), ("row", "bias", None): r(16),
        ("emb", "weight", None): r(11, 16), ("head", "weight", None): r(11, 16),
    }


def _load_all(layers: dict[str, nn.Module], tensors) -> None:
    with torch.no_grad():
        for (layer, pname, sid), tensor in tensors.items():
            param = getattr(layers[layer], pname)
            param.weight_loader(param, tensor, sid)


@pytest.mark.parametrize(("rank", "size"), [(0, 1), (0, 2), (1, 2)])
def test_each_layer_answers_whole_shapes_and_required_shards(monkeypatch, rank, size):
    _as_rank(monkeypatch, rank, size)
    layers = _layers()
    tensors = _whole_tensors()
    for (layer, pname, sid), tensor in tensors.items():
        module = layers[layer]
        param = getattr(module, pname)
        assert weight_spec(param).hf_shape(module, param, sid) == tuple(tensor.shape)
    qkv, gate_up = layers["qkv"], layers["gate_up"]
    assert weight_spec(qkv.weight).hf_shape(qkv, qkv.weight, None) == (60, 16)  # fused whole
    assert weight_spec(qkv.bias).required_shards(qkv, qkv.bias) == {"q", "k", "v"}
    assert weight_spec(gate_up.weight).required_shards(gate_up, gate_up.weight) == {0, 1}
    for name in ("col", "row", "emb"):
        w = layers[name].weight
        assert weight_spec(w).required_shards(layers[name], w) == {None}
    with pytest.raises(ValueError, match="shard 'x'"):
        qkv.weight.weight_loader(qkv.weight, tensors[("qkv", "weight", "q")], "x")
    with pytest.raises(ValueError, match="entries along dim 0 for shard 'k', expected 12"):
        qkv.weight.weight_loader(qkv.weight, torch.zeros(8, 16), "k")
    if size == 1:  # one rank holds everything: gathering is reading
        _load_all(layers, tensors)
        for (layer, pname, sid), tensor in tensors.items():
            module = layers[layer]
            param = getattr(module, pname)
            assert torch.equal(weight_spec(param).gather(module, param, sid), tensor)


def test_packed_input_features_are_cut_on_whole_groups(monkeypatch):
    """A method storing 2 input features per element (say, int4 pairs in a byte):
    a row-parallel rank takes its columns of the packed checkpoint tensor."""

    class PackedMethod(LinearMethod):
        def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                           params_dtype):
            spec = AxisSpec(input_packing=(2, 1), checkpoint_dtypes=frozenset({torch.uint8}))
            layer.add_weight("qweight", torch.empty(sum(output_partition_sizes),
                                                    input_size_per_partition // 2,
                                                    dtype=torch.uint8), spec)

        def apply(self, layer, x, bias=None, out=None):
            raise NotImplementedError

    class PackedConfig(QuantizationConfig):
        def get_linear_method(self, layer, prefix):
            return PackedMethod()

    _as_rank(monkeypatch, 1, 2)
    row = RowParallelLinear(8, 3, quant_config=PackedConfig())
    packed = torch.arange(12, dtype=torch.uint8).view(3, 4)  # 8 features in 4 bytes per row
    q = row.qweight
    assert weight_spec(q).hf_shape(row, q, None) == (3, 4)
    q.weight_loader(q, packed)
    assert torch.equal(q, packed[:, 2:])
    from radixlm.layers.sharding import check_checkpoint_dtype
    check_checkpoint_dtype("qweight", q, "U8")
    with pytest.raises(ValueError, match="float32, which its parameter does not take"):
        check_checkpoint_dtype("qweight", q, torch.float32)
    odd = RowParallelLinear(6, 3, quant_config=PackedConfig(), input_partition=(3, 3))
    with pytest.raises(ValueError, match="whole groups"):
        odd.qweight.weight_loader(odd.qweight, torch.zeros(3, 3, dtype=torch.uint8))


def _gather_worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    distributed.set_tp_group(dist.group.WORLD)
    try:
        layers = _layers()
        tensors = _whole_tensors()
        _load_all(layers, tensors)
        got = {}
        for key in tensors:
            layer, pname, sid = key
            param = getattr(layers[layer], pname)
            got[key] = weight_spec(param).gather(layers[layer], param, sid)
        qkv = layers["qkv"]
        got["qkv-fused"] = weight_spec(qkv.weight).gather(qkv, qkv.weight, None)
        if rank == 0:
            torch.save(got, out)
    finally:
        distributed.set_tp_group(None)
        dist.destroy_process_group()


def test_two_gloo_ranks_gather_every_whole_tensor(tmp_path):
    out = str(tmp_path / "gathered.pt")
    torch.multiprocessing.spawn(_gather_worker, args=(str(tmp_path / "store"), out), nprocs=2)
    got = torch.load(out)
    tensors = _whole_tensors()
    for key, tensor in tensors.items():
        assert torch.equal(got[key], tensor), key
    fused = torch.cat([tensors[("qkv", "weight", s)] for s in "qkv"])
    assert torch.equal(got["qkv-fused"], fused)



def test_derived_addresses_see_what_process_weights_after_loading_moves() -> None:
    """`derived_addresses` lists the tensors a module keeps beside its parameters
    (plain attributes, dataclasses, tuples): a re-derivation into new tensors
    changes the list, one in place does not, and parameters and buffers are
    not in it (a weight update writes those in place)."""
    import dataclasses

    from radixlm.layers.quantization import derived_addresses

    @dataclasses.dataclass(frozen=True)
    class Derived:
        table: torch.Tensor
        parts: tuple[torch.Tensor, ...]

    layer = torch.nn.Linear(4, 4)
    layer.register_buffer("steps", torch.zeros(2))
    model = torch.nn.Sequential(layer)
    layer.derived = Derived(torch.ones(3), (torch.ones(2), torch.ones(5)))
    layer.packed = torch.ones(6)
    before = derived_addresses(model)
    assert len(before) == 4
    assert layer.weight.data_ptr() not in before and layer.steps.data_ptr() not in before
    layer.derived.table.mul_(2)
    layer.packed.copy_(torch.zeros(6))
    assert derived_addresses(model) == before
    layer.derived = Derived(torch.ones(3), layer.derived.parts)
    assert derived_addresses(model) != before
