"""Attention layer variants: sliding windows and logit softcapping.

Each CPU backend (torch native, and our C++ kernels behind the cpu backend)
against a dense reference with HF's semantics: the query at position p sees
keys p - W + 1 .. p (transformers' `sliding_window_overlay`: kv_idx > q_idx -
W), scores s -> c * tanh(s / c) before the mask. Batches mix fresh prompts
(equal-length runs and ragged ones), prompts after a cached prefix, decode
rows and mixed batches. KV slots before a window are poisoned with NaN: a
window layer must not read them (a windowed pool may have freed them).
Backends refuse what they do not compute.
"""

from __future__ import annotations

import pytest
import torch

from radixlm.cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixlm.forward_batch import ForwardBatch, ForwardMode
from radixlm.layers import cpu_ops
from radixlm.layers.attention.base import AttentionBackend
from radixlm.layers.attention.cpu_backend import CpuAttentionBackend
from radixlm.layers.attention.radix_attention import RadixAttention
from radixlm.layers.attention.torch_native import TorchNativeBackend

HEADS, KV_HEADS = 4, 2


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int,
              layer: RadixAttention) -> torch.Tensor:
    """q [n, H, d] at positions first_pos.., keys/values [L, KVH, d] at 0..L-1."""
    group = layer.num_heads // layer.num_kv_heads
    k = keys.float().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, d]
    v = values.float().repeat_interleave(group, 1).transpose(0, 1)
    s = q.float().transpose(0, 1) @ k.transpose(1, 2) * layer.scaling  # [H, n, L]
    if layer.logit_softcap is not None:
        s = torch.tanh(s / layer.logit_softcap) * layer.logit_softcap
    qpos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    kpos = torch.arange(keys.shape[0])[None, :]
    visible = kpos <= qpos
    if layer.sliding_window is not None:
        visible &= kpos > qpos - layer.sliding_window
    s = s.masked_fill(~visible, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1)  # [n, H, d]


def run_batch(backend: AttentionBackend, layer: RadixAttention, prefix: list[int],
              extend: list[int], dtype: torch.dtype, mode: ForwardMode, seed: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(backend output, reference) for requests with these cached prefixes and new
    token counts, over a pool whose slots before each request's window are NaN."""
    d = layer.head_dim
    gen = torch.Generator().manual_seed(seed)
    req_pool = ReqToTokenPool(len(prefix) + 1, 512, "cpu")
    kv_pool = MHATokenToKVPool(4096, dtype, KV_HEADS, d, 1, "cpu")
    for buf in kv_pool.get_kv_buffer(0):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    rows, new_slots = [], []
    for pre, ext in zip(prefix, extend, strict=True):
        row = req_pool.alloc()
        slots = kv_pool.alloc(pre + ext)
        req_pool.req_to_token[row, :pre + ext] = slots.to(torch.int32)
        rows.append(row)
        new_slots.append(slots[pre:])
        if layer.sliding_window is not None:  # slots no query of this batch may read
            dead = slots[:max(0, pre - layer.sliding_window + 1)]
            for buf in kv_pool.get_kv_buffer(0):
                buf[dead] = float("nan")
    n = sum(extend)
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * d, generator=gen).to(dtype)
    q, k, v = qkv.split([HEADS * d, KV_HEADS * d, KV_HEADS * d], dim=-1)  # strided, as models
    num_extend = sum(e > 1 or p == 0 for p, e in zip(prefix, extend)) \
        if mode.is_mixed() else None
    fb = ForwardBatch.build(mode, list(range(n)), rows, prefix, extend, torch.cat(new_slots),
                            req_pool, kv_pool, backend, torch.device("cpu"),
                            num_extend=num_extend)
    backend.begin_forward(fb)
    out = backend.forward(q, k, v, layer, fb).view(n, HEADS, d)
    k_buf, v_buf = kv_pool.get_kv_buffer(0)
    refs, start = [], 0
    for row, pre, ext in zip(rows, prefix, extend, strict=True):
        slots = req_pool.req_to_token[row, :pre + ext].long()
        refs.append(reference(q[start:start + ext].view(ext, HEADS, d), k_buf[slots],
                              v_buf[slots].nan_to_num(0.0), pre, layer))
        start += ext
    return out, torch.cat(refs)


BACKENDS = {"torch_native": TorchNativeBackend, "cpu": CpuAttentionBackend}
VARIANTS = [(None, None), (1, None), (5, None), (40, None), (None, 30.0), (7, 20.0)]
# Fresh prompts (a run of equal lengths, ragged ones, shorter and longer than the
# windows), prompts after a cached prefix (longer than the windows, and shorter).
EXTEND = ([0, 0, 0, 0, 60, 3], [37, 37, 1, 70, 45, 2])


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(out).all(), "read a slot outside the window"
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_extend_matches_reference(backend, window, softcap):
    layer = RadixAttention(0, HEADS, KV_HEADS, 64, 0.125, window, softcap)
    out, ref = run_batch(BACKENDS[backend](), layer, *EXTEND, torch.float32, ForwardMode.EXTEND)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_decode_matches_reference(backend, window, softcap):
    layer = RadixAttention(0, HEADS, KV_HEADS, 64, 0.125, window, softcap)
    prefix = [0, 4, 6, 39, 40, 41, 300]  # around the windows, and a long one
    out, ref = run_batch(BACKENDS[backend](), layer, prefix, [1] * len(prefix), torch.float32,
                         ForwardMode.DECODE)
    _check(out, ref, torch.float32)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_mixed_batch_matches_reference(backend):
    layer = RadixAttention(0, HEADS, KV_HEADS, 64, 0.125, 9, 25.0)
    # Two extend requests (one fresh, one after a prefix), then three decodes.
    out, ref = run_batch(BACKENDS[backend](), layer, [0, 20, 5, 12, 200], [33, 17, 1, 1, 1],
                         torch.float32, ForwardMode.MIXED)
    _check(out, ref, torch.float32)


needs_kernels = pytest.mark.skipif(not cpu_ops.load(), reason="no C++ compiler")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_prefill_kernel_matches_reference(dtype, dim, window, softcap):
    # Fresh prompts and one after a prefix, all through cpu_ops.extend_attention.
    layer = RadixAttention(0, HEADS, KV_HEADS, dim, dim ** -0.5, window, softcap)
    out, ref = run_batch(CpuAttentionBackend(), layer, [0, 0, 300, 0], [37, 1, 70, 100],
                         dtype, ForwardMode.EXTEND, seed=dim)
    _check(out, ref, dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", VARIANTS)
def test_decode_kernel_over_several_splits_matches_reference(dtype, window, softcap):
    # Requests longer than one split (attention.h's kSplit = 256 positions), merged in order.
    layer = RadixAttention(0, HEADS, KV_HEADS, 64, 0.125, window, softcap)
    out, ref = run_batch(CpuAttentionBackend(), layer, [480, 33, 255], [1, 1, 1], dtype,
                         ForwardMode.DECODE, seed=3)
    _check(out, ref, dtype)


def test_window_of_the_contract_is_hf_sliding_window_mask():
    # The contract pins transformers' mask: the last W positions, the query's own included.
    from transformers.masking_utils import sliding_window_causal_mask_function

    window, n = 4, 9
    hf = sliding_window_causal_mask_function(window)
    layer = RadixAttention(0, 1, 1, 16, 1.0, sliding_window=window)
    q = torch.zeros(n, 1, 16)
    keys = torch.zeros(n, 1, 16)
    values = torch.zeros(n, 1, 16)
    values[torch.arange(n), 0, torch.arange(n)] = 1.0  # value j marks key j
    out = reference(q, keys, values, 0, layer)[:, 0, :n]
    t = torch.tensor
    for i in range(n):
        seen = {j for j in range(n) if out[i, j] > 0}
        assert seen == {j for j in range(n) if hf(t(0), t(0), t(i), t(j))}
        assert seen == set(range(max(0, i - window + 1), i + 1))


class NoVariants(TorchNativeBackend):
    supports_sliding_window = supports_logit_softcap = False


def test_backend_refuses_variants_it_does_not_compute() -> None:
    backend = NoVariants()
    backend.check_layer(RadixAttention(0, 4, 2, 16, 0.25))
    with pytest.raises(ValueError, match="layer 3 uses sliding-window attention"):
        backend.check_layer(RadixAttention(3, 4, 2, 16, 0.25, sliding_window=8))
    with pytest.raises(ValueError, match="softcapping"):
        backend.check_layer(RadixAttention(3, 4, 2, 16, 0.25, logit_softcap=50.0))
    for cls in BACKENDS.values():  # these compute both
        cls().check_layer(RadixAttention(3, 4, 2, 16, 0.25, sliding_window=8,
                                         logit_softcap=50.0))


def test_variant_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        RadixAttention(0, 4, 2, 16, 0.25, sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        RadixAttention(0, 4, 2, 16, 0.25, logit_softcap=-1.0)
