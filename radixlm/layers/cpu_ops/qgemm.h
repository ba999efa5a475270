// Quantized-weight products on the CPU: the layout every ISA path reads and
// the table of kernels each one provides.
//
// This header is shared by translation units compiled for different
// instruction sets (one `#pragma GCC target` each), so it holds only plain
// data and constants: an inline function defined here would be emitted once
// per ISA under one name, and the linker could hand the AVX-512 copy to a CPU
// without AVX-512.
//
// Weights W [n, k] (y = x W^T) are cut into tiles of kTile rows. A tile's
// rows are interleaved so that one 64-byte register holds 4 consecutive k of
// each of its 16 rows (byte 4c + j = row c, k = 4g + j of "group" g): one
// u8 x s8 dot instruction (vpdpbusd) then advances all 16 outputs by 4 k.
// Each weight is an unsigned code q (4, 5, 6 or 8 bits) with a scale s and
// either an offset o (symmetric formats: w = s (q - o)) or a min m (w = s q + m)
// per block of kBlock(format) k and row:
//
//   per tile, per block: [nibbles][bit planes] (kBlockBytes bytes)
//     nibbles: kBlock/8 registers of 64 bytes; register p holds group 2p in
//              its low nibbles and group 2p + 1 in its high nibbles
//     planes:  for 5- and 6-bit codes, bit 4 (and 5) of each code: per group,
//              per plane, 8 bytes whose bit i belongs to the group's byte i
//     8-bit codes: kBlock/4 registers of 64 bytes, one per group
//   scales, mins: [tiles][blocks][16] (fp16 where the GGUF format stores fp16,
//              fp32 where its scale is a product, kept exact); per-channel
//              int8 has one fp32 scale per row, [tiles][16]
//
// Activations are quantized per row and block of 32 to int8 (d = max|x|/127,
// q = round(x / d)), llama.cpp's Q8_0, with the block sums the offsets and
// mins need.
#pragma once

#include <stdint.h>

namespace radixlm_q {

constexpr int kTile = 16;      // weight rows per tile: one fp32 register of outputs
constexpr int kActBlock = 32;  // activation values sharing one int8 scale

enum Format : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5, kI8 = 6 };
constexpr int kNumFormats = 7;

template <int F>
struct Traits;
// kBits: code width; kBlock: k per scale; kOffset: o of w = s (q - o) (symmetric
// formats); kAsym: w = s q + m; kF32: fp32 scales (else fp16); kPerChannel: one
// scale per row.
template <>
struct Traits<kQ4_0> {
  static constexpr int kBits = 4, kBlock = 32, kOffset = 8;
  static constexpr bool kAsym = false, kF32 = false, kPerChannel = false;
};
template <>
struct Traits<kQ4_1> {
  static constexpr int kBits = 4, kBlock = 32, kOffset = 0;
  static constexpr bool kAsym = true, kF32 = false, kPerChannel = false;
};
template <>
struct Traits<kQ8_0> {
  static constexpr int kBits = 8, kBlock = 32, kOffset = 128;
  static constexpr bool kAsym = false, kF32 = false, kPerChannel = false;
};
template <>
struct Traits<kQ4_K> {
  static constexpr int kBits = 4, kBlock = 32, kOffset = 0;
  static constexpr bool kAsym = true, kF32 = true, kPerChannel = false;
};
template <>
struct Traits<kQ5_K> {
  static constexpr int kBits = 5, kBlock = 32, kOffset = 0;
  static constexpr bool kAsym = true, kF32 = true, kPerChannel = false;
};
template <>
struct Traits<kQ6_K> {
  static constexpr int kBits = 6, kBlock = 16, kOffset = 32;
  static constexpr bool kAsym = false, kF32 = true, kPerChannel = false;
};
template <>
struct Traits<kI8> {
  static constexpr int kBits = 8, kBlock = 32, kOffset = 128;
  static constexpr bool kAsym = false, kF32 = true, kPerChannel = true;
};

template <int F>
constexpr int kBlockBytes = kTile * Traits<F>::kBlock * Traits<F>::kBits / 8;
template <int F>
constexpr int kPlanes = Traits<F>::kBits == 8 ? 0 : Traits<F>::kBits - 4;

struct PackedWeight {
  int format;
  int64_t n;       // rows of W (outputs); the last tile is zero-padded
  int64_t k;       // columns of W, a multiple of kActBlock
  int64_t tiles;   // ceil(n / kTile)
  int64_t blocks;  // k / kBlock(format)
  const uint8_t* q;
  const void* scales;
  const void* mins;  // asymmetric formats only
};

struct QuantAct {
  int64_t m, k;
  const int8_t* q;       // [m, k]
  const float* d;        // [m, k / 32]
  const int32_t* sum16;  // [m, k / 16]: sum of q over each half block
  const float* dsum;     // [m, k / 32]: d * sum of q over the block
};

struct Out {
  void* data;  // row r, column c at data + r * ld + c
  int64_t ld;
  bool bf16;   // else fp32
};

// An ISA path. All of them compute bit-identical results: the integer dot
// products are exact and the float operations are the same per output (no
// contraction, the same fmas in the same order), so a path may be chosen per
// machine without changing a single token.
struct Kernels {
  const char* name;
  // Rows [m0, m1) of x [*, k] (fp32, or bf16 when x_bf16), row stride ldx.
  void (*quantize)(const void* x, bool x_bf16, int64_t ldx, int64_t m0, int64_t m1, int64_t k,
                   int8_t* q, float* d, int32_t* sum16, float* dsum);
  // out[m0:m1, tiles t0:t1] = x W^T.
  void (*gemm)(const PackedWeight& w, const QuantAct& a, int64_t m0, int64_t m1, int64_t t0,
               int64_t t1, const Out& out);
  // out[i, :] = W[rows[i], :] dequantized, for i in [i0, i1).
  void (*dequantize)(const PackedWeight& w, const int64_t* rows, int64_t i0, int64_t i1,
                     const Out& out);
};

// nullptr where the path was not compiled (not an x86-64 build).
const Kernels* kernels_portable();
const Kernels* kernels_avx2();
const Kernels* kernels_avx512();
const Kernels* kernels_avx512_vnni();

}  // namespace radixlm_q
