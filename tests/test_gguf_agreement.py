"""bench gguf-agreement: the embedded model on its GGUF blocks against its dequantized
weights, through the Engine (greedy tokens, perplexity on the fixed text)."""

from __future__ import annotations

import pytest

from radixlm.bench import gguf_agreement
from radixlm.config import ServerArgs
from radixlm.layers.cpu_ops import qgemm

NEW_TOKENS = 24


def test_first_divergence():
    assert gguf_agreement.first_divergence([1, 2, 3], [1, 2, 3]) == 3
    assert gguf_agreement.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert gguf_agreement.first_divergence([], [4]) == 0


@pytest.fixture(scope="module")
def compared():
    if not qgemm.load():
        pytest.skip("no C++ compiler: the quantized kernels are unavailable")
    args = ServerArgs(dtype="float32", max_total_tokens=4096)
    return gguf_agreement.compare(args, gguf_agreement.PROMPTS, NEW_TOKENS)


def test_greedy_diverges_only_at_near_ties(compared):
    """Where the quantized model's greedy tokens leave the dequantized model's,
    the latter's top two were within 0.5 nats (measured: at most 0.22 over 64
    tokens); a misplaced block would diverge at once and with a wide margin."""
    quant, floats, agree = compared
    assert len(agree) == len(gguf_agreement.PROMPTS) == 10
    for i, n in enumerate(agree):
        if n < NEW_TOKENS:
            assert floats.gaps[i][n] < 0.5, (gguf_agreement.PROMPTS[i], n, floats.gaps[i][n])
    assert sum(agree) >= 0.5 * NEW_TOKENS * len(agree), agree


def test_perplexity_within_3_percent(compared):
    """Same weights, int8-rounded activations: measured +1.3% on the fixed text."""
    quant, floats, _ = compared
    assert 5 < floats.perplexity < 100, floats.perplexity  # a sane text for this model
    assert abs(quant.perplexity / floats.perplexity - 1) < 0.03, (quant.perplexity,
                                                                  floats.perplexity)


def test_stored_dtype_of_the_embedded_file():
    from radixlm.models.gguf_packed import stored_dtype
    from radixlm.models.loader import default_model_path

    dtype, why = stored_dtype(default_model_path())
    assert dtype == "bfloat16" and "Q4_1" in why, why


def test_embedded_model_defaults_to_its_blocks(caplog):
    """No --dtype / --quantization: the GGUF blocks in our kernels, bf16 where the
    CPU computes it natively, both choices and their reasons in the log."""
    import logging

    import torch

    import radixlm
    from radixlm.layers.quantization.gguf import GGUFLinearMethod
    from radixlm.models.loader import native_bf16_isa

    if not qgemm.load():
        pytest.skip("no C++ compiler: the quantized kernels are unavailable")
    with caplog.at_level(logging.INFO), radixlm.Engine(max_total_tokens=1024) as e:
        runner = e.scheduler.worker.runner
        layer = runner.model.model.layers[0]
        out = e.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0})
    assert runner.dtype == (torch.bfloat16 if native_bf16_isa() else torch.float32)
    assert isinstance(layer.self_attn.qkv_proj.quant_method, GGUFLinearMethod)
    assert isinstance(layer.mlp.down_proj.quant_method, GGUFLinearMethod)
    assert "Paris" in out["text"]
    log = caplog.text
    assert "quantization auto -> gguf for a .gguf file" in log
    assert "dtype is taken as bfloat16" in log and "dtype auto ->" in log
    assert "211 tensors kept as GGUF blocks" in log
