"""One key block of flash attention over the token-level pool, shared by the kernels."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixlm.layers.attention.triton_ops.kv_store import FP8_DTYPES

# Scores are kept in the log2 domain: exp2 is the cheap instruction, so the
# softmax scale is multiplied by log2(e) once on the host.
LOG2E = 1.4426950408889634


def score_scales(sm_scale: float, softcap: float | None) -> tuple[float, float]:
    """(qk_scale, cap_log2) for `attend_block`: without a softcap the score in the
    log2 domain is dot * qk_scale; with a softcap c it is cap_log2 * tanh(dot *
    qk_scale), i.e. c * tanh(scale * dot / c) * log2(e)."""
    if softcap is None:
        return sm_scale * LOG2E, 0.0
    return sm_scale / softcap, softcap * LOG2E


def kv_fp8_args(k_buffer: torch.Tensor, q: torch.Tensor,
                kv_scales: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(k_scale pointer, v_scale pointer, KV_FP8) for a kernel launch.

    An FP8 pool (`FP8TokenToKVPool`) holds K / k_scale and V / v_scale: the
    kernels widen each tile to the queries' dtype, fold k_scale into the score
    scale (dot(q, k_codes) * k_scale is the true score) and multiply the
    normalized output by v_scale (the softmax weights sum to 1). The scales are
    one-element fp32 device tensors read inside the kernels: no host sync, and
    CUDA graphs replay new values. Other pools: KV_FP8 False, the pointers unused."""
    if k_buffer.dtype not in FP8_DTYPES or k_buffer.dtype == q.dtype:
        return q, q, False
    if kv_scales is None:
        raise ValueError(f"a {k_buffer.dtype} KV pool needs kv_scales (its layer's k_scale, "
                         "v_scale)")
    k_scale, v_scale = kv_scales
    assert k_scale.dtype == v_scale.dtype == torch.float32 and k_scale.device == q.device
    return k_scale, v_scale, True


@triton.jit
def fp8_score_scale(qk_scale, KScale, KV_FP8: tl.constexpr):
    """The score scale with an FP8 pool's key scale folded in (see `kv_fp8_args`)."""
    if KV_FP8:
        qk_scale = qk_scale * tl.load(KScale)
    return qk_scale


@triton.jit
def fp8_value_scale(out, VScale, KV_FP8: tl.constexpr):
    """A normalized output times an FP8 pool's value scale (see `kv_fp8_args`)."""
    if KV_FP8:
        out = out * tl.load(VScale)
    return out


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): saturates to +-1 without overflow (e^2x -> inf gives 1,
    # -> 0 gives -1); absolute error ~1e-7 near 0, which the cap (~50) scales to
    # ~5e-6 in a score. Portable where libdevice is not (the interpreter).
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@triton.jit
def attend_block(q, k_base, v_base, slot, stride_kn, stride_vn, mask, m_i, l_i, acc,
                 qk_scale, cap_log2, DOT_PREC: tl.constexpr, MASKED: tl.constexpr,
                 SOFTCAP: tl.constexpr, EMPTY_ROWS: tl.constexpr, KV_FP8: tl.constexpr = False):
    """Online-softmax update of (m_i, l_i, acc) by the keys at pool rows `slot`.

    q [M, D] (any dtype), k_base/v_base: K/V pointers of the KV head with the
    feature offsets applied ([1, D]), slot [N] int64 pool rows. Scores are
    dot * qk_scale in the log2 domain, or cap_log2 * tanh(dot * qk_scale) with
    SOFTCAP (`score_scales` gives both numbers); sums in fp32. With MASKED, scores
    where `mask` ([M, N] or [1, N]) is False count as -inf. Without EMPTY_ROWS each
    row must keep at least one visible key over the blocks it has seen, or m_i
    stays -inf (NaN); EMPTY_ROWS (sliding windows, whose rows start at different
    keys) pays one select per row to allow rows that saw nothing yet. KV_FP8:
    the K/V tiles are FP8 codes, widened to q's dtype here (the caller folds
    the scales in: `fp8_score_scale`, `fp8_value_scale`).
    Returns the new (m_i, l_i, acc).
    """
    k = tl.load(k_base + slot[:, None] * stride_kn)
    if KV_FP8:
        k = k.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
    if SOFTCAP:
        qk = cap_log2 * _tanh(qk)
    if MASKED:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_sub = m_new
    if EMPTY_ROWS:
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(qk - m_sub[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + slot[:, None] * stride_vn)
    if KV_FP8:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def load_slots(r2t, offs_n, nmask, SlotMap, MASKED: tl.constexpr, TRANSLATE: tl.constexpr):
    """Pool rows of token positions `offs_n` (int64; with MASKED, positions where
    `nmask` is False read row 0, the padding row). TRANSLATE: the table holds
    full-pool slots and this layer's K/V live in a window pool, at SlotMap[slot]
    (0 once a token's window KV is freed, which the window's range never reaches)."""
    if MASKED:
        slot = tl.load(r2t + offs_n, mask=nmask, other=0)
    else:
        slot = tl.load(r2t + offs_n)
    if TRANSLATE:
        slot = tl.load(SlotMap + slot)
    return slot.to(tl.int64)
