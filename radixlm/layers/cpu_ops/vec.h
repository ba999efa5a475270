// SIMD helpers shared by the CPU kernels: GCC/Clang vector extensions of 16
// floats (one AVX-512 register with -march=native, two AVX2 ones elsewhere),
// loads that widen bf16/fp16 to fp32 and stores that round back.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace radixlm_cpu {

// Written out rather than left to the auto-vectorizer, which scalarized the
// attention loops (a reduction's serial adds, accumulators spilled to memory).
constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vfloat4 __attribute__((vector_size(4 * sizeof(float))));
typedef uint16_t vhalf16 __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vfloat load_vec(const float* p) {
  vfloat v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}
inline vfloat load_vec(const c10::BFloat16* p) {
  // bf16 is the high half of an fp32: widen and shift.
  vhalf16 h;
  __builtin_memcpy(&h, p, sizeof(h));
  vuint w = __builtin_convertvector(h, vuint) << 16;
  vfloat v;
  __builtin_memcpy(&v, &w, sizeof(v));
  return v;
}
inline vfloat load_vec(const c10::Half* p) {
  vfloat v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
inline void store_vec(float* p, vfloat v) { __builtin_memcpy(p, &v, sizeof(v)); }
// x in every lane (a broadcast; `vfloat{} + x` would cost an add).
inline vfloat splat(float x) {
  static_assert(kLanes == 16, "one initializer per lane");
  return vfloat{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
inline void store_vec(c10::BFloat16* p, vfloat v) {
  // Round to nearest even, as torch's float -> bf16 conversion does (NaN aside).
  vuint w;
  __builtin_memcpy(&w, &v, sizeof(w));
  w = (w + 0x7FFF + ((w >> 16) & 1)) >> 16;
  vhalf16 h = __builtin_convertvector(w, vhalf16);
  __builtin_memcpy(p, &h, sizeof(h));
}
inline void store_vec(c10::Half* p, vfloat v) {
  for (int i = 0; i < kLanes; ++i) p[i] = c10::Half(v[i]);
}
// v rounded to T's precision and back, for results torch rounds between ops.
inline vfloat round_to(vfloat v, float*) { return v; }
template <typename T>
inline vfloat round_to(vfloat v, T*) {
  T tmp[kLanes];
  store_vec(tmp, v);
  return load_vec(tmp);
}

inline float hsum(vfloat v) {
  vfloat8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vfloat4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp over a vector: 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2,
// e^r by its degree-6 Taylor polynomial (relative error < 2e-7, below fp32's
// rounding of the sum). Inputs are clamped to [-87, 88] so that 2^n stays a
// normal float: below, e.g. a padded score or -inf, give ~1e-38; above, ~1.7e38
// (+inf included); NaN stays NaN. Always inlined: GCC left it a call in the
// attention tiles (a tenth of the prefill kernel's time); the same operations
// either way, since the library builds with -ffp-contract=off.
__attribute__((always_inline)) inline vfloat exp_vec(vfloat x) {
  const vfloat lo = vfloat{} - 87.f, hi = vfloat{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const float shifter = 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  vfloat n = (x * 1.44269504f + shifter) - shifter;
  vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;  // ln 2 split in two parts
  vfloat p = r * (1.f / 720) + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  vint bits = (__builtin_convertvector(n, vint) + 127) << 23;  // 2^n as a float's bits
  vfloat scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace radixlm_cpu
