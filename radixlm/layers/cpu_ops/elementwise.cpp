// Fused elementwise kernels for half-precision activations on the CPU.
//
// Each replaces a chain of torch ops (RMSNorm: add, cast, pow, mean, rsqrt,
// mul, cast, mul; SwiGLU: chunk, silu, mul; RoPE: index, cast, chunk, 4 muls,
// 2 adds, cat) that each made a pass over the activations, with one pass that
// works in fp32 registers. Intermediate results are rounded to the tensor's
// dtype where torch's op chain rounds them, so outputs match the torch path
// up to the last bit of a few elements.

#include "vec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace radixlm_cpu;

// Rows per thread: enough elements that waking a second thread pays off. A
// decode batch (tens of rows) then runs on the calling thread alone, which
// also keeps it from waiting on a thread the OS has descheduled.
inline int64_t grain(int64_t elements_per_row) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, elements_per_row));
}

template <typename T>
float load1(const T* p) {
  return static_cast<float>(*p);
}
template <typename T>
float round1(float x) {
  return static_cast<float>(T(x));
}

// out = norm(x + residual) * weight, residual_out = x + residual (or norm(x)
// without a residual). Rows of n elements; the last dim contiguous.
template <typename T>
void rms_norm_rows(const T* x, const T* res, const T* w, T* out, T* res_out, int64_t rows,
                   int64_t n, int64_t sx, int64_t sr, int64_t so, int64_t sro, float eps) {
  at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> sum_row(n);
    for (int64_t r = begin; r < end; ++r) {
      float* s = sum_row.data();
      const T* xr = x + r * sx;
      int64_t c = 0;
      vfloat sq = vfloat{};
      for (; c + kLanes <= n; c += kLanes) {
        vfloat v = load_vec(xr + c);
        if (res) {
          v = round_to(v + load_vec(res + r * sr + c), (T*)nullptr);
          store_vec(res_out + r * sro + c, v);
        }
        store_vec(s + c, v);
        sq += v * v;
      }
      float total = hsum(sq);
      for (; c < n; ++c) {
        float v = load1(xr + c);
        if (res) {
          v = round1<T>(v + load1(res + r * sr + c));
          res_out[r * sro + c] = T(v);
        }
        s[c] = v;
        total += v * v;
      }
      const float inv = 1.f / std::sqrt(total / static_cast<float>(n) + eps);
      T* o = out + r * so;
      for (c = 0; c + kLanes <= n; c += kLanes) {
        vfloat normed = round_to(load_vec(s + c) * inv, (T*)nullptr);  // torch: .to(dtype)
        store_vec(o + c, normed * load_vec(w + c));
      }
      for (; c < n; ++c) o[c] = T(round1<T>(s[c] * inv) * load1(w + c));
    }
  });
}

// out[r, :d] = silu(x[r, :d]) * x[r, d:2d], silu rounded to the dtype first
// (torch computes F.silu(gate) into a tensor, then multiplies).
template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t d, int64_t sx, int64_t so) {
  at::parallel_for(0, rows, grain(2 * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * sx;
      const T* up = gate + d;
      T* o = out + r * so;
      int64_t c = 0;
      for (; c + kLanes <= d; c += kLanes) {
        vfloat g = load_vec(gate + c);
        vfloat silu = round_to(g / (1.f + exp_vec(-g)), (T*)nullptr);
        store_vec(o + c, silu * load_vec(up + c));
      }
      for (; c < d; ++c) {
        const float g = load1(gate + c);
        o[c] = T(round1<T>(g / (1.f + std::exp(-g))) * load1(up + c));
      }
    }
  });
}

// In-place neox-style RoPE of `heads` heads of each row: the first rotary_dim
// features of a head split in halves (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin),
// each product and sum rounded to the dtype as the torch path does.
template <typename T>
void rope_rows(T* x, const int64_t* pos, const T* cos_sin, int64_t rows, int64_t heads,
               int64_t head_dim, int64_t rotary_dim, int64_t sx, int64_t scs) {
  const int64_t half = rotary_dim / 2;
  at::parallel_for(0, rows, grain(heads * rotary_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* cs = cos_sin + pos[r] * scs;
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + r * sx + h * head_dim;
        T* x2 = x1 + half;
        int64_t c = 0;
        for (; c + kLanes <= half; c += kLanes) {
          const vfloat a = load_vec(x1 + c), b = load_vec(x2 + c);
          const vfloat cos = load_vec(cs + c), sin = load_vec(cs + half + c);
          T* tag = nullptr;
          const vfloat a_cos = round_to(a * cos, tag), b_sin = round_to(b * sin, tag);
          const vfloat b_cos = round_to(b * cos, tag), a_sin = round_to(a * sin, tag);
          store_vec(x1 + c, a_cos - b_sin);
          store_vec(x2 + c, b_cos + a_sin);
        }
        for (; c < half; ++c) {
          const float a = load1(x1 + c), b = load1(x2 + c);
          const float cos = load1(cs + c), sin = load1(cs + half + c);
          x1[c] = T(round1<T>(a * cos) - round1<T>(b * sin));
          x2[c] = T(round1<T>(b * cos) + round1<T>(a * sin));
        }
      }
    }
  });
}

// k_buf[loc[i]] = k[i] and v_buf[loc[i]] = v[i]: rows of `row` elements.
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_buf,
              const at::Tensor& v_buf, const at::Tensor& loc) {
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.is_contiguous(), "store_kv: int64 loc");
  TORCH_CHECK(k.scalar_type() == k_buf.scalar_type() && v.scalar_type() == v_buf.scalar_type(),
              "store_kv: k/v in the pool's dtype");
  const int64_t n = loc.size(0), row = k_buf[0].numel();
  TORCH_CHECK(k.dim() == 2 && v.dim() == 2 && k.size(0) == n && v.size(0) == n &&
                  k.size(1) == row && v.size(1) == row && k.stride(1) == 1 && v.stride(1) == 1,
              "store_kv: k/v are [n, kv_heads * head_dim] rows");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous(), "store_kv: contiguous pools");
  const int64_t bytes = row * k.element_size();
  const int64_t* slots = loc.data_ptr<int64_t>();
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  char* kd = static_cast<char*>(k_buf.data_ptr());
  char* vd = static_cast<char*>(v_buf.data_ptr());
  const int64_t pool = k_buf.size(0), ksb = k.stride(0) * k.element_size();
  const int64_t vsb = v.stride(0) * v.element_size();
  at::parallel_for(0, n, grain(2 * row), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      TORCH_CHECK(slots[i] >= 0 && slots[i] < pool, "store_kv: slot out of range");
      std::memcpy(kd + slots[i] * bytes, ks + i * ksb, bytes);
      std::memcpy(vd + slots[i] * bytes, vs + i * vsb, bytes);
    }
  });
}

template <typename F>
void dispatch_half(const at::Tensor& t, const char* name, F&& f) {
  switch (t.scalar_type()) {
    case at::kBFloat16: f(static_cast<c10::BFloat16*>(nullptr)); break;
    case at::kHalf: f(static_cast<c10::Half*>(nullptr)); break;
    default: TORCH_CHECK(false, name, ": dtype must be bfloat16 or float16");
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": 2-D with a contiguous last dim");
}

void check_weight(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be contiguous [hidden] in x's dtype");
}

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& out) {
  check_rows(x, "rms_norm x");
  check_weight(x, weight);
  check_rows(out, "rms_norm out");
  dispatch_half(x, "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(static_cast<const T*>(x.data_ptr()), nullptr,
                     static_cast<const T*>(weight.data_ptr()), static_cast<T*>(out.data_ptr()),
                     nullptr, x.size(0), x.size(1), x.stride(0), 0, out.stride(0), 0,
                     static_cast<float>(eps));
  });
}

void fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                        double eps, const at::Tensor& out, const at::Tensor& residual_out) {
  for (auto* t : {&x, &residual, &out, &residual_out}) check_rows(*t, "fused_add_rms_norm");
  check_weight(x, weight);
  dispatch_half(x, "fused_add_rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(static_cast<const T*>(x.data_ptr()),
                     static_cast<const T*>(residual.data_ptr()),
                     static_cast<const T*>(weight.data_ptr()), static_cast<T*>(out.data_ptr()),
                     static_cast<T*>(residual_out.data_ptr()), x.size(0), x.size(1),
                     x.stride(0), residual.stride(0), out.stride(0), residual_out.stride(0),
                     static_cast<float>(eps));
  });
}

void silu_and_mul(const at::Tensor& x, const at::Tensor& out) {
  check_rows(x, "silu_and_mul x");
  check_rows(out, "silu_and_mul out");
  TORCH_CHECK(x.size(1) == 2 * out.size(1), "silu_and_mul: x is [n, 2d], out [n, d]");
  dispatch_half(x, "silu_and_mul", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_and_mul_rows<T>(static_cast<const T*>(x.data_ptr()), static_cast<T*>(out.data_ptr()),
                         x.size(0), out.size(1), x.stride(0), out.stride(0));
  });
}

void rope(const at::Tensor& positions, const at::Tensor& x, const at::Tensor& cos_sin,
          int64_t head_dim, int64_t rotary_dim) {
  check_rows(x, "rope x");
  check_rows(cos_sin, "rope cos_sin");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "rope: positions must be contiguous int64");
  TORCH_CHECK(cos_sin.scalar_type() == x.scalar_type(), "rope: cos_sin in x's dtype");
  TORCH_CHECK(x.size(1) % head_dim == 0 && rotary_dim % 2 == 0 && rotary_dim <= head_dim,
              "rope: bad head_dim / rotary_dim");
  dispatch_half(x, "rope", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_rows<T>(static_cast<T*>(x.data_ptr()), positions.data_ptr<int64_t>(),
                 static_cast<const T*>(cos_sin.data_ptr()), x.size(0), x.size(1) / head_dim,
                 head_dim, rotary_dim, x.stride(0), cos_sin.stride(0));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixlm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, "
        "Tensor(a!) out, Tensor(b!) residual_out) -> ()");
  m.def("silu_and_mul(Tensor x, Tensor(a!) out) -> ()");
  m.def("rope(Tensor positions, Tensor(a!) x, Tensor cos_sin, int head_dim, int rotary_dim) -> ()");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc) -> ()");
}

TORCH_LIBRARY_IMPL(radixlm_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope", &rope);
  m.impl("store_kv", &store_kv);
}
