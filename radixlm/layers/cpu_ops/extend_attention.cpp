// Causal prefill attention of fresh prompts (no cached prefix) in bf16, on CPUs
// with AVX512-BF16.
//
// torch's CPU flash attention runs SmolLM2's prefill (32 prompts x 256 tokens,
// 9 query / 3 KV heads of 64) at about 28 GFLOP/s here, 37-43 ms per layer call,
// about a fifth of the whole prefill: its inner products are not the
// bottleneck, its per-block bookkeeping is. Here both products run on
// `vdpbf16ps`, which multiplies pairs of bf16 and sums them into fp32 lanes:
//   scores: lane j of S[r] += (q[r][2p], q[r][2p+1]) . (k[j][2p], k[j][2p+1]),
//           so the keys are stored as [d / 2][tokens] pairs (a 32-bit transpose);
//   output: lane c of O[r] += (P[r][2i], P[r][2i+1]) . (v[2i][c], v[2i+1][c]),
//           so the values are stored as [tokens / 2][d] pairs of rows.
// Work unit: one (prompt, KV head). Its keys and values are rearranged once
// into those layouts, then every query row of the GROUP heads that share them
// walks the key blocks up to its position with an online softmax, R rows at a
// time with their output in registers. As on GPUs (FlashAttention), the
// probabilities are rounded to bf16 for the second product; the running max,
// sum and output stay fp32.
//
// Layer variants: with a sliding window W the query at position p sees keys
// p - W + 1 .. p only (key blocks wholly before a row's window are skipped,
// partial ones masked); a softcap c maps each scaled score s to
// c * tanh(s / c) before the mask and the softmax.

#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int kBlock = 32;  // keys per online-softmax step (two 16-lane registers)

struct Variant {
  int64_t window;  // 0: none
  float softcap;   // 0: none
};

// c * tanh(x / c), with tanh(y) = 1 - 2 / (exp(2y) + 1).
inline __m512 softcap_ps(__m512 x, float cap) {
  radixlm_cpu::vfloat y;
  const __m512 twice = _mm512_mul_ps(x, _mm512_set1_ps(2.f / cap));
  std::memcpy(&y, &twice, sizeof(y));
  y = radixlm_cpu::exp_vec(y);
  __m512 e;
  std::memcpy(&e, &y, sizeof(e));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

struct Prompt {
  const uint16_t* q;  // the prompt's first query row, head 0
  const uint16_t* k;  // its first key row, KV head 0
  const uint16_t* v;
  uint16_t* out;
  int64_t len;
};

// R query rows (head h, positions p0..p0+R-1) against keys [0, p0 + R): D = 64 or 128.
template <int D, int R>
void attend_rows(const uint16_t* q, int64_t q_row_stride, int rows, int64_t p0,
                 const uint32_t* kp, int64_t kp_stride, const uint32_t* vp, float scale,
                 const Variant& var, uint16_t* out, int64_t out_row_stride) {
  constexpr int DP = D / 2;    // bf16 pairs per row
  constexpr int DV = D / 16;   // 16-lane registers per output row
  __m512 o[R][DV];
  __m512 l[R];
  float m[R];
  const uint32_t* qr[R];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < DV; ++c) o[r][c] = _mm512_setzero_ps();
    l[r] = _mm512_setzero_ps();
    m[r] = -std::numeric_limits<float>::infinity();
    // Rows past `rows` repeat the last real one: same work, results dropped.
    qr[r] = reinterpret_cast<const uint32_t*>(q + std::min(r, rows - 1) * q_row_stride);
  }
  const int64_t last = p0 + rows - 1;  // the last query's position: keys 0..last
  // With a window, the first row's first visible key: earlier blocks are skipped.
  const int64_t lowest = var.window > 0 ? std::max<int64_t>(0, p0 - var.window + 1) : 0;
  alignas(64) uint32_t pb[R][kBlock / 2];
  for (int64_t j0 = lowest / kBlock * kBlock; j0 <= last; j0 += kBlock) {
    __m512 s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    const uint32_t* kb = kp + j0;
    for (int p = 0; p < DP; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * kp_stride);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + p * kp_stride + 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh qq = (__m512bh)_mm512_set1_epi32(static_cast<int>(qr[r][p]));
        s[r][0] = _mm512_dpbf16_ps(s[r][0], qq, k0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], qq, k1);
      }
    }
    const bool diagonal = j0 + kBlock > p0;  // some key in this block is after some query
    // Some key in this block is before some row's window.
    const bool before = var.window > 0 && j0 < last - var.window + 1;
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lane_hi = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int r = 0; r < R; ++r) {
      __m512 a = _mm512_mul_ps(s[r][0], sc), b = _mm512_mul_ps(s[r][1], sc);
      if (var.softcap > 0.f) {
        a = softcap_ps(a, var.softcap);
        b = softcap_ps(b, var.softcap);
      }
      const int64_t pos = p0 + std::min(r, rows - 1);
      if (diagonal) {  // key j is visible to the query at p0 + r when j <= p0 + r
        const int64_t limit = std::min<int64_t>(pos, last) - j0;
        const __m512i lim = _mm512_set1_epi32(static_cast<int>(std::min<int64_t>(limit, 64)));
        a = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(lane, lim), a, ninf);
        b = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(lane_hi, lim), b, ninf);
      }
      if (before) {  // ... and j > pos - window
        const int64_t low = pos - var.window + 1 - j0;
        const __m512i lo = _mm512_set1_epi32(
            static_cast<int>(std::max<int64_t>(-1, std::min<int64_t>(low, 64))));
        a = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(lane, lo), a, ninf);
        b = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(lane_hi, lo), b, ninf);
      }
      const float mx = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(a, b)));
      if (mx == -std::numeric_limits<float>::infinity()) {
        // Nothing of this row's window in the block yet (windows only): no change.
        std::memset(pb[r], 0, sizeof(pb[r]));
        continue;
      }
      // Without a window the first key is always visible, so mx is finite from the
      // first block on; with one, from the first block that reaches the window.
      const float alpha = std::exp(m[r] - mx);
      m[r] = mx;
      const radixlm_cpu::vfloat mxv = radixlm_cpu::vfloat{} + mx;
      radixlm_cpu::vfloat ea, eb;
      std::memcpy(&ea, &a, sizeof(a));
      std::memcpy(&eb, &b, sizeof(b));
      ea = radixlm_cpu::exp_vec(ea - mxv);
      eb = radixlm_cpu::exp_vec(eb - mxv);
      std::memcpy(&a, &ea, sizeof(a));
      std::memcpy(&b, &eb, sizeof(b));
      const __m512 al = _mm512_set1_ps(alpha);
      l[r] = _mm512_add_ps(_mm512_mul_ps(l[r], al), _mm512_add_ps(a, b));
      for (int c = 0; c < DV; ++c) o[r][c] = _mm512_mul_ps(o[r][c], al);
      // P as bf16 pairs (keys 2i, 2i+1) for the second product.
      _mm512_store_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
    const int pairs = static_cast<int>(std::min<int64_t>(kBlock, last + 1 - j0) + 1) / 2;
    const uint32_t* vb = vp + (j0 / 2) * D;
    for (int i = 0; i < pairs; ++i) {
      __m512bh vv[DV];
      for (int c = 0; c < DV; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vb + i * D + c * 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[r][i]));
        for (int c = 0; c < DV; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pp, vv[c]);
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(l[r]));
    uint16_t* dst = out + r * out_row_stride;
    for (int c = 0; c < DV; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[r][c], inv)));
  }
}

template <int D>
void attend_prompt(const Prompt& pr, int kvh_index, int group, int64_t q_sh, int64_t q_st,
                   int64_t k_sh, int64_t k_st, int64_t o_sh, int64_t o_st, float scale,
                   const Variant& var, std::vector<uint32_t>& kp, std::vector<uint32_t>& vp) {
  constexpr int R = D == 64 ? 4 : 2;  // rows x (D / 16) output registers + scores fit in 32
  const int64_t n = pr.len, padded = (n + kBlock - 1) / kBlock * kBlock;
  // Keys as [D / 2][padded] 32-bit pairs; values as [padded / 2][D] pairs of rows.
  // Padding keys are zero (and masked); padding values are zero.
  kp.assign(static_cast<size_t>(D / 2) * padded, 0u);
  vp.assign(static_cast<size_t>(padded / 2) * D, 0u);
  const uint16_t* kbase = pr.k + kvh_index * k_sh;
  const uint16_t* vbase = pr.v + kvh_index * k_sh;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* krow = reinterpret_cast<const uint32_t*>(kbase + j * k_st);
    for (int p = 0; p < D / 2; ++p) kp[p * padded + j] = krow[p];
    const uint16_t* vrow = vbase + j * k_st;
    uint16_t* dst = reinterpret_cast<uint16_t*>(vp.data() + (j / 2) * D) + (j & 1);
    for (int c = 0; c < D; ++c) dst[2 * c] = vrow[c];
  }
  for (int g = 0; g < group; ++g) {
    const int h = kvh_index * group + g;
    for (int64_t p0 = 0; p0 < n; p0 += R) {
      const int rows = static_cast<int>(std::min<int64_t>(R, n - p0));
      attend_rows<D, R>(pr.q + h * q_sh + p0 * q_st, q_st, rows, p0, kp.data(), padded,
                        vp.data(), scale, var, pr.out + h * o_sh + p0 * o_st, o_st);
    }
  }
}

// q/out: [tokens, heads, D]; k/v: [tokens, kv_heads, D] (bf16, last dim
// contiguous, k and v with equal strides); prompt i is rows
// [starts[i], starts[i] + lens[i]) of each and attends causally within itself.
void extend_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& out, const at::Tensor& starts, const at::Tensor& lens,
                      double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3,
              "extend_attention: q/out [tokens, heads, dim], k/v [tokens, kv_heads, dim]");
  for (const at::Tensor* t : {&q, &k, &v, &out})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->stride(2) == 1,
                "extend_attention: bf16 tensors with a contiguous last dim");
  TORCH_CHECK(k.strides() == v.strides() && k.sizes() == v.sizes(),
              "extend_attention: k and v must share shape and strides");
  TORCH_CHECK(starts.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  starts.is_contiguous() && lens.is_contiguous() && starts.numel() == lens.numel(),
              "extend_attention: starts and lens are contiguous int64 of one length");
  const int heads = static_cast<int>(q.size(1)), kv_heads = static_cast<int>(k.size(1));
  const int dim = static_cast<int>(q.size(2));
  TORCH_CHECK(heads % kv_heads == 0, "extend_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(k.size(2) == dim && (dim == 64 || dim == 128),
              "extend_attention: head_dim 64 or 128");
  const int64_t count = starts.numel();
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const auto* qp = static_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = static_cast<const uint16_t*>(k.data_ptr());
  const auto* vpp = static_cast<const uint16_t*>(v.data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(st[i] >= 0 && ln[i] >= 0 && st[i] + ln[i] <= q.size(0) &&
                    st[i] + ln[i] <= k.size(0),
                "extend_attention: prompt rows out of range");
  const int group = heads / kv_heads;
  const float sc = static_cast<float>(scale);
  TORCH_CHECK(window >= 0 && softcap >= 0, "extend_attention: window and softcap are >= 0");
  const Variant var{window, static_cast<float>(softcap)};
  at::parallel_for(0, count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> kbuf, vbuf;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t i = u / kv_heads;
      if (ln[i] == 0) continue;
      const Prompt pr{qp + st[i] * q.stride(0), kp + st[i] * k.stride(0),
                      vpp + st[i] * v.stride(0), op + st[i] * out.stride(0), ln[i]};
      const int g = static_cast<int>(u % kv_heads);
      if (dim == 64)
        attend_prompt<64>(pr, g, group, q.stride(1), q.stride(0), k.stride(1), k.stride(0),
                          out.stride(1), out.stride(0), sc, var, kbuf, vbuf);
      else
        attend_prompt<128>(pr, g, group, q.stride(1), q.stride(0), k.stride(1), k.stride(0),
                           out.stride(1), out.stride(0), sc, var, kbuf, vbuf);
    }
  });
}

}  // namespace

// Registered only where the instructions exist; callers ask
// `hasattr(torch.ops.radixlm_cpu, "extend_attention")`.
TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("extend_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor starts, "
        "Tensor lens, float scale, int window, float softcap) -> ()");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("extend_attention", &extend_attention); }

#endif  // __AVX512BF16__
