"""Linear layers' weight methods on the CPU. In bf16 they run from a weight copy
prepacked for oneDNN, which must give F.linear's results bit for bit and follow
weight loads; which method a layer gets is decided when it is built."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixlm.layers import linear as L
from radixlm.layers.quantization import (
    UnquantizedConfig,
    drop_derived_weights,
    process_weights_after_loading,
)
from radixlm.layers.quantization.unquantized import (
    GemvLinearMethod,
    PrepackedLinearMethod,
    UnquantizedLinearMethod,
)

needs_onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN bf16 is not supported on this CPU")


def _weights(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    return w, b


def _column(w: torch.Tensor, b: torch.Tensor | None = None, **kw) -> L.ColumnParallelLinear:
    """A loaded single-rank layer holding weight `w` (and bias `b`)."""
    layer = L.ColumnParallelLinear(w.shape[1], w.shape[0], bias=b is not None,
                                   params_dtype=w.dtype, **kw)
    layer.weight.weight_loader(layer.weight, w)
    if b is not None:
        layer.bias.weight_loader(layer.bias, b)
    process_weights_after_loading(layer)
    return layer


def _gate_up(w: torch.Tensor, **kw) -> L.MergedColumnParallelLinear:
    half = w.shape[0] // 2
    layer = L.MergedColumnParallelLinear(w.shape[1], [half, half], params_dtype=w.dtype,
                                         fused_silu_mul=True, **kw)
    layer.weight.weight_loader(layer.weight, w[:half], 0)
    layer.weight.weight_loader(layer.weight, w[half:], 1)
    process_weights_after_loading(layer)
    return layer


@needs_onednn_bf16
@pytest.mark.parametrize("shape", [(1, 96), (64, 96), (2, 5, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_equals_f_linear(shape: tuple[int, ...], with_bias: bool) -> None:
    w, b = _weights(160, 96)
    x = torch.randn(*shape).bfloat16()
    bias = b if with_bias else None
    layer = _column(w, bias)
    got = layer(x)
    assert isinstance(layer.quant_method, PrepackedLinearMethod)  # the fast path ran
    assert layer.packed_weight is not None
    assert got.shape == (*shape[:-1], 160)
    assert torch.equal(got, F.linear(x, w, bias))


@needs_onednn_bf16
def test_packed_copy_follows_weight_loads() -> None:
    w, _ = _weights(32, 64)
    layer = _column(w)
    x = torch.randn(4, 64).bfloat16()
    before = layer(x)
    with torch.inference_mode():
        layer.weight.weight_loader(layer.weight, w * 2)  # how loaders write: in place
    assert torch.equal(layer(x), before)  # the packed copy is derived: stale until...
    process_weights_after_loading(layer)  # ...the method derives it again
    after = layer(x)
    assert torch.equal(after, F.linear(x, layer.weight)) and not torch.equal(after, before)
    drop_derived_weights(layer)  # released...
    assert layer.packed_weight is None
    layer.weight.data = layer.weight.data.clone()  # ...and resumed at a new storage
    process_weights_after_loading(layer)
    assert torch.equal(layer(x), F.linear(x, layer.weight))


def test_other_dtypes_and_the_switch_use_f_linear() -> None:
    w, b = _weights(8, 16, torch.float32)
    x = torch.randn(3, 16)
    layer = _column(w, b)
    assert type(layer.quant_method) is UnquantizedLinearMethod
    assert torch.equal(layer(x), F.linear(x, w, b)) and not hasattr(layer, "packed_weight")
    wb, _ = _weights(8, 16)
    off = _column(wb, quant_config=UnquantizedConfig(prepack=False))
    assert type(off.quant_method) is UnquantizedLinearMethod
    assert torch.equal(off(x.bfloat16()), F.linear(x.bfloat16(), wb))
    assert not hasattr(off, "packed_weight")


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_gate_up_with_fused_silu_mul(rows: int) -> None:
    w, _ = _weights(2 * 48, 96)
    x = torch.randn(rows, 96).bfloat16()
    layer = _gate_up(w)
    # Only the halves the fused path reads are packed: the copy costs the weight once.
    assert layer.packed_weight is None and len(layer.packed_halves) == 2
    got = layer(x)
    gate, up = F.linear(x, w).float().chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == (rows, 48) and got.dtype == torch.bfloat16
    # One bf16 rounding more than the unfused kernel (silu(gate) is stored first).
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    with torch.inference_mode():
        layer.weight.data.neg_()
    process_weights_after_loading(layer)
    gate, up = F.linear(x, layer.weight).float().chunk(2, dim=-1)
    torch.testing.assert_close(layer(x).float(), F.silu(gate) * up, rtol=2e-2, atol=2e-2)


def test_fused_silu_mul_declines_other_dtypes() -> None:
    w, _ = _weights(2 * 8, 16, torch.float32)
    layer = _gate_up(w)
    x = torch.randn(3, 16)
    assert layer.quant_method.apply_silu_mul(layer, x) is None
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    assert torch.equal(layer(x), F.silu(gate) * up)  # the unfused path, same kernels


@pytest.mark.parametrize(("device", "dtype", "flags", "method"), [
    ("cpu", torch.bfloat16, {}, PrepackedLinearMethod),
    ("cpu", torch.float32, {}, UnquantizedLinearMethod),
    ("cpu", torch.float16, {}, UnquantizedLinearMethod),
    ("cpu", torch.bfloat16, {"prepack": False}, UnquantizedLinearMethod),
    ("meta", torch.bfloat16, {}, UnquantizedLinearMethod),
    ("cuda", torch.bfloat16, {}, GemvLinearMethod),
    ("cuda", torch.float16, {}, GemvLinearMethod),
    ("cuda", torch.float32, {}, UnquantizedLinearMethod),
    ("cuda", torch.bfloat16, {"gemv": False}, UnquantizedLinearMethod),
    ("cuda", torch.bfloat16, {"prepack": False}, GemvLinearMethod),
])
def test_method_is_chosen_per_layer_from_device_dtype_and_flags(monkeypatch, device, dtype,
                                                                flags, method) -> None:
    """The unquantized config picks from where and in what dtype the layer's weight is
    made (torch's default device, the layer's dtype) and the two --disable flags."""
    from types import SimpleNamespace

    from radixlm.layers.quantization import unquantized

    if method is PrepackedLinearMethod and not unquantized.onednn_bf16():
        pytest.skip("oneDNN bf16 is not supported on this CPU")
    if method is GemvLinearMethod and not unquantized.triton_installed():
        pytest.skip("no Triton")
    # No CUDA here: ask as if the model were being built on a GPU.
    monkeypatch.setattr(torch, "get_default_device", lambda: torch.device(device))
    layer = SimpleNamespace(params_dtype=dtype)
    assert type(UnquantizedConfig(**flags).get_linear_method(layer, "x")) is method


def test_layers_of_one_model_get_their_own_method() -> None:
    """A float32 layer in a bf16 model (say, a router) stays on F.linear."""
    if not (torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("oneDNN bf16 is not supported on this CPU")
    model = nn.Sequential(L.ColumnParallelLinear(16, 8, params_dtype=torch.bfloat16),
                          L.ColumnParallelLinear(8, 4, params_dtype=torch.float32))
    assert [type(m.quant_method) for m in model] == [PrepackedLinearMethod,
                                                     UnquantizedLinearMethod]
    assert model[0].quant_method is not model[1].quant_method


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_methods_write_into_out(dtype) -> None:
    """`out=`: a row-parallel layer's partial sum written where the fused
    all-reduce reads it (CUDA only in the engine, but every method takes it)."""
    w, b = _weights(8, 16, dtype)
    layer = _column(w)
    x = torch.randn(3, 16).to(dtype)
    out = torch.empty(3, 8, dtype=dtype)
    assert layer.quant_method.apply(layer, x, b, out=out) is out
    torch.testing.assert_close(out, F.linear(x, w, b))


def test_pdl_stays_off_without_a_hopper_gpu() -> None:
    """The CPU (and the Triton interpreter) launch kernels plainly: turning
    programmatic dependent launch on is refused and the launch keywords stay off."""
    from radixlm.layers import pdl

    if pdl.supported():
        pytest.skip("this machine supports PDL")
    assert not pdl.set_pdl(True)
    assert pdl.launch_args() == {"PDL": False, "launch_pdl": False}
