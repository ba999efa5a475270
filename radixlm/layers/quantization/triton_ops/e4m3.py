"""Rounding to FP8 e4m3 inside Triton kernels, the same on every backend.

The activation quantizers (`fp8.quantize_activations`' kernels, the W8A8 GEMV's
loop) round to e4m3 with this arithmetic rather than the cast alone where the
result must match torch's round-to-nearest-even bit for bit under Triton's
interpreter, whose own cast mis-rounds at binade edges.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX = 448.0  # the largest e4m3 value (torch.finfo(torch.float8_e4m3fn).max)


@triton.jit
def round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, still in
    fp32, so that the cast to FP8 is exact on every backend (the Triton interpreter's
    own cast mis-rounds at binade edges). Normal range: round fp32's mantissa to 3
    bits (a carry moves into the exponent); below 2^-6 the fixed step 2^-9."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (v + 24576.0) - 24576.0  # fp32's step in [2^14, 2^15) is 2^-9
    return tl.where(tl.abs(v) < 0.015625, subnormal, normal)


@triton.jit
def e4m3_scale(amax):
    """The scale that maps values of largest magnitude amax (fp32) onto e4m3's
    range: amax / 448 correctly rounded, 1e-12 / 448 for an all-zero row. Every
    quantizer whose codes must match `fp8.quantize_rows` bit for bit uses it."""
    return tl.div_rn(tl.maximum(amax, 1e-12), 448.0)


@triton.jit
def e4m3_codes(v, s):
    """v / s (fp32, correctly rounded) clamped to +-448 and rounded to e4m3, still
    in fp32: the codes that go with `e4m3_scale`'s s."""
    return round_e4m3(tl.clamp(tl.div_rn(v, s), -448.0, 448.0))
