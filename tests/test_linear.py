"""`layers.linear.linear`: on the CPU in bf16 it runs from a weight copy prepacked
for oneDNN. It must give F.linear's results bit for bit and follow weight loads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radixlm.layers import linear as L

needs_onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="oneDNN bf16 is not supported on this CPU")


def _weights(out_features: int, in_features: int, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    w = nn.Parameter(torch.randn(out_features, in_features, generator=g).to(dtype),
                     requires_grad=False)
    b = torch.randn(out_features, generator=g).to(dtype)
    return w, b


@needs_onednn_bf16
@pytest.mark.parametrize("shape", [(1, 96), (64, 96), (2, 5, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_equals_f_linear(shape: tuple[int, ...], with_bias: bool) -> None:
    w, b = _weights(160, 96)
    x = torch.randn(*shape).bfloat16()
    bias = b if with_bias else None
    got = L.linear(x, w, bias)
    assert hasattr(w, L._PACKED)  # the fast path ran
    assert got.shape == (*shape[:-1], 160)
    assert torch.equal(got, F.linear(x, w, bias))


@needs_onednn_bf16
def test_packed_copy_follows_weight_loads() -> None:
    w, _ = _weights(32, 64)
    model = nn.Module()
    model.w = w
    x = torch.randn(4, 64).bfloat16()
    before = L.linear(x, w)
    with torch.inference_mode():
        w.data.copy_(w.data * 2)  # how loaders write: in place, same storage
    L.drop_packed_weights(model)
    assert not hasattr(w, L._PACKED)
    after = L.linear(x, w)
    assert torch.equal(after, F.linear(x, w)) and not torch.equal(after, before)
    w.data = w.data.clone()  # a new storage (released and resumed weights)
    assert torch.equal(L.linear(x, w), F.linear(x, w))


def test_other_dtypes_and_the_switch_use_f_linear() -> None:
    w, b = _weights(8, 16, torch.float32)
    x = torch.randn(3, 16)
    assert torch.equal(L.linear(x, w, b), F.linear(x, w, b)) and not hasattr(w, L._PACKED)
    wb, _ = _weights(8, 16)
    L.set_weight_prepack(False)
    try:
        assert torch.equal(L.linear(x.bfloat16(), wb), F.linear(x.bfloat16(), wb))
        assert not hasattr(wb, L._PACKED)
    finally:
        L.set_weight_prepack(True)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_gate_up_with_fused_silu_mul(rows: int) -> None:
    w, _ = _weights(2 * 48, 96)
    x = torch.randn(rows, 96).bfloat16()
    got = L.linear_silu_mul(x, w)
    gate, up = F.linear(x, w).float().chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == (rows, 48) and got.dtype == torch.bfloat16
    # One bf16 rounding more than the unfused kernel (silu(gate) is stored first).
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    model = nn.Module()
    model.w = w
    with torch.inference_mode():
        w.data.neg_()
    L.drop_packed_weights(model)
    assert not hasattr(w, L._PACKED_HALVES)
    gate, up = F.linear(x, w).float().chunk(2, dim=-1)
    torch.testing.assert_close(L.linear_silu_mul(x, w).float(), F.silu(gate) * up,
                               rtol=2e-2, atol=2e-2)


def test_fused_silu_mul_declines_other_dtypes() -> None:
    w, _ = _weights(2 * 8, 16, torch.float32)
    assert L.linear_silu_mul(torch.randn(3, 16), w) is None


def test_pdl_stays_off_without_a_hopper_gpu() -> None:
    """The CPU (and the Triton interpreter) launch kernels plainly: turning
    programmatic dependent launch on is refused and the launch keywords stay off."""
    from radixlm.layers import pdl

    if pdl.supported():
        pytest.skip("this machine supports PDL")
    assert not pdl.set_pdl(True)
    assert pdl.launch_args() == {"PDL": False, "launch_pdl": False}
