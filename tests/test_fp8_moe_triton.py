"""FP8 experts (`Fp8FusedMoEMethod`) through the Triton fused MoE kernels, on the CPU
under Triton's interpreter, against the same method on the torch reference backend.

One layer (8 experts, hidden 64, intermediate 48) loaded from the same random
float experts in each of the method's layouts: online per-row scales (strided
rows, each row's scale after its codes), 32 x 32 block grids with ragged
gate / up / down edges (the kernels' table a row per 16 weight rows), and
per-channel scales; fp16 and fp32 activations (the interpreter computes bf16
wrongly on the CPU, as tests/gpu/test_fused_moe.py notes; the GPU tests run
bf16), 1 and 13 tokens, some pairs another rank's (-1). The kernel converts
each FP8 tile to the activations' dtype and scales the fp32 products, the
reference dequantizes in fp32: they agree to the activations' rounding.

As in test_moe_router_triton.py: the checks run when the process started with
TRITON_INTERPRET=1; otherwise `test_under_interpreter` runs this file again in a
child pytest with it set.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import in_interpreter, run_file_under_interpreter

from radixlm.utils import triton_installed

if not triton_installed():
    pytest.skip("Triton is not installed", allow_module_level=True)

E, H, INTER = 8, 64, 48


def test_under_interpreter() -> None:
    run_file_under_interpreter(__file__)


def _config(fmt: str, backend: str):
    from radixlm.layers.quantization import UnquantizedConfig
    from radixlm.layers.quantization.fp8 import Fp8Config, Fp8Scheme

    floats = UnquantizedConfig(moe_backend=backend)
    scheme = {"online": None,
              "block": Fp8Scheme("block", "weight_scale_inv", (32, 32)),
              "channel": Fp8Scheme("channel", "weight_scale", scalar_ndim=1)}[fmt]
    return Fp8Config(scheme, fallback=floats)


def _checkpoint(fmt: str) -> dict[tuple[str, tuple[int, int | None]], torch.Tensor]:
    """(our parameter, shard) -> the checkpoint tensor, for every expert's parts."""
    from quant_checkpoints import fp8_block, fp8_per_channel

    gen = torch.Generator().manual_seed(0)
    out = {}
    for e in range(E):
        for stack, part, shape in (("gate_up_proj", 0, (INTER, H)), ("gate_up_proj", 1, (INTER, H)),
                                   ("down_proj", None, (H, INTER))):
            w = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            if fmt == "online":
                out[(stack, (e, part))] = w
            elif fmt == "block":
                q, s, _ = fp8_block(w, 32, 32)
                out[(stack, (e, part))], out[(f"{stack}_weight_scale_inv", (e, part))] = q, s
            else:
                q, s, _ = fp8_per_channel(w)
                out[(stack, (e, part))], out[(f"{stack}_weight_scale", (e, part))] = q, s
    return out


def _layer(fmt: str, backend: str, dtype: torch.dtype = torch.float16):
    from radixlm.layers.moe.fused_moe import FusedMoE

    layer = FusedMoE(E, H, INTER, quant_config=_config(fmt, backend),
                     params_dtype=dtype, prefix="model.layers.0.mlp.experts")
    with torch.no_grad():
        for (name, shard), tensor in _checkpoint(fmt).items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor, shard)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _routing(tokens: int, seed: int, dtype: torch.dtype = torch.float16
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:3] for _ in range(tokens)])
    ids = ids.to(torch.int32)
    if tokens > 1:
        ids[torch.rand(ids.shape, generator=gen) < 0.2] = -1  # another rank's experts
    weights = torch.rand(tokens, 3, generator=gen)
    return x, (weights / weights.sum(-1, keepdim=True)).contiguous(), ids.contiguous()


@in_interpreter
@pytest.mark.parametrize("fmt", ["online", "block", "channel"])
@pytest.mark.parametrize("tokens", [1, 13])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_triton_fp8_experts_match_the_torch_backend(fmt, tokens, dtype):
    triton_layer, ref_layer = _layer(fmt, "triton", dtype), _layer(fmt, "torch", dtype)
    assert triton_layer.quant_method.backend.name == "triton"
    if fmt == "block":
        assert triton_layer.fp8_experts.block_shape == (16, 32)
    if fmt == "online":
        assert not triton_layer.fp8_experts.w13.is_contiguous()  # strided rows, read as such
    x, weights, ids = _routing(tokens, seed=tokens, dtype=dtype)
    out = triton_layer(x, weights, ids)
    ref = ref_layer(x, weights, ids)
    assert out.dtype == dtype and out.shape == (tokens, H)
    scale = ref.float().abs().max().item()
    assert scale > 0.1  # the sums are not vanishing
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=tol * scale)


@in_interpreter
def test_the_fp8_kernels_read_the_scales():
    """Halving one expert's gate/up scales halves what the kernel gives for its tokens'
    gate and up products (a scale ignored would leave the output unchanged)."""
    layer = _layer("block", "triton")
    x, weights, _ = _routing(4, seed=3)
    ids = torch.full((4, 3), -1, dtype=torch.int32)
    ids[:, 0] = 2
    before = layer(x, weights, ids).float()
    layer.gate_up_proj_weight_scale_inv.data[2] *= 0.5
    layer.quant_method.process_weights_after_loading(layer)
    after = layer(x, weights, ids).float()
    assert (after - before).abs().max() > 0.05 * before.abs().max()
