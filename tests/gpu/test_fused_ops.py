"""Triton fused ops vs float64 references and the torch paths. Needs CUDA, or the
Triton interpreter on the CPU (`TRITON_INTERPRET=1`; `tests/test_fused_ops_triton.py`
runs this file so), where the ops' default path is made the Triton one too."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from devices import DEV, HAS_CUDA, INTERPRET  # noqa: E402

if not (HAS_CUDA or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from radixlm.layers import fused_ops  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _triton_by_default_on_the_cpu(monkeypatch):
    """Under the interpreter (CPU tensors) the ops' default path is Triton too, as
    on CUDA; `use_triton=False` still picks the torch path."""
    if INTERPRET and not HAS_CUDA:
        monkeypatch.setattr(fused_ops, "_use_triton",
                            lambda x, use: fused_ops.HAS_TRITON and use is not False)
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# One rounding of the output to the dtype (plus the residual's rounding).
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-6}


def _poison_allocator(nbytes: int) -> None:
    # Free a NaN-filled block so the op's torch.empty output likely reuses it:
    # an element the kernel fails to write then shows up as NaN.
    torch.full((nbytes // 4 + 1024,), float("nan"), device=DEV)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [4096, 1000, 8192])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, hidden, with_residual):
    torch.manual_seed(hidden)
    x = (torch.randn(77, hidden, device=DEV) * 3).to(dtype)
    w = torch.randn(hidden, device=DEV).to(dtype)
    r = torch.randn(77, hidden, device=DEV).to(dtype) if with_residual else None
    eps = 1e-6
    # float64 reference from the rounded residual sum the op is defined on.
    s = (x + r) if with_residual else x
    sd = s.double()
    ref = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    _poison_allocator(x.numel() * x.element_size())
    out = fused_ops.rms_norm(x, w, eps, r)
    if with_residual:
        out, new_res = out
        t_out, t_res = fused_ops.rms_norm(x, w, eps, r, use_triton=False)
        if INTERPRET and dtype == torch.bfloat16:  # its conversion to bf16 truncates
            torch.testing.assert_close(new_res, s, rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(new_res, s) and torch.equal(t_res, new_res)
    else:
        t_out = fused_ops.rms_norm(x, w, eps, use_triton=False)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert _rel_err(out, ref) < TOL[dtype]
    assert _rel_err(t_out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim,nq,nk", [(128, 128, 32, 8), (64, 64, 12, 12),
                                                       (128, 64, 8, 1), (256, 256, 4, 2)])
def test_rope_in_place(dtype, head_dim, rotary_dim, nq, nk):
    torch.manual_seed(head_dim + nq)
    t = 333
    cache = fused_ops.rope_cos_sin_cache(rotary_dim, 8192, 500000.0, device=DEV)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    # q and k as strided views into a fused qkv output, as the models produce them.
    qkv = torch.randn(t, (nq + 2 * nk) * head_dim, device=DEV).to(dtype)
    q = qkv[:, :nq * head_dim]
    k = qkv[:, nq * head_dim:(nq + nk) * head_dim]
    v_before = qkv[:, (nq + nk) * head_dim:].clone()

    def ref(x: torch.Tensor, n: int) -> torch.Tensor:
        xd = x.double().view(t, n, head_dim).clone()
        half = rotary_dim // 2
        ang = pos.double()[:, None] * (1.0 / (500000.0 ** (torch.arange(
            0, rotary_dim, 2, device=DEV, dtype=torch.float64) / rotary_dim)))[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        x1, x2 = xd[..., :half].clone(), xd[..., half:rotary_dim].clone()
        xd[..., :half] = x1 * cos - x2 * sin
        xd[..., half:rotary_dim] = x2 * cos + x1 * sin
        return xd.view(t, -1)

    q_ref, k_ref = ref(q, nq), ref(k, nk)
    q_t, k_t = q.clone(), k.clone()
    fused_ops.apply_rope_(pos, q_t, k_t, head_dim, cache, use_triton=False)
    fused_ops.apply_rope_(pos, q, k, head_dim, cache)
    assert torch.equal(qkv[:, (nq + nk) * head_dim:], v_before)  # v untouched
    # fp32 tolerance: cos/sin cache is fp32, the reference recomputes in fp64.
    tol = max(TOL[dtype], 2e-6)
    assert _rel_err(q, q_ref) < tol and _rel_err(k, k_ref) < tol
    assert _rel_err(q_t, q_ref) < tol and _rel_err(k_t, k_ref) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,nq,nk", [(128, 32, 8), (64, 12, 12), (128, 8, 1)])
def test_rope_with_kv_store_matches_rope_then_store(dtype, head_dim, nq, nk):
    """RoPE that also writes the rotated K and the V rows into pool slots: the same
    q and k as the plain op, and the pool as `store_kv` leaves it (no other slot
    written)."""
    from radixlm.layers.attention.triton_ops.kv_store import store_kv

    torch.manual_seed(head_dim + nk)
    t, slots = 45, 200
    cache = fused_ops.rope_cos_sin_cache(head_dim, 4096, 10000.0, device=DEV).to(dtype)
    pos = torch.randint(0, 4096, (t,), device=DEV)
    loc = torch.randperm(slots - 1, device=DEV)[:t] + 1
    qkv = torch.randn(t, (nq + 2 * nk) * head_dim, device=DEV).to(dtype)
    bufs = [torch.randn(slots, nk, head_dim, device=DEV).to(dtype) for _ in range(2)]
    orig, ref_qkv, ref_bufs = qkv.clone(), qkv.clone(), [b.clone() for b in bufs]

    def split(x: torch.Tensor) -> list[torch.Tensor]:
        return list(x.split([nq * head_dim, nk * head_dim, nk * head_dim], dim=-1))

    q, k, v = split(ref_qkv)
    fused_ops.apply_rope_(pos, q, k, head_dim, cache)
    store_kv(k, v, *ref_bufs, loc)
    q, k, v = split(qkv)
    fused_ops.apply_rope_(pos, q, k, head_dim, cache, kv_store=(v, *bufs, loc))
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(bufs[0], ref_bufs[0]) and torch.equal(bufs[1], ref_bufs[1])
    # The torch path (CPU, no Triton) stores the same rows, up to its rounding.
    q, k, v = split(orig)
    tbufs = [b.clone() for b in ref_bufs]
    fused_ops.apply_rope_(pos, q, k, head_dim, cache, use_triton=False,
                          kv_store=(v, *tbufs, loc))
    assert torch.equal(tbufs[1], bufs[1])
    assert _rel_err(tbufs[0], bufs[0]) < max(TOL[dtype], 2e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [14336, 1000, 64])
def test_silu_and_mul(dtype, d):
    torch.manual_seed(d)
    x = (torch.randn(129, 2 * d, device=DEV) * 4).to(dtype)
    xd = x.double()
    ref = xd[:, :d] * torch.sigmoid(xd[:, :d]) * xd[:, d:]
    _poison_allocator(x.numel() * x.element_size() // 2)
    out = fused_ops.silu_and_mul(x)
    assert out.shape == (129, d) and out.dtype == dtype and torch.isfinite(out).all()
    assert _rel_err(out, ref) < TOL[dtype]
    assert _rel_err(fused_ops.silu_and_mul(x, use_triton=False), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [3840, 1000])
def test_rms_norm_with_pre_norm_is_norm_then_add_then_norm(dtype, hidden):
    """A sandwich layer's post-norm, the residual add and the next pre-norm in one
    pass: bit for bit the two fused calls it replaces in half precision (same
    roundings, same sums),
    and the torch path within one rounding."""
    torch.manual_seed(hidden)
    x = (torch.randn(33, hidden, device=DEV) * 5).to(dtype)
    r = torch.randn(33, hidden, device=DEV).to(dtype)
    pw = (1 + torch.randn(hidden, device=DEV) * 0.1)  # Gemma's float32 (1 + w) scales
    w = (1 + torch.randn(hidden, device=DEV) * 0.1)
    want, want_res = fused_ops.rms_norm(fused_ops.rms_norm(x, pw, 1e-6), w, 1e-6, r)
    _poison_allocator(x.numel() * x.element_size())
    out, res = fused_ops.rms_norm(x, w, 1e-6, r, pre_weight=pw)
    if dtype == torch.float32:  # no rounding between: the compiler may fuse into FMAs
        assert _rel_err(out, want) < 1e-6 and _rel_err(res, want_res) < 1e-6
    else:
        assert torch.equal(out, want) and torch.equal(res, want_res)
    t_out, t_res = fused_ops.rms_norm(x, w, 1e-6, r, pre_weight=pw, use_triton=False)
    assert _rel_err(t_res, res) < TOL[dtype] and _rel_err(t_out, out) < 2 * TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,nq,nk,store", [(128, 32, 8, False), (256, 16, 8, True),
                                                  (64, 12, 12, True), (128, 8, 1, False)])
def test_rope_with_qk_norm_is_norm_then_rope(dtype, head_dim, nq, nk, store):
    """Per-head QK RMSNorm inside the rotation's kernel against the norm kernel then
    the rotation: equal up to the norm's summation order (two half-row sums), the
    pool rows written as the plain rotation writes them."""
    torch.manual_seed(head_dim + nq)
    t, slots = 57, 128
    cache = fused_ops.rope_cos_sin_cache(head_dim, 4096, 1e6, device=DEV).to(dtype)
    pos = torch.randint(0, 4096, (t,), device=DEV)
    loc = torch.randperm(slots, device=DEV)[:t]
    qkv = (torch.randn(t, (nq + 2 * nk) * head_dim, device=DEV) * 3).to(dtype)
    wq = torch.randn(head_dim, device=DEV).to(dtype)
    wk = (1 + torch.randn(head_dim, device=DEV) * 0.1)
    split = [nq * head_dim, nk * head_dim, nk * head_dim]
    orig = qkv.clone()
    ref_q, ref_k, ref_v = qkv.clone().split(split, dim=-1)
    ref_q = fused_ops.rms_norm(ref_q.reshape(-1, head_dim), wq, 1e-6).view(t, -1)
    ref_k = fused_ops.rms_norm(ref_k.reshape(-1, head_dim), wk, 1e-6).view(t, -1)
    fused_ops.apply_rope_(pos, ref_q, ref_k, head_dim, cache)
    q, k, v = qkv.split(split, dim=-1)
    bufs = [torch.zeros(slots, nk, head_dim, device=DEV, dtype=dtype) for _ in range(2)]
    fused_ops.apply_rope_(pos, q, k, head_dim, cache, qk_norm=(wq, wk, 1e-6),
                          kv_store=(v, *bufs, loc) if store else None)
    tol = max(2 * TOL[dtype], 2e-6)
    assert _rel_err(q, ref_q) < tol and _rel_err(k, ref_k) < tol
    if store:
        assert torch.equal(bufs[0][loc].view(t, -1), k)
        assert torch.equal(bufs[1][loc].view(t, -1), ref_v)
    tq, tk, _ = orig.split(split, dim=-1)
    tq, tk = fused_ops.apply_rope_(pos, tq.clone(), tk.clone(), head_dim, cache,
                                   qk_norm=(wq, wk, 1e-6), use_triton=False)
    assert _rel_err(tq, ref_q) < tol and _rel_err(tk, ref_k) < tol


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,nq,nk", [(128, 4, 2), (64, 3, 1), (96, 2, 2)])
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("extra", ["plain", "bias", "bias+qk_norm"])
def test_rope_adds_split_sums_as_the_second_launch(dtype, head_dim, nq, nk, split, extra):
    """RoPE with the K/V store given a qkv product's split-K partial sums
    (`layers/split_sums.py`): q, k, v, the pool rows and every other pool slot are
    what the sum's own launch and then the RoPE kernel leave, bit for bit (with
    the QK norm on a GPU, up to the norm's summation order: one program a head
    here, one a token there)."""
    from radixlm.layers.quantization.triton_ops.int4 import sum_splits
    from radixlm.layers.split_sums import SplitSums

    torch.manual_seed(head_dim + nq + split)
    t, slots, n = 3, 16, (nq + 2 * nk) * head_dim
    cache = fused_ops.rope_cos_sin_cache(head_dim, 4096, 5e5, device=DEV).to(dtype)
    pos = torch.randint(0, 4096, (t,), device=DEV)
    loc = torch.randperm(slots, device=DEV)[:t]
    ws = torch.randn(split, t, n, device=DEV) * 4
    bias = torch.randn(n, device=DEV).to(dtype) if "bias" in extra else None
    norm = ((torch.randn(head_dim, device=DEV).to(dtype),
             (1 + torch.randn(head_dim, device=DEV) * 0.1).to(dtype), 1e-6)
            if "qk_norm" in extra else None)
    bufs = [torch.randn(slots, nk, head_dim, device=DEV).to(dtype) for _ in range(2)]
    ref_bufs = [b.clone() for b in bufs]
    sizes = [nq * head_dim, nk * head_dim, nk * head_dim]

    ref = sum_splits(ws, bias, torch.empty(t, n, device=DEV, dtype=dtype), silu_mul=False)
    q, k, v = ref.split(sizes, dim=-1)
    fused_ops.apply_rope_(pos, q, k, head_dim, cache, kv_store=(v, *ref_bufs, loc),
                          qk_norm=norm)
    y = torch.full((t, n), float("nan"), device=DEV, dtype=dtype)
    q, k, v = y.split(sizes, dim=-1)
    fused_ops.apply_rope_(pos, q, k, head_dim, cache, kv_store=(v, *bufs, loc), qk_norm=norm,
                          sums=SplitSums(ws, bias, y))
    if norm is not None and HAS_CUDA:
        tol = max(2 * TOL[dtype], 2e-6)
        assert _rel_err(y, ref) < tol and _rel_err(bufs[0], ref_bufs[0]) < tol
        assert torch.equal(y[:, -nk * head_dim:], ref[:, -nk * head_dim:])  # v as summed
    else:
        assert torch.equal(y, ref) and torch.equal(bufs[0], ref_bufs[0])
    assert torch.equal(bufs[1], ref_bufs[1])
    # Without a K/V store the sums take their own launch first, then the rotation.
    y2 = torch.full((t, n), float("nan"), device=DEV, dtype=dtype)
    q, k, _ = y2.split(sizes, dim=-1)
    fused_ops.apply_rope_(pos, q, k, head_dim, cache, qk_norm=norm, sums=SplitSums(ws, bias, y2))
    assert torch.equal(y2, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [15360, 1000, 64])
def test_gelu_tanh_and_mul(dtype, d):
    """One kernel for GeGLU: within one rounding of float64, and within the same of
    the unfused torch ops (the gelu rounded before the product, as they round it)."""
    torch.manual_seed(d)
    x = (torch.randn(65, 2 * d, device=DEV) * 4).to(dtype)
    xd = x.double()
    g = xd[:, :d]
    ref = 0.5 * g * (1 + torch.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3))) * xd[:, d:]
    _poison_allocator(x.numel() * x.element_size() // 2)
    out = fused_ops.gelu_tanh_and_mul(x)
    assert out.shape == (65, d) and out.dtype == dtype and torch.isfinite(out).all()
    assert _rel_err(out, ref) < 2 * TOL[dtype]
    unfused = fused_ops.gelu_tanh_and_mul(x, use_triton=False)
    assert _rel_err(out, unfused) < 2 * TOL[dtype]


def test_empty_inputs():
    x = torch.empty(0, 4096, device=DEV, dtype=torch.bfloat16)
    w = torch.ones(4096, device=DEV, dtype=torch.bfloat16)
    assert fused_ops.rms_norm(x, w, 1e-6).shape == (0, 4096)
    assert fused_ops.silu_and_mul(torch.empty(0, 128, device=DEV)).shape == (0, 64)
