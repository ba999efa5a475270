// Torch ops over the quantized-weight kernels of qgemm.h: checks, threading,
// and the choice of ISA path (the best this CPU runs, or the one asked for).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <tuple>
#include <vector>

#include "qgemm.h"
#include "qgemm_pool.h"

namespace {

using namespace radixlm_q;

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Vnni = 3, kNumIsas = 4 };

bool cpu_has(int64_t isa) {
#if defined(__x86_64__)
  switch (isa) {
    case kPortable: return true;
    case kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    case kAvx512Vnni: return cpu_has(kAvx512) && __builtin_cpu_supports("avx512vnni");
  }
  return false;
#else
  return isa == kPortable;
#endif
}

const Kernels* table(int64_t isa) {
  switch (isa) {
    case kPortable: return kernels_portable();
    case kAvx2: return kernels_avx2();
    case kAvx512: return kernels_avx512();
    case kAvx512Vnni: return kernels_avx512_vnni();
  }
  return nullptr;
}

bool isa_supported(int64_t isa) { return table(isa) != nullptr && cpu_has(isa); }

// isa < 0: the best path this CPU runs.
const Kernels* kernels_for(int64_t isa) {
  if (isa < 0) {
    for (int64_t i = kNumIsas - 1; i >= 0; --i)
      if (isa_supported(i)) return table(i);
  }
  TORCH_CHECK(isa < kNumIsas && isa_supported(isa), "quantized-kernel ISA path ", isa,
              " is not available on this CPU or build");
  return table(isa);
}

std::string isa_name(int64_t isa) { return kernels_for(isa)->name; }

int64_t block_of(int64_t format) {
  switch (format) {
    case kQ6_K: return Traits<kQ6_K>::kBlock;
    default: return 32;
  }
}

int64_t block_bytes_of(int64_t format) {
  switch (format) {
    case kQ4_0: return kBlockBytes<kQ4_0>;
    case kQ4_1: return kBlockBytes<kQ4_1>;
    case kQ8_0: return kBlockBytes<kQ8_0>;
    case kQ4_K: return kBlockBytes<kQ4_K>;
    case kQ5_K: return kBlockBytes<kQ5_K>;
    case kQ6_K: return kBlockBytes<kQ6_K>;
    case kI8: return kBlockBytes<kI8>;
  }
  TORCH_CHECK(false, "unknown quantized format ", format);
}

bool is_asym(int64_t format) { return format == kQ4_1 || format == kQ4_K || format == kQ5_K; }
bool f32_scales(int64_t format) { return format >= kQ4_K; }

PackedWeight packed_weight(const at::Tensor& qweight, const at::Tensor& scales,
                           const at::Tensor& mins, int64_t format, int64_t n, int64_t k) {
  TORCH_CHECK(format >= 0 && format < kNumFormats, "unknown quantized format ", format);
  TORCH_CHECK(n > 0 && k > 0 && k % kActBlock == 0, "quantized weight: n=", n, ", k=", k,
              " (k must be a positive multiple of ", kActBlock, ")");
  const int64_t tiles = (n + kTile - 1) / kTile, blocks = k / block_of(format);
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous() &&
                  qweight.numel() == tiles * blocks * block_bytes_of(format),
              "qweight must be contiguous uint8 with ", tiles * blocks * block_bytes_of(format),
              " bytes for n=", n, ", k=", k);
  const int64_t scale_count = format == kI8 ? tiles * kTile : tiles * blocks * kTile;
  const auto scale_type = f32_scales(format) ? at::kFloat : at::kHalf;
  TORCH_CHECK(scales.scalar_type() == scale_type && scales.is_contiguous() &&
                  scales.numel() == scale_count,
              "scales must be contiguous ", scale_type, " with ", scale_count, " values");
  if (is_asym(format))
    TORCH_CHECK(mins.scalar_type() == scale_type && mins.is_contiguous() &&
                    mins.numel() == scale_count,
                "mins must be contiguous ", scale_type, " with ", scale_count, " values");
  return PackedWeight{static_cast<int>(format), n, k, tiles, blocks, qweight.data_ptr<uint8_t>(),
                      scales.data_ptr(), is_asym(format) ? mins.data_ptr() : nullptr};
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1,
              what, " must be a 2-D CPU tensor with a contiguous last dimension");
}

// Threading. Products and activation quantizations run on the pool of
// qgemm_pool.h: the caller and pool_threads() - 1 workers that spin
// (yielding) between the products of a forward pass, then sleep. Not on
// at::parallel_for: under the engine's passive OpenMP wait policy every
// product paid a sleeping thread's wake-up. bench.cpu_qgemm's model pass (121
// SmolLM2 linears, 2 threads, passive), ms, old threading -> pool, one run:
//   M = 1: 10.9 -> 7.9, 4: 12.1 -> 10.4, 8: 22.8 -> 10.5, 32: 34.4 -> 24.4,
//   256: 247 -> 210 (docs/kernels.md has the figures of record).
// pool_rows (set_threading) bounds the rows that take the pool: every size by
// default here, none where qgemm.py finds OpenMP's threads spinning when idle
// (not OMP_WAIT_POLICY=PASSIVE: they then hold the second core against our
// workers, and OpenMP's own products are fast). 0 gives the threading before
// the pool: fewer than 8 rows on the calling
// thread alone (kSerialRows), more on at::parallel_for. That is also the
// fallback when the pool is held by another Python thread's product.
std::atomic<int64_t> g_pool_rows{std::numeric_limits<int64_t>::max()};

// The pool, made on first use and remade when torch's thread count changes.
// g_pool_mu is held around each pooled job: a second Python thread that finds
// it held takes the fallback; fork() takes it (prepare), so no job is in
// flight when the child drops the pool, whose threads the child does not have
// (the object is leaked there, never joined).
std::mutex g_pool_mu;
Pool* g_pool = nullptr;  // under g_pool_mu

void pool_fork_prepare() { g_pool_mu.lock(); }
void pool_fork_parent() { g_pool_mu.unlock(); }
void pool_fork_child() {
  g_pool = nullptr;
  g_pool_mu.unlock();
}

Pool* pool_of(int workers) {  // under g_pool_mu
  static const bool registered = [] {
    pthread_atfork(pool_fork_prepare, pool_fork_parent, pool_fork_child);
    return true;
  }();
  (void)registered;
  if (g_pool == nullptr || g_pool->workers() != workers) {
    delete g_pool;  // joins its threads: none is in a job (we hold the lock)
    g_pool = nullptr;
    g_pool = new Pool(workers);
  }
  return g_pool;
}

// The threads the pool works with: torch's count, or the count pinned while a
// decode-sized step runs torch's own ops on one thread (qgemm.py,
// torch_ops_on_one_thread), so that the products keep both cores.
std::atomic<int> g_pinned_threads{0};

int pool_threads() {
  const int pinned = g_pinned_threads.load(std::memory_order_relaxed);
  return pinned > 0 ? pinned : at::get_num_threads();
}

// Pins the pool's thread count (0: torch's again); returns the previous pin.
int64_t pin_pool_threads(int64_t threads) {
  return g_pinned_threads.exchange(static_cast<int>(std::max<int64_t>(0, threads)));
}

// fn(ctx, c) for c in [0, count) on the pool; false (nothing run) when the pool
// does not take it: rows >= pool_rows, one thread, inside a parallel region,
// fewer than 2 chunks, or the pool held by another thread.
bool pool_run(int64_t rows, Pool::Fn fn, const void* ctx, int64_t count) {
  if (rows >= g_pool_rows.load(std::memory_order_relaxed) || count < 2 ||
      count > Pool::kMaxChunks)
    return false;
  const int threads = pool_threads();
  if (threads < 2 || at::in_parallel_region()) return false;
  std::unique_lock<std::mutex> lock(g_pool_mu, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  pool_of(threads - 1)->run(fn, ctx, count);
  return true;
}

template <typename Body>
bool on_pool(int64_t rows, int64_t count, const Body& body) {
  return pool_run(
      rows, [](const void* ctx, int64_t c) { (*static_cast<const Body*>(ctx))(c); }, &body,
      count);
}

// pool_run's address, for the other extension (radixlm_cpu: decode attention's
// units) to run its work on the same workers: two pools would spin against
// each other on the same cores, and OpenMP's sleeping threads wake too slowly
// for work of ~100 us (qgemm.py hands it over at load: _share_pool).
int64_t pool_entry() { return reinterpret_cast<int64_t>(&pool_run); }

// Pool chunks of a product: tile_step tiles x up to kRowsPerItem rows (the
// rows the kernel passes over each group of 4 tiles while it is in L1/L2).
// ~4 chunks per thread, so that a late worker costs at most a quarter of its
// share (the caller takes the rest); even (the kernel runs tiles in pairs); at
// most 32 tiles (200-350 KB of 4-8 bit weights at k = 576-1536, 10-25 us at
// one core's bandwidth). 2 or 8 chunks per thread, or 16 or 64 tiles at most,
// measured the same within noise.
int64_t tile_step(int64_t tiles, int threads) {
  const int64_t step = (tiles + 4 * threads - 1) / (4 * threads);
  return std::min<int64_t>(32, std::max<int64_t>(2, (step + 1) & ~int64_t{1}));
}

// The fallback's work items: groups of tiles x blocks of rows, each worth at
// least ~2^17 multiply-adds per thread.
constexpr int64_t kTilesPerItem = 4, kRowsPerItem = 128;
// The fallback below this many rows: the calling thread alone (waking a
// passive OpenMP thread per product cost more than it gained: 9.5-9.8 ms per
// SmolLM2 decode token's matmuls on one thread vs 14-15 ms on two at 1 row).
constexpr int64_t kSerialRows = 8;

void run_gemm(const Kernels* kernels, const PackedWeight& w, const QuantAct& a, const Out& out) {
  const int64_t step = tile_step(w.tiles, pool_threads());
  const int64_t row_chunks = (a.m + kRowsPerItem - 1) / kRowsPerItem;
  const auto chunk = [&](int64_t c) {
    const int64_t tg = c / row_chunks, rb = c % row_chunks;
    const int64_t t0 = tg * step, t1 = std::min(w.tiles, t0 + step);
    const int64_t m0 = rb * kRowsPerItem, m1 = std::min(a.m, m0 + kRowsPerItem);
    kernels->gemm(w, a, m0, m1, t0, t1, out);
  };
  if (on_pool(a.m, (w.tiles + step - 1) / step * row_chunks, chunk)) return;
  if (a.m < kSerialRows) {
    kernels->gemm(w, a, 0, a.m, 0, w.tiles, out);
    return;
  }
  const int64_t tile_items = (w.tiles + kTilesPerItem - 1) / kTilesPerItem;
  const int64_t row_items = (a.m + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t work_per_item = std::min(a.m, kRowsPerItem) * kTilesPerItem * kTile * w.k;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / work_per_item);
  at::parallel_for(0, tile_items * row_items, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tg = item / row_items, rb = item % row_items;
      const int64_t t0 = tg * kTilesPerItem, t1 = std::min(w.tiles, t0 + kTilesPerItem);
      const int64_t m0 = rb * kRowsPerItem, m1 = std::min(a.m, m0 + kRowsPerItem);
      kernels->gemm(w, a, m0, m1, t0, t1, out);
    }
  });
}

// pool_rows < 0 and spin_us < 0 keep the current value; returns the values now.
std::tuple<int64_t, int64_t> set_threading(int64_t pool_rows, int64_t spin_us) {
  if (pool_rows >= 0) g_pool_rows.store(pool_rows);
  if (spin_us >= 0) Pool::spin_ns().store(spin_us * 1000);
  return {g_pool_rows.load(), Pool::spin_ns().load() / 1000};
}

struct ActBuffers {
  at::Tensor q, d, sum16, dsum;
  QuantAct view() const {
    return QuantAct{q.size(0), q.size(1), q.data_ptr<int8_t>(), d.data_ptr<float>(),
                    sum16.data_ptr<int32_t>(), dsum.data_ptr<float>()};
  }
};

void check_act_input(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) % kActBlock == 0, "x has ", x.size(1),
              " columns; quantized products need a multiple of ", kActBlock);
}

// x quantized into a's buffers ([x.size(0), x.size(1)]).
void quantize_rows(const Kernels* kernels, const at::Tensor& x, const QuantAct& a) {
  const int64_t m = x.size(0), k = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const void* data = x.data_ptr();
  const int64_t ld = x.stride(0);
  int8_t* q = const_cast<int8_t*>(a.q);
  float* d = const_cast<float*>(a.d);
  int32_t* sum16 = const_cast<int32_t*>(a.sum16);
  float* dsum = const_cast<float*>(a.dsum);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / k);  // rows
  const auto rows = [&](int64_t b, int64_t e) {
    kernels->quantize(data, bf16, ld, b, e, k, q, d, sum16, dsum);
  };
  const auto chunk = [&](int64_t c) { rows(c * grain, std::min(m, (c + 1) * grain)); };
  if (!on_pool(m, (m + grain - 1) / grain, chunk)) at::parallel_for(0, m, grain, rows);
}

ActBuffers quantize_into(const Kernels* kernels, const at::Tensor& x) {
  check_act_input(x);
  const int64_t m = x.size(0), k = x.size(1);
  ActBuffers buf{at::empty({m, k}, x.options().dtype(at::kChar)),
                 at::empty({m, k / kActBlock}, x.options().dtype(at::kFloat)),
                 at::empty({m, k / 16}, x.options().dtype(at::kInt)),
                 at::empty({m, k / kActBlock}, x.options().dtype(at::kFloat))};
  quantize_rows(kernels, x, buf.view());
  return buf;
}

// linear's quantized activations up to this many values live in a buffer
// per calling thread instead of four tensors: a decode-sized product paid
// ~2 us of its 15-80 us for the allocations. Larger ones (prefill) allocate,
// so no thread keeps megabytes.
constexpr int64_t kScratchValues = int64_t{1} << 20;

QuantAct scratch_act(int64_t m, int64_t k) {
  thread_local std::vector<int64_t> scratch;  // 8-byte aligned
  const int64_t blocks = m * k / kActBlock;
  // q: m k bytes, then d, sum16 (2 per block), dsum: 4 bytes each.
  const int64_t bytes = m * k + 4 * blocks * 4;
  if (int64_t(scratch.size()) * 8 < bytes) scratch.resize((bytes + 7) / 8);
  uint8_t* base = reinterpret_cast<uint8_t*>(scratch.data());
  float* d = reinterpret_cast<float*>(base + m * k);  // m k is a multiple of 32
  int32_t* sum16 = reinterpret_cast<int32_t*>(d + blocks);
  float* dsum = reinterpret_cast<float*>(sum16 + 2 * blocks);
  return QuantAct{m, k, reinterpret_cast<int8_t*>(base), d, sum16, dsum};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_act(const at::Tensor& x,
                                                                        int64_t isa) {
  ActBuffers buf = quantize_into(kernels_for(isa), x);
  return {buf.q, buf.d, buf.sum16, buf.dsum};
}

Out out_view(const at::Tensor& out, int64_t m, int64_t n) {
  check_rows(out, "out");
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "out must be [", m, ", ", n, "], got ",
              out.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "out must be float32 or bfloat16");
  return Out{out.data_ptr(), out.stride(0), out.scalar_type() == at::kBFloat16};
}

// out = x W^T for activations already quantized by quantize_act: several
// weights (q, k and v of one layer, each in its own format) share one
// quantization, each writing its columns of one output.
void gemm(const at::Tensor& xq, const at::Tensor& xd, const at::Tensor& xsum16,
          const at::Tensor& xdsum, const at::Tensor& qweight, const at::Tensor& scales,
          const at::Tensor& mins, int64_t format, int64_t n, at::Tensor& out, int64_t isa) {
  check_rows(xq, "xq");
  const int64_t m = xq.size(0), k = xq.size(1);
  TORCH_CHECK(xq.scalar_type() == at::kChar && xq.is_contiguous() && xd.is_contiguous() &&
                  xsum16.is_contiguous() && xdsum.is_contiguous() &&
                  xd.numel() == m * (k / kActBlock) && xsum16.numel() == m * (k / 16) &&
                  xdsum.numel() == m * (k / kActBlock),
              "activations must come from quantize_act");
  const PackedWeight w = packed_weight(qweight, scales, mins, format, n, k);
  const QuantAct a{m, k, xq.data_ptr<int8_t>(), xd.data_ptr<float>(), xsum16.data_ptr<int32_t>(),
                   xdsum.data_ptr<float>()};
  run_gemm(kernels_for(isa), w, a, out_view(out, m, n));
}

// x [m, k] (float32 or bfloat16) times W^T -> [m, n] in x's dtype.
at::Tensor linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                  const at::Tensor& mins, int64_t format, int64_t n, int64_t isa) {
  const Kernels* kernels = kernels_for(isa);
  check_act_input(x);
  const int64_t m = x.size(0), k = x.size(1);
  const PackedWeight w = packed_weight(qweight, scales, mins, format, n, k);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m * k <= kScratchValues) {
    const QuantAct a = scratch_act(m, k);
    quantize_rows(kernels, x, a);
    run_gemm(kernels, w, a, out_view(out, m, n));
  } else {
    const ActBuffers buf = quantize_into(kernels, x);
    run_gemm(kernels, w, buf.view(), out_view(out, m, n));
  }
  return out;
}

// The routed experts of one token: out[e] = x[m == 1 ? 0 : e] W_e^T for the
// weights W_e of one shape and format (gate/up of each chosen expert against the
// one token, or down against each expert's own row). The rows are quantized
// once, and every expert's tiles are one pool job, so the products of a MoE
// layer hand off to the workers once instead of once per expert, and a worker
// that finishes one expert's tiles takes the next's.
void grouped_linear(const at::Tensor& x, at::TensorList qweights, at::TensorList scales,
                    at::TensorList mins, int64_t format, int64_t n, at::Tensor& out,
                    int64_t isa) {
  const Kernels* kernels = kernels_for(isa);
  check_act_input(x);
  const int64_t experts = static_cast<int64_t>(qweights.size()), m = x.size(0), k = x.size(1);
  TORCH_CHECK(experts > 0 && static_cast<int64_t>(scales.size()) == experts &&
                  static_cast<int64_t>(mins.size()) == experts,
              "grouped_linear: one qweight, scales and mins per expert");
  TORCH_CHECK(m == 1 || m == experts, "grouped_linear: x has one row, or one per expert");
  std::vector<PackedWeight> w;
  w.reserve(experts);
  for (int64_t e = 0; e < experts; ++e)
    w.push_back(packed_weight(qweights[e], scales[e], mins[e], format, n, k));
  const Out o = out_view(out, experts, n);
  const int64_t elem = o.bf16 ? 2 : 4;
  // The per-thread scratch where it holds the rows, as `linear` takes it.
  ActBuffers buf;
  QuantAct all;
  if (m * k <= kScratchValues) {
    all = scratch_act(m, k);
    quantize_rows(kernels, x, all);
  } else {
    buf = quantize_into(kernels, x);
    all = buf.view();
  }
  const auto row = [&](int64_t e) {
    const int64_t r = m == 1 ? 0 : e, blocks = k / kActBlock;
    return QuantAct{1, k, all.q + r * k, all.d + r * blocks, all.sum16 + r * (k / 16),
                    all.dsum + r * blocks};
  };
  const int64_t step = tile_step(w[0].tiles * experts, pool_threads());
  const int64_t per_expert = (w[0].tiles + step - 1) / step;
  const auto chunk = [&](int64_t c) {
    const int64_t e = c / per_expert, t0 = (c % per_expert) * step;
    const Out oe{static_cast<char*>(o.data) + e * o.ld * elem, o.ld, o.bf16};
    kernels->gemm(w[e], row(e), 0, 1, t0, std::min(w[e].tiles, t0 + step), oe);
  };
  if (on_pool(1, experts * per_expert, chunk)) return;
  for (int64_t c = 0; c < experts * per_expert; ++c) chunk(c);
}

// Rows `rows` of W, dequantized to `dtype` (float32 or bfloat16): an embedding
// lookup, or the whole weight read back.
at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
                      int64_t format, int64_t n, int64_t k, const at::Tensor& rows,
                      at::ScalarType dtype) {
  const PackedWeight w = packed_weight(qweight, scales, mins, format, n, k);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1, "rows must be 1-D int64");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  const at::Tensor idx = rows.contiguous();
  const int64_t count = idx.numel();
  const int64_t* ids = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < n, "row ", ids[i], " out of range [0, ", n, ")");
  at::Tensor out = at::empty({count, k}, rows.options().dtype(dtype));
  const Out o = out_view(out, count, k);
  const Kernels* portable = kernels_portable();
  at::parallel_for(0, count, std::max<int64_t>(1, (int64_t{1} << 16) / k),
                   [&](int64_t b, int64_t e) { portable->dequantize(w, ids, b, e, o); });
  return out;
}

}  // namespace

TORCH_LIBRARY(radixlm_q, m) {
  m.def("isa_supported(int isa) -> bool", &isa_supported);
  m.def("isa_name(int isa) -> str", &isa_name);
  m.def("set_threading(int pool_rows, int spin_us) -> (int, int)", &set_threading);
  m.def("pool_entry() -> int", &pool_entry);
  m.def("pin_pool_threads(int threads) -> int", &pin_pool_threads);
  m.def("quantize_act(Tensor x, int isa) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("gemm(Tensor xq, Tensor xd, Tensor xsum16, Tensor xdsum, Tensor qweight, Tensor scales, "
        "Tensor mins, int format, int n, Tensor(a!) out, int isa) -> ()");
  m.def("linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins, int format, int n, "
        "int isa) -> Tensor");
  m.def("dequantize(Tensor qweight, Tensor scales, Tensor mins, int format, int n, int k, "
        "Tensor rows, ScalarType dtype) -> Tensor");
  m.def("grouped_linear(Tensor x, Tensor[] qweights, Tensor[] scales, Tensor[] mins, "
        "int format, int n, Tensor(a!) out, int isa) -> ()");
}

TORCH_LIBRARY_IMPL(radixlm_q, CPU, m) {
  m.impl("quantize_act", &quantize_act);
  m.impl("gemm", &gemm);
  m.impl("linear", &linear);
  m.impl("dequantize", &dequantize);
  m.impl("grouped_linear", &grouped_linear);
}
