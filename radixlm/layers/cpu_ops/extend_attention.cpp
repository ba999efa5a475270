// Causal prefill ("extend") attention on the CPU, straight from the KV pool: the
// new rows of each request attend to its cached prefix and to themselves.
//
// torch's CPU flash attention runs SmolLM2's prefill (32 prompts x 256 tokens,
// 9 query / 3 KV heads of 64) at about 28 GFLOP/s here, 37-43 ms per layer call,
// about a fifth of the whole prefill: its inner products are not the
// bottleneck, its per-block bookkeeping is. Here, in bf16 on CPUs with
// AVX512-BF16, both products run on `vdpbf16ps` (attention.h has the layouts).
// Work unit: one (request, KV head, chunk of new rows), pulled by idle threads
// longest first, in one parallel pass. A unit packs its keys and values (from
// the first position its first row sees, block-aligned, to its last row) from
// the pool into its thread's buffers, which stay hot in cache and are kept from
// call to call; then every query row of the GROUP heads that share the KV head
// walks the key blocks up to its position, R rows at a time with their output in
// registers, split by split (attention.h), so each row gets the bits a decode
// step at its position would: the result of a row does not depend on where its
// chunk began, how much of the prompt was cached, or what else is in the batch.
// A request is cut into chunks only when it is more than an eighth of a thread's
// share of the call's work (a long prompt spreads over the threads; a batch of
// short ones packs each request's keys once per KV head, as the fresh-prompt
// kernel this one replaced did).
//
// Layer variants: with a sliding window W the query at position p sees keys
// p - W + 1 .. p only (key blocks wholly before a row's window are skipped,
// partial ones masked); a softcap c maps each scaled score s to
// c * tanh(s / c) before the mask and the softmax.

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

struct Unit {
  int64_t req, kv_head, first_pos, stop_pos;  // new rows at positions [first_pos, stop_pos)
  int64_t work;                               // its cost (for the order)
};

// One thread's buffers (`thread_scratch`: no allocation, no page faults per
// layer): the unit's packed keys and values (one KV head, P: the flavour's
// element), query rows padded to the compiled width, the splits' results.
template <typename P>
struct Scratch {
  std::vector<P> kt, vr, qrows;
  std::vector<float> acc, part;
  std::vector<int64_t> slots;
};

// Rows [p0, p0 + rows) of head h: every split they see, folded in order, then
// normalized into out. The first split is written straight into the
// accumulator: what `fold` makes of (m, l, o) into a fresh (-inf) state.
template <int DV, int R, typename T, typename P, typename Split>
void attend_rows(const Args<T>& a, const Unit& u, int h, int64_t p0, int rows,
                 const void* const* q, Split split, Scratch<P>& w) {
  constexpr int D = DV * kLanes;
  int64_t pos[R], lo[R];
  for (int r = 0; r < R; ++r) {
    pos[r] = p0 + std::min(r, rows - 1);
    lo[r] = first_visible(pos[r], a.window);
  }
  float M[R], L[R], pm[R], pl[R];
  float* acc = w.acc.data();
  const int64_t s0 = lo[0] / kSplit, s1 = pos[rows - 1] / kSplit;
  split(q, pos, lo, rows, s0 * kSplit, SplitOut{M, L, acc, 1});
  for (int64_t s = s0 + 1; s <= s1; ++s) {
    split(q, pos, lo, rows, s * kSplit, SplitOut{pm, pl, w.part.data(), 1});
    for (int r = 0; r < rows; ++r)
      fold(M[r], L[r], acc + r * D, pm[r], pl[r], w.part.data() + r * D, D);
  }
  const int64_t row0 = a.starts[u.req] + (p0 - a.prefix_lens[u.req]);
  for (int r = 0; r < rows; ++r) {
    T* dst = a.out + (row0 + r) * a.o_st + h * a.o_sh;
    if (a.dim == D) {
      finish(acc + r * D, L[r], dst, D);
    } else {
      T tmp[D];
      finish(acc + r * D, L[r], tmp, D);
      std::memcpy(dst, tmp, sizeof(T) * a.dim);
    }
  }
}

// One unit: its keys and values (from the first position its first row sees,
// block-aligned, to its last row) packed from the pool into the thread's
// buffers, then every query row of the group's heads over its positions, R
// rows at a time.
template <int DV, typename T, typename P>
void attend_unit(const Args<T>& a, const Unit& u, Scratch<P>& w) {
  constexpr int D = DV * kLanes;
  constexpr int R = rows_per_tile<DV>();
  constexpr bool pairs = std::is_same_v<P, uint32_t>;
  constexpr int per_key = pairs ? D / 2 : D;  // elements per packed position (and query row)
  const int group = a.heads / a.kv_heads, g = static_cast<int>(u.kv_head);
  const int64_t i = u.req, lo_first = first_visible(u.first_pos, a.window);
  const int64_t first = lo_first / kBlock * kBlock, count = u.stop_pos - first;
  const int64_t n = round_up(count, kBlock);
  w.kt.resize(static_cast<size_t>(n) * per_key);
  w.vr.resize(static_cast<size_t>(n) * per_key);
  a.r2t.copy(a.rows[i], first, count, w.slots);
  const KvRows<T> kv{a.k, a.v, a.k_sn, a.v_sn, a.k_sh, a.v_sh, w.slots.data(), lo_first - first};
  pack_range(kv, g, count, 0, n, a.dim, D, n, w.kt.data(), w.vr.data());
  const P* kt = w.kt.data();
  const P* vr = w.vr.data();
  auto split = [&](const void* const* q, const int64_t* pos, const int64_t* lo, int rows,
                   int64_t sb, const SplitOut& out) {
#if defined(__AVX512BF16__)
    if constexpr (pairs) {
      split_bf16<DV, R>(reinterpret_cast<const uint32_t* const*>(q), pos, lo, rows, kt, vr, n,
                        first, sb, a.scale, a.softcap, out);
      return;
    }
#endif
    if constexpr (!pairs)
      split_f32<DV, R>(reinterpret_cast<const float* const*>(q), pos, lo, rows, kt, vr, n,
                       first, sb, a.scale, a.softcap, out);
  };
  // Query rows are read in place when they are already in the flavour's layout
  // (bf16 pairs, or fp32, at the compiled width); else copied, widened, zero-padded.
  constexpr bool same = pairs ? std::is_same_v<T, c10::BFloat16> : std::is_same_v<T, float>;
  const bool in_place = same && a.dim == D && (a.q_st * sizeof(T)) % 4 == 0 &&
                        (a.q_sh * sizeof(T)) % 4 == 0 &&
                        reinterpret_cast<uintptr_t>(a.q) % 4 == 0;
  if (!in_place) {
    if constexpr (pairs) w.qrows.assign(static_cast<size_t>(R) * per_key, 0u);
    else w.qrows.resize(static_cast<size_t>(R) * per_key);
  }
  w.acc.resize(static_cast<size_t>(R) * D);
  w.part.resize(static_cast<size_t>(R) * D);
  const int64_t row_of_first = a.starts[i] - a.prefix_lens[i];  // q row of position 0
  for (int hh = 0; hh < group; ++hh) {
    const int h = g * group + hh;
    for (int64_t p0 = u.first_pos; p0 < u.stop_pos; p0 += R) {
      const int rows = static_cast<int>(std::min<int64_t>(R, u.stop_pos - p0));
      const void* q[R];
      for (int r = 0; r < R; ++r) {
        const T* src = a.q + (row_of_first + p0 + std::min(r, rows - 1)) * a.q_st + h * a.q_sh;
        if (in_place) {
          q[r] = src;
          continue;
        }
        P* dst = w.qrows.data() + std::min(r, rows - 1) * per_key;
        q[r] = dst;
        if (r >= rows) continue;
        if constexpr (pairs) {
          std::memcpy(dst, src, a.dim * sizeof(T));
        } else {
          for (int c = 0; c < D; c += kLanes) store_vec(dst + c, load_widened(src, c, a.dim));
        }
      }
      attend_rows<DV, R>(a, u, h, p0, rows, q, split, w);
    }
  }
}

// The cost of the rows at positions [p0, p1): the blocks they walk, plus a block each.
inline int64_t rows_work(int64_t p0, int64_t p1, int64_t window) {
  int64_t work = 0;
  for (int64_t p = p0; p < p1; ++p) work += p / kBlock - first_visible(p, window) / kBlock + 2;
  return work;
}

// Work units: each request's new rows for one KV head, cut into chunks when the
// request alone is more than a small share of the call's work (a long prompt
// spreads over the threads; a batch of short ones keeps one unit per (request,
// KV head), packing its keys once). Chunks hold whole register tiles of R rows.
template <int R, typename T>
std::vector<Unit> make_units(const Args<T>& a, int64_t count) {
  constexpr int64_t kMinChunkRows = 32;
  std::vector<int64_t> work(count);
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pre = a.prefix_lens[i];
    work[i] = rows_work(pre, pre + a.extend_lens[i], a.window);
    total += work[i] * a.kv_heads;
  }
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t target = std::max<int64_t>(1, total / (threads * 8));
  std::vector<Unit> units;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t pre = a.prefix_lens[i], stop = pre + a.extend_lens[i];
    for (int64_t p = pre; p < stop;) {
      int64_t end = stop, w = work[i];
      if (work[i] > target) {  // cut after the tile that reaches the target
        end = p;
        w = 0;
        while (end < stop && (w < target || end - p < kMinChunkRows)) {
          const int64_t e = std::min(stop, end + R);
          w += rows_work(end, e, a.window);
          end = e;
        }
        if (stop - end < kMinChunkRows) {  // no runt at the end
          w += rows_work(end, stop, a.window);
          end = stop;
        }
      }
      for (int g = 0; g < a.kv_heads; ++g) units.push_back({i, g, p, end, w});
      p = end;
    }
  }
  // Longest first.
  std::stable_sort(units.begin(), units.end(),
                   [](const Unit& x, const Unit& y) { return x.work > y.work; });
  return units;
}

template <int DV, typename T, typename P>
void run_flavour(const Args<T>& a, int64_t count) {
  const std::vector<Unit> units = make_units<rows_per_tile<DV>()>(a, count);
  const int64_t jobs = static_cast<int64_t>(units.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), jobs);
  if (workers <= 0) return;
  // Units pulled by idle threads, in order.
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch<P>& w = thread_scratch<Scratch<P>>();
    for (int64_t j = next++; j < jobs; j = next++) attend_unit<DV>(a, units[j], w);
    // A long prompt's buffers are not kept for the rest of the process.
    constexpr size_t kKeep = size_t{4} << 20;
    if (w.kt.capacity() * sizeof(P) > kKeep) {
      std::vector<P>().swap(w.kt);
      std::vector<P>().swap(w.vr);
    }
  });
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
