"""Fused elementwise/row ops for the model layers: RMSNorm (+ residual add, + a
sandwich pre-norm), RoPE (+ a per-head QK norm), SiLU- and GELU-tanh-and-mul.

Each op has a Triton kernel for CUDA tensors and a pure-torch path, used on the
CPU, when Triton is missing, or with `use_triton=False`; the torch path is also
the reference the GPU tests compare against. All arithmetic is fp32 inside;
results are rounded once to the input dtype.

Semantics (both paths):
- `rms_norm(x, w, eps)` -> x * rsqrt(mean(x^2) + eps) * w.
- `rms_norm(x, w, eps, residual)` -> (normed, new_residual) with
  new_residual = x + residual rounded to x's dtype (as the unfused model code
  does), normed computed from that rounded sum.
- `rms_norm(x, w, eps, residual, pre_weight=pw)`: x is first normalized with
  pw and rounded (a sandwich layer's post-norm), then as above: one pass for
  norm -> add -> norm.
- `apply_rope_(positions, q, k, head_dim, cos_sin_cache)`: neox / rotate-half
  style, in place on the first `rotary_dim` dims of each head; cos_sin_cache is
  [max_position, rotary_dim] = cat(cos, sin) along the last dim.
  `qk_norm=(wq, wk, eps)` (full rotary only): each head of q and k is first
  RMS-normalized with wq / wk and rounded (Qwen3's and Gemma 3's QK norm).
- `silu_and_mul(x)`: x = [..., 2 * d] -> silu(x[..., :d]) * x[..., d:].
- `gelu_tanh_and_mul(x)`: gelu_tanh(x[..., :d]), rounded, times x[..., d:]
  (GeGLU as the unfused `F.gelu(gate, approximate="tanh") * up` rounds it).
- `fp8_out` (`rms_norm`, `silu_and_mul`): the output, rounded to x's dtype,
  then quantized per row to FP8 in the same pass: (codes, scales [rows, 1]),
  what `quantize_activations` makes of the unfused output, bit for bit
  (`layers/fp8_rows.py` says who asks for it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from radixlm.layers import pdl
from radixlm.layers.fp8_rows import FP8, quantize_rows_torch
from radixlm.layers.split_sums import SplitSums

try:  # CPU-only installs may lack Triton; the torch paths cover them.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False


def _use_triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        return HAS_TRITON and x.is_cuda
    return use_triton and HAS_TRITON


# ---------------------------------------------------------------- torch paths

def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    new_residual = None
    if residual is not None:
        x = x + residual
        new_residual = x
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    y = y.to(x.dtype)
    return y if new_residual is None else (y, new_residual)


def apply_rope_torch_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                      cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rot = cos_sin_cache.shape[-1]
    half = rot // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    for t in (q, k):
        tv = t.view(t.shape[0], -1, head_dim)
        x1 = tv[..., :half].float()
        x2 = tv[..., half:rot].float()
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        tv[..., :rot] = out.to(t.dtype)
    return q, k


def rms_norm_heads_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                         head_dim: int) -> torch.Tensor:
    """Per-head RMSNorm of [T, heads * head_dim] rows, rounded once."""
    xf = x.float().view(x.shape[0], -1, head_dim)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return xf.to(x.dtype).view(x.shape)


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    xf = x.float()
    return (F.silu(xf[..., :d]) * xf[..., d:]).to(x.dtype)


def rope_cos_sin_cache(rotary_dim: int, max_position: int, base: float = 10000.0,
                       inv_freq: torch.Tensor | None = None,
                       device: torch.device | str = "cpu") -> torch.Tensor:
    """[max_position, rotary_dim] fp32 = cat(cos, sin); pass `inv_freq` for scaled RoPE."""
    if inv_freq is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64)
                                   / rotary_dim))
    t = torch.arange(max_position, dtype=torch.float64)
    freqs = torch.outer(t, inv_freq.to(torch.float64).cpu())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).float().to(device)


# ---------------------------------------------------------------- Triton kernels

if HAS_TRITON:
    from radixlm.layers.pdl import pdl_trigger, pdl_wait
    from radixlm.layers.quantization.triton_ops.e4m3 import e4m3_codes, e4m3_scale

    @triton.jit
    def _store_row(Y, S, row, stride_y, offs, mask, y, QUANT: tl.constexpr):
        """A row's output y (fp32, already rounded to the activation dtype): as it
        is, or with QUANT as FP8 codes and the row's scale (`Fp8Rows`; the
        arithmetic of `quantize_activations`)."""
        if QUANT:
            s = e4m3_scale(tl.max(tl.abs(y), 0))
            tl.store(S + row, s)
            y = e4m3_codes(y, s)
        tl.store(Y + row * stride_y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_kernel(X, R, W, Y, RO, PW, S, stride_x, stride_r, stride_y, stride_ro, N, eps,
                         HAS_RES: tl.constexpr, HAS_PRE: tl.constexpr, BLOCK: tl.constexpr,
                         QUANT: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        # The weights before the wait: after it only x and the residual are read.
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_PRE:
            pw = tl.load(PW + offs, mask=mask, other=0.0).to(tl.float32)
        pdl_wait(PDL)
        pdl_trigger(PDL)
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_PRE:  # normalize x first, rounded as a separate norm's output would be
            pre = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
            x = (x * pre * pw).to(X.dtype.element_ty).to(tl.float32)
        if HAS_RES:
            r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
            # Round the sum to the activation dtype before normalizing, as the
            # unfused `x + residual` would, so both paths see the same residual.
            s = (x + r).to(RO.dtype.element_ty)
            tl.store(RO + row * stride_ro + offs, s, mask=mask)
            x = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
        y = (x * rstd * w).to(X.dtype.element_ty).to(tl.float32)
        _store_row(Y, S, row, stride_y, offs, mask, y, QUANT)

    @triton.jit
    def _norm_weights(W, offs, dmask, HALF: tl.constexpr):
        """A head's norm weights as the two [1, HALF] halves `_norm_heads` takes."""
        w1 = tl.load(W + offs, mask=dmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + offs, mask=dmask, other=0.0).to(tl.float32)[None, :]
        return w1, w2

    @triton.jit
    def _norm_heads(x1, x2, w1, w2, eps, HEAD_DIM: tl.constexpr, dtype: tl.constexpr):
        """RMSNorm of each row (head) of a [heads, HALF] x2 tile pair, rounded."""
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)[:, None]
        return ((x1 * rstd * w1).to(dtype).to(tl.float32),
                (x2 * rstd * w2).to(dtype).to(tl.float32))

    @triton.jit
    def _rotate(x1, x2, cos, sin, dtype: tl.constexpr):
        """Rotary embedding of a head's two halves at a position's cos / sin,
        rounded to `dtype`."""
        return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)

    @triton.jit
    def _rope_kernel(Q, K, CosSin, Pos, stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                     V, KBuf, VBuf, Loc, stride_vt, WQ, WK, eps,
                     QK_NORM: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr,
                     BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_HALF: tl.constexpr,
                     STORE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                     PDL: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        # The position, its cos/sin row, the cache slot and the q/k norm weights are
        # the step's inputs and constants (`radixlm.layers.pdl`): read before the wait.
        pos = tl.load(Pos + t).to(tl.int64)
        offs = tl.arange(0, BLOCK_HALF)
        dmask = offs < HALF
        cos = tl.load(CosSin + pos * stride_cs + offs, mask=dmask, other=0.0).to(tl.float32)
        sin = tl.load(CosSin + pos * stride_cs + HALF + offs, mask=dmask,
                      other=0.0).to(tl.float32)
        if STORE:
            row = tl.load(Loc + t).to(tl.int64) * (NK * HEAD_DIM)
        if QK_NORM:
            wq1, wq2 = _norm_weights(WQ, offs, dmask, HALF)
            wk1, wk2 = _norm_weights(WK, offs, dmask, HALF)
        # All query heads of the token in one tile, all key heads in another: one
        # program per token reads its cos/sin row once.
        hq = tl.arange(0, BLOCK_HQ)
        mq = (hq < NQ)[:, None] & dmask[None, :]
        pq = Q + t * stride_qt + hq[:, None] * stride_qh + offs[None, :]
        hk = tl.arange(0, BLOCK_HK)
        mk = (hk < NK)[:, None] & dmask[None, :]
        pk = K + t * stride_kt + hk[:, None] * stride_kh + offs[None, :]
        dv = tl.arange(0, BLOCK_D)
        mv = (hk < NK)[:, None] & (dv < HEAD_DIM)[None, :]
        heads = hk[:, None] * HEAD_DIM + dv[None, :]
        pdl_wait(PDL)
        pdl_trigger(PDL)
        # q, k and v (the kernel before wrote them) all loaded before any store: a
        # store to Q could alias K for all the compiler knows, so loads after it
        # would wait for it, a round trip each.
        if STORE:
            v = tl.load(V + t * stride_vt + heads, mask=mv)
        x1 = tl.load(pq, mask=mq, other=0.0).to(tl.float32)
        x2 = tl.load(pq + HALF, mask=mq, other=0.0).to(tl.float32)
        y1 = tl.load(pk, mask=mk, other=0.0).to(tl.float32)
        y2 = tl.load(pk + HALF, mask=mk, other=0.0).to(tl.float32)
        if QK_NORM:
            x1, x2 = _norm_heads(x1, x2, wq1, wq2, eps, HEAD_DIM, Q.dtype.element_ty)
            y1, y2 = _norm_heads(y1, y2, wk1, wk2, eps, HEAD_DIM, K.dtype.element_ty)
        q1, q2 = _rotate(x1, x2, cos, sin, Q.dtype.element_ty)
        tl.store(pq, q1, mask=mq)
        tl.store(pq + HALF, q2, mask=mq)
        k1, k2 = _rotate(y1, y2, cos, sin, K.dtype.element_ty)
        tl.store(pk, k1, mask=mk)
        tl.store(pk + HALF, k2, mask=mk)
        if STORE:  # the rotated K row and the V row into the pool's slot (full rotary only)
            pkb = KBuf + row + hk[:, None] * HEAD_DIM + offs[None, :]
            tl.store(pkb, k1, mask=mk)
            tl.store(pkb + HALF, k2, mask=mk)
            tl.store(VBuf + row + heads, v, mask=mv)

    @triton.jit
    def _rope_sums_kernel(WS, Bias, Y, CosSin, Pos, KBuf, VBuf, Loc, WQ, WK, eps, stride_ws,
                          stride_wt, stride_yt, stride_cs, SPLIT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, QK_NORM: tl.constexpr, NQ: tl.constexpr,
                          NK: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
        """Program (t, h): head h of token t's qkv row as the product's split-K sum
        (`_int4_split_sum_kernel`'s arithmetic: partial sums in split order, the
        bias, one rounding), then as `_rope_kernel` leaves it: q and k heads
        (normed and) rotated, written into Y; k and v heads also into the pool's
        slot Loc[t]."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs = tl.arange(0, BLOCK_HALF)
        dmask = (offs < HALF)[None, :]
        col = h * HEAD_DIM + offs[None, :]
        # The step's inputs and the constants before the wait (`radixlm.layers.pdl`).
        pos = tl.load(Pos + t).to(tl.int64)
        cos = tl.load(CosSin + pos * stride_cs + offs[None, :], mask=dmask,
                      other=0.0).to(tl.float32)
        sin = tl.load(CosSin + pos * stride_cs + HALF + offs[None, :], mask=dmask,
                      other=0.0).to(tl.float32)
        row = tl.load(Loc + t).to(tl.int64) * (NK * HEAD_DIM)
        if HAS_BIAS:
            b1 = tl.load(Bias + col, mask=dmask, other=0.0).to(tl.float32)
            b2 = tl.load(Bias + HALF + col, mask=dmask, other=0.0).to(tl.float32)
        if QK_NORM:
            wq1, wq2 = _norm_weights(WQ, offs, offs < HALF, HALF)
            wk1, wk2 = _norm_weights(WK, offs, offs < HALF, HALF)
        pdl_wait(PDL)
        pdl_trigger(PDL)
        at = WS + t * stride_wt + col
        a1 = tl.load(at, mask=dmask, other=0.0)
        a2 = tl.load(at + HALF, mask=dmask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            a1 += tl.load(at + s * stride_ws, mask=dmask, other=0.0)
            a2 += tl.load(at + s * stride_ws + HALF, mask=dmask, other=0.0)
        if HAS_BIAS:
            a1 += b1
            a2 += b2
        dtype = Y.dtype.element_ty
        x1 = a1.to(dtype).to(tl.float32)
        x2 = a2.to(dtype).to(tl.float32)
        py = Y + t * stride_yt + col
        if h >= NQ + NK:  # a v head: stored as summed
            tl.store(py, x1.to(dtype), mask=dmask)
            tl.store(py + HALF, x2.to(dtype), mask=dmask)
            pv = VBuf + row + (h - NQ - NK) * HEAD_DIM + offs[None, :]
            tl.store(pv, x1.to(dtype), mask=dmask)
            tl.store(pv + HALF, x2.to(dtype), mask=dmask)
        else:
            if QK_NORM:
                if h < NQ:
                    x1, x2 = _norm_heads(x1, x2, wq1, wq2, eps, HEAD_DIM, dtype)
                else:
                    x1, x2 = _norm_heads(x1, x2, wk1, wk2, eps, HEAD_DIM, dtype)
            r1, r2 = _rotate(x1, x2, cos, sin, dtype)
            tl.store(py, r1, mask=dmask)
            tl.store(py + HALF, r2, mask=dmask)
            if h >= NQ:
                pk = KBuf + row + (h - NQ) * HEAD_DIM + offs[None, :]
                tl.store(pk, r1, mask=dmask)
                tl.store(pk + HALF, r2, mask=dmask)

    @triton.jit
    def _act_and_mul_kernel(X, Y, stride_x, stride_y, D, BLOCK: tl.constexpr,
                            GELU_TANH: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)
        pdl_trigger(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < D
        a = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(X + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
        if GELU_TANH:
            # tanh(u) = 1 - 2 / (exp(2u) + 1); the gelu rounded before the product.
            u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
            g = 0.5 * a * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
            y = g.to(Y.dtype.element_ty).to(tl.float32) * b
        else:
            y = a / (1.0 + tl.exp(-a)) * b
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_row(X, row, stride_x, cols, mask, D, dtype: tl.constexpr):
        """silu(gate) * up of a row's columns `cols`, rounded to `dtype`, in fp32."""
        a = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(X + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
        return (a / (1.0 + tl.exp(-a)) * b).to(dtype).to(tl.float32)

    @triton.jit
    def _silu_mul_fp8_kernel(X, Q, S, stride_x, stride_q, D, BLOCK: tl.constexpr,
                             STEPS: tl.constexpr, PDL: tl.constexpr):
        """Program per row: silu(gate) * up rounded to x's dtype, then quantized per
        row to FP8 (`Fp8Rows`): the row's scale, its codes."""
        pdl_wait(PDL)
        pdl_trigger(PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        if STEPS == 1:
            y = _silu_mul_row(X, row, stride_x, offs, offs < D, D, X.dtype.element_ty)
            _store_row(Q, S, row, stride_q, offs, offs < D, y, QUANT=True)
        else:
            amax = tl.zeros([BLOCK], dtype=tl.float32)
            for i in range(STEPS):
                cols = i * BLOCK + offs
                y = _silu_mul_row(X, row, stride_x, cols, cols < D, D, X.dtype.element_ty)
                amax = tl.maximum(amax, tl.abs(y))
            s = e4m3_scale(tl.max(amax, 0))
            tl.store(S + row, s)
            for i in range(STEPS):
                cols = i * BLOCK + offs
                y = _silu_mul_row(X, row, stride_x, cols, cols < D, D, X.dtype.element_ty)
                q = e4m3_codes(y, s)
                tl.store(Q + row * stride_q + cols, q.to(Q.dtype.element_ty), mask=cols < D)


# ---------------------------------------------------------------- public ops

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, pre_weight: torch.Tensor | None = None,
             use_triton: bool | None = None, fp8_out: bool = False) -> Any:
    """RMSNorm over the last dim; with `residual`, returns (normed, x + residual);
    `pre_weight` (needs `residual`): x is RMS-normalized with it first. `fp8_out`:
    normed is the output quantized per row to FP8, a (codes, scales [rows, 1])
    pair (`Fp8Rows`; the codes `quantize_activations` makes of the output)."""
    assert pre_weight is None or residual is not None
    if not _use_triton(x, use_triton):
        if pre_weight is not None:
            x = rms_norm_torch(x, pre_weight, eps)
        out = rms_norm_torch(x, weight, eps, residual)
        if not fp8_out:
            return out
        if residual is None:
            return quantize_rows_torch(out.reshape(-1, out.shape[-1]))
        return quantize_rows_torch(out[0].reshape(-1, out[0].shape[-1])), out[1]
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    y2 = torch.empty((rows, n), dtype=FP8 if fp8_out else x.dtype, device=x.device)
    scales = torch.empty((rows, 1), dtype=torch.float32, device=x.device) if fp8_out else None
    y = (y2, scales) if fp8_out else y2.view(x.shape)
    s_arg = scales if fp8_out else weight  # (unused without fp8_out)
    block = triton.next_power_of_2(n)
    # Enough warps that each thread holds <= 16 fp32 of the row.
    warps = max(1, min(16, block // 512))
    if residual is None:
        if rows:
            _rms_norm_kernel[(rows,)](x2, x2, weight, y2, y2, weight, s_arg, x2.stride(0), 0,
                                      y2.stride(0), 0, n, eps, HAS_RES=False, HAS_PRE=False,
                                      BLOCK=block, QUANT=fp8_out, num_warps=warps,
                                      **pdl.launch_args())
        return y
    r2 = residual.reshape(-1, n)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    ro2 = new_res.view(-1, n)
    if rows:
        _rms_norm_kernel[(rows,)](x2, r2, weight, y2, ro2,
                                  weight if pre_weight is None else pre_weight, s_arg,
                                  x2.stride(0), r2.stride(0), y2.stride(0), ro2.stride(0), n,
                                  eps, HAS_RES=True, HAS_PRE=pre_weight is not None,
                                  BLOCK=block, QUANT=fp8_out, num_warps=warps,
                                  **pdl.launch_args())
    return y, new_res


def apply_rope_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
                cos_sin_cache: torch.Tensor, *, use_triton: bool | None = None,
                kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
                = None, qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                sums: SplitSums | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE in place. q: [T, nq * head_dim], k: [T, nk * head_dim] (rows may be
    strided, e.g. views into a fused qkv output); returns (q, k).

    `kv_store` (v, k_buffer, v_buffer, loc): also write the rotated k and v rows
    into slots `loc` of the pool's [size, nk, head_dim] buffers, as
    `store_kv` does, in the same kernel (needs rotary over the whole head).
    `qk_norm` (wq, wk, eps): per-head RMSNorm of q and k first, in the same kernel
    (rotary over the whole head). `sums` (with `kv_store`): q, k and v are the
    views of `sums.out` [T, (nq + 2 nk) head_dim], not written yet: the kernel
    adds the product's split-K partial sums first (`layers/split_sums.py`), with
    the second launch's arithmetic, so the same bits as `sums.finish()` before."""
    if sums is not None:
        if kv_store is not None and _use_triton(q, use_triton):
            return _rope_sums(positions, q, k, head_dim, cos_sin_cache, kv_store, qk_norm, sums)
        sums.finish()
    if not _use_triton(q, use_triton):
        if qk_norm is not None:
            wq, wk, eps = qk_norm
            q.copy_(rms_norm_heads_torch(q, wq, eps, head_dim))
            k.copy_(rms_norm_heads_torch(k, wk, eps, head_dim))
        apply_rope_torch_(positions, q, k, head_dim, cos_sin_cache)
        if kv_store is not None:
            v, k_buf, v_buf, loc = kv_store
            k_buf[loc] = k.view(-1, *k_buf.shape[1:])
            v_buf[loc] = v.view(-1, *v_buf.shape[1:])
        return q, k
    t = q.shape[0]
    if t == 0:
        return q, k
    qv = q.view(t, -1, head_dim)
    kv = k.view(t, -1, head_dim)
    assert qv.stride(2) == 1 and kv.stride(2) == 1 and cos_sin_cache.stride(1) == 1
    rot = cos_sin_cache.shape[-1]
    assert rot % 2 == 0 and rot <= head_dim
    nq, nk = qv.shape[1], kv.shape[1]
    half = rot // 2
    store = kv_store is not None
    if store:
        v, k_buf, v_buf, loc = kv_store
        vv = v.view(t, nk, head_dim)
        assert rot == head_dim and vv.stride(1) == head_dim and vv.stride(2) == 1
        assert k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.dtype == k.dtype
        assert k_buf.shape[1:] == (nk, head_dim) and v_buf.dtype == v.dtype
    else:
        vv, k_buf, v_buf, loc = kv, kv, kv, positions  # unused pointers
    if qk_norm is not None:
        assert rot == head_dim, "a fused QK norm needs rotary over the whole head"
        wq, wk, eps = qk_norm
    else:
        wq, wk, eps = cos_sin_cache, cos_sin_cache, 0.0  # unused
    _rope_kernel[(t,)](
        qv, kv, cos_sin_cache, positions, qv.stride(0), qv.stride(1), kv.stride(0), kv.stride(1),
        cos_sin_cache.stride(0), vv, k_buf, v_buf, loc, vv.stride(0), wq, wk, eps,
        QK_NORM=qk_norm is not None, NQ=nq, NK=nk, BLOCK_HQ=triton.next_power_of_2(nq),
        BLOCK_HK=triton.next_power_of_2(nk), HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        STORE=store, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4,
        **pdl.launch_args(),
    )
    return q, k


def _rope_sums(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, head_dim: int,
               cos_sin_cache: torch.Tensor,
               kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
               qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
               sums: SplitSums) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_rope_` with `sums` and `kv_store` on Triton: one program a token and head."""
    ws, y = sums.partials, sums.out
    t, n = y.shape
    nq, nk = q.shape[1] // head_dim, k.shape[1] // head_dim
    _, k_buf, v_buf, loc = kv_store
    assert cos_sin_cache.shape[-1] == head_dim and cos_sin_cache.stride(1) == 1
    assert n == (nq + 2 * nk) * head_dim and y.is_contiguous() and ws.shape[1:] == (t, n)
    assert ws.stride(2) == 1 and q.data_ptr() == y.data_ptr()
    assert k_buf.is_contiguous() and v_buf.is_contiguous() and k_buf.dtype == y.dtype
    assert k_buf.shape[1:] == (nk, head_dim) and v_buf.dtype == y.dtype
    wq, wk, eps = qk_norm if qk_norm is not None else (cos_sin_cache, cos_sin_cache, 0.0)
    half = head_dim // 2
    _rope_sums_kernel[(t, nq + 2 * nk)](
        ws, sums.bias if sums.bias is not None else ws, y, cos_sin_cache, positions, k_buf,
        v_buf, loc, wq, wk, eps, ws.stride(0), ws.stride(1), y.stride(0),
        cos_sin_cache.stride(0), SPLIT=ws.shape[0], HAS_BIAS=sums.bias is not None,
        QK_NORM=qk_norm is not None, NQ=nq, NK=nk, HALF=half,
        BLOCK_HALF=triton.next_power_of_2(half), HEAD_DIM=head_dim, num_warps=1,
        **pdl.launch_args())
    return q, k


def silu_and_mul(x: torch.Tensor, *, use_triton: bool | None = None,
                 fp8_out: bool = False) -> Any:
    """[..., 2 * d] -> [..., d]: silu(gate) * up. `fp8_out`: quantized per row to
    FP8, a (codes [rows, d], scales [rows, 1]) pair (`Fp8Rows`)."""
    if not _use_triton(x, use_triton):
        y = silu_and_mul_torch(x)
        return quantize_rows_torch(y.reshape(-1, y.shape[-1])) if fp8_out else y
    if fp8_out:
        return _silu_and_mul_fp8(x)
    return _act_and_mul(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor, *, use_triton: bool | None = None) -> torch.Tensor:
    """[..., 2 * d] -> [..., d]: gelu_tanh(gate) * up."""
    if not _use_triton(x, use_triton):
        return gelu_tanh_and_mul_torch(x)
    return _act_and_mul(x, gelu_tanh=True)


def _silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    q = torch.empty((rows, d), dtype=FP8, device=x.device)
    s = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        # A row of up to 16384 features in registers (its scale and codes from one
        # read); longer rows read twice, 4096 features a step.
        block, steps = triton.next_power_of_2(d), 1
        if block > 16384:
            block, steps = 4096, triton.cdiv(d, 4096)
        _silu_mul_fp8_kernel[(rows,)](x2, q, s, x2.stride(0), q.stride(0), d, BLOCK=block,
                                      STEPS=steps, num_warps=max(4, min(16, block // 1024)),
                                      **pdl.launch_args())
    return q, s


def _act_and_mul(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    y2 = y.view(-1, d)
    rows = x2.shape[0]
    if rows:
        block = min(1024, triton.next_power_of_2(d))
        _act_and_mul_kernel[(rows, triton.cdiv(d, block))](
            x2, y2, x2.stride(0), y2.stride(0), d, BLOCK=block, GELU_TANH=gelu_tanh,
            num_warps=4, **pdl.launch_args())
    return y
