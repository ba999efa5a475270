// AVX-512 (F, BW, VL, DQ) without VNNI: Skylake-X, Cascade Lake's predecessors.
#include <stdint.h>

#include "qgemm.h"

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#define QG_VNNI 0
#define QG_NAME "avx512"
#define QG_ENTRY kernels_avx512
#include "qgemm_avx512.inc"
#else
namespace radixlm_q {
const Kernels* kernels_avx512() { return nullptr; }
}  // namespace radixlm_q
#endif
