// The portable path: plain C++ over the layout of qgemm.h, one output at a
// time. It is the reference the SIMD paths must match bit for bit, and what
// runs on CPUs without AVX2 (or not x86-64).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "qgemm.h"

namespace radixlm_q {
namespace {

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do {
      mant <<= 1;
      ++e;
    } while ((mant & 0x400) == 0);
    bits = sign | uint32_t(112 - e) << 23 | ((mant & 0x3FF) << 13);
  }
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

float load_x(const void* x, bool bf16, int64_t i) {
  if (!bf16) return static_cast<const float*>(x)[i];
  uint32_t bits = uint32_t(static_cast<const uint16_t*>(x)[i]) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

void store(const Out& out, int64_t r, int64_t c, float v) {
  if (!out.bf16) {
    static_cast<float*>(out.data)[r * out.ld + c] = v;
    return;
  }
  uint32_t w;
  memcpy(&w, &v, 4);
  w = (w + 0x7FFF + ((w >> 16) & 1)) >> 16;  // round to nearest even, as vec.h does
  static_cast<uint16_t*>(out.data)[r * out.ld + c] = uint16_t(w);
}

void quantize(const void* x, bool x_bf16, int64_t ldx, int64_t m0, int64_t m1, int64_t k,
              int8_t* q, float* d, int32_t* sum16, float* dsum) {
  const int64_t blocks = k / kActBlock;
  for (int64_t r = m0; r < m1; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k0 = b * kActBlock;
      float amax = 0.f;
      for (int i = 0; i < kActBlock; ++i) amax = fmaxf(amax, fabsf(load_x(x, x_bf16, r * ldx + k0 + i)));
      const float scale = amax / 127.f;
      const float inv = scale != 0.f ? 1.f / scale : 0.f;
      int32_t half[2] = {0, 0};
      for (int i = 0; i < kActBlock; ++i) {
        // rintf rounds half to even, as cvtps2dq does.
        const int32_t v = int32_t(rintf(load_x(x, x_bf16, r * ldx + k0 + i) * inv));
        q[r * k + k0 + i] = int8_t(v);
        half[i / 16] += v;
      }
      d[r * blocks + b] = scale;
      sum16[r * 2 * blocks + 2 * b] = half[0];
      sum16[r * 2 * blocks + 2 * b + 1] = half[1];
      dsum[r * blocks + b] = scale * float(half[0] + half[1]);
    }
  }
}

// Code of row c, k = kk of block b of tile t.
template <int F>
int code(const PackedWeight& w, int64_t t, int64_t b, int c, int kk) {
  const uint8_t* block = w.q + (t * w.blocks + b) * kBlockBytes<F>;
  const int g = kk / 4, byte = 4 * c + kk % 4;
  if (Traits<F>::kBits == 8) return block[64 * g + byte];
  int v = (block[64 * (g / 2) + byte] >> (4 * (g % 2))) & 0xF;
  const uint8_t* planes = block + 8 * Traits<F>::kBlock;  // after kBlock/8 registers of 64 bytes
  for (int p = 0; p < kPlanes<F>; ++p) {
    const uint8_t bits = planes[(g * kPlanes<F> + p) * 8 + byte / 8];
    v |= ((bits >> (byte % 8)) & 1) << (4 + p);
  }
  return v;
}

template <int F>
float scale_at(const PackedWeight& w, const void* s, int64_t i) {
  if (Traits<F>::kF32) return static_cast<const float*>(s)[i];
  return half_to_float(static_cast<const uint16_t*>(s)[i]);
}

template <int F>
float dot_row(const PackedWeight& w, const QuantAct& a, int64_t r, int64_t t, int c) {
  using T = Traits<F>;
  const int64_t act_blocks = a.k / kActBlock;
  float acc = 0.f;
  for (int64_t b = 0; b < w.blocks; ++b) {
    const int64_t k0 = b * T::kBlock, ab = k0 / kActBlock;
    int32_t dot = 0;
    for (int kk = 0; kk < T::kBlock; ++kk) dot += code<F>(w, t, b, c, kk) * a.q[r * a.k + k0 + kk];
    const int32_t* s16 = a.sum16 + r * 2 * act_blocks;
    if (T::kOffset) {
      const int32_t sx = T::kBlock == 16 ? s16[k0 / 16] : s16[2 * ab] + s16[2 * ab + 1];
      dot -= T::kOffset * sx;
    }
    const float dx = a.d[r * act_blocks + ab];
    if (T::kPerChannel) {
      acc = fmaf(float(dot), dx, acc);
      continue;
    }
    const int64_t si = (t * w.blocks + b) * kTile + c;
    acc = fmaf(float(dot), scale_at<F>(w, w.scales, si) * dx, acc);
    if (T::kAsym) acc = fmaf(scale_at<F>(w, w.mins, si), a.dsum[r * act_blocks + ab], acc);
  }
  if (T::kPerChannel) acc *= static_cast<const float*>(w.scales)[t * kTile + c];
  return acc;
}

template <int F>
void gemm_format(const PackedWeight& w, const QuantAct& a, int64_t m0, int64_t m1, int64_t t0,
                 int64_t t1, const Out& out) {
  for (int64_t r = m0; r < m1; ++r)
    for (int64_t t = t0; t < t1; ++t)
      for (int c = 0; c < kTile && t * kTile + c < w.n; ++c)
        store(out, r, t * kTile + c, dot_row<F>(w, a, r, t, c));
}

template <int F>
void dequantize_format(const PackedWeight& w, const int64_t* rows, int64_t i0, int64_t i1,
                       const Out& out) {
  using T = Traits<F>;
  for (int64_t i = i0; i < i1; ++i) {
    const int64_t t = rows[i] / kTile;
    const int c = int(rows[i] % kTile);
    const float channel = T::kPerChannel ? static_cast<const float*>(w.scales)[rows[i]] : 0.f;
    for (int64_t b = 0; b < w.blocks; ++b) {
      const int64_t si = (t * w.blocks + b) * kTile + c;
      const float s = T::kPerChannel ? channel : scale_at<F>(w, w.scales, si);
      for (int kk = 0; kk < T::kBlock; ++kk) {
        const int q = code<F>(w, t, b, c, kk);
        // The same operations as gguf's dequantization, so the values agree bit for bit.
        const float v = T::kAsym ? s * float(q) + scale_at<F>(w, w.mins, si)
                                 : s * float(q - T::kOffset);
        store(out, i, b * T::kBlock + kk, v);
      }
    }
  }
}

void gemm(const PackedWeight& w, const QuantAct& a, int64_t m0, int64_t m1, int64_t t0,
          int64_t t1, const Out& out) {
  switch (w.format) {
    case kQ4_0: return gemm_format<kQ4_0>(w, a, m0, m1, t0, t1, out);
    case kQ4_1: return gemm_format<kQ4_1>(w, a, m0, m1, t0, t1, out);
    case kQ8_0: return gemm_format<kQ8_0>(w, a, m0, m1, t0, t1, out);
    case kQ4_K: return gemm_format<kQ4_K>(w, a, m0, m1, t0, t1, out);
    case kQ5_K: return gemm_format<kQ5_K>(w, a, m0, m1, t0, t1, out);
    case kQ6_K: return gemm_format<kQ6_K>(w, a, m0, m1, t0, t1, out);
    case kI8: return gemm_format<kI8>(w, a, m0, m1, t0, t1, out);
  }
}

void dequantize(const PackedWeight& w, const int64_t* rows, int64_t i0, int64_t i1,
                const Out& out) {
  switch (w.format) {
    case kQ4_0: return dequantize_format<kQ4_0>(w, rows, i0, i1, out);
    case kQ4_1: return dequantize_format<kQ4_1>(w, rows, i0, i1, out);
    case kQ8_0: return dequantize_format<kQ8_0>(w, rows, i0, i1, out);
    case kQ4_K: return dequantize_format<kQ4_K>(w, rows, i0, i1, out);
    case kQ5_K: return dequantize_format<kQ5_K>(w, rows, i0, i1, out);
    case kQ6_K: return dequantize_format<kQ6_K>(w, rows, i0, i1, out);
    case kI8: return dequantize_format<kI8>(w, rows, i0, i1, out);
  }
}

const Kernels kPortable = {"portable", quantize, gemm, dequantize};

}  // namespace

const Kernels* kernels_portable() { return &kPortable; }

}  // namespace radixlm_q
