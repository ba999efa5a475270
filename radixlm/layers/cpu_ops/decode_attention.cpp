// Decode attention on the CPU straight from the token-level KV pool.
//
// One query token per request attends to the request's `seq_len` tokens, whose
// K/V rows sit at arbitrary pool slots `req_to_token[row, pos]`. The torch path
// first gathers every request's K/V into a padded copy (and, for bf16, converts
// it to fp32 because SDPA's half-precision single-query path is slow), then
// reads that copy again: three passes over the KV bytes. Here each K/V row is
// read once from the pool into a small per-split buffer in the layout the
// products want (attention.h) and consumed there.
//
// Work unit (request b, split s, KV head g): the split's keys of head g are
// packed, then the GROUP = heads / kv_heads query heads of g attend to them
// together (GQA: one read of each key for the group). Splits are kSplit
// positions wide and aligned to absolute positions, so a long request spreads
// over the threads and a row's arithmetic is the same as in the prefill kernel
// (extend_attention.cpp) and for any batch; the splits are folded in order.
//
// Layer variants: a sliding window W reads only the request's last W tokens
// (the query's own included), never the rows before them; a softcap c maps
// each scaled score s to c * tanh(s / c) before the softmax.

#include "attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <type_traits>
#include <vector>

namespace {

using namespace radixlm_cpu;
using namespace radixlm_cpu::attn;

template <typename T>
struct Args {
  const T* q; int64_t q_sb, q_sh;
  const T* k; int64_t k_sn, k_sh;
  const T* v; int64_t v_sn, v_sh;
  SlotTable r2t;
  const int64_t* rows;
  const int64_t* seq_lens;
  int heads, kv_heads, dim, dp;  // dp: the head dim padded to an instantiated width
  float scale;
  int64_t window;   // 0: none
  float softcap;    // 0: none
  int max_splits;
  float* part_m;    // [bs, heads, max_splits]
  float* part_l;
  float* part_o;    // [bs, heads, max_splits, dp]
};

struct Request {
  int64_t pos, lo, first_split, num_splits;
  template <typename T>
  static Request of(const Args<T>& a, int64_t b) {
    const int64_t len = a.seq_lens[b];
    if (len <= 0) return {0, 0, 0, 0};
    const int64_t pos = len - 1, lo = first_visible(pos, a.window);
    return {pos, lo, lo / kSplit, pos / kSplit - lo / kSplit + 1};
  }
};

// Scratch of one thread (`thread_scratch`): packed keys/values of one split of
// one KV head, its group's query rows. A unit spans at most kSplit positions,
// so what a thread keeps is bounded (256 KB at a head of 128 in fp32).
template <typename T>
struct Scratch {
  std::vector<float> kf, vf, qf;
  std::vector<uint32_t> kp, vp, qp;
  std::vector<int64_t> slots;
};

// One (request, split, KV head): the split's keys and values of that KV head
// are packed (one pass over its part of the pool rows), then the group's heads,
// R at a time, write their partial results. A unit per KV head, not per split
// alone: a short context is one split, and its heads are what the threads share.
template <int DV, typename T>
void attend_unit(const Args<T>& a, int64_t b, const Request& rq, int64_t s, int g,
                 Scratch<T>& w) {
  constexpr int D = DV * kLanes;
  constexpr int R = rows_per_tile<DV>();
  const int group = a.heads / a.kv_heads;
  const int64_t sb = s * kSplit, first = std::max(sb, rq.lo / kBlock * kBlock);
  const int64_t stop = std::min(sb + kSplit, rq.pos + 1), count = stop - first;
  const int64_t n = round_up(count, kBlock);
  const int64_t slot = s - rq.first_split;
  int64_t pos[R], lo[R];  // every head of the group at the request's last position
  std::fill(pos, pos + R, rq.pos);
  std::fill(lo, lo + R, rq.lo);
  a.r2t.copy(a.rows[b], first, count, w.slots);
  const KvRows<T> kv{a.k, a.v, a.k_sn, a.v_sn, a.k_sh, a.v_sh, w.slots.data(),
                     std::max<int64_t>(0, rq.lo - first)};
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    w.kp.resize(static_cast<size_t>(D / 2) * n);
    w.vp.resize(static_cast<size_t>(n / 2) * D);
    pack_range(kv, g, count, 0, n, a.dim, D, n, w.kp.data(), w.vp.data());
    w.qp.assign(static_cast<size_t>(group) * D / 2, 0u);
    for (int h = 0; h < group; ++h)
      std::memcpy(w.qp.data() + h * D / 2, a.q + b * a.q_sb + (g * group + h) * a.q_sh,
                  a.dim * sizeof(T));
    for (int h0 = 0; h0 < group; h0 += R) {
      const int rows = std::min(R, group - h0);
      const uint32_t* q[R];
      for (int r = 0; r < R; ++r) q[r] = w.qp.data() + (h0 + std::min(r, rows - 1)) * D / 2;
      const int64_t at = (b * a.heads + g * group + h0) * a.max_splits + slot;
      split_bf16<DV, R>(q, pos, lo, rows, w.kp.data(), w.vp.data(), n, first, sb, a.scale,
                        a.softcap, {a.part_m + at, a.part_l + at, a.part_o + at * D, a.max_splits});
    }
    return;
  }
#endif
  w.kf.resize(static_cast<size_t>(D) * n);
  w.vf.resize(static_cast<size_t>(n) * D);
  pack_range(kv, g, count, 0, n, a.dim, D, n, w.kf.data(), w.vf.data());
  w.qf.resize(static_cast<size_t>(group) * D);
  for (int h = 0; h < group; ++h) {
    const T* src = a.q + b * a.q_sb + (g * group + h) * a.q_sh;
    for (int c = 0; c < D; c += kLanes)
      store_vec(w.qf.data() + h * D + c, load_widened(src, c, a.dim));
  }
  for (int h0 = 0; h0 < group; h0 += R) {
    const int rows = std::min(R, group - h0);
    const float* q[R];
    for (int r = 0; r < R; ++r) q[r] = w.qf.data() + (h0 + std::min(r, rows - 1)) * D;
    const int64_t at = (b * a.heads + g * group + h0) * a.max_splits + slot;
    split_f32<DV, R>(q, pos, lo, rows, w.kf.data(), w.vf.data(), n, first, sb, a.scale,
                     a.softcap, {a.part_m + at, a.part_l + at, a.part_o + at * D, a.max_splits});
  }
}

// The quantized products' worker pool where its extension handed it over
// (qgemm.cpp's pool_run: rows, fn, ctx, chunks; false when it did not take
// the job), else null: the units then go to at::parallel_for. A short
// context's units take ~10-20 us each, where waking a sleeping OpenMP thread
// costs more than the second core gains; the pool's workers are spinning
// between the products around the attention.
using PoolRun = bool (*)(int64_t, void (*)(const void*, int64_t), const void*, int64_t);
std::atomic<PoolRun> g_pool_run{nullptr};

void set_pool(int64_t entry) { g_pool_run.store(reinterpret_cast<PoolRun>(entry)); }

template <int DV, typename T>
void run(const Args<T>& a, int64_t bs, T* out, int64_t o_sb, int64_t o_sh) {
  std::vector<Request> reqs(bs);
  std::vector<int64_t> unit_start(bs + 1, 0);
  for (int64_t b = 0; b < bs; ++b) {
    reqs[b] = Request::of(a, b);
    unit_start[b + 1] = unit_start[b] + reqs[b].num_splits;
  }
  // Units: (request, split) pairs times the KV heads, each pair's heads adjacent.
  const int64_t units = unit_start[bs] * a.kv_heads;
  const auto unit_range = [&](int64_t begin, int64_t end) {
    Scratch<T>& w = thread_scratch<Scratch<T>>();
    const int64_t first_pair = begin / a.kv_heads;
    int64_t b = std::upper_bound(unit_start.begin(), unit_start.end(), first_pair) -
                unit_start.begin() - 1;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t pair = u / a.kv_heads;
      while (unit_start[b + 1] <= pair) ++b;
      attend_unit<DV>(a, b, reqs[b], reqs[b].first_split + (pair - unit_start[b]),
                      static_cast<int>(u % a.kv_heads), w);
    }
  };
  const auto one_unit = [&](int64_t u) { unit_range(u, u + 1); };
  using OneUnit = decltype(one_unit);
  const PoolRun pool = g_pool_run.load();
  if (pool == nullptr ||
      !pool(bs, [](const void* ctx, int64_t u) { (*static_cast<const OneUnit*>(ctx))(u); },
            &one_unit, units))
    at::parallel_for(0, units, 1, unit_range);
  constexpr int D = DV * kLanes;
  const int64_t merge_grain = std::max<int64_t>(16, (int64_t{1} << 16) / (a.max_splits * D));
  at::parallel_for(0, bs * a.heads, merge_grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / a.heads, h = bh % a.heads;
      T* o = out + b * o_sb + h * o_sh;
      if (reqs[b].num_splits == 0) {  // padding rows
        for (int i = 0; i < a.dim; ++i) o[i] = T(0.f);
        continue;
      }
      float M = kNegInf, L = 0.f;
      for (int64_t s = 0; s < reqs[b].num_splits; ++s) {
        const int64_t at = bh * a.max_splits + s;
        fold(M, L, acc.data(), a.part_m[at], a.part_l[at], a.part_o + at * D, D);
      }
      if (a.dim == D) {
        finish(acc.data(), L, o, D);
      } else {
        T tmp[D];
        finish(acc.data(), L, tmp, D);
        std::memcpy(o, tmp, sizeof(T) * a.dim);
      }
    }
  });
}

// q: [bs, heads, dim]; k_buf/v_buf: [pool, kv_heads, dim] (last dim contiguous);
// req_to_token: [rows, max_context] int32/int64; req_pool_indices, seq_lens: [bs]
// int64; out: [bs, heads, dim], same dtype as q and the pool.
void decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      const at::Tensor& out, const at::Tensor& req_to_token,
                      const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                      double scale, int64_t window, double softcap) {
  attn::check_layout("decode_attention", "[bs, heads, dim]", q, k_buf, v_buf, out,
                     req_to_token);
  TORCH_CHECK(req_pool_indices.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  req_pool_indices.is_contiguous() && seq_lens.is_contiguous(),
              "decode_attention: req_pool_indices and seq_lens must be contiguous int64");
  const int64_t bs = q.size(0);
  const int heads = static_cast<int>(q.size(1)), kv_heads = static_cast<int>(k_buf.size(1));
  const int dim = static_cast<int>(q.size(2));
  attn::check_heads("decode_attention", q, k_buf, v_buf, window, softcap);
  const int dp = padded_lanes(dim) * kLanes;
  int max_splits = 1;
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < bs; ++b) {
    if (lens[b] <= 0) continue;
    const int64_t pos = lens[b] - 1;
    max_splits = std::max<int>(max_splits, static_cast<int>(
        pos / kSplit - first_visible(pos, window) / kSplit + 1));
  }
  auto f32 = q.options().dtype(at::kFloat);
  at::Tensor part_m = at::empty({bs, heads, max_splits}, f32);
  at::Tensor part_l = at::empty({bs, heads, max_splits}, f32);
  at::Tensor part_o = at::empty({bs, heads, max_splits, dp}, f32);
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt || req_to_token.scalar_type() == at::kLong,
              "req_to_token: int32 or int64");
  const SlotTable r2t{req_to_token.data_ptr(), req_to_token.scalar_type() == at::kInt,
                      req_to_token.stride(0)};
  auto launch = [&](auto* q_ptr) {
    using T = std::remove_pointer_t<decltype(q_ptr)>;
    Args<T> a{q_ptr, q.stride(0), q.stride(1),
              static_cast<const T*>(k_buf.data_ptr()), k_buf.stride(0), k_buf.stride(1),
              static_cast<const T*>(v_buf.data_ptr()), v_buf.stride(0), v_buf.stride(1),
              r2t, req_pool_indices.data_ptr<int64_t>(), lens,
              heads, kv_heads, dim, dp, static_cast<float>(scale),
              window, static_cast<float>(softcap), max_splits,
              part_m.data_ptr<float>(), part_l.data_ptr<float>(), part_o.data_ptr<float>()};
    T* o = static_cast<T*>(out.data_ptr());
    with_width(dp / kLanes, [&](auto dv) {
      run<decltype(dv)::value>(a, bs, o, out.stride(0), out.stride(1));
    });
  };
  switch (q.scalar_type()) {
    case at::kFloat: launch(q.data_ptr<float>()); break;
    case at::kBFloat16: launch(q.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: launch(q.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "decode_attention: dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY(radixlm_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor(a!) out, "
        "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float scale, "
        "int window, float softcap) -> ()");
  m.def("set_pool(int entry) -> ()", &set_pool);
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("decode_attention", &decode_attention); }
