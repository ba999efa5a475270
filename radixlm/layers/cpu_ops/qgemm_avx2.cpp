// The AVX2 path (Haswell and later, Zen 1-3): a tile's 16 rows as two halves
// of 8, each half reading bytes [32h, 32h + 32) of the tile's 64-byte group
// registers; u8 x s8 dots by vpmaddubsw + vpmaddwd. Same results as the
// portable path, bit for bit (see qgemm.h).
#include <stdint.h>

#include "qgemm.h"

#if defined(__x86_64__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

namespace radixlm_q {
namespace {

inline __m256 load8(const void* x, bool bf16, int64_t i) {
  if (!bf16) return _mm256_loadu_ps(static_cast<const float*>(x) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
      static_cast<const uint16_t*>(x) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

void quantize(const void* x, bool x_bf16, int64_t ldx, int64_t m0, int64_t m1, int64_t k,
              int8_t* q, float* d, int32_t* sum16, float* dsum) {
  const int64_t blocks = k / kActBlock;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t r = m0; r < m1; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t i = r * ldx + b * kActBlock;
      __m256 v[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = load8(x, x_bf16, i + 8 * j);
        amax = _mm256_max_ps(amax, _mm256_and_ps(v[j], abs_mask));
      }
      const float scale = hmax(amax) / 127.f;
      const __m256 inv = _mm256_set1_ps(scale != 0.f ? 1.f / scale : 0.f);
      __m256i qi[4];
      for (int j = 0; j < 4; ++j) qi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
      const int32_t s0 = hsum(_mm256_add_epi32(qi[0], qi[1]));
      const int32_t s1 = hsum(_mm256_add_epi32(qi[2], qi[3]));
      // The packs work within 128-bit lanes; the permute restores the order.
      const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
      const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b),
                                                     _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + r * k + b * kActBlock), p8);
      d[r * blocks + b] = scale;
      sum16[r * 2 * blocks + 2 * b] = s0;
      sum16[r * 2 * blocks + 2 * b + 1] = s1;
      dsum[r * blocks + b] = scale * float(s0 + s1);
    }
  }
}

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc += per-lane sums of 4 products, codes (u8, at most 63: no saturation) times x.
inline __m256i dot_small(__m256i acc, __m256i codes, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(codes, x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// 8-bit codes q + 128: |q| times x carrying q's sign, the offset included.
inline __m256i dot8(__m256i acc, __m256i codes, __m256i x) {
  const __m256i w = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80)));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// 32 bits -> 32 bytes of `value` where the bit is set, 0 elsewhere.
inline __m256i expand_bits(uint32_t bits, char value) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                       3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(value));
}

template <int P>
inline __m256i add_planes(__m256i v, const uint8_t* planes, int half) {
  for (int p = 0; p < P; ++p) {
    uint32_t bits;
    __builtin_memcpy(&bits, planes + 8 * p + 4 * half, 4);
    v = _mm256_or_si256(v, expand_bits(bits, static_cast<char>(16 << p)));
  }
  return v;
}

template <int F>
inline __m256 load_scales(const void* s, int64_t i) {
  if constexpr (Traits<F>::kF32) return _mm256_loadu_ps(static_cast<const float*>(s) + i);
  return _mm256_cvtph_ps(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(s) + i)));
}

inline void store8(const Out& out, int64_t r, int64_t c, __m256 v, int64_t valid) {
  alignas(32) float tmp[8];
  if (valid >= 8 && !out.bf16) {
    _mm256_storeu_ps(static_cast<float*>(out.data) + r * out.ld + c, v);
    return;
  }
  _mm256_store_ps(tmp, v);
  for (int64_t i = 0; i < valid && i < 8; ++i) {
    if (!out.bf16) {
      static_cast<float*>(out.data)[r * out.ld + c + i] = tmp[i];
      continue;
    }
    uint32_t u;
    __builtin_memcpy(&u, &tmp[i], 4);
    static_cast<uint16_t*>(out.data)[r * out.ld + c + i] =
        static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  }
}

// Rows [r0, r0 + MR) times rows [8 h, 8 h + 8) of tile t.
template <int F, int MR>
void half_tile_rows(const PackedWeight& w, const QuantAct& a, int64_t t, int half, int64_t r0,
                    const Out& out) {
  using T = Traits<F>;
  constexpr int kGroups = T::kBlock / 4, kP = kPlanes<F>;
  constexpr int kOffset = T::kOffset - (T::kBits == 8 ? 128 : 0);
  const int64_t act_blocks = a.k / kActBlock;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const int8_t* x[MR];
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) {
    x[r] = a.q + (r0 + r) * a.k;
    acc[r] = _mm256_setzero_ps();
  }
  const uint8_t* block = w.q + t * w.blocks * kBlockBytes<F> + 32 * half;
  for (int64_t b = 0; b < w.blocks; ++b, block += kBlockBytes<F>) {
    const int64_t k0 = b * T::kBlock, ab = k0 / kActBlock;
    __m256i dot[MR];
    for (int r = 0; r < MR; ++r) dot[r] = _mm256_setzero_si256();
    if constexpr (T::kBits == 8) {
      for (int g = 0; g < kGroups; ++g) {
        const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * g));
        for (int r = 0; r < MR; ++r) dot[r] = dot8(dot[r], codes, bcast4(x[r] + k0 + 4 * g));
      }
    } else {
      const uint8_t* planes = block - 32 * half + 8 * T::kBlock;
      for (int p = 0; p < kGroups / 2; ++p) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * p));
        __m256i lo = _mm256_and_si256(packed, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
        if constexpr (kP > 0) {
          lo = add_planes<kP>(lo, planes + 2 * p * kP * 8, half);
          hi = add_planes<kP>(hi, planes + (2 * p + 1) * kP * 8, half);
        }
        for (int r = 0; r < MR; ++r) {
          dot[r] = dot_small(dot[r], lo, bcast4(x[r] + k0 + 8 * p));
          dot[r] = dot_small(dot[r], hi, bcast4(x[r] + k0 + 8 * p + 4));
        }
      }
    }
    const int64_t si = (t * w.blocks + b) * kTile + 8 * half;
    __m256 s = _mm256_setzero_ps(), mn = _mm256_setzero_ps();
    if constexpr (!T::kPerChannel) s = load_scales<F>(w.scales, si);
    if constexpr (T::kAsym) mn = load_scales<F>(w.mins, si);
    for (int r = 0; r < MR; ++r) {
      const int64_t row = r0 + r;
      __m256i di = dot[r];
      if constexpr (kOffset != 0) {
        const int32_t* s16 = a.sum16 + row * 2 * act_blocks;
        const int32_t sx = T::kBlock == 16 ? s16[k0 / 16] : s16[2 * ab] + s16[2 * ab + 1];
        di = _mm256_sub_epi32(di, _mm256_set1_epi32(kOffset * sx));
      }
      const __m256 dx = _mm256_set1_ps(a.d[row * act_blocks + ab]);
      if constexpr (T::kPerChannel) {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(di), dx, acc[r]);
      } else {
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(di), _mm256_mul_ps(s, dx), acc[r]);
        if constexpr (T::kAsym)
          acc[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(a.dsum[row * act_blocks + ab]), acc[r]);
      }
    }
  }
  const int64_t c = t * kTile + 8 * half;
  for (int r = 0; r < MR; ++r) {
    if constexpr (T::kPerChannel)
      acc[r] = _mm256_mul_ps(acc[r], _mm256_loadu_ps(static_cast<const float*>(w.scales) + c));
    store8(out, r0 + r, c, acc[r], w.n - c);
  }
}

template <int F, int MR>
void tile_rows(const PackedWeight& w, const QuantAct& a, int64_t t, int64_t r0, const Out& out) {
  half_tile_rows<F, MR>(w, a, t, 0, r0, out);
  if (t * kTile + 8 < w.n) half_tile_rows<F, MR>(w, a, t, 1, r0, out);
}

constexpr int64_t kTileGroup = 4;

template <int F>
void gemm_format(const PackedWeight& w, const QuantAct& a, int64_t m0, int64_t m1, int64_t t0,
                 int64_t t1, const Out& out) {
  for (int64_t tg = t0; tg < t1; tg += kTileGroup) {
    const int64_t tend = tg + kTileGroup < t1 ? tg + kTileGroup : t1;
    int64_t r = m0;
    for (; r + 4 <= m1; r += 4)
      for (int64_t t = tg; t < tend; ++t) tile_rows<F, 4>(w, a, t, r, out);
    for (int64_t t = tg; t < tend; ++t) {
      switch (m1 - r) {
        case 3: tile_rows<F, 3>(w, a, t, r, out); break;
        case 2: tile_rows<F, 2>(w, a, t, r, out); break;
        case 1: tile_rows<F, 1>(w, a, t, r, out); break;
        default: break;
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

const Kernels kTable = {"avx2", quantize, gemm, nullptr};

}  // namespace

const Kernels* kernels_avx2() { return &kTable; }

}  // namespace radixlm_q
#else
namespace radixlm_q {
const Kernels* kernels_avx2() { return nullptr; }
}  // namespace radixlm_q
#endif
