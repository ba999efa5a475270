"""float64 references for the attention kernel tests (Triton, FP8 KV, windows)."""

from __future__ import annotations

import torch

# ||out - ref|| / ||ref|| bounds: bf16 has 8 mantissa bits (P and the output are
# rounded to it), fp16 11, fp32 runs true fp32 products ("ieee").
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-4}


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                  scale: float, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """float64 causal GQA attention: q [m, H, D] at positions q_pos [m], k/v [n, KVH, D]
    at 0..n-1; with HF's conventions for a sliding window (the query at p sees keys
    p - W + 1 .. p) and a softcap c (scores c * tanh(s / c))."""
    h, kvh = q.shape[1], k.shape[1]
    kd = k.double().repeat_interleave(h // kvh, 1)
    vd = v.double().repeat_interleave(h // kvh, 1)
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    keys = torch.arange(k.shape[0], device=q.device)
    for s in range(0, q.shape[0], 256):  # row chunks bound the [H, m, n] score memory
        pos = q_pos[s:s + 256, None]
        sc = torch.einsum("mhd,nhd->hmn", q[s:s + 256].double(), kd) * scale
        if softcap is not None:
            sc = softcap * torch.tanh(sc / softcap)
        hide = keys[None, :] > pos
        if window is not None:
            hide |= keys[None, :] <= pos - window
        out[s:s + 256] = torch.einsum("hmn,nhd->mhd",
                                      sc.masked_fill(hide[None], float("-inf")).softmax(-1), vd)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
