"""Our C++ CPU kernels (radixlm/layers/cpu_ops) against the torch paths they replace."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from radixlm.cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixlm.forward_batch import ForwardBatch, ForwardMode
from radixlm.layers import cpu_ops
from radixlm.layers.activation import SiluAndMul
from radixlm.layers.attention.cpu_backend import CpuAttentionBackend
from radixlm.layers.attention.radix_attention import RadixAttention
from radixlm.layers.attention.torch_native import TorchNativeBackend
from radixlm.layers.norm import RMSNorm
from radixlm.layers.rotary import RotaryEmbedding

HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    # A machine with a compiler must build them (CI has one); without, they are optional.
    if not cpu_ops.load():
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler is present but the CPU kernels did not build (see log)")
        pytest.skip("no C++ compiler: the CPU kernels are unavailable")


def reference_decode(q, k_buf, v_buf, req_to_token, rows, seq_lens, scale):
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        if n == 0:
            continue
        slots = req_to_token[rows[b], :n].long()
        keys = k_buf[slots].float().transpose(0, 1)
        values = v_buf[slots].float().transpose(0, 1)
        out[b] = F.scaled_dot_product_attention(
            q[b].float()[:, None], keys, values, scale=scale, enable_gqa=True)[:, 0]
    return out


def random_pool_batch(bs, heads, kv_heads, dim, max_len, dtype, index_dtype, gen):
    lens = torch.randint(1, max_len + 1, (bs,), generator=gen)
    lens[0] = max_len
    pool = int(lens.sum()) + 16
    k_buf = torch.randn(pool, kv_heads, dim, generator=gen).to(dtype)
    v_buf = torch.randn(pool, kv_heads, dim, generator=gen).to(dtype)
    # Scattered slots, as a long-running pool hands them out.
    slots = torch.randperm(pool - 1, generator=gen) + 1
    req_to_token = torch.zeros(bs + 3, max_len + 4, dtype=index_dtype)
    rows = torch.randperm(bs + 3, generator=gen)[:bs]
    used = 0
    for b in range(bs):
        n = int(lens[b])
        req_to_token[rows[b], :n] = slots[used:used + n].to(index_dtype)
        used += n
    q = torch.randn(bs, heads, dim, generator=gen).to(dtype)
    return q, k_buf, v_buf, req_to_token, rows, lens


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64),
                                                (14, 2, 64), (6, 1, 80)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_decode_attention_matches_sdpa(dtype, heads, kv_heads, dim, index_dtype):
    gen = torch.Generator().manual_seed(heads * dim + index_dtype.itemsize)
    # Up to 600 tokens: requests over one to three 256-position splits.
    q, k_buf, v_buf, r2t, rows, lens = random_pool_batch(5, heads, kv_heads, dim, 600, dtype,
                                                         index_dtype, gen)
    out = torch.empty_like(q)
    scale = dim ** -0.5
    cpu_ops.decode_attention(q, k_buf, v_buf, out, r2t, rows, lens, scale)
    ref = reference_decode(q, k_buf, v_buf, r2t, rows, lens, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # the output's own rounding
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: raw-key scores
def test_decode_attention_lengths_and_padding_rows(dtype):
    gen = torch.Generator().manual_seed(7)
    q, k_buf, v_buf, r2t, rows, lens = random_pool_batch(6, 8, 2, 64, 70, dtype,
                                                         torch.int32, gen)
    lens = torch.tensor([1, 31, 32, 33, 70, 0])  # around the 32-token block; a padding row
    out = torch.full_like(q, float("nan"))
    cpu_ops.decode_attention(q, k_buf, v_buf, out, r2t, rows, lens, 0.125)
    ref = reference_decode(q, k_buf, v_buf, r2t, rows, lens, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    assert torch.all(out[5] == 0)


def test_decode_attention_rejects_bad_inputs():
    q = torch.randn(2, 9, 64)
    k = torch.randn(10, 3, 64)
    r2t = torch.zeros(2, 8, dtype=torch.int32)
    lens = torch.tensor([1, 1])
    rows = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_ops.decode_attention(q, k.bfloat16(), k.bfloat16(), torch.empty_like(q), r2t,
                                 rows, lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of kv_heads"):
        cpu_ops.decode_attention(torch.randn(2, 8, 64), k, k, torch.empty(2, 8, 64), r2t,
                                 rows, lens, 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16, at most 256"):
        cpu_ops.decode_attention(torch.randn(2, 3, 24), torch.randn(10, 3, 24),
                                 torch.randn(10, 3, 24), torch.empty(2, 3, 24), r2t, rows,
                                 lens, 1.0)


def bit_identical_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a == b).float().mean().item()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("hidden", [576, 100])  # 100: a tail past the 16-lane blocks
def test_rms_norm_matches_torch(dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(33, hidden, generator=gen).to(dtype)
    res = torch.randn(33, hidden, generator=gen).to(dtype)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=gen).to(dtype)
    xf, rf = x.float(), res.float()
    s = (xf + rf).to(dtype)
    ref_res = s
    sf = s.float()
    ref = norm.weight * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out, new_res = cpu_ops.rms_norm(x, norm.weight, 1e-5, res)
    assert torch.equal(new_res, ref_res)
    torch.testing.assert_close(out, ref)
    assert bit_identical_fraction(out, ref) > 0.99
    assert torch.equal(norm(x, res)[0], out)  # the layer takes the kernel for half precision
    alone = cpu_ops.rms_norm(x, norm.weight, 1e-5)
    xf = x.float()
    ref = norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(alone, ref)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("inter", [1536, 40])
def test_silu_and_mul_matches_torch(dtype, inter):
    x = (torch.randn(17, 2 * inter, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    ref = F.silu(gate) * up
    out = cpu_ops.silu_and_mul(x)
    torch.testing.assert_close(out, ref)
    assert bit_identical_fraction(out, ref) > 0.99
    assert torch.equal(SiluAndMul()(x), out)


def test_silu_and_mul_keeps_inf_and_nan():
    """Overflowed activations: silu(+inf) = +inf and NaN stays NaN, as in torch
    (the vector exp clamps its argument instead of converting inf to an exponent)."""
    gate = torch.tensor([float("inf"), float("nan"), 90.0, 3.0] * 4)
    x = torch.cat([gate, torch.ones(16)]).view(1, 32).bfloat16()
    out = cpu_ops.silu_and_mul(x)[0].float()
    ref = F.silu(gate.bfloat16()).float()
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out[~ref.isnan()], ref[~ref.isnan()])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (128, 128), (64, 32)])
def test_rope_matches_torch(dtype, head_dim, rotary_dim):
    rope = RotaryEmbedding(head_dim, rotary_dim, 4096, {"rope_theta": 10000.0,
                                                         "rope_type": "default"}, dtype)
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    qkv = torch.randn(21, (6 + 2 * 2) * head_dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([6 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (21,), generator=gen)
    cos, sin = rope.cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    ref_q, ref_k = rope._rotate(q.clone(), cos, sin), rope._rotate(k.clone(), cos, sin)
    out_q, out_k = rope(positions, q, k)  # in place, through the kernel
    assert out_q.data_ptr() == q.data_ptr()
    torch.testing.assert_close(out_q, ref_q)
    torch.testing.assert_close(out_k, ref_k)
    assert bit_identical_fraction(out_q, ref_q) > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_decode_matches_torch_native(dtype):
    """The backend seam: same ForwardBatch, same pool, both backends."""
    heads, kv_heads, dim, layers = 9, 3, 64, 2
    req_pool = ReqToTokenPool(4, 600, "cpu")
    kv_pool = MHATokenToKVPool(2048, dtype, kv_heads, dim, layers, "cpu")
    gen = torch.Generator().manual_seed(11)
    for layer in range(layers):
        for buf in kv_pool.get_kv_buffer(layer):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    lens = [5, 300, 517]
    rows = [req_pool.alloc() for _ in lens]
    for row, n in zip(rows, lens):
        req_pool.req_to_token[row, :n + 1] = kv_pool.alloc(n + 1).to(torch.int32)
    new_slots = torch.cat([req_pool.req_to_token[r, n:n + 1].long() for r, n in zip(rows, lens)])

    layer = RadixAttention(1, heads, kv_heads, dim, 0.125)

    q = torch.randn(3, heads * dim, generator=gen).to(dtype)
    k = torch.randn(3, kv_heads * dim, generator=gen).to(dtype)
    v = torch.randn(3, kv_heads * dim, generator=gen).to(dtype)
    outs = []
    for backend in (TorchNativeBackend(), CpuAttentionBackend()):
        fb = ForwardBatch.build(ForwardMode.DECODE, [1, 2, 3], rows, lens, [1] * 3, new_slots,
                                req_pool, kv_pool, backend, torch.device("cpu"))
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, layer, fb))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_index_put(dtype):
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(7, 9 * 64 + 2 * 3 * 64, generator=gen).to(dtype)
    _, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # strided rows, as in the model
    loc = torch.randperm(40, generator=gen)[:7]
    k_buf, v_buf = torch.zeros(40, 3, 64, dtype=dtype), torch.zeros(40, 3, 64, dtype=dtype)
    cpu_ops.store_kv(k, v, k_buf, v_buf, loc)
    ref_k, ref_v = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
    ref_k[loc], ref_v[loc] = k.view(-1, 3, 64), v.view(-1, 3, 64)
    assert torch.equal(k_buf, ref_k) and torch.equal(v_buf, ref_v)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.store_kv(k, v, k_buf, v_buf, loc + 40)


def reference_prefill(q, k_buf, v_buf, r2t, rows, prefix, extend, scale):
    out, start = [], 0
    for row, pre, ext in zip(rows.tolist(), prefix.tolist(), extend.tolist()):
        slots = r2t[row, :pre + ext].long()
        keys, values = (b[slots].float().transpose(0, 1) for b in (k_buf, v_buf))
        qi = q[start:start + ext].float().transpose(0, 1)
        mask = torch.arange(pre + ext)[None, :] <= torch.arange(pre, pre + ext)[:, None]
        out.append(F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask, scale=scale,
                                                  enable_gqa=True).transpose(0, 1))
        start += ext
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64), (6, 1, 80)])
def test_extend_attention_matches_causal_sdpa(dtype, heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(3)
    # Lengths around the 32-key blocks, the 4-row (dim 64) / 2-row tiles and the
    # 128-row work units; prompts after a cached prefix (one over a 256-position split).
    prefix = torch.tensor([0, 0, 0, 0, 0, 40, 0, 300, 7])
    extend = torch.tensor([1, 5, 31, 33, 70, 9, 200, 20, 0])
    n = int(extend.sum())
    pool = int((prefix + extend).sum()) + 8
    k_buf = torch.randn(pool, kv_heads, dim, generator=gen).to(dtype)
    v_buf = torch.randn(pool, kv_heads, dim, generator=gen).to(dtype)
    r2t = torch.zeros(len(prefix) + 2, 400, dtype=torch.int32)
    rows = torch.randperm(len(prefix) + 2, generator=gen)[:len(prefix)]
    slots = torch.randperm(pool, generator=gen)
    used = 0
    for row, total in zip(rows.tolist(), (prefix + extend).tolist()):
        r2t[row, :total] = slots[used:used + total].int()
        used += total
    qkv = torch.randn(n + 2, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q = qkv[:, :heads * dim].view(n + 2, heads, dim)  # strided, as the models' q is
    out = torch.full((n + 2, heads, dim), 7.0, dtype=dtype)
    cpu_ops.extend_attention(q, k_buf, v_buf, out, r2t, rows, prefix, extend, dim ** -0.5)
    ref = reference_prefill(q, k_buf, v_buf, r2t, rows, prefix, extend, dim ** -0.5)
    # bf16 probabilities in the second product and a bf16 output: ~1e-2 absolute.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[:n].float(), ref, atol=tol, rtol=tol)
    assert torch.all(out[n:] == 7.0)  # rows of no request are untouched
    # The first row of a prompt sees only itself: its output is its own value row.
    first = int(extend[:4].sum())
    own = v_buf[r2t[rows[4], 0].long()].float().repeat_interleave(heads // kv_heads, 0)
    torch.testing.assert_close(out[first].float(), own, atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.extend_attention(q, k_buf, v_buf, out, r2t, rows, prefix, extend + 1000, 0.1)


def test_cpu_backend_extend_mixes_fresh_and_cached_prompts():
    """Fresh prompts and one after a cached prefix, in one batch: the kernel must
    agree with the torch backend on it."""
    heads, kv_heads, dim, dtype = 9, 3, 64, torch.bfloat16
    req_pool = ReqToTokenPool(4, 200, "cpu")
    kv_pool = MHATokenToKVPool(1024, dtype, kv_heads, dim, 1, "cpu")
    gen = torch.Generator().manual_seed(8)
    for buf in kv_pool.get_kv_buffer(0):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    prefix, extend = [0, 40, 0], [37, 9, 64]
    rows = [req_pool.alloc() for _ in prefix]
    new = []
    for row, pre, ext in zip(rows, prefix, extend):
        slots = kv_pool.alloc(pre + ext).to(torch.int32)
        req_pool.req_to_token[row, :pre + ext] = slots
        new.append(slots[pre:].long())

    layer = RadixAttention(0, heads, kv_heads, dim, 0.125)

    n = sum(extend)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    outs = []
    for backend in (TorchNativeBackend(), CpuAttentionBackend()):
        fb = ForwardBatch.build(ForwardMode.EXTEND, list(range(n)), rows, prefix, extend,
                                torch.cat(new), req_pool, kv_pool, backend,
                                torch.device("cpu"))
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, layer, fb))
    torch.testing.assert_close(outs[1].float(), outs[0].float(), atol=2e-2, rtol=2e-2)


def test_a_killed_builds_lock_is_dropped_a_fresh_one_kept(tmp_path) -> None:
    """torch waits forever on a build directory's lock; one older than any build
    was left by a killed process and must not hang every later start."""
    import os
    import time

    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    stale.touch()
    fresh.touch()
    old = time.time() - cpu_ops.STALE_LOCK_SECONDS - 5
    os.utime(stale, (old, old))
    cpu_ops._drop_stale_lock(stale)
    cpu_ops._drop_stale_lock(fresh)
    cpu_ops._drop_stale_lock(tmp_path / "absent")
    assert not stale.exists() and fresh.exists()
