"""Quantized checkpoints through the whole engine on CUDA (CUDA graphs on), in
bf16, against the same model with the dequantized weights.

One GPU-sized random Llama (hidden 1024, 4 layers, head_dim 128), written by
the tests in each format (tests/quant_checkpoints.py: FP8 128x128 blocks,
online FP8, compressed-tensors per-channel, AWQ, GPTQ act-order). On the GPU
the FP8 formats quantize prefill activations to FP8 (W8A8, batches above 8
rows) and decode reads the weights at bf16 precision, and int4 tiles are
dequantized to bf16 for the tensor cores, so the quantized engine is close to,
not equal to, the dequantized one: prompt logprobs within 0.2 nats on average
and the first greedy tokens agreeing. The figures print (`pytest -s`) for the report.

The random model's projections are scaled down (`TAME`) so that rounding is
not amplified layer after layer: at 0.3 (where these tests first ran) the
same weights in bf16 differ from fp32 by 0.33 nats per prompt token, and an
exact torch simulation of per-token FP8 activations (fp32, no kernel of ours)
by 0.95-1.12 nats, which is what the kernels showed; a trained model is far
less sensitive. At 0.05 those are 0.035 and 0.05 nats.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_models import MARGIN_TOP, agreement, first_token_margins  # noqa: E402
from quant_checkpoints import (  # noqa: E402
    GPU_LLAMA,
    GPU_TAME,
    HF_FP8_BLOCK_CONFIG,
    awq,
    awq_config,
    compressed_tensors,
    ct_args,
    ct_config,
    fp8_per_channel,
    gptq,
    gptq_config,
    hf_fp8_block,
    save_tame_model,
    tiny_llama,
    write,
    write_online_fp8_dequantized,
    write_pair,
)

import radixlm  # noqa: E402
from radixlm.layers.linear import MergedColumnParallelLinear  # noqa: E402
from radixlm.layers.quantization import get_quantization_config  # noqa: E402
from radixlm.layers.quantization.fp8 import Fp8ProductMethod  # noqa: E402
from radixlm.layers.quantization.triton_ops import fp8 as F  # noqa: E402

SIZES = GPU_LLAMA
NEW = 16
TAME = GPU_TAME  # the projections' scale: see the module docstring
FORMATS = {
    "fp8-block": (hf_fp8_block(), HF_FP8_BLOCK_CONFIG),
    "ct-fp8-channel": (compressed_tensors("channel"),
                       ct_config(ct_args("channel"), ct_args("token", dynamic=True))),
    "awq-g128": (awq(128), awq_config(128)),
    "gptq-act-order": (gptq(128, desc_act=True), gptq_config(128, desc_act=True)),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant-gpu")
    config = tiny_llama(**SIZES)
    floats = save_tame_model(config, root / "float", TAME)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, SIZES["vocab_size"], (n,), generator=g).tolist()
               for n in (7, 40, 200, 3)]
    return root, config, floats, prompts


def _run(path: str, quantization: str | None, prompts: list[list[int]], **kw):
    with radixlm.Engine(path, dtype="bfloat16", skip_tokenizer_init=True,
                        max_total_tokens=8192, quantization=quantization, **kw) as e:
        return e.generate(input_ids=prompts, sampling_params={"max_new_tokens": NEW,
                                                              "temperature": 0,
                                                              "ignore_eos": True},
                          return_logprob=True, logprob_start_len=0,
                          top_logprobs_num=MARGIN_TOP)


# A first token the reference prefers to ours by less than this is a near-tie that
# the quantized model's noise (~0.07 nats a prompt token here) may turn; the bf16
# reference has exact ties too (margin 0: which of them argmax picks is arbitrary),
# and changes of a scale's last bit flipped such first tokens (BENCHMARKS 2026-12-07).
NEAR_TIE = 0.1


def _compare(ours, ref, label: str) -> None:
    a = agreement(ours, ref)
    margins = first_token_margins(ours, ref)
    print(f"\n{label}: prompt logprobs vs the dequantized model: mean |diff| {a.mean:.4f}, "
          f"max {a.max:.3f}; first tokens equal {a.first}/{len(ours)} (the reference's "
          f"margins where not: {[round(m, 3) for m in margins]}), greedy tokens equal "
          f"{a.same}/{NEW * len(ours)}")
    # A misread layout gives noise (errors of several nats); W8A8 prefill and bf16
    # rounding of dequantized tiles stay well under these. First tokens: at most one
    # differs beyond a near-tie of the reference.
    assert a.mean < 0.2 and sum(m >= NEAR_TIE for m in margins) <= 1, label


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_quantized_checkpoint_on_cuda_tracks_its_dequantized_model(fmt, model):
    """FP8 and int4 checkpoints on our kernels (GEMV, W8A8 GEMM, int4 tiles)."""
    root, config, floats, prompts = model
    quantize, qconfig = FORMATS[fmt]
    q, deq = write_pair(root, fmt, config, floats, quantize, qconfig)
    _compare(_run(q, None, prompts), _run(deq, None, prompts), fmt)


def test_awq_on_the_cuda_core_gemv_tracks_its_dequantized_model(model, monkeypatch):
    """$RADIXLM_INT4_GEMV=fma: qweight kept in the GPTQ form, decode's one-row
    products on the CUDA-core GEMV, more rows on the GEMMs over those words (the
    default, fragment order, is what the test above runs)."""
    monkeypatch.setenv("RADIXLM_INT4_GEMV", "fma")
    root, config, floats, prompts = model
    quantize, qconfig = FORMATS["awq-g128"]
    q, deq = write_pair(root, "awq-g128", config, floats, quantize, qconfig)
    _compare(_run(q, None, prompts), _run(deq, None, prompts), "awq-g128, CUDA-core GEMV")


def test_awq_layer_held_in_fragment_order(monkeypatch):
    """$RADIXLM_INT4_GEMV=mma on a layer built on CUDA: qweight is the fragment-order
    words (no second copy), read back as the checkpoint's tensor; its products at
    1, 3 (a misaligned view: copied), 8, 40 and 100 (two launches) rows and the fused SiLU track the
    dequantized weight as the GPTQ-form layer's do."""
    monkeypatch.setenv("RADIXLM_INT4_GEMV", "mma")
    quant = get_quantization_config(tiny_llama(quantization_config=awq_config(128)))
    with torch.device("cuda"):
        layer = MergedColumnParallelLinear(1024, [512, 512], params_dtype=torch.float16,
                                           fused_silu_mul=True, quant_config=quant)
    assert layer.quant_method.fragment and layer.qweight.shape == (64, 16, 32, 4)
    torch.manual_seed(5)
    tensors = {}
    for part, shard in (("gate", 0), ("up", 1)):
        made, _ = awq(128)(f"model.layers.0.mlp.{part}_proj.weight",
                           torch.randn(512, 1024) * 0.05)
        for key, t in made.items():
            p = getattr(layer, key)
            p.weight_loader(p, t.cuda(), shard)
            tensors[(key, shard)] = t
    layer.quant_method.process_weights_after_loading(layer)
    for (key, shard), t in tensors.items():
        p = getattr(layer, key)
        assert torch.equal(p.weight_spec.gather(layer, p, shard).cpu(), t), (key, shard)
    w = layer.int4
    assert w.qweight is None and w.mma.data_ptr() == layer.qweight.data_ptr()
    deq = w.dequantize().double()  # [N, K]
    for m in (1, 3, 8, 40, 100):
        base = torch.randn(m, 1040, device="cuda").half()
        x = base[:, 8:1032] if m == 3 else base[:, :1024].contiguous()
        ref = x.double() @ deq.T
        got = layer.quant_method.apply(layer, x)
        torch.testing.assert_close(got.double(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max())
    x = torch.randn(1, 1024, device="cuda").half()
    gate, up = (x.double() @ deq.T).split(512, -1)
    want = torch.nn.functional.silu(gate) * up
    got = layer.quant_method.apply_silu_mul(layer, x)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max())


@pytest.mark.parametrize("mode", ["mma", "fma", "w8a8"])
def test_online_fp8_on_the_other_gemvs_tracks_its_dequantized_model(mode, model,
                                                                    monkeypatch):
    """$RADIXLM_FP8_GEMV=mma / fma / w8a8: decode's products on the MMA GEMV from
    the fragment-order copy / on the FMA GEMV / with FP8 activations (the default,
    the MMA GEMV reading the weight where it lies, is the test below)."""
    monkeypatch.setenv("RADIXLM_FP8_GEMV", mode)
    test_online_fp8_on_cuda_tracks_its_dequantized_model(model)


def test_block_fp8_on_the_w8a8_gemv_tracks_its_dequantized_model(model, monkeypatch):
    """$RADIXLM_FP8_GEMV=w8a8 on a 128 x 128 block checkpoint: decode's activations
    per token and group of 128, as prefill's."""
    monkeypatch.setenv("RADIXLM_FP8_GEMV", "w8a8")
    test_quantized_checkpoint_on_cuda_tracks_its_dequantized_model("fp8-block", model)


def test_online_fp8_in_a_batch_of_twenty_tracks_its_dequantized_model(model):
    """Twenty sequences decoded together: the default route's products at 17-32
    rows go through the W8A8 GEMV (`fp8_w8a8_gemv.MIN_ROWS`)."""
    root, config, floats, prompts = model
    g = torch.Generator().manual_seed(2)
    batch = [torch.randint(10, SIZES["vocab_size"], (5 + 7 * i,), generator=g).tolist()
             for i in range(20)]
    ref = write_online_fp8_dequantized(root, config, floats)
    _compare(_run(str(root / "float"), "fp8", batch), _run(ref, None, batch), "fp8 online, 20")


def test_online_fp8_on_cuda_tracks_its_dequantized_model(model):
    root, config, floats, prompts = model
    ref = write_online_fp8_dequantized(root, config, floats)
    _compare(_run(str(root / "float"), "fp8", prompts), _run(ref, None, prompts), "fp8 online")


@pytest.mark.parametrize("fmt", ["float", "awq-g128"])
def test_fp8_lm_head_on_cuda_tracks_its_dequantized_model(fmt, model):
    """--lm-head-quantization fp8 (a float model, an AWQ checkpoint): the head's
    products on the FP8 GEMV and GEMM against the model whose head holds the
    dequantized codes."""
    root, config, floats, prompts = model
    src, deq = str(root / "float"), dict(floats)
    if fmt != "float":
        src, deq_path = write_pair(root, fmt, config, floats, *FORMATS[fmt])
        deq = load_file(str(Path(deq_path) / "model.safetensors"))
    deq["lm_head.weight"] = fp8_per_channel(deq["lm_head.weight"])[2]
    ref = write(root / f"{fmt}-fp8-head-deq", config, deq, None)
    _compare(_run(src, None, prompts, lm_head_quantization="fp8"), _run(ref, None, prompts),
             f"{fmt} + fp8 head")


@pytest.mark.parametrize("fmt", ["awq-g128", "online-fp8"])
def test_folded_norms_track_the_norm_kernels(fmt, model):
    """Decode with each RMSNorm folded into the GEMVs around it (--enable-norm-fold:
    `layers/norm_fold.py`) against the same checkpoint with the norm kernels:
    only the norm's rounding moves."""
    root, config, floats, prompts = model
    if fmt == "online-fp8":
        src, quantization = str(root / "float"), "fp8"
    else:
        src, quantization = write_pair(root, fmt, config, floats, *FORMATS[fmt])[0], None
    ours = _run(src, quantization, prompts, enable_norm_fold=True)
    ref = _run(src, quantization, prompts)
    _compare(ours, ref, f"{fmt}, norms folded")
    # The prompts' logprobs come from prefills (not folded): the decode steps are
    # the tokens after the first. Where the two runs agree, their logprobs must.
    diffs = []
    for o, r in zip(ours, ref, strict=True):
        assert o["output_ids"][:2] == r["output_ids"][:2], fmt
        for a, b in zip(o["meta_info"]["output_token_logprobs"][1:],
                        r["meta_info"]["output_token_logprobs"][1:], strict=True):
            if a[1] != b[1]:
                break
            diffs.append(abs(a[0] - b[0]))
    print(f"{fmt}: decode logprobs of agreeing tokens, mean |diff| "
          f"{sum(diffs) / len(diffs):.4f} over {len(diffs)}, max {max(diffs):.3f}")
    assert sum(diffs) / len(diffs) < 0.1, fmt


@pytest.mark.parametrize("fmt", ["awq", "online-fp8"])
def test_split_sums_out_of_their_launches_change_no_bit(fmt, tmp_path, monkeypatch):
    """A model whose qkv projection is 6144 wide (16 + 2 x 16 heads of 128: its
    split-K sum, where it takes a second launch, `mma_gemv.pick_config`, goes to
    the RoPE + K/V store kernel), and whose gate/up (K 2048 in whole runs) sums
    with its SiLU in its program (AWQ: the pair form; online FP8: the halves
    form) (`layers/split_sums.py`, the default): greedy tokens and their logprobs
    the same as with the second launches ($RADIXLM_SPLIT_SUMS=launch), and the
    model tracks its dequantized weights as the narrow model does."""
    from radixlm.layers.quantization.triton_ops import fp8_mma as FM
    from radixlm.layers.quantization.triton_ops import int4_mma as MM

    config = tiny_llama(**{**SIZES, "hidden_size": 2048, "num_attention_heads": 16,
                           "num_key_value_heads": 16, "num_hidden_layers": 2})
    gate_up = 2 * config.intermediate_size
    assert MM.pairs(1, gate_up, True, None, 2048 // 128)
    assert FM.halves(gate_up, 2048 // 128, True, None, 0)
    floats = save_tame_model(config, tmp_path / "float", TAME)
    if fmt == "awq":
        src, deq = write_pair(tmp_path, "awq", config, floats, *FORMATS["awq-g128"])
        quantization = None
    else:
        src, quantization = str(tmp_path / "float"), "fp8"
        deq = write_online_fp8_dequantized(tmp_path, config, floats)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, SIZES["vocab_size"], (n,), generator=g).tolist()
               for n in (5, 60, 17)]
    fused = _run(src, quantization, prompts)
    monkeypatch.setenv("RADIXLM_SPLIT_SUMS", "launch")
    apart = _run(src, quantization, prompts)
    for a, b in zip(fused, apart, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
    _compare(fused, _run(deq, None, prompts), f"{fmt}, qkv 6144 wide, gate/up in its program")


def test_dummy_fp8_and_awq_engines_run(model):
    root, config, _, prompts = model
    for quantization in ("fp8", "awq"):
        with radixlm.Engine(str(root / "float"), dtype="bfloat16", skip_tokenizer_init=True,
                            max_total_tokens=8192, load_format="dummy",
                            quantization=quantization) as e:
            out = e.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 4,
                                                                     "temperature": 0})
            assert all(len(o["output_ids"]) == 4 for o in out)


def test_layer_methods_run_our_kernels(monkeypatch):
    """A layer built on CUDA runs the kernels (the fused SiLU FMA GEMV at 1-8 rows,
    under $RADIXLM_FP8_GEMV=fma)."""
    monkeypatch.setenv("RADIXLM_FP8_GEMV", "fma")
    quant = get_quantization_config(tiny_llama(), "fp8")
    with torch.device("cuda"):
        layer = MergedColumnParallelLinear(1024, [2816, 2816], params_dtype=torch.bfloat16,
                                           fused_silu_mul=True, quant_config=quant)
    w = torch.randn(5632, 1024, device="cuda") * 0.05
    layer.weight.weight_loader(layer.weight, w)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(4, 1024, device="cuda").bfloat16()
    f = layer.fp8
    want = F.fp8_linear(x, f.weight, f.scales, 0, 1, None, silu_mul=True)
    assert torch.equal(layer(x), want)


def test_fp8_rows_handed_over_change_nothing(model, monkeypatch):
    """Online FP8 where the norms and SiLU-and-mul write the W8A8 GEMM's FP8 rows
    themselves (`Fp8Rows`, the default) against every projection quantizing its
    own input: the same tokens and logprobs, bit for bit (the codes are the same),
    and the hand-over did happen (prefill's 250 rows take the GEMM)."""
    root, config, floats, prompts = model
    taken = []
    takes = Fp8ProductMethod.takes_fp8_rows

    def spy(self, layer, rows):
        taken.append(takes(self, layer, rows))
        return taken[-1]
    monkeypatch.setattr(Fp8ProductMethod, "takes_fp8_rows", spy)
    handed = _run(str(root / "float"), "fp8", prompts)
    assert any(taken)
    monkeypatch.setattr(Fp8ProductMethod, "takes_fp8_rows", lambda self, layer, rows: False)
    own = _run(str(root / "float"), "fp8", prompts)
    for a, b in zip(handed, own, strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["meta_info"]["input_token_logprobs"] == b["meta_info"]["input_token_logprobs"]
        assert a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"]
