"""FP8 and int4 checkpoints on the CPU, in the layouts the tools write
(tests/quant_checkpoints.py), against the same models with the dequantized
weights.

On the CPU every format multiplies with its weight dequantized at matmul
time, so a quantized checkpoint must give the dequantized model's logits up
to float32 rounding: any misread scale, nibble order, zero offset, block
edge or fused part shows. Greedy agreement with the original float model
(before quantization) is printed for the report (`pytest -s`). Read-back
gives the checkpoint's own tensors; tensor-parallel pieces load and sum to
the whole; what the formats can hold but radixlm cannot run is refused.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kv_runner import KVRunner, greedy_through_kv, token_agreement
from quant_checkpoints import (
    HF_FP8_BLOCK_CONFIG,
    RAGGED,
    autofp8,
    awq,
    awq_config,
    compressed_tensors,
    ct_args,
    ct_config,
    fp8_per_channel,
    gptq,
    gptq_config,
    hf_fp8_block,
    is_linear,
    save_float_model,
    tiny_llama,
    write,
    write_pair,
)
from safetensors.torch import load_file

from radixlm import distributed
from radixlm.layers.linear import QKVParallelLinear, RowParallelLinear
from radixlm.layers.quantization import get_quantization_config, process_weights_after_loading
from radixlm.layers.quantization import int4 as I
from radixlm.layers.quantization.fp8 import Fp8LinearMethod, Fp8OnlineLinearMethod
from radixlm.layers.quantization.int4 import Int4LinearMethod
from radixlm.layers.quantization.unquantized import UnquantizedLinearMethod
from radixlm.models.loader import load_config, load_model
from radixlm.models.weight_map import WeightMap

PROMPTS = [[3, 17, 99, 5, 42, 8, 150, 61, 7, 23, 11, 90], [120, 4, 66, 31, 2, 19, 77]]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quant")


@pytest.fixture(scope="module")
def aligned(root):
    config = tiny_llama()
    return config, save_float_model(config, root / "aligned"), str(root / "aligned")


@pytest.fixture(scope="module")
def ragged(root):
    config = tiny_llama(**RAGGED)
    return config, save_float_model(config, root / "ragged"), str(root / "ragged")


def load(path: str, quantization: str | None = None) -> torch.nn.Module:
    config = load_config(path)
    return load_model(path, config, "safetensors", torch.float32, "cpu",
                      quant_config=get_quantization_config(config, quantization))


def logits(model: torch.nn.Module) -> list[torch.Tensor]:
    runner = KVRunner(model)
    return [runner.extend([(runner.new_request(), ids)], all_rows=True) for ids in PROMPTS]


def check_against(model: torch.nn.Module, dequantized: str, original: str, label: str) -> None:
    """Logits equal the dequantized model's up to fp32 rounding; greedy tokens equal
    its tokens; agreement with the original float model printed."""
    ref = load(dequantized)
    for ours, want in zip(logits(model), logits(ref), strict=True):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    tokens = greedy_through_kv(model, PROMPTS, NEW_TOKENS)
    assert tokens == greedy_through_kv(ref, PROMPTS, NEW_TOKENS)
    unquantized = load(original)
    error = max(((a - b).abs().max() / b.abs().max()).item()
                for a, b in zip(logits(model), logits(unquantized), strict=True))
    same = token_agreement(tokens, greedy_through_kv(unquantized, PROMPTS, NEW_TOKENS))
    print(f"\n{label}: greedy agreement with the unquantized model "
          f"{same:.0%} of {NEW_TOKENS * len(PROMPTS)} "
          f"tokens, logits within {error:.1%} of its largest")


def methods(model: torch.nn.Module) -> dict[str, type]:
    return {n: type(m.quant_method) for n, m in model.named_modules()
            if hasattr(m, "quant_method") and n != "model.embed_tokens"}


# ---- FP8 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["aligned", "ragged"])
def test_fp8_online_quantizes_float_weights_per_channel(which, request, root):
    config, floats, path = request.getfixturevalue(which)
    deq = {k: fp8_per_channel(w)[2] if k.endswith("proj.weight") else w
           for k, w in floats.items()}
    ref = write(root / f"{which}-fp8-online-deq", config, deq, None)
    model = load(path, "fp8")
    kinds = methods(model)
    assert kinds.pop("lm_head") is UnquantizedLinearMethod
    assert set(kinds.values()) == {Fp8OnlineLinearMethod}
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    check_against(model, ref, path, f"fp8 online ({which})")
    # Read-back: the FP8 values times their scales, as floats.
    slot = WeightMap(model).resolve("model.layers.0.self_attn.k_proj.weight")
    assert torch.equal(slot.gather(), deq["model.layers.0.self_attn.k_proj.weight"])


def test_fp8_block_checkpoint_with_ragged_blocks(ragged, root):
    config, floats, path = ragged
    q, ref = write_pair(root, "fp8-block", config, floats, hf_fp8_block(), HF_FP8_BLOCK_CONFIG)
    model = load(q)  # auto-detected from config.json
    kinds = methods(model)
    assert kinds.pop("lm_head") is UnquantizedLinearMethod
    assert set(kinds.values()) == {Fp8LinearMethod}
    qkv = model.model.layers[0].self_attn.qkv_proj
    # q: 200 rows (2 blocks), k and v: 40 rows each (one ragged block each) by 2
    # columns; a scale row per 8 weight rows (gcd of 128, 200 and 40) for the kernels.
    assert qkv.weight_scale_inv.shape == (4, 2) and qkv.fp8.scale_rows == 8
    check_against(model, ref, path, "fp8 128x128 blocks, ragged edges")
    assert load(q, "fp8") is not None  # --quantization may confirm the format
    with pytest.raises(ValueError, match="quantization='int8' contradicts the checkpoint's "
                                         "quantization_config \\(quant_method='fp8'\\)"):
        load(q, "int8")


def test_fp8_block_checkpoint_matches_transformers(aligned, root):
    """transformers reads the same files with its own FP8 code (on the CPU it
    dequantizes at load): an independent reader of the layout."""
    from transformers import AutoModelForCausalLM

    config, floats, path = aligned
    q, _ = write_pair(root, "fp8-block-hf", config, floats, hf_fp8_block(), HF_FP8_BLOCK_CONFIG)
    hf = AutoModelForCausalLM.from_pretrained(q, dtype=torch.float32).eval()
    ours = logits(load(q))
    with torch.no_grad():
        for ids, got in zip(PROMPTS, ours, strict=True):
            want = hf(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_fp8_smaller_blocks_and_per_tensor_scales(aligned, root):
    config, floats, path = aligned
    blocks = {**HF_FP8_BLOCK_CONFIG, "weight_block_size": [64, 32]}
    q, ref = write_pair(root, "fp8-block-64x32", config, floats, hf_fp8_block(64, 32), blocks)
    check_against(load(q), ref, path, "fp8 64x32 blocks")
    static = {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    q, ref = write_pair(root, "autofp8", config, floats, autofp8(0.05), static)
    model = load(q)
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert qkv.weight_scale.shape == (3,) and qkv.input_scale.shape == (3,)
    check_against(model, ref, path, "fp8 per-tensor (AutoFP8), static activations")


@pytest.mark.parametrize(("label", "weights", "acts", "static"), [
    ("channel", ct_args("channel"), ct_args("token", dynamic=True), None),
    ("tensor", ct_args("tensor"), ct_args("tensor"), 0.05),
    ("block", ct_args("block", block_structure=[128, 128]),
     ct_args("group", dynamic=True, group_size=128), None),
    ("channel-w8a16", ct_args("channel"), None, None),
])
def test_compressed_tensors_fp8(label, weights, acts, static, ragged, root):
    config, floats, path = ragged
    strategy = weights["strategy"]
    layers = config.num_hidden_layers
    kv = {f"model.layers.{i}.self_attn.{n}_scale": torch.tensor([0.5 + i], dtype=torch.bfloat16)
          for i in range(layers) for n in "kv"}
    q, ref = write_pair(root, f"ct-{label}", config, floats,
                        compressed_tensors(strategy, static), ct_config(weights, acts, kv=True),
                        extra=kv)
    model = load(q)
    assert set(methods(model).values()) == {Fp8LinearMethod, UnquantizedLinearMethod}
    check_against(model, ref, path, f"compressed-tensors fp8 {label}")
    attn = model.model.layers[1].self_attn.attn
    assert attn.k_scale.item() == 1.5 and attn.v_scale.item() == 1.5
    assert load(q, "fp8") is not None and load(q, "compressed-tensors") is not None


def test_older_compressed_tensors_kv_scale_names(aligned, root):
    """k_proj.output_scale / v_proj.output_scale land on the attention layer too."""
    config, floats, path = aligned
    kv = {"model.layers.0.self_attn.k_proj.output_scale": torch.tensor([0.25]),
          "model.layers.0.self_attn.v_proj.output_scale": torch.tensor([0.75])}
    q, _ = write_pair(root, "ct-old-kv", config, floats, compressed_tensors("channel"),
                      ct_config(ct_args("channel"), ct_args("token", dynamic=True), kv=True),
                      extra=kv)
    attn = load(q).model.layers[0].self_attn.attn
    assert (attn.k_scale.item(), attn.v_scale.item()) == (0.25, 0.75)


# ---- int4 ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("label", "quantize", "qconfig"), [
    ("awq g128", awq(128), awq_config(128)),
    ("awq g64", awq(64), awq_config(64)),
    ("gptq v1 sym g128", gptq(128), gptq_config(128)),
    ("gptq v1 sym g64 act-order", gptq(64, desc_act=True), gptq_config(64, desc_act=True)),
    ("gptq v2 asym g128", gptq(128, sym=False, v1=False),
     gptq_config(128, sym=False, v1=False)),
])
@pytest.mark.parametrize("held", ["gptq form", "fragment order"])
def test_int4_checkpoints(label, quantize, qconfig, held, aligned, root, monkeypatch):
    """Logits, greedy tokens and read-back of each int4 format, with qweight held
    as GPTQ packs it or in the tensor-core kernels' fragment order (what CUDA
    layers hold under $RADIXLM_INT4_GEMV=mma; here the products dequantize from
    it). Act-order layers stay in GPTQ form."""
    config, floats, path = aligned
    q, ref = write_pair(root, label.replace(" ", "-"), config, floats, quantize, qconfig)
    if held == "fragment order":
        monkeypatch.setattr(I, "fragment_order", I.fragment_fits)
    model = load(q)
    qweight = model.model.layers[0].self_attn.qkv_proj.qweight
    assert qweight.dim() == (4 if held == "fragment order" and "act-order" not in label else 2)
    kinds = methods(model)
    assert kinds.pop("lm_head") is UnquantizedLinearMethod
    assert set(kinds.values()) == {Int4LinearMethod}
    check_against(model, ref, path, label)
    # Read-back gives the checkpoint's tensors, bit for bit.
    saved = load_file(str(Path(q) / "model.safetensors"))
    weights = WeightMap(model)
    for name in ("model.layers.0.self_attn.k_proj.qweight", "model.layers.1.mlp.up_proj.qzeros",
                 "model.layers.0.mlp.down_proj.scales", "model.layers.1.self_attn.o_proj.qweight"):
        assert torch.equal(weights.resolve(name).gather(), saved[name]), name
    assert load(q, qconfig["quant_method"]) is not None


@pytest.mark.parametrize("held", ["gptq form", "fragment order"])
def test_int4_weights_update_in_place(held, aligned, root, monkeypatch):
    """What a weight update does (another checkpoint's tensors written into the
    parameters, then `process_weights_after_loading`), with qweight in either
    form: the same logits as that checkpoint loaded fresh, and back again."""
    config, floats, _ = aligned
    q1, _ = write_pair(root, "update-1", config, floats, awq(128), awq_config(128))
    other = {k: v * 1.5 if is_linear(k) else v for k, v in floats.items()}
    q2, _ = write_pair(root, "update-2", config, other, awq(128), awq_config(128))
    if held == "fragment order":
        monkeypatch.setattr(I, "fragment_order", I.fragment_fits)
    model = load(q1)
    before, after = logits(model), logits(load(q2))
    assert not torch.equal(before[0], after[0])
    for path, want in ((q2, after), (q1, before)):
        WeightMap(model).load(iter(load_file(str(Path(path) / "model.safetensors")).items()))
        process_weights_after_loading(model)
        for got, ref in zip(logits(model), want, strict=True):
            assert torch.equal(got, ref)


# ---- tensor parallelism ------------------------------------------------------------------------
def _as_rank(monkeypatch, rank: int, size: int) -> None:
    monkeypatch.setattr(distributed, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(distributed, "get_tp_size", lambda: size)


def _built(monkeypatch, rank, size, make, tensors):
    _as_rank(monkeypatch, rank, size)
    layer = make()
    for (param, shard), t in tensors.items():
        p = getattr(layer, param)
        p.weight_loader(p, t, shard)
    process_weights_after_loading(layer)
    return layer


TP_FORMATS = ["awq", "gptq", "gptq-act-order", "awq-fragment", "gptq-fragment", "fp8-block",
              "fp8-online"]


@contextlib.contextmanager
def held_in_fragment_order(on: bool) -> Iterator[None]:
    """int4 layers built inside hold qweight in MMA fragment order where it fits
    (`int4.fragment_fits`), as CUDA layers do under $RADIXLM_INT4_GEMV=mma."""
    real = I.fragment_order
    if on:
        I.fragment_order = I.fragment_fits
    try:
        yield
    finally:
        I.fragment_order = real


def _tp_setup(fmt: str):
    """(layer factories, the whole checkpoint tensors of each) in format `fmt`:
    a row-parallel [256, 512] layer and a QKV layer of 4 + 2 + 2 heads (of 128 for
    128 x 128 FP8 blocks, so that a rank's KV head is whole blocks; else 64)."""
    torch.manual_seed(0)
    hd = 128 if fmt == "fp8-block" else 64
    if fmt == "fp8-online":
        quant = get_quantization_config(tiny_llama(), "fp8")

        def make_t(name, w):
            return {"weight": w}, w
    elif fmt == "fp8-block":
        quant = get_quantization_config(tiny_llama(quantization_config=HF_FP8_BLOCK_CONFIG))
        make_t = hf_fp8_block()
    else:
        act = "act" in fmt
        kind = fmt.split("-")[0]
        qc = awq_config(64) if kind == "awq" else gptq_config(64, desc_act=act)
        quant = get_quantization_config(tiny_llama(quantization_config=qc))
        make_t = awq(64) if kind == "awq" else gptq(64, desc_act=act)
    w_row, w_q, w_kv = (torch.randn(*s) * 0.1 for s in ((256, 512), (4 * hd, 256),
                                                         (2 * hd, 256)))
    row_t = {(k, None): v for k, v in make_t("model.layers.0.mlp.down_proj.weight",
                                             w_row)[0].items()}
    qkv_t = {}
    for shard, w in (("q", w_q), ("k", w_kv), ("v", w_kv * 0.5)):
        name = f"model.layers.0.self_attn.{shard}_proj.weight"
        qkv_t.update({(k, shard): v for k, v in make_t(name, w)[0].items()})

    fragment = fmt.endswith("-fragment")

    def row():
        with held_in_fragment_order(fragment):
            return RowParallelLinear(512, 256, quant_config=quant,
                                     prefix="model.layers.0.mlp.down")

    def qkv():
        with held_in_fragment_order(fragment):
            return QKVParallelLinear(256, hd, 4, 2, quant_config=quant,
                                     prefix="model.layers.0.self_attn.qkv_proj")
    return (row, row_t), (qkv, qkv_t)


@pytest.mark.parametrize("fmt", TP_FORMATS)
def test_tensor_parallel_pieces_sum_to_the_whole(fmt, monkeypatch):
    """A row-parallel layer's ranks sum, and a QKV layer's ranks concatenate, to
    the one-rank product."""
    (row, row_t), (qkv, qkv_t) = _tp_setup(fmt)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    full = _built(monkeypatch, 0, 1, row, row_t)
    want = full.quant_method.apply(full, x)
    pieces, qkv_out = [], []
    for rank in range(2):
        layer = _built(monkeypatch, rank, 2, row, row_t)
        pieces.append(layer.quant_method.apply(layer, x[:, 256 * rank:256 * (rank + 1)]))
        fused = _built(monkeypatch, rank, 2, qkv, qkv_t)
        hd = fused.head_size
        qkv_out.append(fused.quant_method.apply(fused, x[:, :256]).split([2 * hd, hd, hd], -1))
    torch.testing.assert_close(pieces[0] + pieces[1], want, rtol=1e-5, atol=1e-5)
    whole = _built(monkeypatch, 0, 1, qkv, qkv_t)
    q, k, v = whole.quant_method.apply(whole, x[:, :256]).split([4 * hd, 2 * hd, 2 * hd], -1)
    for part, got in zip((q, k, v), zip(*qkv_out, strict=True), strict=True):
        torch.testing.assert_close(torch.cat(got, -1), part, rtol=1e-5, atol=1e-5)


def test_int4_fragment_order_converts_wide_layers_a_block_at_a_time():
    """A merged layer of two 2560-column parts (conversion blocks of 2048 cross the
    parts' edges): held in fragment order it reads back each part's checkpoint
    tensor and dequantizes to the same weight as the GPTQ-form layer."""
    from radixlm.layers.linear import MergedColumnParallelLinear

    quant = get_quantization_config(tiny_llama(quantization_config=awq_config(64)))
    torch.manual_seed(0)
    made = {shard: awq(64)("model.layers.0.mlp.gate_proj.weight",
                           torch.randn(2560, 128) * 0.05)[0] for shard in (0, 1)}
    weights = []
    for fragment in (False, True):
        with held_in_fragment_order(fragment):
            layer = MergedColumnParallelLinear(128, [2560, 2560], quant_config=quant,
                                               params_dtype=torch.float16)
        assert layer.qweight.dim() == (4 if fragment else 2)
        for shard, tensors in made.items():
            for key, t in tensors.items():
                p = getattr(layer, key)
                p.weight_loader(p, t, shard)
        process_weights_after_loading(layer)
        for shard, tensors in made.items():
            spec = layer.qweight.weight_spec
            assert torch.equal(spec.gather(layer, layer.qweight, shard), tensors["qweight"])
        weights.append(layer.int4.dequantize())
    assert torch.equal(weights[0], weights[1])


def _gather_worker(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    distributed.set_tp_group(dist.group.WORLD)
    try:
        got = {}
        for fmt in TP_FORMATS:
            for make, tensors in _tp_setup(fmt):
                layer = make()
                for (param, shard), t in tensors.items():
                    p = getattr(layer, param)
                    p.weight_loader(p, t, shard)
                for (param, shard) in tensors:
                    p = getattr(layer, param)
                    got[(fmt, layer.prefix, param, shard)] = \
                        p.weight_spec.gather(layer, p, shard)
        if rank == 0:
            torch.save(got, out)
    finally:
        distributed.set_tp_group(None)
        dist.destroy_process_group()


def test_two_gloo_ranks_read_back_the_checkpoint_tensors(tmp_path):
    out = str(tmp_path / "gathered.pt")
    torch.multiprocessing.spawn(_gather_worker, args=(str(tmp_path / "store"), out), nprocs=2)
    got = torch.load(out)
    for fmt in TP_FORMATS:
        for make, tensors in _tp_setup(fmt):
            prefix = make().prefix
            for (param, shard), t in tensors.items():
                back = got[(fmt, prefix, param, shard)]
                if fmt == "fp8-online":  # floats in, the FP8 values times their scales out
                    t = fp8_per_channel(t)[2]
                assert torch.equal(back, t), (fmt, prefix, param, shard)


def test_a_tensor_parallel_cut_inside_an_fp8_block_is_refused(monkeypatch):
    quant = get_quantization_config(tiny_llama(quantization_config=HF_FP8_BLOCK_CONFIG))
    _as_rank(monkeypatch, 0, 2)
    with pytest.raises(ValueError, match="down: tensor-parallel size 2 cuts a "
                                         r"weight_block_size \[128, 128\] FP8 weight inside a "
                                         "block"):
        RowParallelLinear(384, 256, quant_config=quant, prefix="down")  # 192 per rank
    awq_quant = get_quantization_config(tiny_llama(quantization_config=awq_config(128)))
    with pytest.raises(ValueError, match="cuts awq tensor qzeros inside a packed word or group"):
        RowParallelLinear(384, 256, quant_config=awq_quant, prefix="down")


# ---- refusals, dummy weights ---------------------------------------------------------------
@pytest.mark.parametrize(("qconfig", "message"), [
    ({**HF_FP8_BLOCK_CONFIG, "fmt": "e5m2"}, "fmt='e5m2'"),
    ({**HF_FP8_BLOCK_CONFIG, "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
    ({**HF_FP8_BLOCK_CONFIG, "per_expert": True}, "field\\(s\\) radixlm does not read: "
                                                  "per_expert"),
    ({**awq_config(128), "version": "gemv"}, "version='gemv'"),
    ({**awq_config(128), "zero_point": False}, "zero_point=false"),
    ({**gptq_config(128), "bits": 8}, "bits=8"),
    ({**gptq_config(128), "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({**gptq_config(128), "lm_head": True}, "lm_head=True"),
    (ct_config({**ct_args("channel"), "num_bits": 4, "type": "int"}, None), "num_bits=4"),
    (ct_config(ct_args("tensor"), ct_args("token", dynamic=False)),
     "static input activations by 'token'"),
    ({**awq_config(128), "modules_to_not_convert": ["self_attn.q_proj"]},
     "leaves model.layers.0.self_attn.q_proj unquantized but not the other parts"),
])
def test_what_radixlm_cannot_run_is_refused_by_name(qconfig, message):
    with pytest.raises(ValueError, match=message):
        config = tiny_llama(quantization_config=qconfig)
        with torch.device("meta"):
            load_model("", config, "dummy", torch.float32, "meta",
                       quant_config=get_quantization_config(config))


def test_awq_on_a_float_checkpoint_is_refused_and_dummy_awq_runs(aligned, root):
    config, _, path = aligned
    with pytest.raises(ValueError, match="quantization='awq' reads AWQ checkpoints"):
        load(path, "awq")
    config.save_pretrained(root / "config-only")
    for quantization, kind in (("awq", Int4LinearMethod), ("gptq", Int4LinearMethod),
                               ("fp8", Fp8OnlineLinearMethod)):
        model = load_model(str(root / "config-only"), config, "dummy", torch.float32, "cpu",
                           quant_config=get_quantization_config(config, quantization))
        assert methods(model)["model.layers.0.mlp.gate_up_proj"] is kind
        out = logits(model)[0]
        assert torch.isfinite(out).all() and out.std() > 0


def test_our_int4_packers_write_what_the_tools_write():
    """The packers behind dummy weights and bench quant-perplexity, against the
    tools' loops (tests/quant_checkpoints.py); unpacking inverts packing."""
    from radixlm.layers.quantization import int4 as I

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 0.1
    for ours, tools in ((I.awq_tensors(w, 64), awq(64)("x.weight", w)[0]),
                        (I.gptq_tensors(w, 64), gptq(64)("x.weight", w)[0])):
        assert ours.keys() == tools.keys()
        for key, tensor in tools.items():
            assert torch.equal(ours[key], tensor), key
    q = torch.randint(0, 16, (40, 24), generator=torch.Generator().manual_seed(4))
    assert torch.equal(I.unpack_cols(I.pack_cols(q, I.AWQ_ORDER), I.AWQ_ORDER), q)
    assert torch.equal(I.unpack_rows(I.pack_rows(q)), q)


def test_bench_quant_prints_each_method_beside_the_first(aligned, capsys, monkeypatch):
    """`bench quant` end to end on the CPU (it runs on the GPU only when a device is
    lent, so a broken attribute there would cost a device call): two rounds, the
    second in reverse order, figures as min / median / max."""
    from radixlm.bench import quant as bench_quant

    order = []
    real = bench_quant.run_one
    monkeypatch.setattr(bench_quant, "run_one",
                        lambda sa, q, a: order.append(q) or real(sa, q, a))
    bench_quant.main(["--model-path", aligned[2], "--quantizations", "none,fp8,none:fp8",
                      "--input-len", "8", "--output-len", "4", "--device", "cpu",
                      "--dtype", "float32", "--skip-tokenizer-init", "--repeats", "2"])
    # every other round reversed
    assert order == ["none", "fp8", "none:fp8", "none:fp8", "fp8", "none"]
    table = capsys.readouterr().out.split("quantization", 1)[1]
    rows = {line.split()[0]: line for line in table.splitlines()[1:] if line.strip()}
    assert {"none", "fp8", "none:fp8"} <= set(rows)
    assert rows["none"].count(" / ") == 4  # min / median / max, decode and output
    assert "1.00x" in rows["none"]


def test_bench_quant_perplexity_counts_the_projection_bytes(aligned):
    """The weights-MB column of `bench quant-perplexity`: every projection's bytes
    (it printed 0.0 while it looked for the runner where the scheduler no longer
    keeps it); FP8 codes take a quarter of fp32's."""
    import radixlm
    from radixlm.bench.quant_perplexity import linear_weight_bytes

    sizes = {}
    for q in ("none", "fp8"):
        with radixlm.Engine(aligned[2], device="cpu", dtype="float32", quantization=q,
                            skip_tokenizer_init=True, log_level="warning") as e:
            sizes[q] = linear_weight_bytes(e)
    config = aligned[0]
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    assert sizes["none"] == 4 * layers * (h * (h + 2 * kv) + h * h + 3 * h * inter)
    assert sizes["none"] // 4 <= sizes["fp8"] < sizes["none"] // 3
