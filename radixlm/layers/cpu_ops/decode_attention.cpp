// Decode attention on the CPU straight from the token-level KV pool.
//
// One query token per request attends to the request's `seq_len` tokens, whose
// K/V rows sit at arbitrary pool slots `req_to_token[row, pos]`. The torch path
// first gathers every request's K/V into a padded copy (and, for bf16, converts
// it to fp32 because SDPA's half-precision single-query path is slow), then
// reads that copy again: three passes over the KV bytes. Here each K/V row is
// read once, widened to fp32 in a small per-block buffer and consumed there
// (online softmax, fp32 accumulation), so the step is bound by one read of
// the KV: 2.8 ms vs 16 ms per layer for the torch path at 64 requests x 320
// tokens of SmolLM2 in bf16, on one core of this 2-core machine.
//
// Work unit (request b, split s), all heads: the GROUP = heads / kv_heads
// query heads of a KV head share each K/V row read (GQA). Requests are cut
// into splits only when there are fewer requests than threads can use (one
// long sequence); splits are merged by their log-sum-exps.
//
// Layer variants: a sliding window W reads only the request's last W tokens
// (the query's own included), never the rows before them; a softcap c maps
// each scaled score s to c * tanh(s / c) before the softmax.

#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace radixlm_cpu;

constexpr int kBlockN = 32;      // tokens scored per online-softmax step

template <typename T>
inline void row_to_float(const T* src, float* dst, int n) {
  for (int c = 0; c < n; c += kLanes) store_vec(dst + c, load_vec(src + c));
}

inline float dot(const float* a, const float* b, int n) {
  vfloat acc = load_vec(a) * load_vec(b);
  for (int c = kLanes; c < n; c += kLanes) acc += load_vec(a + c) * load_vec(b + c);
  return hsum(acc);
}

// bf16 pools on CPUs with AVX512-BF16: scores straight from bf16 query and key
// rows. The products of bf16 pairs are exact in fp32 and summed in fp32, as the
// widened path does (in another order; denormals flush). The keys are then
// copied as raw bf16, half the bytes and none of the widening: 1.47 vs 1.75 ms
// per layer at 64 requests x 320 tokens on 2 threads, pools beyond L3.
#if defined(__AVX512BF16__)
constexpr bool kBf16Dot = true;
inline float dot_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int n) {
  __m512 acc = _mm512_setzero_ps();
  for (int c = 0; c < n; c += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + c),
                           (__m512bh)_mm512_loadu_si512(k + c));
  return _mm512_reduce_add_ps(acc);
}
#else
constexpr bool kBf16Dot = false;
inline float dot_bf16(const c10::BFloat16*, const c10::BFloat16*, int) { return 0.f; }
#endif

// acc[:n] = acc * alpha + sum_j p[j] * rows[j, :n]. Four column registers are
// carried across the rows at once: one would be a chain of dependent FMAs
// (latency-bound, measured 30% of the kernel), four keep both FMA units busy.
inline void rescale_accumulate(float alpha, const float* p, const float* rows, int count,
                               int stride, int n, float* acc) {
  int c = 0;
  for (; c + 4 * kLanes <= n; c += 4 * kLanes) {
    vfloat r0 = load_vec(acc + c) * alpha, r1 = load_vec(acc + c + kLanes) * alpha;
    vfloat r2 = load_vec(acc + c + 2 * kLanes) * alpha, r3 = load_vec(acc + c + 3 * kLanes) * alpha;
    for (int j = 0; j < count; ++j) {
      const float* row = rows + j * stride + c;
      r0 += p[j] * load_vec(row);
      r1 += p[j] * load_vec(row + kLanes);
      r2 += p[j] * load_vec(row + 2 * kLanes);
      r3 += p[j] * load_vec(row + 3 * kLanes);
    }
    store_vec(acc + c, r0);
    store_vec(acc + c + kLanes, r1);
    store_vec(acc + c + 2 * kLanes, r2);
    store_vec(acc + c + 3 * kLanes, r3);
  }
  for (; c < n; c += kLanes) {
    vfloat r = load_vec(acc + c) * alpha;
    for (int j = 0; j < count; ++j) r += p[j] * load_vec(rows + j * stride + c);
    store_vec(acc + c, r);
  }
}

template <typename T, typename I>
struct Args {
  const T* q; int64_t q_sb, q_sh;
  const T* k; int64_t k_sn, k_sh;
  const T* v; int64_t v_sn, v_sh;
  const I* r2t; int64_t r2t_s;
  const int64_t* rows;
  const int64_t* seq_lens;
  int heads, kv_heads, dim, splits;
  float scale;
  int64_t window;   // 0: none
  float softcap;    // 0: none
  float* part_o;    // [bs, heads, splits, dim]
  float* part_lse;  // [bs, heads, splits]
};

// Attention of every head of request b over its tokens [start, end): writes
// the normalized partial output and log-sum-exp of split s for each head.
// Each block of tokens is first copied out of the pool (all KV heads of a
// token are adjacent there) into an fp32 buffer by a loop of nothing but
// independent loads, so many cache misses are in flight at once; the math
// then runs on the buffer. Interleaving the loads with the math left the
// misses one at a time (measured 2x slower at 64 x 320 tokens).
template <typename T, typename I>
void attend_chunk(const Args<T, I>& a, int64_t b, int s, int64_t start, int64_t end) {
  const int heads = a.heads, kvh = a.kv_heads, group = heads / kvh, d = a.dim;
  const int stride = kvh * d;  // between tokens in the block buffer
  std::vector<float> buf(2 * heads * d + kBlockN * stride + heads * kBlockN + 3 * heads);
  float* qf = buf.data();                 // [heads, d], pre-scaled
  float* acc = qf + heads * d;            // [heads, d]
  float* rows = acc + heads * d;          // [kBlockN, kvh, d]: the block's K, then V
  float* score = rows + kBlockN * stride; // [heads, kBlockN]
  float* m = score + heads * kBlockN;     // [heads] running max
  float* l = m + heads;                   // [heads] running sum of exponentials
  float* alpha = l + heads;               // [heads] this block's rescale factor
  constexpr bool raw_keys = kBf16Dot && std::is_same_v<T, c10::BFloat16>;
  const bool bf16_dot = raw_keys && d % 32 == 0;  // scores from the bf16 query row itself
  for (int h = 0; h < heads; ++h) {
    if (!bf16_dot) {
      row_to_float(a.q + b * a.q_sb + h * a.q_sh, qf + h * d, d);
      for (int i = 0; i < d; ++i) qf[h * d + i] *= a.scale;
    }
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.f;
  }
  std::fill(acc, acc + heads * d, 0.f);
  const I* r2t = a.r2t + a.rows[b] * a.r2t_s;
  auto copy_block = [&](const T* pool, int64_t sn, int64_t sh, int64_t n0, int bn) {
    for (int j = 0; j < bn; ++j) {
      const T* token = pool + static_cast<int64_t>(r2t[n0 + j]) * sn;
      for (int g = 0; g < kvh; ++g) row_to_float(token + g * sh, rows + j * stride + g * d, d);
    }
  };
  // The bf16 block of keys fits in the first half of `rows` (V overwrites it later).
  T* raw = reinterpret_cast<T*>(rows);
  for (int64_t n0 = start; n0 < end; n0 += kBlockN) {
    const int bn = static_cast<int>(std::min<int64_t>(kBlockN, end - n0));
    if (bf16_dot) {
      for (int j = 0; j < bn; ++j) {
        const T* token = a.k + static_cast<int64_t>(r2t[n0 + j]) * a.k_sn;
        for (int g = 0; g < kvh; ++g)
          std::memcpy(raw + j * stride + g * d, token + g * a.k_sh, d * sizeof(T));
      }
    } else {
      copy_block(a.k, a.k_sn, a.k_sh, n0, bn);
    }
    for (int h = 0; h < heads; ++h) {
      const float* keys = rows + (h / group) * d;
      float* sh = score + h * kBlockN;
      float mx = m[h];
      if (bf16_dot) {
        if constexpr (raw_keys) {
          const T* qh = a.q + b * a.q_sb + h * a.q_sh;
          const T* kh = raw + (h / group) * d;
          for (int j = 0; j < bn; ++j) {
            sh[j] = dot_bf16(qh, kh + j * stride, d) * a.scale;
            mx = std::max(mx, sh[j]);
          }
        }
      } else {
        for (int j = 0; j < bn; ++j) {
          sh[j] = dot(qf + h * d, keys + j * stride, d);
          mx = std::max(mx, sh[j]);
        }
      }
      if (a.softcap > 0.f) {  // c * tanh(s / c) is increasing: the block max is recomputed
        mx = m[h];
        for (int j = 0; j < bn; ++j) {
          sh[j] = a.softcap * std::tanh(sh[j] / a.softcap);
          mx = std::max(mx, sh[j]);
        }
      }
      for (int j = bn; j < kBlockN; ++j) sh[j] = -1e30f;  // a short last block
      alpha[h] = std::exp(m[h] - mx);  // exp(-inf) = 0 on the first block
      vfloat sum = vfloat{};
      for (int j = 0; j < kBlockN; j += kLanes) {
        vfloat e = exp_vec(load_vec(sh + j) - mx);
        store_vec(sh + j, e);
        sum += e;
      }
      l[h] = l[h] * alpha[h] + hsum(sum);
      m[h] = mx;
    }
    copy_block(a.v, a.v_sn, a.v_sh, n0, bn);
    for (int h = 0; h < heads; ++h)
      rescale_accumulate(alpha[h], score + h * kBlockN, rows + (h / group) * d, bn,
                         stride, d, acc + h * d);
  }
  for (int h = 0; h < heads; ++h) {
    float* o = a.part_o + ((b * heads + h) * a.splits + s) * d;
    const float inv = 1.f / l[h];
    for (int i = 0; i < d; ++i) o[i] = acc[h * d + i] * inv;
    a.part_lse[(b * heads + h) * a.splits + s] = m[h] + std::log(l[h]);
  }
}

// The first token a request of `len` tokens attends to (its window's start).
template <typename T, typename I>
inline int64_t first_token(const Args<T, I>& a, int64_t len) {
  return a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
}

template <typename T, typename I>
void run(const Args<T, I>& a, int64_t bs, T* out, int64_t o_sb, int64_t o_sh) {
  at::parallel_for(0, bs * a.splits, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int s = static_cast<int>(u % a.splits);
      const int64_t b = u / a.splits;
      const int64_t len = a.seq_lens[b], first = first_token(a, len);
      const int64_t chunk = (len - first + a.splits - 1) / a.splits;
      const int64_t start = first + s * chunk, stop = std::min(len, start + chunk);
      if (start < stop) attend_chunk(a, b, s, start, stop);
    }
  });
  // Merge the splits of each (request, head) by their log-sum-exps.
  const int d = a.dim;
  const int64_t merge_grain = std::max<int64_t>(16, (int64_t{1} << 16) / (a.splits * d));
  at::parallel_for(0, bs * a.heads, merge_grain, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(d);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / a.heads, h = bh % a.heads;
      const int64_t len = a.seq_lens[b], n = len - first_token(a, len);
      const int64_t chunk = std::max<int64_t>(1, (n + a.splits - 1) / a.splits);
      const int valid = static_cast<int>(std::min<int64_t>(a.splits, (n + chunk - 1) / chunk));
      T* o = out + b * o_sb + h * o_sh;
      if (len == 0) {  // padding rows
        for (int i = 0; i < d; ++i) o[i] = T(0.f);
        continue;
      }
      const float* lse = a.part_lse + bh * a.splits;
      float mx = -std::numeric_limits<float>::infinity();
      for (int s = 0; s < valid; ++s) mx = std::max(mx, lse[s]);
      std::fill(sum.begin(), sum.end(), 0.f);
      float total = 0.f;
      for (int s = 0; s < valid; ++s) {
        const float w = std::exp(lse[s] - mx);
        total += w;
        const float* po = a.part_o + (bh * a.splits + s) * d;
        for (int i = 0; i < d; ++i) sum[i] += w * po[i];
      }
      for (int i = 0; i < d; ++i) o[i] = T(sum[i] / total);
    }
  });
}

// q: [bs, heads, dim]; k_buf/v_buf: [pool, kv_heads, dim] (last dim contiguous);
// req_to_token: [rows, max_context] int32/int64; req_pool_indices, seq_lens: [bs]
// int64; out: [bs, heads, dim], same dtype as q and the pool.
void decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      const at::Tensor& out, const at::Tensor& req_to_token,
                      const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                      double scale, int64_t num_splits, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k_buf.dim() == 3 && v_buf.dim() == 3,
              "decode_attention: q/out [bs, heads, dim], k/v [pool, kv_heads, dim]");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && q.scalar_type() == v_buf.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "decode_attention: q, k, v and out must share one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k_buf.stride(2) == 1 && v_buf.stride(2) == 1 &&
                  out.stride(2) == 1 && req_to_token.stride(1) == 1,
              "decode_attention: the last dimension must be contiguous");
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  req_pool_indices.is_contiguous() && seq_lens.is_contiguous(),
              "decode_attention: req_pool_indices and seq_lens must be contiguous int64");
  const int64_t bs = q.size(0);
  const int heads = static_cast<int>(q.size(1)), kv_heads = static_cast<int>(k_buf.size(1));
  const int dim = static_cast<int>(q.size(2));
  TORCH_CHECK(heads % kv_heads == 0, "decode_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(k_buf.size(2) == dim && v_buf.size(2) == dim, "decode_attention: head_dim mismatch");
  TORCH_CHECK(dim % kLanes == 0, "decode_attention: head_dim must be a multiple of 16");
  TORCH_CHECK(window >= 0 && softcap >= 0, "decode_attention: window and softcap are >= 0");
  const int splits = static_cast<int>(std::max<int64_t>(1, num_splits));
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor part_o = at::empty({bs, heads, splits, dim}, f32);
  at::Tensor part_lse = at::empty({bs, heads, splits}, f32);
  auto launch = [&](auto* q_ptr, auto* r2t_ptr) {
    using T = std::remove_pointer_t<decltype(q_ptr)>;
    using I = std::remove_pointer_t<decltype(r2t_ptr)>;
    Args<T, I> a{q_ptr, q.stride(0), q.stride(1),
                 static_cast<const T*>(k_buf.data_ptr()), k_buf.stride(0), k_buf.stride(1),
                 static_cast<const T*>(v_buf.data_ptr()), v_buf.stride(0), v_buf.stride(1),
                 r2t_ptr, req_to_token.stride(0),
                 req_pool_indices.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                 heads, kv_heads, dim, splits, static_cast<float>(scale),
                 window, static_cast<float>(softcap),
                 part_o.data_ptr<float>(), part_lse.data_ptr<float>()};
    run(a, bs, static_cast<T*>(out.data_ptr()), out.stride(0), out.stride(1));
  };
  auto with_index = [&](auto* q_ptr) {
    if (req_to_token.scalar_type() == at::kInt) {
      launch(q_ptr, req_to_token.data_ptr<int32_t>());
    } else {
      TORCH_CHECK(req_to_token.scalar_type() == at::kLong, "req_to_token: int32 or int64");
      launch(q_ptr, req_to_token.data_ptr<int64_t>());
    }
  };
  switch (q.scalar_type()) {
    case at::kFloat: with_index(q.data_ptr<float>()); break;
    case at::kBFloat16: with_index(q.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: with_index(q.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "decode_attention: dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY(radixlm_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor(a!) out, "
        "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float scale, "
        "int num_splits, int window, float softcap) -> ()");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
