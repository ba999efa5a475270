// Causal prefill ("extend") attention on the CPU, straight from the KV pool: the
// new rows of each request attend to its cached prefix and to themselves.
//
// torch's CPU flash attention runs SmolLM2's prefill (32 prompts x 256 tokens,
// 9 query / 3 KV heads of 64) at about 28 GFLOP/s here, 37-43 ms per layer call,
// about a fifth of the whole prefill: its inner products are not the
// bottleneck, its per-block bookkeeping is. Here, in bf16 on CPUs with
// AVX512-BF16, both products run on `vdpbf16ps` (attention.h has the layouts).
// Each request's keys and values (from the first one its first new row sees to
// its last) are packed once from the pool, in parallel. Work unit: one
// (request, KV head, chunk of up to kChunkRows new rows): every query row of
// the GROUP heads that share the KV head walks the key blocks up to its
// position, R rows at a time with their output in registers, split by split
// (attention.h), so each row gets the bits a decode step at its position
// would: the result of a row does not depend on where its chunk began, how
// much of the prompt was cached, or what else is in the batch. Units are
// handed to threads longest first.
//
// Layer variants: with a sliding window W the query at position p sees keys
// p - W + 1 .. p only (key blocks wholly before a row's window are skipped,
// partial ones masked); a softcap c maps each scaled score s to
// c * tanh(s / c) before the mask and the softmax.

#include "attention.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <type_traits>
#include <vector>

namespace {

using namespace radixlm_cpu;
using namespace radixlm_cpu::attn;

constexpr int64_t kChunkRows = 128;  // new rows per work unit

template <typename T>
struct Args {
  const T* q; int64_t q_st, q_sh;  // [tokens, heads, dim]
  T* out; int64_t o_st, o_sh;
  const T* k; int64_t k_sn, k_sh;  // pools [slots, kv_heads, dim]
  const T* v; int64_t v_sn, v_sh;
  SlotTable r2t;
  const int64_t* rows;
  const int64_t* prefix_lens;
  const int64_t* extend_lens;
  const int64_t* starts;  // first new row of each request in q / out
  int heads, kv_heads, dim, dp;
  float scale;
  int64_t window;  // 0: none
  float softcap;   // 0: none
};

// Request i's packed keys and values: positions [first, first + n) of every KV
// head, head g's at kt + g * kt_head, vr + g * vr_head (P: the flavour's element).
struct Packed {
  int64_t first, n, offset;  // offset of the request's block in the shared buffers
};

struct Unit {
  int64_t req, kv_head, first_pos, stop_pos;  // new rows at positions [first_pos, stop_pos)
};

template <typename P>
struct Shared {
  std::vector<P> kt, vr;
  std::vector<Packed> packs;
  int64_t kt_per_key, vr_per_key;  // elements per packed position (one head)
  P* keys(int64_t req, int g) {
    const Packed& p = packs[req];
    return kt.data() + p.offset * kt_per_key + g * p.n * kt_per_key;
  }
  P* values(int64_t req, int g) {
    const Packed& p = packs[req];
    return vr.data() + p.offset * vr_per_key + g * p.n * vr_per_key;
  }
};

struct Scratch {
  std::vector<float> qf, acc, part;
  std::vector<uint32_t> qp;
  std::vector<int64_t> slots;
};

// Rows [p0, p0 + rows) of head h: every split they see, folded in order, then
// normalized into out.
template <int DV, int R, typename T, typename Split>
void attend_rows(const Args<T>& a, const Unit& u, int h, int64_t p0, int rows,
                 const void* const* q, Split split, Scratch& w) {
  constexpr int D = DV * kLanes;
  int64_t pos[R], lo[R];
  for (int r = 0; r < R; ++r) {
    pos[r] = p0 + std::min(r, rows - 1);
    lo[r] = first_visible(pos[r], a.window);
  }
  float M[R], L[R], pm[R], pl[R];
  std::fill(M, M + R, kNegInf);
  std::fill(L, L + R, 0.f);
  w.acc.resize(static_cast<size_t>(R) * D);
  w.part.resize(static_cast<size_t>(R) * D);
  for (int64_t s = lo[0] / kSplit; s <= pos[rows - 1] / kSplit; ++s) {
    split(q, pos, lo, rows, s * kSplit, SplitOut{pm, pl, w.part.data(), 1});
    for (int r = 0; r < rows; ++r)
      fold(M[r], L[r], w.acc.data() + r * D, pm[r], pl[r], w.part.data() + r * D, D);
  }
  const int64_t row0 = a.starts[u.req] + (p0 - a.prefix_lens[u.req]);
  for (int r = 0; r < rows; ++r) {
    T* dst = a.out + (row0 + r) * a.o_st + h * a.o_sh;
    if (a.dim == D) {
      finish(w.acc.data() + r * D, L[r], dst, D);
    } else {
      T tmp[D];
      finish(w.acc.data() + r * D, L[r], tmp, D);
      std::memcpy(dst, tmp, sizeof(T) * a.dim);
    }
  }
}

// Every query row of the unit (the group's heads over its positions), R rows at a time.
template <int DV, typename T, typename P>
void attend_unit(const Args<T>& a, const Unit& u, Shared<P>& sh, Scratch& w) {
  constexpr int D = DV * kLanes;
  constexpr int R = rows_per_tile<DV>();
  const int group = a.heads / a.kv_heads, g = static_cast<int>(u.kv_head);
  const Packed& pk = sh.packs[u.req];
  const P* kt = sh.keys(u.req, g);
  const P* vr = sh.values(u.req, g);
  const int64_t row_of_first = a.starts[u.req] - a.prefix_lens[u.req];  // q row of position 0
  constexpr bool pairs = std::is_same_v<P, uint32_t>;
  constexpr int qw = pairs ? D / 2 : D;  // a query row's packed width
  auto split = [&](const void* const* q, const int64_t* pos, const int64_t* lo, int rows,
                   int64_t sb, const SplitOut& out) {
#if defined(__AVX512BF16__)
    if constexpr (pairs) {
      split_bf16<DV, R>(reinterpret_cast<const uint32_t* const*>(q), pos, lo, rows, kt, vr,
                        pk.n, pk.first, sb, a.scale, a.softcap, out);
      return;
    }
#endif
    if constexpr (!pairs)
      split_f32<DV, R>(reinterpret_cast<const float* const*>(q), pos, lo, rows, kt, vr, pk.n,
                       pk.first, sb, a.scale, a.softcap, out);
  };
  if constexpr (pairs) w.qp.assign(static_cast<size_t>(R) * qw, 0u);
  else w.qf.resize(static_cast<size_t>(R) * qw);
  for (int hh = 0; hh < group; ++hh) {
    const int h = g * group + hh;
    for (int64_t p0 = u.first_pos; p0 < u.stop_pos; p0 += R) {
      const int rows = static_cast<int>(std::min<int64_t>(R, u.stop_pos - p0));
      const void* q[R];
      for (int r = 0; r < R; ++r) {
        const T* src = a.q + (row_of_first + p0 + r) * a.q_st + h * a.q_sh;
        if constexpr (pairs) {
          if (r < rows) std::memcpy(w.qp.data() + r * qw, src, a.dim * sizeof(T));
          q[r] = w.qp.data() + std::min(r, rows - 1) * qw;
        } else {
          if (r < rows)
            for (int c = 0; c < D; c += kLanes)
              store_vec(w.qf.data() + r * qw + c, load_widened(src, c, a.dim));
          q[r] = w.qf.data() + std::min(r, rows - 1) * qw;
        }
      }
      attend_rows<DV, R>(a, u, h, p0, rows, q, split, w);
    }
  }
}

// Jobs pulled by idle threads, in order: `jobs` of them, job(i, scratch).
template <typename F>
void pull(int64_t jobs, F&& job) {
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), jobs);
  if (workers <= 0) return;
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch w;
    for (int64_t i = next++; i < jobs; i = next++) job(i, w);
  });
}

template <int DV, typename T, typename P>
void run_flavour(const Args<T>& a, int64_t count) {
  constexpr int D = DV * kLanes;
  constexpr int64_t kPackCols = 256;  // positions per packing job
  Shared<P> sh;
  sh.kt_per_key = std::is_same_v<P, uint32_t> ? D / 2 : D;
  sh.vr_per_key = std::is_same_v<P, uint32_t> ? D / 2 : D;
  // Each request's keys and values are packed once, from the first position its
  // first new row sees (block-aligned) to its last, for every KV head.
  int64_t total = 0;
  std::vector<std::array<int64_t, 4>> pack_jobs;  // request, head, first column, end column
  sh.packs.resize(count);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pre = a.prefix_lens[i], stop = pre + a.extend_lens[i];
    const int64_t first = first_visible(pre, a.window) / kBlock * kBlock;
    const int64_t n = a.extend_lens[i] ? round_up(stop - first, kBlock) : 0;
    sh.packs[i] = {first, n, total};
    total += n * a.kv_heads;
    for (int g = 0; g < a.kv_heads; ++g)
      for (int64_t c = 0; c < n; c += kPackCols) pack_jobs.push_back({i, g, c, std::min(n, c + kPackCols)});
  }
  sh.kt.resize(total * sh.kt_per_key);
  sh.vr.resize(total * sh.vr_per_key);
  pull(static_cast<int64_t>(pack_jobs.size()), [&](int64_t j, Scratch& w) {
    const auto [i, g, c0, c1] = pack_jobs[j];
    const Packed& pk = sh.packs[i];
    const int64_t stop = a.prefix_lens[i] + a.extend_lens[i];
    a.r2t.copy(a.rows[i], pk.first + c0, std::min(stop, pk.first + c1) - pk.first - c0, w.slots);
    // The slots cover [first + c0, ...): index them from c0.
    const KvRows<T> kv{a.k, a.v, a.k_sn, a.v_sn, a.k_sh, a.v_sh, w.slots.data() - c0,
                       first_visible(a.prefix_lens[i], a.window) - pk.first};
    pack_range(kv, static_cast<int>(g), stop - pk.first, c0, c1, a.dim, D, pk.n,
               sh.keys(i, static_cast<int>(g)), sh.values(i, static_cast<int>(g)));
  });
  std::vector<Unit> units;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pre = a.prefix_lens[i], stop = pre + a.extend_lens[i];
    for (int64_t p = pre; p < stop; p += kChunkRows)
      for (int g = 0; g < a.kv_heads; ++g)
        units.push_back({i, g, p, std::min(stop, p + kChunkRows)});
  }
  // Longest first (work grows with the last position).
  std::stable_sort(units.begin(), units.end(), [&](const Unit& x, const Unit& y) {
    return (x.stop_pos - x.first_pos) * x.stop_pos > (y.stop_pos - y.first_pos) * y.stop_pos;
  });
  pull(static_cast<int64_t>(units.size()),
       [&](int64_t j, Scratch& w) { attend_unit<DV>(a, units[j], sh, w); });
}

template <int DV, typename T>
void run(const Args<T>& a, int64_t count) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    run_flavour<DV, T, uint32_t>(a, count);
    return;
  }
#endif
  run_flavour<DV, T, float>(a, count);
}

// q/out: [tokens, heads, dim]; k_buf/v_buf: [pool, kv_heads, dim], the new
// tokens' K/V already stored; request i has prefix_lens[i] cached tokens and
// extend_lens[i] new ones, its new rows following request i - 1's in q/out
// (rows past the last request's are untouched).
void extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      const at::Tensor& out, const at::Tensor& req_to_token,
                      const at::Tensor& req_pool_indices, const at::Tensor& prefix_lens,
                      const at::Tensor& extend_lens, double scale, int64_t window,
                      double softcap) {
  attn::check_layout("extend_attention", "[tokens, heads, dim]", q, k_buf, v_buf, out,
                     req_to_token);
  for (const at::Tensor* t : {&req_pool_indices, &prefix_lens, &extend_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() &&
                    t->numel() == req_pool_indices.numel(),
                "extend_attention: req_pool_indices, prefix_lens and extend_lens are "
                "contiguous int64 of one length");
  const int heads = static_cast<int>(q.size(1)), kv_heads = static_cast<int>(k_buf.size(1));
  const int dim = static_cast<int>(q.size(2));
  attn::check_heads("extend_attention", q, k_buf, v_buf, window, softcap);
  const int64_t count = req_pool_indices.numel();
  const int64_t* pre = prefix_lens.data_ptr<int64_t>();
  const int64_t* ext = extend_lens.data_ptr<int64_t>();
  std::vector<int64_t> starts(count);
  int64_t rows = 0;
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(pre[i] >= 0 && ext[i] >= 0 && pre[i] + ext[i] <= req_to_token.size(1),
                "extend_attention: request lengths out of range");
    starts[i] = rows;
    rows += ext[i];
  }
  TORCH_CHECK(rows <= q.size(0) && rows <= out.size(0), "extend_attention: q rows out of range");
  const int dp = padded_lanes(dim) * kLanes;
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt || req_to_token.scalar_type() == at::kLong,
              "req_to_token: int32 or int64");
  const SlotTable r2t{req_to_token.data_ptr(), req_to_token.scalar_type() == at::kInt,
                      req_to_token.stride(0)};
  auto launch = [&](auto* q_ptr) {
    using T = std::remove_pointer_t<decltype(q_ptr)>;
    Args<T> a{q_ptr, q.stride(0), q.stride(1),
              static_cast<T*>(out.data_ptr()), out.stride(0), out.stride(1),
              static_cast<const T*>(k_buf.data_ptr()), k_buf.stride(0), k_buf.stride(1),
              static_cast<const T*>(v_buf.data_ptr()), v_buf.stride(0), v_buf.stride(1),
              r2t, req_pool_indices.data_ptr<int64_t>(), pre, ext, starts.data(), heads,
              kv_heads, dim, dp, static_cast<float>(scale), window,
              static_cast<float>(softcap)};
    with_width(dp / kLanes, [&](auto dv) { run<decltype(dv)::value>(a, count); });
  };
  switch (q.scalar_type()) {
    case at::kFloat: launch(q.data_ptr<float>()); break;
    case at::kBFloat16: launch(q.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: launch(q.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "extend_attention: dtype must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("extend_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor(a!) out, "
        "Tensor req_to_token, Tensor req_pool_indices, Tensor prefix_lens, "
        "Tensor extend_lens, float scale, int window, float softcap) -> ()");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) { m.impl("extend_attention", &extend_attention); }
