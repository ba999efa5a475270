"""--lm-head-quantization fp8: the LM head as FP8 codes with a scale per vocabulary
row, whatever the other layers are (layers/quantization/fp8_head.py).

Each model is checked against a float checkpoint whose head holds the
dequantized FP8 weights (written independently, by the tests' own FP8 writer):
the same logits up to fp32 rounding and the same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kv_runner import greedy_through_kv
from quant_checkpoints import (
    awq,
    awq_config,
    fp8_per_channel,
    is_linear,
    save_float_model,
    tiny_llama,
    write,
    write_pair,
)
from safetensors.torch import load_file
from test_quant_checkpoints import PROMPTS, check_against, load, logits

from radixlm.layers.quantization import get_quantization_config, process_weights_after_loading
from radixlm.layers.quantization.fp8 import Fp8OnlineLinearMethod
from radixlm.layers.quantization.fp8_head import Fp8TiedHeadMethod, check_head_quantized
from radixlm.layers.quantization.int4 import Int4LinearMethod
from radixlm.models.loader import load_config, load_model
from radixlm.models.weight_map import WeightMap

FP8 = torch.float8_e4m3fn


def load_head(path: str, quantization: str | None = None) -> torch.nn.Module:
    config = load_config(path)
    quant = get_quantization_config(config, quantization, lm_head="fp8")
    model = load_model(path, config, "safetensors", torch.float32, "cpu", quant_config=quant)
    check_head_quantized(model, "fp8")
    return model


def head_dequantized(tensors: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """`tensors` with an untied head holding the FP8-rounded head (of the embedding
    where the head is tied)."""
    head = tensors["model.embed_tokens.weight" if tied else "lm_head.weight"]
    return {**tensors, "lm_head.weight": fp8_per_channel(head)[2]}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fp8_head")


@pytest.fixture(scope="module")
def untied(root):
    config = tiny_llama()
    return config, save_float_model(config, root / "untied"), str(root / "untied")


def test_an_untied_head_is_held_in_fp8_and_computes_the_rounded_head(untied, root):
    config, floats, path = untied
    ref = write(root / "untied-deq", config, head_dequantized(floats, tied=False), None)
    model = load_head(path)
    head = model.lm_head
    assert isinstance(head.quant_method, Fp8OnlineLinearMethod)
    assert head.weight.dtype == FP8  # no float copy of the head is kept
    check_against(model, ref, path, "fp8 head (untied)")
    # Read back as floats: the codes times their scales.
    slot = WeightMap(model).resolve("lm_head.weight")
    assert torch.equal(slot.gather(), head_dequantized(floats, tied=False)["lm_head.weight"])


def test_bench_quant_counts_the_head_as_its_products_read_it(untied, root):
    """`bench quant`'s bytes a step: the FP8 head's codes (and their scales), for a
    tied head the derived codes and scales, not the shared float table."""
    from radixlm.bench.quant import step_bytes

    config, _, path = untied
    v, h = config.vocab_size, config.hidden_size
    floats, fp8 = step_bytes(load(path)), step_bytes(load_head(path))
    assert floats - fp8 == v * h * 4 - v * (h + 16)  # fp32 rows -> codes + 16-byte scale pad
    tied = tiny_llama(tie_word_embeddings=True)
    save_float_model(tied, root / "tied-bytes")
    assert (step_bytes(load(str(root / "tied-bytes")))
            - step_bytes(load_head(str(root / "tied-bytes")))) == v * h * 3 - v * 4


def test_a_tied_head_derives_its_codes_from_the_embedding_and_follows_updates(root):
    config = tiny_llama(tie_word_embeddings=True)
    floats = save_float_model(config, root / "tied")
    untied_config = tiny_llama()
    ref = write(root / "tied-deq", untied_config, head_dequantized(floats, tied=True), None)
    model = load_head(str(root / "tied"))
    assert isinstance(model.lm_head.quant_method, Fp8TiedHeadMethod)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # lookups stay float
    check_against(model, ref, str(root / "tied"), "fp8 head (tied)")
    # An update of the embedding re-derives the head's codes.
    other = {k: v * 1.5 if k == "model.embed_tokens.weight" else v for k, v in floats.items()}
    want = logits(load(write(root / "tied-2-deq", untied_config,
                             head_dequantized(other, tied=True), None)))
    WeightMap(model).load(iter(other.items()))
    process_weights_after_loading(model)
    for got, ref_logits in zip(logits(model), want, strict=True):
        torch.testing.assert_close(got, ref_logits, rtol=1e-5,
                                   atol=1e-5 * ref_logits.abs().max().item())


@pytest.mark.parametrize("quantization", ["fp8", "awq"])
def test_the_head_goes_fp8_beside_quantized_layers(quantization, untied, root):
    """FP8 online layers and an AWQ checkpoint leave the head to the option."""
    config, floats, path = untied
    if quantization == "fp8":
        deq = {k: fp8_per_channel(w)[2] if is_linear(k) else w for k, w in floats.items()}
        src, ref = path, write(root / "fp8-all-deq", config, head_dequantized(deq, False), None)
        layer_method = Fp8OnlineLinearMethod
    else:
        src, deq_path = write_pair(root, "awq", config, floats, awq(128), awq_config(128))
        deq = load_file(str(Path(deq_path) / "model.safetensors"))
        ref = write(root / "awq-head-deq", config, head_dequantized(deq, False), None)
        layer_method = Int4LinearMethod
    model = load_head(src, quantization)
    assert isinstance(model.lm_head.quant_method, Fp8OnlineLinearMethod)
    assert isinstance(model.model.layers[0].mlp.down_proj.quant_method, layer_method)
    check_against(model, ref, path, f"{quantization} + fp8 head")


def test_the_option_is_refused_where_it_cannot_reach_the_head(untied):
    _, _, path = untied
    with pytest.raises(ValueError, match="lm_head_quantization='int4'"):
        get_quantization_config(load_config(path), None, lm_head="int4")
    plain = load(path)  # the head left float: what a format that keeps its own head does
    with pytest.raises(ValueError, match=r"lm_head_quantization='fp8'.*"
                                         r"\(UnquantizedLinearMethod\)"):
        check_head_quantized(plain, "fp8")
    del plain.lm_head  # an EAGLE draft without a head multiplies by the target's
    check_head_quantized(plain, "fp8")


def test_greedy_tokens_of_the_fp8_head_through_the_engine(untied):
    """The server path: ServerArgs' flag reaches the head and decoding runs."""
    from radixlm.engine import Engine

    _, _, path = untied
    engine = Engine(model_path=path, dtype="float32", quantization="none",
                    lm_head_quantization="fp8", skip_tokenizer_init=True, device="cpu",
                    max_total_tokens=512)
    try:
        runner = engine.scheduler.worker.runner
        assert isinstance(runner.model.lm_head.quant_method, Fp8OnlineLinearMethod)
        want = greedy_through_kv(load_head(path), PROMPTS[:1], 4)[0]
        out = engine.generate(input_ids=PROMPTS[0],
                              sampling_params={"temperature": 0, "max_new_tokens": 4})
        assert out["output_ids"] == want
    finally:
        engine.shutdown()
