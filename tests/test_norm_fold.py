"""The residual RMSNorm folded into the projections around it (layers/norm_fold.py).

On the CPU the weight methods fold with torch around their products (the
defaults of `LinearMethod`), so these tests pin the decoder's folded forward and
the fold's arithmetic; the CUDA kernels that fold in their epilogues are pinned
against the same arithmetic in tests/gpu/test_quant_kernels.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kv_runner import KVRunner, greedy_through_kv
from quant_checkpoints import awq, awq_config, save_float_model, tiny_llama, write_pair
from test_quant_checkpoints import PROMPTS, load

from radixlm.layers.fused_ops import rms_norm_torch
from radixlm.layers.norm_fold import FoldedNorm, NormTarget, fold_into
from radixlm.layers.quantization.int4 import Int4LinearMethod
from radixlm.layers.quantization.unquantized import UnquantizedLinearMethod
from radixlm.models.decoder import DecoderModel

NEW_TOKENS = 6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fold_computes_the_norm_of_the_residual_sum(dtype):
    """x * rstd of a fold is the norm of h + residual, up to one more rounding of
    the activation dtype; the residual stream is rounded as the norm kernel
    rounds it; squares split over column sets add up to the whole row's."""
    torch.manual_seed(0)
    h, r = torch.randn(3, 64, dtype=dtype), torch.randn(3, 64, dtype=dtype)
    w = (1 + 0.1 * torch.randn(64)).to(dtype)
    folded = fold_into(h, NormTarget(r, w, 1e-6))
    want_res = (h.float() + r.float()).to(dtype)
    assert torch.equal(folded.residual, want_res)
    want = rms_norm_torch(want_res, w, 1e-6)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(folded.normalized().float(), want.float(), rtol=tol, atol=tol)
    split = FoldedNorm(folded.x, (want_res.float() ** 2).view(3, 4, 16).sum(-1),
                       folded.residual, 1e-6)
    torch.testing.assert_close(split.rstd(), folded.rstd(), rtol=1e-6, atol=0)
    # Where the first layer's norm ran as a kernel, x is its output as it is.
    assert FoldedNorm(want, None, want_res, 1e-6).normalized() is want


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root: Path = tmp_path_factory.mktemp("norm_fold")
    config = tiny_llama(num_hidden_layers=3)
    floats = save_float_model(config, root / "float")
    awq_path, _ = write_pair(root, "awq", config, floats, awq(128), awq_config(128))
    return {"float": str(root / "float"), "awq": awq_path}


def decode_logits(model: torch.nn.Module) -> list[torch.Tensor]:
    """Logits of a prefill of both prompts and three decode steps of their argmax."""
    runner = KVRunner(model)
    slots = [runner.new_request() for _ in PROMPTS]
    out = [runner.extend(list(zip(slots, PROMPTS, strict=True)))]
    for _ in range(3):
        nxt = out[-1].argmax(-1).tolist()
        out.append(runner.decode(list(zip(slots, nxt, strict=True))))
    return out


@pytest.mark.parametrize("which", ["float", "awq"])
def test_the_folded_forward_gives_the_unfolded_logits_and_tokens(which, models, monkeypatch):
    """Decode steps through `forward_folded` (forced on: on the CPU no method's
    kernels fold, so `enable_norm_fold` would leave it off) give the unfolded
    model's logits up to fp32 rounding and its greedy tokens; a prefill of more
    rows than the fold takes runs unfolded."""
    plain, folded = load(models[which]), load(models[which])
    folded.model.fold_rows = 2
    calls = []
    real = DecoderModel.forward_folded
    monkeypatch.setattr(DecoderModel, "forward_folded",
                        lambda self, *a: calls.append(a[1].shape[0]) or real(self, *a))
    for ours, want in zip(decode_logits(folded), decode_logits(plain), strict=True):
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert calls == [2, 2, 2]  # the decode steps; the 19-token prefill was not folded
    assert greedy_through_kv(folded, PROMPTS, NEW_TOKENS) == \
        greedy_through_kv(plain, PROMPTS, NEW_TOKENS)


def test_the_fold_is_enabled_only_where_every_layer_folds_in_kernels(models, monkeypatch):
    model = load(models["awq"])
    assert model.enable_norm_fold() == 0  # CPU: the int4 method's kernels are CUDA's
    # Say the int4 kernels fold up to 16 rows as inputs and 8 as outputs.
    monkeypatch.setattr(Int4LinearMethod, "norm_fold_rows",
                        lambda self, layer, output: 8 if output else 16)
    assert model.enable_norm_fold() == 8
    assert model.model.fold_rows == 8
    # A layer that cannot fold keeps every norm a kernel: one whose MLP is float ...
    floats = load(models["float"])
    floats.model.layers[0] = model.model.layers[0]
    assert floats.enable_norm_fold() == 0
    monkeypatch.setattr(UnquantizedLinearMethod, "norm_fold_rows", lambda self, layer, o: 64)
    assert floats.enable_norm_fold() == 8
    # ... or a sandwich layer (Gemma's norms around each block).
    model.model.layers[1].sandwich = True
    assert model.enable_norm_fold() == 0
