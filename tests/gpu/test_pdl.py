"""Programmatic dependent launch (radixlm/layers/pdl.py): a chain of dependent decode
kernels computes the same bits with PDL as without, eagerly and replayed from a CUDA
graph (Hopper or newer only)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from gpu_models import capture_graph  # noqa: E402

from radixlm.layers import pdl  # noqa: E402
from radixlm.layers.fused_ops import rms_norm  # noqa: E402
from radixlm.layers.gemv import gemv  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
if not pdl.supported(DEV):
    pytest.skip("PDL needs compute capability >= 9 and a Triton with gdc_wait",
                allow_module_level=True)

H, D = 4096, 7168  # hidden and MLP width: kernels long enough for a launch to overlap


@pytest.fixture(autouse=True)
def _pdl_off_after():
    yield
    pdl.set_pdl(False)
    torch.cuda.empty_cache()  # ~0.9 GB of weights per test: back to the driver


def _weights(layers: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator(device=DEV).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=DEV, generator=g) * shape[-1] ** -0.5).bfloat16()

    return [(torch.rand(H, device=DEV, generator=g).bfloat16() + 0.5, rand(H, H),
             rand(2 * D, H), rand(H, D)) for _ in range(layers)]


def _chain(x: torch.Tensor, res: torch.Tensor, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm (+ residual) -> GEMV -> gate/up GEMV with SiLU-and-mul -> GEMV, per layer:
    every kernel reads what the one before it wrote."""
    for norm_w, w1, w2, w3 in weights:
        h, res = rms_norm(x, norm_w, 1e-5, res)
        x = gemv(gemv(gemv(h, w1), w2, silu_mul=True), w3)
    return x, res


def _same_bits_with_pdl(chain, inputs) -> None:
    """`chain(x, residual)` with PDL, eagerly and replayed from one CUDA graph per
    input in turn, gives the bits it gives without PDL."""
    assert not pdl.set_pdl(False)
    want = [chain(x, r) for x, r in inputs]
    assert pdl.set_pdl(True, DEV)
    x_in, r_in = (t.clone() for t in inputs[0])
    graph, (x_out, r_out) = capture_graph(lambda: chain(x_in, r_in))
    for (x, r), (wx, wr) in zip(inputs, want):
        ex, er = chain(x, r)
        assert torch.equal(ex, wx) and torch.equal(er, wr)
        x_in.copy_(x)
        r_in.copy_(r)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x_out, wx) and torch.equal(r_out, wr)


@pytest.mark.parametrize("rows", [1, 4])  # the fma and the mma GEMV kernels
def test_pdl_chain_bit_identical(rows):
    weights = _weights(4)
    inputs = [(torch.randn(rows, H, device=DEV).bfloat16(),
               torch.randn(rows, H, device=DEV).bfloat16()) for _ in range(4)]
    _same_bits_with_pdl(lambda x, r: _chain(x, r, weights), inputs)


E, TOP_K, MOE_H, MOE_I = 64, 8, 2048, 768  # a Qwen3-MoE-like layer, fewer experts


def _moe_chain(x: torch.Tensor, res: torch.Tensor, layers) -> tuple[torch.Tensor, torch.Tensor]:
    """Norm (+ residual) -> router logits -> top-k -> gate/up -> down, per layer. The
    down kernel reads the router's ids before its PDL wait (two launches back):
    a stale read would route this replay's token by the last one's choice."""
    from radixlm.layers.moe.triton_ops.fused_moe import fused_experts
    from radixlm.layers.moe.triton_ops.topk import fused_topk

    for norm_w, router, w13, w2 in layers:
        h, res = rms_norm(x, norm_w, 1e-5, res)
        weights, ids = fused_topk(h, router, TOP_K, True, torch.bfloat16)
        x = fused_experts(h, w13, w2, weights, ids, direct=True)
    return x, res


def test_pdl_moe_chain_bit_identical():
    g = torch.Generator(device=DEV).manual_seed(1)
    layers = [(torch.rand(MOE_H, device=DEV, generator=g).bfloat16() + 0.5,
               torch.randn(E, MOE_H, device=DEV, generator=g),
               (torch.randn(E, 2 * MOE_I, MOE_H, device=DEV, generator=g) * 0.03).bfloat16(),
               (torch.randn(E, MOE_H, MOE_I, device=DEV, generator=g) * 0.03).bfloat16())
              for _ in range(3)]
    # Each input routes its token to other experts than the one before it.
    inputs = [(torch.randn(1, MOE_H, device=DEV, generator=g).bfloat16(),
               torch.randn(1, MOE_H, device=DEV, generator=g).bfloat16()) for _ in range(6)]
    _same_bits_with_pdl(lambda x, r: _moe_chain(x, r, layers), inputs)


def test_pdl_switch():
    assert pdl.set_pdl(True, DEV)
    assert pdl.launch_args() == {"PDL": True, "launch_pdl": True}
    assert not pdl.set_pdl(False)
    assert pdl.launch_args() == {"PDL": False, "launch_pdl": False}
