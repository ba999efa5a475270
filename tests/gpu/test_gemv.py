"""Triton GEMV (radixlm/layers/gemv.py) vs a float32 reference (CUDA only)."""

from __future__ import annotations

import functools

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from radixlm.layers import gemv as G  # noqa: E402

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
# (K, N): Llama-3.1-8B linears at tp=1, then per rank at tp=2, then Qwen3-30B-A3B's
# qkv and o. Those under 4096 x 4096 take pick_config's small-matrix tiles at one row.
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256),
          (4096, 3072), (2048, 4096), (4096, 14336), (7168, 4096), (4096, 64128),
          (2048, 5120), (4096, 2048)]


@pytest.fixture(scope="module", autouse=True)
def _free_weights():
    """The cached weights pin ~2.2 GB: give them back before the next module, whose
    memory accounting (runtime control's release test) shares this process."""
    yield
    _weights.cache_clear()
    torch.cuda.empty_cache()


@functools.cache  # ~2.2 GB for all shapes
def _weights(k: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(k * 7 + n)
    w = (torch.randn(n, k, device=DEV, generator=g) * k ** -0.5).to(dtype)
    b = torch.randn(n, device=DEV, generator=g).to(dtype)
    return w, b


def _check(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None,
           config: G.GemvConfig | None = None) -> None:
    # Free a NaN-filled block first so an output element the kernel fails to write shows up.
    torch.full((x.shape[0] * w.shape[0] + 1024,), float("nan"), device=DEV)
    out = G.gemv(x, w, b, config)
    ref = x.float() @ w.float().T
    if b is not None:
        ref += b.float()
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    # One rounding to bf16 (rel 2^-8) on values of order 1; fp32 sums differ only in order.
    torch.testing.assert_close(out.float(), ref, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_llama_shapes(k, n, m, bias):
    w, b = _weights(k, n, torch.bfloat16)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    _check(x, w, b if bias else None)


@pytest.mark.parametrize("kernel", ["fma", "mma"])
@pytest.mark.parametrize("k,n", [(4104, 1000), (640, 4099), (8, 24)])
def test_gemv_ragged_shapes(kernel, k, n):
    # K not a multiple of the K block, N not a multiple of the column block.
    w = (torch.randn(n, k, device=DEV) * k ** -0.5).half()
    b = torch.randn(n, device=DEV).half()
    for m in ([1] if kernel == "fma" else [1, 5, 8]):
        x = torch.randn(m, k, device=DEV).half()
        _check(x, w, b, G.GemvConfig(kernel, 16, 512, 4, 3))


@pytest.mark.parametrize("k,n", [(4096, 28672), (4096, 14336), (640, 2 * 1000)])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_gemv_silu_mul_matches_unfused(k, n, m):
    """The fused gate/up + SiLU-and-mul equals the GEMV followed by `silu_and_mul`,
    bit for bit (both round gate and up to bf16 first)."""
    from radixlm.layers.fused_ops import silu_and_mul

    w = _weights(k, n, torch.bfloat16)[0] if n > 2000 else \
        (torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    torch.full((m * n + 1024,), float("nan"), device=DEV)
    out = G.gemv(x, w, silu_mul=True)
    assert out.shape == (m, n // 2)
    assert torch.equal(out, silu_and_mul(G.gemv(x, w)))


def test_gemv_3d_input_and_fp16():
    w, b = _weights(4096, 4096, torch.float16)
    x = torch.randn(2, 3, 4096, device=DEV).half()
    out = G.gemv(x, w, b)
    assert out.shape == (2, 3, 4096)
    ref = x.float() @ w.float().T + b.float()
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)


def test_use_gemv_rules():
    w = torch.randn(4096, 4096, device=DEV).bfloat16()
    x = torch.randn(1, 4096, device=DEV).bfloat16()
    assert G.use_gemv(x, w)
    assert not G.use_gemv(torch.randn(9, 4096, device=DEV).bfloat16(), w)  # M > 8
    assert not G.use_gemv(x.float(), w.float())  # dtype
    assert not G.use_gemv(x.cpu(), w.cpu())  # device
    assert not G.use_gemv(x, w.t())  # weight not contiguous
    assert not G.use_gemv(x.half(), w)  # mixed dtypes


@pytest.mark.parametrize("m", [1, 4])
def test_gemv_cuda_graph(m):
    k, n = 4096, 6144
    w, b = _weights(k, n, torch.bfloat16)
    x = torch.randn(m, k, device=DEV).bfloat16()
    G.gemv(x, w, b)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = G.gemv(x, w, b)
    for _ in range(2):
        x.copy_(torch.randn(m, k, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        ref = x.float() @ w.float().T + b.float()
        torch.testing.assert_close(out.float(), ref, rtol=1.6e-2, atol=1e-2)
