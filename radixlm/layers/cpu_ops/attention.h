// The arithmetic every CPU attention kernel shares, so that a query row's
// result does not depend on how its context was divided.
//
// A query at position p attends to the keys at positions lo..p (lo = 0, or
// p - W + 1 with a sliding window W). Whatever kernel computes it (decode:
// one row per request; extend: the new rows of a prompt after any cached
// prefix, in any chunking), the row goes through the same operations in the
// same order:
//   - the context is cut into splits of kSplit positions and blocks of kBlock
//     positions, both aligned to absolute positions (block b covers
//     [32 b, 32 b + 32)), never to where a chunk or a cached prefix begins;
//   - within a split, an online softmax walks the blocks in order from fresh
//     state (`split_bf16` / `split_f32`); keys a row does not see (outside
//     lo..p, or padding) get probability exactly 0, so a block holding keys
//     after the row (an extend's later rows) changes nothing, and a block
//     wholly outside the row's range is skipped or is an exact no-op;
//   - the splits' partial results are folded in position order (`fold`) and
//     normalized once (`finish`).
// Decode runs the splits of a request in parallel and folds them afterwards;
// extend runs them one after another; the bits are the same. The library is
// built with -ffp-contract=off and every fused multiply-add is explicit, so
// the compiler cannot contract one inlined copy and not another.
//
// Two flavours of arithmetic, chosen by the pool's dtype and the CPU, never
// by the batch:
//   - bf16 pools on CPUs with AVX512-BF16: both products on `vdpbf16ps` (pairs
//     of bf16 multiplied exactly and summed into fp32 lanes), the
//     probabilities rounded to bf16 for the second product (as FlashAttention
//     does on GPUs). Keys are packed as [dim / 2][keys] pairs (a 32-bit
//     transpose), values as [keys / 2][dim] pairs of rows.
//   - everything else (fp32, fp16, bf16 elsewhere): values widened to fp32,
//     products as fp32 multiply-adds; keys packed as [dim][keys], values as
//     plain rows.
// Head dims are processed in 16-lane registers; a head dim between the
// instantiated widths runs zero-padded to the next one (zero query and key
// lanes add exact zeros to a score).

#pragma once

#include "vec.h"

#include <ATen/ATen.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace radixlm_cpu::attn {

constexpr int kBlock = 32;       // keys per online-softmax step (two 16-lane registers)
constexpr int64_t kSplit = 256;  // positions per split: decode's unit of parallel work
static_assert(kSplit % kBlock == 0, "splits are whole blocks");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// One thread's buffers `S`, kept from call to call by both kernels: fresh ones
// page-faulted ~1 MB a layer, which cost more than the attention (OLMoE's 16
// heads of 128 at 160 tokens, bf16, in the engine's decode: 614 us a call,
// 192 us with the buffers kept).
template <typename S>
S& thread_scratch() {
  thread_local S w;
  return w;
}

// The first position a query at `pos` sees.
inline int64_t first_visible(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// a * b + c, rounded once where the CPU fuses it; the same everywhere in one build.
inline vfloat fma_vec(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return a * b + c;  // -ffp-contract=off: a multiply and an add
#endif
}

inline float hmax(vfloat v) {
  vfloat8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  vfloat8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  a = a > b ? a : b;
  vfloat4 c = __builtin_shufflevector(a, a, 0, 1, 2, 3), d = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  c = c > d ? c : d;
  return std::max(std::max(c[0], c[2]), std::max(c[1], c[3]));
}

// c * tanh(x / c), with tanh(y) = 1 - 2 / (exp(2y) + 1).
inline vfloat softcap_vec(vfloat x, float cap) {
  const vfloat e = exp_vec(x * (2.f / cap));
  return (1.f - 2.f / (e + 1.f)) * cap;
}

// Lanes j of a block (key at j0 + j, j0 + 16 + j for the high half) that a query
// with visible range [lo, pos] sees, as all-ones int lanes.
inline vint visible_lanes(int64_t j0, int half, int64_t lo, int64_t pos) {
  const vint lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const int64_t base = j0 + 16 * half;
  const int hi = static_cast<int>(std::clamp<int64_t>(pos - base, -1, 16));
  const int low = static_cast<int>(std::clamp<int64_t>(lo - base, -1, 16));
  return (lane <= hi) & (lane >= low);
}

// ---- one split of up to R query rows ----------------------------------------
//
// Rows r < rows: a query row (see the flavours for its layout) at position pos[r]
// seeing keys from lo[r]; all rows share the packed keys/values, which cover
// positions [base, base + n) (n a multiple of kBlock, base a multiple of
// kBlock). The split covers positions [sb, sb + kSplit). Writes each row's
// partial result: m (max score; -inf when the row sees nothing here), l (sum of
// exp(score - m)) and o[D] (sum of exp(score - m) * value, unnormalized).
struct SplitOut {
  float* m;
  float* l;
  float* o;        // fp32, D per row
  int64_t stride;  // row r's results at m[r * stride], l[r * stride], o + r * stride * D
};

// Every flavour's block loop bounds: from the block of the lowest visible
// position to the last position of any row, within the split.
inline void block_range(const int64_t* pos, const int64_t* lo, int rows, int64_t sb,
                        int64_t& first, int64_t& last) {
  int64_t lo_min = lo[0], p_max = pos[0];
  for (int r = 1; r < rows; ++r) {
    lo_min = std::min(lo_min, lo[r]);
    p_max = std::max(p_max, pos[r]);
  }
  first = std::max(sb, lo_min / kBlock * kBlock);
  last = std::min(sb + kSplit - 1, p_max);
}

// Scores of one block half after scale, softcap and the row's mask (-inf where
// not visible); `vis` gets the mask. FULL: every key of the block is visible to
// every row of the tile, so the mask (all ones) is not applied: the same values.
template <bool FULL>
__attribute__((always_inline)) inline vfloat masked_scores(vfloat s, float scale, float softcap, int64_t j0, int half,
                            int64_t lo, int64_t pos, vint& vis) {
  s = s * scale;
  if (softcap > 0.f) s = softcap_vec(s, softcap);
  if constexpr (FULL) return s;
  vis = visible_lanes(j0, half, lo, pos);
  const vfloat ninf = vfloat{} + kNegInf;
  return vis ? s : ninf;
}

// Online-softmax step of one row over one block: updates m, l (16 lanes) and
// returns alpha (what o is rescaled by) and the probabilities pa/pb (exactly 0
// where not visible); false when the row sees nothing yet (state untouched).
template <bool FULL>
__attribute__((always_inline)) inline bool softmax_step(vfloat a, vfloat b, vint va, vint vb, float& m, vfloat& l,
                         float& alpha, vfloat& pa, vfloat& pb) {
  const float mx = std::max(m, hmax(a > b ? a : b));
  if (mx == kNegInf) return false;
  alpha = std::exp(m - mx);  // exp(-inf) = 0 on the row's first block
  m = mx;
  pa = exp_vec(a - mx);
  pb = exp_vec(b - mx);
  if constexpr (!FULL) {
    const vfloat zero = vfloat{};
    pa = va ? pa : zero;
    pb = vb ? pb : zero;
  }
  l = l * alpha + (pa + pb);
  return true;
}

// Whether every row r < rows sees the whole block at j0.
inline bool block_full(const int64_t* pos, const int64_t* lo, int rows, int64_t j0) {
  for (int r = 0; r < rows; ++r)
    if (lo[r] > j0 || pos[r] < j0 + kBlock - 1) return false;
  return true;
}

// The split loops below keep their accumulators in registers: the scores of a
// block and the outputs are register arrays indexed only by unrolled constants
// inside the product loops, and cross into memory (`sc`, `ob`) once per block
// for the per-row softmax step, whose loop indexes rows at run time. (When the
// step indexed the register arrays directly, GCC kept them in memory and stored
// every accumulator on every iteration of both product loops, which made them
// store-bound.) The operations and their order are those of one row alone.

// The per-row softmax step of a block over the scores in sc[r] (2 x 16 lanes):
// probabilities to prob (F: the element type, see below, via `emit`), alpha[r]
// the rescale of row r's output, scaled[r] whether it applies (false: the row
// sees nothing yet, its state untouched).
template <int R, typename Emit>
inline void rows_step(const float (*sc)[kBlock], const int64_t* pos, const int64_t* lo, int rows,
                      int64_t j0, float scale, float softcap, float* m, vfloat* l,
                      float* alpha, bool* scaled, Emit emit) {
  auto step = [&](auto full) {
    constexpr bool F = decltype(full)::value;
    for (int r = 0; r < R; ++r) {
      const int rr = std::min(r, rows - 1);
      vint va, vb;
      const vfloat a = masked_scores<F>(load_vec(sc[r]), scale, softcap, j0, 0, lo[rr], pos[rr], va);
      const vfloat b =
          masked_scores<F>(load_vec(sc[r] + kLanes), scale, softcap, j0, 1, lo[rr], pos[rr], vb);
      vfloat pa, pb;
      scaled[r] = softmax_step<F>(a, b, va, vb, m[r], l[r], alpha[r], pa, pb);
      emit(r, scaled[r], pa, pb);
    }
  };
  if (block_full(pos, lo, rows, j0)) step(std::true_type{});
  else step(std::false_type{});
}

template <int DV, int R>
__attribute__((noinline)) void split_f32(const float* const* q, const int64_t* pos,
                                         const int64_t* lo, int rows, const float* kt,
                                         const float* vr, int64_t n, int64_t base, int64_t sb,
                                         float scale, float softcap, const SplitOut& out) {
  // q[r]: D floats. kt: [D][n] keys, vr: [n][D] values (fp32).
  constexpr int D = DV * kLanes;
  alignas(64) float ob[R][D];  // outputs between blocks
  alignas(64) float sc[R][kBlock];
  alignas(64) float p[R][kBlock];
  vfloat l[R];
  float m[R], alpha[R];
  bool scaled[R];
  const float* qr[R];
  for (int r = 0; r < R; ++r) {
    std::memset(ob[r], 0, sizeof(ob[r]));
    l[r] = vfloat{};
    m[r] = kNegInf;
    qr[r] = q[std::min(r, rows - 1)];  // rows past `rows` repeat the last: results dropped
  }
  int64_t first, last;
  block_range(pos, lo, rows, sb, first, last);
  for (int64_t j0 = first; j0 <= last; j0 += kBlock) {
    {
      const float* kb = kt + (j0 - base);
      vfloat s[R][2];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = vfloat{};
      for (int c = 0; c < D; ++c) {
        const vfloat k0 = load_vec(kb + c * n), k1 = load_vec(kb + c * n + kLanes);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const vfloat qc = splat(qr[r][c]);
          s[r][0] = fma_vec(qc, k0, s[r][0]);
          s[r][1] = fma_vec(qc, k1, s[r][1]);
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        store_vec(sc[r], s[r][0]);
        store_vec(sc[r] + kLanes, s[r][1]);
      }
    }
    rows_step<R>(sc, pos, lo, rows, j0, scale, softcap, m, l, alpha, scaled,
                 [&](int r, bool ok, vfloat pa, vfloat pb) {
                   if (!ok) {
                     std::memset(p[r], 0, sizeof(p[r]));
                     return;
                   }
                   store_vec(p[r], pa);
                   store_vec(p[r] + kLanes, pb);
                 });
    // Keys past every row's position have probability 0 for all: not read.
    const int count = static_cast<int>(std::min<int64_t>(kBlock, last + 1 - j0));
    const float* vb = vr + (j0 - base) * D;
    vfloat o[R][DV];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const vfloat al = splat(alpha[r]);
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) {
        o[r][c] = load_vec(ob[r] + c * kLanes);
        if (scaled[r]) o[r][c] = o[r][c] * al;
      }
    }
    for (int j = 0; j < count; ++j) {
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) {
        const vfloat v = load_vec(vb + j * D + c * kLanes);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) o[r][c] = fma_vec(splat(p[r][j]), v, o[r][c]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) store_vec(ob[r] + c * kLanes, o[r][c]);
  }
  for (int r = 0; r < rows; ++r) {
    out.m[r * out.stride] = m[r];
    out.l[r * out.stride] = hsum(l[r]);
    std::memcpy(out.o + r * out.stride * D, ob[r], sizeof(ob[r]));
  }
}

#if defined(__AVX512BF16__)
template <int DV, int R>
__attribute__((noinline)) void split_bf16(const uint32_t* const* q, const int64_t* pos,
                                          const int64_t* lo, int rows, const uint32_t* kt,
                                          const uint32_t* vr, int64_t n, int64_t base,
                                          int64_t sb, float scale, float softcap,
                                          const SplitOut& out) {
  // q[r]: D / 2 bf16 pairs. kt: [D / 2][n] key pairs, vr: [n / 2][D] pairs of value rows.
  constexpr int D = DV * kLanes, DP = D / 2;
  alignas(64) float ob[R][D];  // outputs between blocks
  alignas(64) float sc[R][kBlock];
  alignas(64) uint32_t pp[R][kBlock / 2];
  vfloat l[R];
  float m[R], alpha[R];
  bool scaled[R];
  const uint32_t* qr[R];
  for (int r = 0; r < R; ++r) {
    std::memset(ob[r], 0, sizeof(ob[r]));
    l[r] = vfloat{};
    m[r] = kNegInf;
    qr[r] = q[std::min(r, rows - 1)];
  }
  int64_t first, last;
  block_range(pos, lo, rows, sb, first, last);
  for (int64_t j0 = first; j0 <= last; j0 += kBlock) {
    {
      const uint32_t* kb = kt + (j0 - base);
      __m512 s[R][2];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
      for (int p = 0; p < DP; ++p) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * n);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + p * n + kLanes);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          const __m512bh qq = (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[r][p]));
          s[r][0] = _mm512_dpbf16_ps(s[r][0], qq, k0);
          s[r][1] = _mm512_dpbf16_ps(s[r][1], qq, k1);
        }
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        _mm512_store_ps(sc[r], s[r][0]);
        _mm512_store_ps(sc[r] + kLanes, s[r][1]);
      }
    }
    rows_step<R>(sc, pos, lo, rows, j0, scale, softcap, m, l, alpha, scaled,
                 [&](int r, bool ok, vfloat pa, vfloat pb) {
                   if (!ok) {
                     std::memset(pp[r], 0, sizeof(pp[r]));
                     return;
                   }
                   // P as bf16 pairs (keys 2i, 2i + 1) for the second product.
                   _mm512_store_si512(pp[r], (__m512i)_mm512_cvtne2ps_pbh((__m512)pb, (__m512)pa));
                 });
    const int pairs = static_cast<int>(std::min<int64_t>(kBlock, last + 1 - j0) + 1) / 2;
    const uint32_t* vb = vr + ((j0 - base) / 2) * D;
    __m512 o[R][DV];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 al = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) {
        o[r][c] = _mm512_load_ps(ob[r] + c * kLanes);
        if (scaled[r]) o[r][c] = _mm512_mul_ps(o[r][c], al);
      }
    }
    for (int i = 0; i < pairs; ++i) {
      __m512bh vv[DV];
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vb + i * D + c * kLanes);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r][i]));
#pragma GCC unroll 16
        for (int c = 0; c < DV; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pv, vv[c]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < DV; ++c) _mm512_store_ps(ob[r] + c * kLanes, o[r][c]);
  }
  for (int r = 0; r < rows; ++r) {
    out.m[r * out.stride] = m[r];
    out.l[r * out.stride] = hsum(l[r]);
    std::memcpy(out.o + r * out.stride * D, ob[r], sizeof(ob[r]));
  }
}
#endif

// ---- folding splits --------------------------------------------------------

// (M, L, O) <- itself merged with a split's (m, l, o); splits are folded in
// position order, starting from M = -inf.
inline void fold(float& M, float& L, float* O, float m, float l, const float* o, int d) {
  if (m == kNegInf) return;  // the row saw nothing in that split
  if (M == kNegInf) {
    M = m;
    L = l;
    std::memcpy(O, o, sizeof(float) * d);
    return;
  }
  const float mx = std::max(M, m), a = std::exp(M - mx), b = std::exp(m - mx);
  L = L * a + l * b;
  for (int c = 0; c < d; c += kLanes) store_vec(O + c, load_vec(O + c) * a + load_vec(o + c) * b);
  M = mx;
}

template <typename T>
inline void finish(const float* O, float L, T* out, int d) {
  const float inv = 1.f / L;
  for (int c = 0; c < d; c += kLanes) store_vec(out + c, load_vec(O + c) * inv);
}

// ---- packing keys and values ---------------------------------------------------

// The keys/values a kernel reads: the j-th of them (j from 0) at pool slot
// slots[j], KV head g at offset g * k_sh, `dim` elements (the last dim
// contiguous). The first `skip` are before every query's window: never read (a
// window pool may have freed their slots), packed as zeros.
template <typename T>
struct KvRows {
  const T* k;
  const T* v;
  int64_t k_sn, v_sn;    // between pool slots
  int64_t k_sh, v_sh;    // between KV heads
  const int64_t* slots;  // the positions' pool slots (from a req_to_token row)
  int64_t skip;
};

// A req_to_token table, int32 or int64.
struct SlotTable {
  const void* data;
  bool int32;
  int64_t row_stride;
  // slots[j] = table[row, first + j] for j < count, as int64.
  void copy(int64_t row, int64_t first, int64_t count, std::vector<int64_t>& slots) const {
    slots.resize(count);
    if (int32) {
      const int32_t* p = static_cast<const int32_t*>(data) + row * row_stride + first;
      for (int64_t j = 0; j < count; ++j) slots[j] = p[j];
    } else {
      const int64_t* p = static_cast<const int64_t*>(data) + row * row_stride + first;
      std::memcpy(slots.data(), p, sizeof(int64_t) * count);
    }
  }
};

// The head-dim widths (16-lane registers) the kernels are compiled for; other
// multiples of 16 run zero-padded to the next one.
inline int padded_lanes(int dim) {
  const int dv = dim / kLanes;
  if (dv == 3) return 4;
  if (dv == 7) return 8;
  return dv <= 8 ? dv : 16;
}

// f<DV>() for the compiled width `dv`.
template <typename F>
inline void with_width(int dv, F&& f) {
  switch (dv) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    default: break;
  }
}

// Query rows per register tile at width DV (outputs, sums and scores in 32 registers).
template <int DV>
constexpr int rows_per_tile() { return DV <= 4 ? 4 : (DV <= 8 ? 2 : 1); }

// 16 elements of a row from column c (fewer than 16 left: the rest zero), as
// fp32 lanes.
template <typename T>
inline vfloat load_widened(const T* row, int c, int dim) {
  if (c + kLanes <= dim) return load_vec(row + c);
  T tmp[kLanes] = {};
  for (int i = 0; c + i < dim; ++i) tmp[i] = row[c + i];
  return load_vec(tmp);
}

#if defined(__AVX512F__)
// Transpose 16 rows of 16 32-bit lanes in place.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // Rows now hold 4x4 transposed tiles in each 128-bit lane; gather the lanes.
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif

// F32 flavour: columns [c0, c1) (multiples of 16) of head g's keys into kt [Dp][n]
// and values into vr [n][Dp] (fp32, zero beyond `dim` and for positions not
// read: skipped or past `count`).
template <typename T>
void pack_f32(const KvRows<T>& kv, int g, int64_t count, int64_t c0, int64_t c1, int dim,
              int dp, int64_t n, float* kt, float* vr) {
  auto has = [&](int64_t j) { return j >= kv.skip && j < count; };
  for (int64_t j = c0; j < c1; ++j) {
    if (!has(j)) {
      std::memset(vr + j * dp, 0, sizeof(float) * dp);
      continue;
    }
    const T* value = kv.v + kv.slots[j] * kv.v_sn + g * kv.v_sh;
    for (int c = 0; c < dp; c += kLanes) store_vec(vr + j * dp + c, load_widened(value, c, dim));
  }
#if defined(__AVX512F__)
  for (int64_t j0 = c0; j0 < c1; j0 += kLanes) {
    for (int d0 = 0; d0 < dp; d0 += kLanes) {
      __m512i r[16];
      for (int t = 0; t < kLanes; ++t) {
        const int64_t j = j0 + t;
        r[t] = has(j) ? (__m512i)load_widened(kv.k + kv.slots[j] * kv.k_sn + g * kv.k_sh, d0, dim)
                      : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int i = 0; i < kLanes; ++i) _mm512_storeu_si512(kt + (d0 + i) * n + j0, r[i]);
    }
  }
#else
  for (int c = 0; c < dp; ++c)
    for (int64_t j = c0; j < c1; ++j)
      kt[c * n + j] = has(j) && c < dim
                          ? static_cast<float>((kv.k + kv.slots[j] * kv.k_sn + g * kv.k_sh)[c])
                          : 0.f;
#endif
}

#if defined(__AVX512BF16__)
// bf16 flavour: columns [c0, c1) (multiples of 32) of head g's keys into kt
// [Dp / 2][n] pairs and values into vr [n / 2][Dp] pairs of rows, zero beyond
// `dim` and for positions not read.
inline void pack_bf16(const KvRows<c10::BFloat16>& kv, int g, int64_t count, int64_t c0,
                      int64_t c1, int dim, int dp, int64_t n, uint32_t* kt, uint32_t* vr) {
  auto has = [&](int64_t j) { return j >= kv.skip && j < count; };
  const int pairs = dim / 2, dpp = dp / 2;
  for (int64_t j0 = c0; j0 < c1; j0 += kLanes) {
    for (int p0 = 0; p0 < dpp; p0 += kLanes) {
      const __mmask16 cols = p0 >= pairs ? 0 : static_cast<__mmask16>(
          pairs - p0 >= 16 ? 0xFFFF : (1u << (pairs - p0)) - 1);
      __m512i r[16];
      for (int t = 0; t < kLanes; ++t) {
        const int64_t j = j0 + t;
        r[t] = has(j) ? _mm512_maskz_loadu_epi32(
                            cols, reinterpret_cast<const uint32_t*>(
                                      kv.k + kv.slots[j] * kv.k_sn + g * kv.k_sh) + p0)
                      : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int i = 0; i < std::min(kLanes, dpp - p0); ++i)
        _mm512_storeu_si512(kt + (p0 + i) * n + j0, r[i]);
    }
  }
  // Value pairs: u32 c of pair i = v[2i][c] | v[2i + 1][c] << 16.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                              24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17,
                                              1, 16, 0);
  for (int64_t j = c0; j < c1; j += 2) {
    const uint16_t* a = has(j) ? reinterpret_cast<const uint16_t*>(
                                     kv.v + kv.slots[j] * kv.v_sn + g * kv.v_sh) : nullptr;
    const uint16_t* b = has(j + 1) ? reinterpret_cast<const uint16_t*>(
                                         kv.v + kv.slots[j + 1] * kv.v_sn + g * kv.v_sh) : nullptr;
    for (int d0 = 0; d0 < dp; d0 += kLanes) {
      const __mmask16 cols = d0 >= dim ? 0 : static_cast<__mmask16>(
          dim - d0 >= 16 ? 0xFFFF : (1u << (dim - d0)) - 1);
      const __m256i va = a ? _mm256_maskz_loadu_epi16(cols, a + d0) : _mm256_setzero_si256();
      const __m256i vb = b ? _mm256_maskz_loadu_epi16(cols, b + d0) : _mm256_setzero_si256();
      const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(va), vb, 1);
      _mm512_storeu_si512(vr + (j / 2) * dp + d0, _mm512_permutexvar_epi16(interleave, ab));
    }
  }
}
#endif

// Head g's columns [c0, c1) (multiples of kBlock) in the flavour of P: uint32_t
// for bf16 pairs, float otherwise.
template <typename T, typename P>
inline void pack_range(const KvRows<T>& kv, int g, int64_t count, int64_t c0, int64_t c1,
                       int dim, int dp, int64_t n, P* kt, P* vr) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<P, uint32_t>) {
    pack_bf16(kv, g, count, c0, c1, dim, dp, n, kt, vr);
    return;
  }
#endif
  if constexpr (std::is_same_v<P, float>) pack_f32(kv, g, count, c0, c1, dim, dp, n, kt, vr);
}

// The argument checks both attention entry points make, worded with the op's
// name (`op`) and what a q/out row is (`rows`, e.g. "[bs, heads, dim]").
inline void check_layout(const char* op, const char* rows, const at::Tensor& q,
                         const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& out,
                         const at::Tensor& req_to_token) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3,
              op, ": q/out ", rows, ", k/v [pool, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && q.scalar_type() == v_buf.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              op, ": q, k, v and out must share one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k_buf.stride(2) == 1 && v_buf.stride(2) == 1 &&
                  out.stride(2) == 1 && req_to_token.stride(1) == 1,
              op, ": the last dimension must be contiguous");
}

inline void check_heads(const char* op, const at::Tensor& q, const at::Tensor& k_buf,
                        const at::Tensor& v_buf, int64_t window, double softcap) {
  const int64_t heads = q.size(1), kv_heads = k_buf.size(1), dim = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0, op, ": heads must be a multiple of kv_heads");
  TORCH_CHECK(k_buf.size(2) == dim && v_buf.size(2) == dim, op, ": head_dim mismatch");
  TORCH_CHECK(dim % kLanes == 0 && dim <= 256,
              op, ": head_dim must be a multiple of 16, at most 256");
  TORCH_CHECK(window >= 0 && softcap >= 0, op, ": window and softcap are >= 0");
}

}  // namespace radixlm_cpu::attn
