"""Linear layers on CUDA: each gets the GEMV method when built in bf16/fp16, and it
runs exactly our GEMV where `use_gemv` takes the shape and cuBLAS elsewhere
(same bits as calling the kernels directly); `--disable-gemv` keeps cuBLAS."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from radixlm.layers.fused_ops import silu_and_mul  # noqa: E402
from radixlm.layers.gemv import gemv, use_gemv  # noqa: E402
from radixlm.layers.linear import (  # noqa: E402
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from radixlm.layers.quantization import UnquantizedConfig  # noqa: E402
from radixlm.layers.quantization.unquantized import (  # noqa: E402
    GemvLinearMethod,
    UnquantizedLinearMethod,
)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _free_memory():
    yield
    torch.cuda.empty_cache()


def _filled(layer: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, device=DEV, generator=g) * p.shape[-1] ** -0.5)
    return layer


def _build(cls, *args, **kw):
    with torch.device(DEV):
        return _filled(cls(*args, params_dtype=torch.bfloat16, **kw))


def test_methods_chosen_on_cuda():
    assert isinstance(_build(ColumnParallelLinear, 256, 256).quant_method, GemvLinearMethod)
    off = _build(ColumnParallelLinear, 256, 256, quant_config=UnquantizedConfig(gemv=False))
    assert type(off.quant_method) is UnquantizedLinearMethod
    with torch.device(DEV):
        fp32 = ColumnParallelLinear(256, 256, params_dtype=torch.float32)
    assert type(fp32.quant_method) is UnquantizedLinearMethod


@pytest.mark.parametrize("rows", [1, 4, 8, 9, 64])
def test_gemv_method_runs_the_same_kernels(rows):
    layer = _build(ColumnParallelLinear, 4096, 6144, bias=True)
    x = torch.randn(rows, 4096, device=DEV).bfloat16()
    w, b = layer.weight, layer.bias
    want = gemv(x, w, b) if use_gemv(x, w) else F.linear(x, w, b)
    assert use_gemv(x, w) == (rows <= 8)
    assert torch.equal(layer(x), want)


@pytest.mark.parametrize("rows", [1, 8, 9])
def test_gate_up_fused_path_matches_the_kernel(rows):
    layer = _build(MergedColumnParallelLinear, 4096, [14336, 14336], fused_silu_mul=True)
    x = torch.randn(rows, 4096, device=DEV).bfloat16()
    w = layer.weight
    want = gemv(x, w, silu_mul=True) if use_gemv(x, w) else silu_and_mul(F.linear(x, w))
    assert torch.equal(layer(x), want)


def test_cublas_when_gemv_is_off():
    layer = _build(ColumnParallelLinear, 4096, 6144, quant_config=UnquantizedConfig(gemv=False))
    x = torch.randn(1, 4096, device=DEV).bfloat16()
    assert torch.equal(layer(x), F.linear(x, layer.weight))


@pytest.mark.parametrize("rows", [1, 16])
def test_out_buffer(rows):
    """A row-parallel layer's partial sum written into a given buffer (the fused
    all-reduce's), through the GEMV or cuBLAS."""
    layer = _build(RowParallelLinear, 4096, 4096, bias=True)
    x = torch.randn(rows, 4096, device=DEV).bfloat16()
    out = torch.empty(rows, 4096, device=DEV, dtype=torch.bfloat16)
    got = layer.quant_method.apply(layer, x, layer.bias, out=out)
    assert got.data_ptr() == out.data_ptr()
    w, b = layer.weight, layer.bias
    want = gemv(x, w, b) if use_gemv(x, w) else \
        torch.addmm(b, x, w.t(), out=torch.empty_like(out))
    assert torch.equal(out, want)
