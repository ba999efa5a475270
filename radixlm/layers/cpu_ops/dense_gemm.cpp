// Products with float weights whose result for a row does not depend on how
// many rows are multiplied at once.
//
// MKL's sgemm and oneDNN's bf16 products choose their kernels and reduction
// orders by the number of rows: a row alone (a decode step) and the same row in
// a prefill of 64 get different low bits (measured: fp32 from M = 2 on, bf16
// from M = 32 on at SmolLM2's LM-head shape). Here every output element is one
// chain of fused multiply-adds over k = 0 .. K-1 in order, in one register
// lane, whatever the row count, the tile a row lands in or the threads:
//   - fp32 weights (and fp16, and bf16 on CPUs without AVX512-BF16), widened
//     to fp32 and packed as panels [N / 32][K][32]: lane n of a panel row gets
//     x[m][k] * W[n][k] per k;
//   - bf16 weights on CPUs with AVX512-BF16: panels [N / 32][K / 2][32] of
//     (W[n][2k], W[n][2k + 1]) pairs for `vdpbf16ps`, one exact pair product
//     summed into fp32 per step.
// A tile is up to kRows rows by one panel (two 16-lane registers each), over
// the whole K: the accumulators never leave the registers, the bias is added
// once at the end, then the result is rounded to the output dtype. Threads
// split the rows and panels, never K.

#include "attention.h"  // fma_vec, vec helpers

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

namespace {

using namespace radixlm_cpu;
using radixlm_cpu::attn::fma_vec;

constexpr int kPanel = 32;  // output columns per panel
#if defined(__AVX512F__)
constexpr int kRows = 12;   // 24 accumulators of the 32 registers
#else
constexpr int kRows = 3;    // 16-lane vectors are two AVX2 registers each
#endif
constexpr int64_t kBlockRows = 16 * kRows;  // rows of x widened and read per task

// ---- fp32 flavour ----------------------------------------------------------

template <int MR>
void tile_f32(const float* x, int64_t x_s, const float* panel, int64_t k, float* acc_out) {
  vfloat acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = vfloat{};
  for (int64_t i = 0; i < k; ++i) {
    const vfloat b0 = load_vec(panel + i * kPanel), b1 = load_vec(panel + i * kPanel + kLanes);
    for (int r = 0; r < MR; ++r) {
      const vfloat a = splat(x[r * x_s + i]);
      acc[r][0] = fma_vec(a, b0, acc[r][0]);
      acc[r][1] = fma_vec(a, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    store_vec(acc_out + r * kPanel, acc[r][0]);
    store_vec(acc_out + r * kPanel + kLanes, acc[r][1]);
  }
}

#if defined(__AVX512BF16__)
template <int MR>
void tile_bf16(const uint32_t* x, int64_t x_s, const uint32_t* panel, int64_t k2,
               float* acc_out) {
  __m512 acc[MR][2];
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k2; ++i) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + i * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + i * kPanel + kLanes);
    for (int r = 0; r < MR; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_s + i]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
    }
  }
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(acc_out + r * kPanel, acc[r][0]);
    _mm512_storeu_ps(acc_out + r * kPanel + kLanes, acc[r][1]);
  }
}
#endif

// tile<MR>(...) for 1 <= mr <= kRows.
template <typename F>
inline void with_rows(int mr, F&& f) {
  switch (mr) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
#if defined(__AVX512F__)
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 9: f(std::integral_constant<int, 9>{}); break;
    case 10: f(std::integral_constant<int, 10>{}); break;
    case 11: f(std::integral_constant<int, 11>{}); break;
    case 12: f(std::integral_constant<int, 12>{}); break;
#endif
    default: break;
  }
}

// Writes rows [m0, m0 + mr) x panel p of y from the fp32 tile (+ bias).
template <typename T>
void store_tile(const float* acc, int mr, int64_t p, int64_t n, const float* bias, T* y,
                int64_t y_s) {
  const int64_t c0 = p * kPanel, width = std::min<int64_t>(kPanel, n - c0);
  for (int r = 0; r < mr; ++r) {
    T* dst = y + r * y_s + c0;
    if (width == kPanel) {
      for (int h = 0; h < 2; ++h) {
        vfloat v = load_vec(acc + r * kPanel + h * kLanes);
        if (bias) v = v + load_vec(bias + c0 + h * kLanes);
        store_vec(dst + h * kLanes, v);
      }
    } else {
      for (int64_t c = 0; c < width; ++c) {
        const float v = acc[r * kPanel + c] + (bias ? bias[c0 + c] : 0.f);
        dst[c] = T(v);
      }
    }
  }
}

// The work split both flavours share: tasks of (a block of kBlockRows rows, a run of
// panels), enough for every thread; a task's panels share its block's rows. `rows_of(m0,
// mb, scratch, stride)` returns the block's rows as the tile reads them (in place or
// widened into `scratch`), `tile(rows_c, rows, stride, p, acc)` computes one tile of
// rows_c::value rows by panel p into acc. Threads split rows and panels, never K.
template <typename R, typename T, typename RowsOf, typename Tile>
void for_each_tile(int64_t m, int64_t n, const float* bias, T* yp, int64_t y_s,
                   RowsOf&& rows_of, Tile&& tile) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  const int64_t blocks = (m + kBlockRows - 1) / kBlockRows;
  const int64_t per = std::max<int64_t>(1, panels * blocks / (4 * at::get_num_threads()));
  const int64_t chunks = (panels + per - 1) / per;
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<R> scratch;
    std::vector<float> acc(kRows * kPanel);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / chunks, p0 = (t % chunks) * per, p1 = std::min(panels, p0 + per);
      const int64_t m0 = b * kBlockRows, mb = std::min(kBlockRows, m - m0);
      int64_t xr_s = 0;
      const R* xr = rows_of(m0, mb, scratch, xr_s);
      for (int64_t p = p0; p < p1; ++p) {
        for (int64_t r0 = 0; r0 < mb; r0 += kRows) {
          const int mr = static_cast<int>(std::min<int64_t>(kRows, mb - r0));
          with_rows(mr, [&](auto rows_c) { tile(rows_c, xr + r0 * xr_s, xr_s, p, acc.data()); });
          store_tile(acc.data(), mr, p, n, bias, yp + (m0 + r0) * y_s, y_s);
        }
      }
    }
  });
}

template <typename T>
void linear_f32(const at::Tensor& x, const float* packed, int64_t n, int64_t k,
                const float* bias, const at::Tensor& y) {
  const T* xp = static_cast<const T*>(x.data_ptr());
  const int64_t x_s = x.stride(0);
  auto rows_of = [&](int64_t m0, int64_t mb, std::vector<float>& rows, int64_t& stride) {
    if constexpr (std::is_same_v<T, float>) {
      stride = x_s;
      return xp + m0 * x_s;
    } else {  // widened to fp32 once per task
      rows.resize(mb * k);
      for (int64_t r = 0; r < mb; ++r)
        for (int64_t i = 0; i < k; ++i) rows[r * k + i] = static_cast<float>(xp[(m0 + r) * x_s + i]);
      stride = k;
      return static_cast<const float*>(rows.data());
    }
  };
  auto tile = [&](auto rows_c, const float* xr, int64_t xr_s, int64_t p, float* acc) {
    tile_f32<decltype(rows_c)::value>(xr, xr_s, packed + p * k * kPanel, k, acc);
  };
  for_each_tile<float>(x.size(0), n, bias, static_cast<T*>(y.data_ptr()), y.stride(0),
                       rows_of, tile);
}

#if defined(__AVX512BF16__)
void linear_bf16(const at::Tensor& x, const uint32_t* packed, int64_t n, int64_t k,
                 const float* bias, const at::Tensor& y) {
  using T = c10::BFloat16;
  const int64_t k2 = (k + 1) / 2;
  const T* xp = static_cast<const T*>(x.data_ptr());
  const int64_t x_s = x.stride(0);
  const bool direct = k % 2 == 0 && x_s % 2 == 0;  // rows readable as bf16 pairs in place
  auto rows_of = [&](int64_t m0, int64_t mb, std::vector<uint32_t>& rows, int64_t& stride) {
    if (direct) {
      stride = x_s / 2;
      return reinterpret_cast<const uint32_t*>(xp + m0 * x_s);
    }
    rows.assign(mb * k2, 0u);  // an odd K: pad each row with a zero
    for (int64_t r = 0; r < mb; ++r)
      std::memcpy(rows.data() + r * k2, xp + (m0 + r) * x_s, sizeof(T) * k);
    stride = k2;
    return static_cast<const uint32_t*>(rows.data());
  };
  auto tile = [&](auto rows_c, const uint32_t* xr, int64_t xr_s, int64_t p, float* acc) {
    tile_bf16<decltype(rows_c)::value>(xr, xr_s, packed + p * k2 * kPanel, k2, acc);
  };
  for_each_tile<uint32_t>(x.size(0), n, bias, static_cast<T*>(y.data_ptr()), y.stride(0),
                          rows_of, tile);
}
#endif

bool bf16_pairs(at::ScalarType t) {
#if defined(__AVX512BF16__)
  return t == at::kBFloat16;
#else
  (void)t;
  return false;
#endif
}

// weight [n, k] (float32, bfloat16 or float16) -> its panels: float32 [panels, k, 32],
// or for bf16 pairs int32 [panels, ceil(k / 2), 32]; padding columns are zero.
at::Tensor dense_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "dense_pack: weight [out, in]");
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  if (bf16_pairs(w.scalar_type())) {
    const int64_t k2 = (k + 1) / 2;
    at::Tensor out = at::zeros({panels, k2, kPanel}, w.options().dtype(at::kInt));
    const uint16_t* src = static_cast<const uint16_t*>(w.data_ptr());
    uint16_t* dst = static_cast<uint16_t*>(out.data_ptr());
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p)
        for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c)
          for (int64_t i = 0; i < k; ++i)
            dst[((p * k2 + i / 2) * kPanel + c) * 2 + (i & 1)] = src[(p * kPanel + c) * k + i];
    });
    return out;
  }
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16 ||
                  w.scalar_type() == at::kHalf,
              "dense_pack: weight dtype must be float32, bfloat16 or float16");
  const at::Tensor wf = w.to(at::kFloat);
  at::Tensor out = at::zeros({panels, k, kPanel}, w.options().dtype(at::kFloat));
  const float* src = wf.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c)
        for (int64_t i = 0; i < k; ++i) dst[(p * k + i) * kPanel + c] = src[(p * kPanel + c) * k + i];
  });
  return out;
}

// y[m, :n] = x[m, :k] W^T + bias, y in x's dtype; x and y 2-D with contiguous rows.
void dense_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const std::optional<at::Tensor>& bias, const at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.stride(1) == 1 && y.stride(1) == 1,
              "dense_linear: x [m, k] and y [m, n] with contiguous rows");
  TORCH_CHECK(y.size(0) == x.size(0) && y.size(1) == n && y.scalar_type() == x.scalar_type(),
              "dense_linear: y must be [x rows, n] in x's dtype");
  TORCH_CHECK(packed.dim() == 3 && packed.size(0) == (n + kPanel - 1) / kPanel &&
                  packed.size(2) == kPanel && packed.is_contiguous(),
              "dense_linear: packed weights from dense_pack for n outputs");
  const int64_t k = x.size(1);
  const float* b = nullptr;
  at::Tensor bf;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "dense_linear: bias must have n elements");
    bf = bias->to(at::kFloat).contiguous();
    b = bf.data_ptr<float>();
  }
  if (packed.scalar_type() == at::kInt) {
#if defined(__AVX512BF16__)
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.size(1) == (k + 1) / 2,
                "dense_linear: bf16-pair weights take bf16 input of the packed width");
    linear_bf16(x, static_cast<const uint32_t*>(packed.data_ptr()), n, k, b, y);
    return;
#else
    TORCH_CHECK(false, "dense_linear: bf16-pair weights need AVX512-BF16");
#endif
  }
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.size(1) == k,
              "dense_linear: packed weights of another input width");
  const float* pw = packed.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat: linear_f32<float>(x, pw, n, k, b, y); break;
    case at::kBFloat16: linear_f32<c10::BFloat16>(x, pw, n, k, b, y); break;
    case at::kHalf: linear_f32<c10::Half>(x, pw, n, k, b, y); break;
    default: TORCH_CHECK(false, "dense_linear: x must be float32, bfloat16 or float16");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("dense_pack(Tensor weight) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor packed, int n, Tensor? bias, Tensor(a!) y) -> ()");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("dense_pack", &dense_pack);
  m.impl("dense_linear", &dense_linear);
}
