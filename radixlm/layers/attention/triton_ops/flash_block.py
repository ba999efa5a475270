"""One key block of flash attention over the token-level pool, shared by the kernels."""

from __future__ import annotations

import triton
import triton.language as tl

# Scores are kept in the log2 domain: exp2 is the cheap instruction, so the
# softmax scale is multiplied by log2(e) once on the host.
LOG2E = 1.4426950408889634


@triton.jit
def attend_block(q, k_base, v_base, slot, stride_kn, stride_vn, mask, m_i, l_i, acc,
                 sm_scale_log2, DOT_PREC: tl.constexpr, MASKED: tl.constexpr):
    """Online-softmax update of (m_i, l_i, acc) by the keys at pool rows `slot`.

    q [M, D] (any dtype), k_base/v_base: K/V pointers of the KV head with the
    feature offsets applied ([1, D]), slot [N] int64 pool rows. With MASKED, scores
    where `mask` ([M, N] or [1, N]) is False count as -inf; each row must keep at
    least one visible key over the blocks it has seen, or m_i stays -inf (NaN).
    Scores are in the log2 domain (log2(e) folded into sm_scale_log2), sums in fp32.
    Returns the new (m_i, l_i, acc).
    """
    k = tl.load(k_base + slot[:, None] * stride_kn)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
    if MASKED:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_base + slot[:, None] * stride_vn)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc
