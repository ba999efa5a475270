// AVX-512 with VNNI (Cascade Lake, Ice Lake and later, Zen 4): vpdpbusd.
#include <stdint.h>

#include "qgemm.h"

#if defined(__x86_64__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c")
#define QG_VNNI 1
#define QG_NAME "avx512_vnni"
#define QG_ENTRY kernels_avx512_vnni
#include "qgemm_avx512.inc"
#else
namespace radixlm_q {
const Kernels* kernels_avx512_vnni() { return nullptr; }
}  // namespace radixlm_q
#endif
