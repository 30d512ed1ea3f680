// Weight-only quantized matmul on the CPU: out = x @ dequantize(W).T, W kept in GGUF's 4- and 8-bit blocks.
//
// As llama.cpp does, each activation row is quantized to 8 bits per block of 32 (one fp32 scale per block), so a
// block's products are integer multiply-adds and one float multiply by the two scales. Decode reads each weight byte
// once per step: at one row the step is bound by memory bandwidth, so 4.5 bits per weight instead of 32 is the gain.
//
// The weights are interleaved by 16 output rows (layers/quantized.py), as llama.cpp's repacked CPU formats are: one
// 32-bit lane of a 512-bit register holds four consecutive weights of one row, so a multiply-add of four weights by
// four broadcast activations advances 16 output rows at once and a block's sum stays in an int32 lane until its one
// float multiply. Against one row at a time (products of one row summed across lanes, then a float multiply-add per
// two blocks) this is about a third of the instructions per weight, which is what steps of 8-64 rows are bound by.
// Where the CPU has AVX-512 VNNI (Zen 4 and 5, Sapphire Rapids and later) that multiply-add is one vpdpbusd; with
// AVX2 two instructions (maddubs: u8 x i8 pairs summed to i16, then to i32) on 8 rows at a time, the second shared
// by several chunks where the weights have at most 6 bits (few_bits_tile); else plain loops.
//
// Layout: qweight [groups, blocks, chunks, 16, 4]: group g holds output rows 16g..16g+15 (the last one padded with
// zeros), block b weights 32b..32b+31, chunk c of a row four bytes:
//   4-bit (uint8, 4 chunks): bytes 4c..4c+3 of the row's block, weight j in the low nibble of byte j and weight
//                            16 + j in its high nibble (Q4_0, Q4_1, Q4_K);
//   5-bit (uint8, 5 chunks): the 4-bit chunks of the weights' low four bits, then a chunk of their fifth bits: of
//                            weight 4c + k in bit 2c of its byte k, of 16 + 4c + k in bit 2c + 1 (Q5_0, Q5_1,
//                            Q5_K), so that one shift and one mask of the whole chunk move chunk c's fifth bits
//                            beside its nibbles;
//   6-bit (uint8, 6 chunks): the 4-bit chunks, then two chunks of the top two bits, of weights 4c + k (chunk 4)
//                            and of 16 + 4c + k (chunk 5) in bits 2c, 2c + 1 of byte k (Q6_K);
//   8-bit (int8, 8 chunks):  weights 4c..4c+3 (Q8_0);
//   16-bit (uint8, 16 chunks): bf16 weights themselves, chunk c a pair of two (cpu.h's pair_first) as an AMX B tile
//                            holds them (tiles.cpp). A dense model's bf16 weights (layers/quantized.py's
//                            from_dense) take this kernel's path without its int8 activations: fp32 rows, each
//                            weight widened exactly, fp32 multiply-adds; at one row oneDNN's prepacked bf16 matmul
//                            read them at 0.75x the speed (measured on Sapphire Rapids), and the fused decode layer
//                            runs them.
// Fewer bits, fewer bytes to read: 5.5 to 7 bits a weight with the scales (Q5_*) and 8 (Q6_K) where a byte a
// weight read 8.5 to 10; at one row the kernel's time follows.
// scales and shift: [groups, in / sub, 16], w = scale * (q - zero) + shift per `sub` = 32 (or 16: 6- and 8-bit)
// weights; the shift (a min) may be absent, the zero point (Q4_0's 8, Q5_0's 16, Q6_K's 32) is one integer for the
// matrix. fp32, or fp16
// where the file's scales are fp16 values themselves (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): 2 bytes less per 32 weights
// to read, a tenth of a Q4_0 matrix.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TOKENMILL_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define TOKENMILL_VNNI512 1
#endif

namespace {

constexpr int64_t kBlock = 32;  // weights per block (and activations per scale)
constexpr int64_t kLanes = tokenmill::kInterleave;
constexpr int64_t kRowTile = 8;  // activation rows that share one unpacking of a weight block

using tokenmill::QuantizedMatrix;
using tokenmill::QuantizedRows;
using tokenmill::Array;

// A block of 32 values (fp32, or bf16 widened exactly) quantized to int8 at scale amax / 127, each rounded to nearest
// (ties to even) as std::nearbyint does, into dst; sums: the codes' sums of each half. Returns the scale.
template <typename T>
inline float quantize_block(const T* x, int8_t* dst, int32_t* sums) {
#if defined(__AVX512F__)
  __m512 lo, hi;
  if constexpr (std::is_same_v<T, float>) {
    lo = _mm512_loadu_ps(x);
    hi = _mm512_loadu_ps(x + 16);
  } else {  // a bf16 is the top half of an fp32
    const auto widen = [](const T* p) {
      const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
    };
    lo = widen(x);
    hi = widen(x + 16);
  }
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  // max_ps gives its second operand where the first is NaN: a NaN value is passed over, as std::max does
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(hi, magnitude),
                                                        _mm512_max_ps(_mm512_and_ps(lo, magnitude),
                                                                      _mm512_setzero_ps())));
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  // cvtps_epi32 rounds as nearbyint does (to nearest even, the default mode); cvtepi32_epi8 keeps the low byte as
  // static_cast<int8_t> does
  const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
  const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(qlo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(qhi));
  sums[0] = _mm512_reduce_add_epi32(qlo);
  sums[1] = _mm512_reduce_add_epi32(qhi);
  return d;
#else
  alignas(32) float v[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) v[j] = static_cast<float>(x[j]);
#if defined(TOKENMILL_AVX2)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 most = _mm256_setzero_ps();
  for (int64_t j = 0; j < kBlock; j += 8)
    most = _mm256_max_ps(_mm256_and_ps(_mm256_load_ps(v + j), magnitude), most);  // NaN passed over
  const float amax = tokenmill::hmax(most);
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  __m256i c[4];
  for (int j = 0; j < 4; ++j) c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + 8 * j), _mm256_set1_ps(inv)));
  // each code's low byte, as static_cast<int8_t> keeps it (packus of values within 0..255 saturates nothing); the
  // packs interleave 128-bit lanes, the permute puts the eight fours back in order
  const __m256i low = _mm256_set1_epi32(0xFF);
  const __m256i words = _mm256_packus_epi32(_mm256_and_si256(c[0], low), _mm256_and_si256(c[1], low));
  const __m256i words2 = _mm256_packus_epi32(_mm256_and_si256(c[2], low), _mm256_and_si256(c[3], low));
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(words, words2),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), bytes);
  for (int half = 0; half < 2; ++half) {
    const __m256i both = _mm256_add_epi32(c[2 * half], c[2 * half + 1]);
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0x4E));
    sums[half] = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32(sum, 0xB1)));
  }
  return d;
#else
  float amax = 0.f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  int32_t codes[kBlock];
  for (int64_t j = 0; j < kBlock; ++j) codes[j] = static_cast<int32_t>(std::nearbyint(v[j] * inv));
  sums[0] = sums[1] = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    dst[j] = static_cast<int8_t>(codes[j]);
    sums[j / 16] += codes[j];
  }
  return d;
#endif
#endif
}

// Rows quantized to int8 per block of 32 (quantize_block); x fp32 or bf16 (a bf16 model's rows, not widened in a
// pass of their own). zero: the weights' integer zero point as the kernel subtracts it (starts), shifted: whether
// the weights have a shift (xsums).
template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t in, int64_t sub, int32_t zero, bool shifted) {
  const int64_t blocks = in / kBlock, groups = in / sub, parts = kBlock / sub;  // parts: 1, or 2 halves of 16
  QuantizedRows out{Array<int8_t>(rows * in), Array<float>(rows * blocks),
                    Array<int32_t>(rows * groups), Array<int32_t>(rows * groups),
                    Array<float>(shifted ? rows * groups : 0)};
  // the raw pointers, restrict: the int8 stores would otherwise make the compiler reload every array's address
  int8_t* __restrict const q = out.q.data();
  float* __restrict const scale = out.scale.data();
  int32_t* __restrict const isums = out.isums.data();
  int32_t* __restrict const starts = out.starts.data();
  float* __restrict const xsums = out.xsums.data();
  const auto quantize = [&](int64_t begin, int64_t end) {
    alignas(64) int8_t codes[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      // the row's tile starts at row 8 * tile and holds n rows: 8, or fewer in the last; i: the row's place in it
      const int64_t tile = r / kRowTile, i = r % kRowTile, n = std::min(kRowTile, rows - tile * kRowTile);
      int8_t* const row_q = q + tile * kRowTile * in + i * 4;  // the row's four values at (b * 8 + u) * n * 4
      const int64_t first = tile * kRowTile * groups + i;       // its sums at first + k * n
      float* const row_scale = scale + tile * kRowTile * blocks + i;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t sums[2];
        // one row is laid out as itself; a tile's rows take the block's 8 fours to their places beside each other
        const float d = quantize_block(x + r * in + b * kBlock, n == 1 ? row_q + b * kBlock : codes, sums);
        if (n > 1)
          for (int64_t u = 0; u < kBlock / 4; ++u)
            std::memcpy(row_q + (b * (kBlock / 4) + u) * n * 4, codes + 4 * u, 4);
        row_scale[b * n] = d;
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t k = first + (b * parts + p) * n;
          const int32_t sum = parts == 1 ? sums[0] + sums[1] : sums[p];
          isums[k] = sum;
          starts[k] = -zero * sum;
          if (shifted) xsums[k] = d * static_cast<float>(sum);
        }
      }
    }
  };
  at::parallel_for(0, rows, 16, quantize);  // a decode step's few rows on this thread
  return out;
}

// q of weight j (0..31) of a row's block (row: the block's first byte of that row's lane), one at a time: the
// scalar paths.
template <int BITS>
inline int32_t code(const uint8_t* row, int64_t j) {
  if constexpr (BITS == 8) {
    return static_cast<int8_t>(row[(j / 4) * kLanes * 4 + (j & 3)]);
  } else {
    const int c = static_cast<int>(j & 15) / 4, half = j >= 16;
    const int64_t k = j & 3;
    const uint8_t byte = row[c * kLanes * 4 + k];
    int32_t v = half ? (byte >> 4) : (byte & 0x0F);
    if constexpr (BITS > 4) {
      const uint8_t high = row[tokenmill::high_chunk<BITS>(half) * kLanes * 4 + k];
      v |= ((high >> tokenmill::high_shift<BITS>(c, half)) & tokenmill::high_mask<BITS>()) << 4;
    }
    return v;
  }
}

inline int32_t load32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

#if defined(TOKENMILL_VNNI512)
// One register: all 16 rows of a group.
struct Isa {
  static constexpr int kLanes = 16;
  using I = __m512i;
  using F = __m512;
  struct Signed8 {
    I u;  // q + 128: vpdpbusd multiplies unsigned by signed, so the zero point grows by kSignedZero
  };
  static constexpr int32_t kSignedZero = 128;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I low(I v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
  static I high(I v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
  // nibbles | each byte of h's bits from `from` (mask: of what width) moved to bit 4 (shifts of at most 4 within
  // 16-bit lanes keep to the byte)
  static I with_high(I nibbles, I h, int from, int mask) {
    const __m128i n = _mm_cvtsi32_si128(from > 4 ? from - 4 : 4 - from);
    const I moved = from > 4 ? _mm512_srl_epi16(h, n) : _mm512_sll_epi16(h, n);
    return _mm512_or_si512(nibbles, _mm512_and_si512(moved, _mm512_set1_epi8(static_cast<char>(mask << 4))));
  }
  static Signed8 signed8(I v) { return {_mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)))}; }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  // acc + per lane the sum of four weights times the four activations at x
  static I dot4(I acc, I w, const int8_t* x) { return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(load32(x))); }
  static I dot4(I acc, Signed8 w, const int8_t* x) { return dot4(acc, w.u, x); }
  static F zero_f() { return _mm512_setzero_ps(); }
  static F load_f(const float* p) { return _mm512_loadu_ps(p); }
  static F load_f(const at::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static F fma(I sums, F scale, float x_scale, F acc) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, _mm512_set1_ps(x_scale)), acc);
  }
  static F fma(F a, float b, F acc) { return _mm512_fmadd_ps(a, _mm512_set1_ps(b), acc); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  // the first and the second bf16 of each lane, as fp32
  static F first_bf16(I v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
  static F second_bf16(I v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(~0xFFFF))); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
};
#elif defined(TOKENMILL_AVX2)
// One register: 8 of a group's 16 rows (the group runs as two halves).
struct Isa {
  static constexpr int kLanes = 8;
  using I = __m256i;
  using F = __m256;
  struct Signed8 {
    I abs, raw;  // maddubs multiplies unsigned by signed: |w|, and w's sign moves to the activations
  };
  static constexpr int32_t kSignedZero = 0;
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I low(I v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
  static I high(I v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
  static I with_high(I nibbles, I h, int from, int mask) {
    const __m128i n = _mm_cvtsi32_si128(from > 4 ? from - 4 : 4 - from);
    const I moved = from > 4 ? _mm256_srl_epi16(h, n) : _mm256_sll_epi16(h, n);
    return _mm256_or_si256(nibbles, _mm256_and_si256(moved, _mm256_set1_epi8(static_cast<char>(mask << 4))));
  }
  static Signed8 signed8(I v) { return {_mm256_sign_epi8(v, v), v}; }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static I dot4(I acc, I w, const int8_t* x) {
    const I pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi32(load32(x)));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static I dot4(I acc, Signed8 w, const int8_t* x) {
    const I pairs = _mm256_maddubs_epi16(w.abs, _mm256_sign_epi8(_mm256_set1_epi32(load32(x)), w.raw));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  // dot4 in two steps, for weights of few bits: the pairs' int16 sums of several chunks add up before one widening
  static I pairs(I w, const int8_t* x) { return _mm256_maddubs_epi16(w, _mm256_set1_epi32(load32(x))); }
  static I add16(I a, I b) { return _mm256_add_epi16(a, b); }
  static I widen_add(I acc, I pairs) { return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))); }
  static F zero_f() { return _mm256_setzero_ps(); }
  static F load_f(const float* p) { return _mm256_loadu_ps(p); }
  static F load_f(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F fma(I sums, F scale, float x_scale, F acc) {
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(scale, _mm256_set1_ps(x_scale)), acc);
  }
  static F fma(F a, float b, F acc) { return _mm256_fmadd_ps(a, _mm256_set1_ps(b), acc); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F first_bf16(I v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static F second_bf16(I v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(~0xFFFF))); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
};
#endif

// The zero point the integer sums start from: the weights', and for 8-bit weights on VNNI the 128 that makes them
// unsigned.
inline int32_t kernel_zero(const QuantizedMatrix& w) {
#if defined(TOKENMILL_AVX2)
  return static_cast<int32_t>(w.zero) + (w.bits == 8 ? Isa::kSignedZero : 0);
#else
  return static_cast<int32_t>(w.zero);
#endif
}

// Ask for the cache lines a later block will read: the hardware prefetcher alone left single-row decode at about half
// the memory bandwidth (measured on a 2-core Zen 3).
inline void prefetch(const void* p, int64_t bytes) {
#ifdef TOKENMILL_AVX2
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + off, _MM_HINT_T0);
#else
  (void)p, (void)bytes;
#endif
}

#if defined(TOKENMILL_AVX2) && !defined(TOKENMILL_VNNI512)
// group_tile for 4- to 6-bit weights on AVX2 (and AVX-512 without VNNI). maddubs gives int16 lanes of two products
// each, at most 2 x (2^BITS - 1) x 127 (an activation's code is within +-127: quantize_block): kPairSums of them add
// up in int16 before one madd widens them to int32 (a madd after every maddubs doubles the multiply instructions). The
// block's eight unpacked chunks stay in registers while each row passes over them, the rows' sums in `out`: in the
// chunk-outer order N rows' sums stay live, and at N = 5 they spill. The integer sums are exact in any order, and
// each row's float steps are group_tile's: the same results to the bit.
template <int BITS, int SUB, typename S, int N>
void few_bits_tile(const QuantizedMatrix& w, int64_t g, const QuantizedRows& x, int64_t r0, float (*out)[kLanes]) {
  using V = Isa;
  using I = typename V::I;
  constexpr int kPairSums = 32767 / (2 * ((1 << BITS) - 1) * 127);  // 4-bit: 8, 5-bit: 4, 6-bit: 2
  constexpr int kParts = kBlock / SUB, kChunks = SUB / 4;             // per block: scales, and chunks a scale
  const int64_t blocks = w.in / kBlock, groups = w.in / SUB;
  const int64_t block_bytes = BITS * kLanes * 4;
  const uint8_t* q = w.q + g * blocks * block_bytes;
  const S* scales = static_cast<const S*>(w.scales) + g * groups * kLanes;
  const S* shift = w.shift ? static_cast<const S*>(w.shift) + g * groups * kLanes : nullptr;
  const int8_t* xq = x.q.data() + r0 * w.in;
  const float* xs = x.scale.data() + r0 * blocks;
  const int32_t* starts = x.starts.data() + r0 * groups;
  const float* xsums = shift ? x.xsums.data() + r0 * groups : nullptr;
  constexpr int64_t kAhead = 4;  // blocks
  for (int i = 0; i < N; ++i) std::fill(out[i], out[i] + kLanes, 0.f);
  for (int64_t lane0 = 0; lane0 < kLanes; lane0 += V::kLanes) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* at = q + b * block_bytes + lane0 * 4;
      if (lane0 == 0) prefetch(at + kAhead * block_bytes, block_bytes);
      I chunk[8];  // chunk[m]: weights 4m..4m+3 of the block, a lane a row
      I planes[2]{};
      if constexpr (BITS > 4) {
        for (int half = 0; half < 2; ++half)
          planes[half] = V::load(at + tokenmill::high_chunk<BITS>(half) * kLanes * 4);
      }
      for (int c = 0; c < 4; ++c) {
        const I v = V::load(at + c * kLanes * 4);
        chunk[c] = V::low(v), chunk[4 + c] = V::high(v);
        if constexpr (BITS > 4) {
          constexpr int mask = tokenmill::high_mask<BITS>();
          chunk[c] = V::with_high(chunk[c], planes[0], tokenmill::high_shift<BITS>(c, 0), mask);
          chunk[4 + c] = V::with_high(chunk[4 + c], planes[1], tokenmill::high_shift<BITS>(c, 1), mask);
        }
      }
      const int8_t* xb = xq + b * kBlock * N;
      for (int p = 0; p < kParts; ++p) {
        const int64_t k = b * kParts + p;
        const typename V::F scale = V::load_f(scales + k * kLanes + lane0);
#pragma GCC unroll 8
        for (int i = 0; i < N; ++i) {
          I sum = V::set1(starts[k * N + i]);
          for (int m0 = p * kChunks; m0 < (p + 1) * kChunks; m0 += kPairSums) {
            I pairs = V::pairs(chunk[m0], xb + (m0 * N + i) * 4);
            for (int m = m0 + 1; m < std::min(m0 + kPairSums, (p + 1) * kChunks); ++m)
              pairs = V::add16(pairs, V::pairs(chunk[m], xb + (m * N + i) * 4));
            sum = V::widen_add(sum, pairs);
          }
          float* to = out[i] + lane0;
          typename V::F acc = V::fma(sum, scale, xs[b * N + i], V::load_f(to));
          if (shift) acc = V::fma(V::load_f(shift + k * kLanes + lane0), xsums[k * N + i], acc);
          V::store(to, acc);
        }
      }
    }
  }
}
#endif

// Group g's 16 output rows for activation rows r0..r0+N-1 into out[i][16] (lanes past the matrix's rows: zeros).
// Each row's arithmetic is the same whatever N: a row's result does not depend on its batch.
template <int BITS, int SUB, typename S, int N>
void group_tile(const QuantizedMatrix& w, int64_t g, const QuantizedRows& x, int64_t r0, float (*out)[kLanes]) {
#if defined(TOKENMILL_AVX2) && !defined(TOKENMILL_VNNI512)
  if constexpr (BITS != 8) {
    few_bits_tile<BITS, SUB, S, N>(w, g, x, r0, out);
    return;
  }
#endif
  const int64_t blocks = w.in / kBlock, groups = w.in / SUB;
  const int64_t block_bytes = BITS * kLanes * 4;  // BITS chunks
  const uint8_t* q = w.q + g * blocks * block_bytes;
  const S* scales = static_cast<const S*>(w.scales) + g * groups * kLanes;
  const S* shift = w.shift ? static_cast<const S*>(w.shift) + g * groups * kLanes : nullptr;
  // the rows' tile (r0 a multiple of kRowTile, N its rows): row i's four values from value j at
  // xq + ((j / 4) * N + i) * 4, its scales, starts and sums from index k at k * N + i
  const int8_t* xq = x.q.data() + r0 * w.in;
  const float* xs = x.scale.data() + r0 * blocks;
#if defined(TOKENMILL_AVX2)
  using V = Isa;
  const int32_t* starts = x.starts.data() + r0 * groups;
  const float* xsums = shift ? x.xsums.data() + r0 * groups : nullptr;
  constexpr int64_t kAhead = 4;  // blocks
  for (int64_t lane0 = 0; lane0 < kLanes; lane0 += V::kLanes) {
    typename V::F acc[N];
    for (int i = 0; i < N; ++i) acc[i] = V::zero_f();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* at = q + b * block_bytes + lane0 * 4;
      if (lane0 == 0) prefetch(at + kAhead * block_bytes, block_bytes);
      // values k..k+3 of the block (k a multiple of 4) of row i: fixed offsets from the block's start, so the
      // unrolled loops address them without index arithmetic (it was a third of the instructions at 5 rows)
      const int8_t* xb = xq + b * kBlock * N;
      const auto four = [&](int k, int i) { return xb + ((k / 4) * N + i) * 4; };
      typename V::I sums[N];
      // One scale's worth of weights (a block, or half of one): the integer sums, then one float multiply-add.
      const auto finish = [&](int64_t k, const typename V::I (&s)[N]) {
        const typename V::F scale = V::load_f(scales + k * kLanes + lane0);
        for (int i = 0; i < N; ++i) acc[i] = V::fma(s[i], scale, xs[b * N + i], acc[i]);
        if (shift) {
          const typename V::F m = V::load_f(shift + k * kLanes + lane0);
          for (int i = 0; i < N; ++i) acc[i] = V::fma(m, xsums[k * N + i], acc[i]);
        }
      };
      const auto start = [&](int64_t k, typename V::I (&s)[N]) {
        for (int i = 0; i < N; ++i) s[i] = V::set1(starts[k * N + i]);
      };
      if constexpr (BITS != 8 && V::kLanes == 16) {  // VNNI only: AVX2 takes few_bits_tile
        // A scale per 16 (Q6_K): the low nibbles are weights 0-15 and the high ones the next sub-block, each summed
        // on its own.
        // With one scale per block, the high nibbles still sum apart where vpdpbusd runs (AVX-512): one chain of 8
        // dependent vpdpbusd a row and block was bound by their latency, two of 4 are not (integer sums: the same
        // result in any order).
        constexpr bool kTwoChains = SUB == 16 || V::kLanes == 16;
        typename V::I upper[N];
        typename V::I (&high_sums)[N] = kTwoChains ? upper : sums;
        start(b * (kBlock / SUB), sums);
        if constexpr (SUB == 16) {
          start(2 * b + 1, upper);
        } else if constexpr (kTwoChains) {
          for (int i = 0; i < N; ++i) upper[i] = V::set1(0);
        }
        typename V::I planes[2]{};
        if constexpr (BITS > 4) {
          for (int half = 0; half < 2; ++half)
            planes[half] = V::load(at + tokenmill::high_chunk<BITS>(half) * kLanes * 4);
        }
        for (int c = 0; c < 4; ++c) {
          const typename V::I v = V::load(at + c * kLanes * 4);
          typename V::I lo = V::low(v), hi = V::high(v);
          if constexpr (BITS > 4) {
            constexpr int mask = tokenmill::high_mask<BITS>();
            lo = V::with_high(lo, planes[0], tokenmill::high_shift<BITS>(c, 0), mask);
            hi = V::with_high(hi, planes[1], tokenmill::high_shift<BITS>(c, 1), mask);
          }
          for (int i = 0; i < N; ++i) {
            sums[i] = V::dot4(sums[i], lo, four(4 * c, i));
            high_sums[i] = V::dot4(high_sums[i], hi, four(16 + 4 * c, i));
          }
        }
        if constexpr (SUB != 16 && kTwoChains) {
          for (int i = 0; i < N; ++i) sums[i] = V::add(sums[i], upper[i]);
        }
        finish(b * (kBlock / SUB), sums);
        if constexpr (SUB == 16) finish(2 * b + 1, upper);
      } else if constexpr (BITS == 8) {
        // odd chunks sum apart where vpdpbusd runs (AVX-512): two chains of dependent vpdpbusd, not one
        constexpr bool kTwoChains = V::kLanes == 16;
        typename V::I odd[N];
#pragma GCC unroll 8
        for (int64_t c = 0; c < 8; ++c) {
          if (c % (SUB / 4) == 0) {
            start(b * (kBlock / SUB) + c / (SUB / 4), sums);
            if constexpr (kTwoChains) {
              for (int i = 0; i < N; ++i) odd[i] = V::set1(0);
            }
          }
          const typename V::Signed8 v = V::signed8(V::load(at + c * kLanes * 4));
          typename V::I (&into)[N] = kTwoChains && c % 2 ? odd : sums;
          for (int i = 0; i < N; ++i) into[i] = V::dot4(into[i], v, four(4 * static_cast<int>(c), i));
          if (c % (SUB / 4) == SUB / 4 - 1) {
            if constexpr (kTwoChains) {
              for (int i = 0; i < N; ++i) sums[i] = V::add(sums[i], odd[i]);
            }
            finish(b * (kBlock / SUB) + c / (SUB / 4), sums);
          }
        }
      }
    }
    for (int i = 0; i < N; ++i) V::store(out[i] + lane0, acc[i]);
  }
#else
  for (int i = 0; i < N; ++i) {
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      float acc = 0.f;
      for (int64_t k = 0; k < groups; ++k) {  // k: one scale's SUB weights, from weight k * SUB of the row
        const int32_t isum = x.isums[r0 * groups + k * N + i];
        const float x_scale = xs[(k * SUB / kBlock) * N + i];
        int32_t sum = -static_cast<int32_t>(w.zero) * isum;
        for (int64_t j = k * SUB; j < (k + 1) * SUB; ++j) {
          const int64_t b = j / kBlock, in_block = j % kBlock;
          sum += code<BITS>(q + b * block_bytes + lane * 4, in_block) * xq[((j / 4) * N + i) * 4 + j % 4];
        }
        acc += static_cast<float>(sum) * (static_cast<float>(scales[k * kLanes + lane]) * x_scale);
        if (shift) {
          const float x_sum = x_scale * static_cast<float>(isum);
          acc += static_cast<float>(shift[k * kLanes + lane]) * x_sum;
        }
      }
      out[i][lane] = acc;
    }
  }
#endif
}


// The bf16 value at p (2 bytes, unaligned), as fp32: exactly.
inline float bf16_at(const uint8_t* p) {
  at::BFloat16 v;
  std::memcpy(&v, p, sizeof v);
  return static_cast<float>(v);
}

// bf16 weights (16 bits): group g's 16 output rows for fp32 activation rows r0..r0+N-1, as group_tile.
template <int N>
void bf16_group_tile(const QuantizedMatrix& w, int64_t g, const float* x, int64_t r0, float (*out)[kLanes]) {
  const int64_t blocks = w.in / kBlock, block_bytes = 16 * kLanes * 4;
  const uint8_t* q = w.q + g * blocks * block_bytes;
#if defined(TOKENMILL_AVX2)
  using V = Isa;
  constexpr int64_t kAhead = 2;  // blocks
  const float* xr[N];
  for (int i = 0; i < N; ++i) xr[i] = x + (r0 + i) * w.in;
  for (int64_t lane0 = 0; lane0 < kLanes; lane0 += V::kLanes) {
    typename V::F first[N], second[N];  // two sums a row: half as long a chain of dependent multiply-adds
    for (int i = 0; i < N; ++i) first[i] = second[i] = V::zero_f();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* at = q + b * block_bytes + lane0 * 4;
      if (lane0 == 0) prefetch(at + kAhead * block_bytes, block_bytes);
#pragma GCC unroll 16
      for (int c = 0; c < 16; ++c) {
        const typename V::I v = V::load(at + c * kLanes * 4);
        const typename V::F e = V::first_bf16(v), o = V::second_bf16(v);
        const int64_t j = b * kBlock + tokenmill::pair_first(c);
        for (int i = 0; i < N; ++i) {
          first[i] = V::fma(e, xr[i][j], first[i]);
          second[i] = V::fma(o, xr[i][j + 2], second[i]);
        }
      }
    }
    for (int i = 0; i < N; ++i) V::store(out[i] + lane0, V::add(first[i], second[i]));
  }
#else
  for (int i = 0; i < N; ++i)
    for (int64_t lane = 0; lane < kLanes; ++lane) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b)
        for (int c = 0; c < 16; ++c)
          for (int half = 0; half < 2; ++half)
            acc += bf16_at(q + (b * 16 + c) * kLanes * 4 + lane * 4 + 2 * half) *
                   x[(r0 + i) * w.in + b * kBlock + tokenmill::pair_first(c) + 2 * half];
      out[i][lane] = acc;
    }
#endif
}

#if defined(TOKENMILL_VNNI512)
// 16 bf16, widened to fp32 exactly
inline __m512 widen_bf16(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

// fp32 values rounded to bf16 (to nearest, ties to even; NaN stays NaN), as 32-bit lanes holding the bf16 in their
// high half: exactly the bf16 widened back.
inline __m512i round_to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i half = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));  // ties go to the even bf16
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, half), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

// n sums to bf16 (rounded as at::BFloat16 rounds), 16 at a time.
inline void store_bf16(at::BFloat16* to, const float* from, int64_t n) {
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + j),
                        _mm512_cvtepi32_epi16(round_to_bf16(_mm512_loadu_ps(from + j))));
  for (; j < n; ++j) to[j] = static_cast<at::BFloat16>(from[j]);
}

constexpr int64_t kMaxSetRows = 12;  // rows a tile of over_group_sets, at most

// out[rows, w.out] (fp32, or each sum rounded to bf16), sets of `per` groups (16 outputs each) shared among the
// threads: tile(g0, gn, r0, n, t) puts the gn groups from g0 of rows r0..r0+n-1 in t (n <= tile_rows <=
// kMaxSetRows, gn <= per <= 4). Rows go in blocks of about kRowBlockBytes (row_bytes a row), every set of a thread's
// over a block before the next, as over_groups has them.
template <typename TO, typename Tile>
void over_group_sets(int64_t rows, int64_t row_bytes, int64_t tile_rows, int64_t per, const QuantizedMatrix& w,
                     TO* out, Tile tile) {
  const int64_t groups = (w.out + kLanes - 1) / kLanes;
  const int64_t sets = (groups + per - 1) / per;
  const int64_t block = std::max<int64_t>(1, tokenmill::kRowBlockBytes / (row_bytes * tile_rows)) * tile_rows;
  at::parallel_for(0, sets, 1, [&](int64_t begin, int64_t end) {
    float t[kMaxSetRows][4 * kLanes];
    for (int64_t first = 0; first < rows; first += block) {
      const int64_t last = std::min(rows, first + block);
      for (int64_t set = begin; set < end; ++set) {
        const int64_t g0 = set * per, gn = std::min(per, groups - g0);
        const int64_t valid = std::min(gn * kLanes, w.out - g0 * kLanes);
        for (int64_t r0 = first; r0 < last; r0 += tile_rows) {
          const int64_t n = std::min(tile_rows, last - r0);
          tile(g0, gn, r0, n, t);
          for (int64_t i = 0; i < n; ++i) {
            TO* to = out + (r0 + i) * w.out + g0 * kLanes;
            if constexpr (std::is_same_v<TO, float>) {
              std::memcpy(to, t[i], valid * sizeof(float));
            } else {
              store_bf16(to, t[i], valid);
            }
          }
        }
      }
    }
  });
}
#endif

#if defined(TOKENMILL_VNNI512) && defined(__AVX512BF16__)
#define TOKENMILL_DPBF16 1
// The bits of a bf16: those of the value, or of the fp32 rounded to bf16 (to nearest, ties to even).
inline uint32_t bf16_bits(at::BFloat16 v) { return v.x; }
inline uint32_t bf16_bits(float v) { return at::BFloat16(v).x; }

// bf16 rows (x, or fp32 rows rounded to bf16) in the weights' pair order: a row's block b, chunk c holds the
// activations that chunk c of the weights' block multiplies, x[32b + pair_first(c)] and the one 2 after it, as one
// 32-bit pair.
template <typename T>
Array<uint32_t> paired_rows(const T* x, int64_t rows, int64_t in) {
  Array<uint32_t> out(rows * in / 2);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < in / kBlock; ++b)
        for (int c = 0; c < 16; ++c) {
          const T* at = x + r * in + b * kBlock + tokenmill::pair_first(c);
          out[(r * in + b * kBlock) / 2 + c] = bf16_bits(at[0]) | bf16_bits(at[2]) << 16;
        }
  });
  return out;
}

// bf16 weights (16 bits) times bf16 rows (paired_rows), GN groups (16 output rows each) by N rows into
// out[N][GN * 16]: each chunk's two products a lane in one vdpbf16ps, half the instructions of widening both to fp32,
// and each broadcast pair of activations feeding GN of them (one group a tile was bound by the broadcasts). The
// products of two bf16 are exact in fp32 and summed in fp32 in the same order whatever N and GN: a row's result
// does not depend on its batch.
template <int GN, int N>
void bf16_dot_tile(const QuantizedMatrix& w, int64_t g0, const uint32_t* x, int64_t r0, float (*out)[4 * kLanes]) {
  const int64_t pairs = w.in / 2;  // a row's chunks of 64 bytes, in order: block b's chunk c is chunk 16b + c
  const uint8_t* q[GN];
  for (int j = 0; j < GN; ++j) q[j] = w.q + (g0 + j) * pairs * kLanes * 4;
  const uint32_t* xr[N];
  for (int i = 0; i < N; ++i) xr[i] = x + (r0 + i) * pairs;
  __m512 acc[N][GN];
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < GN; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < pairs; ++k) {
    __m512i v[GN];
    for (int j = 0; j < GN; ++j) v[j] = _mm512_loadu_si512(q[j] + k * kLanes * 4);
    for (int i = 0; i < N; ++i) {
      const __m512i pair = _mm512_set1_epi32(static_cast<int32_t>(xr[i][k]));
      for (int j = 0; j < GN; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)pair, (__m512bh)v[j]);
    }
  }
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < GN; ++j) _mm512_storeu_ps(out[i] + j * kLanes, acc[i][j]);
}

constexpr int64_t kDotRows = 6;  // rows a bf16_dot_tile: 6 x 4 sums, 4 weight vectors and a pair in 32 registers
static_assert(kDotRows <= kMaxSetRows, "over_group_sets' tile holds these rows");

// out[rows, w.out] = bf16 rows (paired_rows) times bf16 weights: sets of 4 groups shared among the threads (2 where
// few sets split unevenly: SmolLM2's 576 outputs made 9, one thread's 5 to the other's 4), rows in blocks as
// over_groups has them; sums as fp32 or rounded once to bf16.
template <typename TO>
void bf16_dot_matmul(const uint32_t* x, int64_t rows, const QuantizedMatrix& w, TO* out) {
  const int64_t groups = (w.out + kLanes - 1) / kLanes;
  const int64_t threads = at::get_num_threads(), sets = (groups + 3) / 4;
  const int64_t per = sets % threads == 0 || sets >= 8 * threads ? 4 : 2;
  over_group_sets(rows, w.in * 2, kDotRows, per, w, out, [&](int64_t g0, int64_t gn, int64_t r0, int64_t n, auto t) {
    tokenmill::with_count<kDotRows>(n, [&](auto count) {
      tokenmill::with_count<4>(gn, [&](auto set) {
        bf16_dot_tile<decltype(set)::value, decltype(count)::value>(w, g0, x, r0, t);
      });
    });
  });
}
#endif

#if defined(TOKENMILL_VNNI512)
#define TOKENMILL_WIDE_BF16 1
// fp32 rows in the weights' pair order, two floats a chunk: row r's chunk 16b + c holds x[32b + pair_first(c)] and
// x[32b + pair_first(c) + 2]. bf16 rows widen exactly; round: fp32 rows rounded to bf16 first (a bf16 model's rows).
template <typename T>
Array<float> paired_floats(const T* x, int64_t rows, int64_t in, bool round) {
  Array<float> out(rows * in);
  // output lane p of a block's 32 takes input pair_first(p / 2) + 2 * (p % 2) (bit 4: from the second vector)
  alignas(64) int32_t index[2][kLanes];
  for (int p = 0; p < 2 * kLanes; ++p) index[p / kLanes][p % kLanes] = tokenmill::pair_first(p / 2) + 2 * (p % 2);
  const __m512i lo = _mm512_load_si512(index[0]), hi = _mm512_load_si512(index[1]);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < in / kBlock; ++b) {
        const T* from = x + r * in + b * kBlock;
        __m512 a, c;
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          a = widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from)));
          c = widen_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + kLanes)));
        } else {
          a = _mm512_loadu_ps(from);
          c = _mm512_loadu_ps(from + kLanes);
          if (round) {
            a = _mm512_castsi512_ps(_mm512_slli_epi32(round_to_bf16(a), 16));
            c = _mm512_castsi512_ps(_mm512_slli_epi32(round_to_bf16(c), 16));
          }
        }
        float* to = out.data() + r * in + b * kBlock;
        _mm512_storeu_ps(to, _mm512_permutex2var_ps(a, lo, c));
        _mm512_storeu_ps(to + kLanes, _mm512_permutex2var_ps(a, hi, c));
      }
  });
  return out;
}

constexpr int64_t kWideFewRows = 5;  // up to this many rows: tiles of 4 groups (20 sums), else 2 groups by 12 rows
constexpr int64_t kWideRows = 12;
static_assert(kWideRows <= kMaxSetRows, "over_group_sets' tile holds these rows");

// bf16 weights widened to fp32 times fp32 rows (paired_floats), GN groups (16 output rows each) by N rows into
// out[N][GN * 16]: each broadcast activation feeds GN multiply-adds, each widened weight vector N. One sum a row and
// output, each chunk's first product then its second, chunk by chunk: the same arithmetic whatever GN and N (a row's
// result does not depend on its batch), where one group a tile with two sums a row (the AVX2 path's) was bound by
// its broadcasts at many rows and by its two sums' adds at few.
template <int GN, int N>
void bf16_wide_tile(const QuantizedMatrix& w, int64_t g0, const float* x, int64_t r0, float (*out)[4 * kLanes]) {
  const int64_t pairs = w.in / 2;
  const uint8_t* q[GN];
  for (int j = 0; j < GN; ++j) q[j] = w.q + (g0 + j) * pairs * kLanes * 4;
  const float* xr[N];
  for (int i = 0; i < N; ++i) xr[i] = x + (r0 + i) * w.in;
  __m512 acc[N][GN];
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < GN; ++j) acc[i][j] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < pairs; ++k) {
    if constexpr (N <= kWideFewRows) {  // few rows read the weights at memory speed: ask for them 2 blocks ahead
      if (k % 16 == 0)
        for (int j = 0; j < GN; ++j) prefetch(q[j] + (k + 32) * kLanes * 4, 16 * kLanes * 4);
    }
    __m512 first[GN], second[GN];
    for (int j = 0; j < GN; ++j) {
      const __m512i v = _mm512_loadu_si512(q[j] + k * kLanes * 4);
      first[j] = Isa::first_bf16(v);
      second[j] = Isa::second_bf16(v);
    }
    for (int i = 0; i < N; ++i) {
      const __m512 a = _mm512_set1_ps(xr[i][2 * k]), b = _mm512_set1_ps(xr[i][2 * k + 1]);
      for (int j = 0; j < GN; ++j) acc[i][j] = _mm512_fmadd_ps(second[j], b, _mm512_fmadd_ps(first[j], a, acc[i][j]));
    }
  }
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < GN; ++j) _mm512_storeu_ps(out[i] + j * kLanes, acc[i][j]);
}

// out[rows, w.out] = paired fp32 rows times bf16 weights widened, sums as fp32 or rounded once to bf16: sets of
// groups shared among the threads, rows in blocks kept in cache while the weights pass.
template <typename TO>
void bf16_wide_matmul(const float* x, int64_t rows, const QuantizedMatrix& w, TO* out) {
  if (rows == 0) return;
  const int64_t groups = (w.out + kLanes - 1) / kLanes;
  const bool few = rows <= kWideFewRows;
  const int64_t per = few && groups >= 8 * at::get_num_threads() ? 4 : 2;
  over_group_sets(rows, w.in * 4, few ? rows : kWideRows, per, w, out,
                  [&](int64_t g0, int64_t gn, int64_t r0, int64_t n, auto t) {
    if (few) {
      tokenmill::with_count<kWideFewRows>(n, [&](auto count) {
        tokenmill::with_count<4>(gn, [&](auto set) {
          bf16_wide_tile<decltype(set)::value, decltype(count)::value>(w, g0, x, r0, t);
        });
      });
    } else {
      tokenmill::with_count<kWideRows>(n, [&](auto count) {
        tokenmill::with_count<2>(gn, [&](auto set) {
          bf16_wide_tile<decltype(set)::value, decltype(count)::value>(w, g0, x, r0, t);
        });
      });
    }
  });
}
#endif

// out[rows, w.out], groups shared among the threads: tile(g, r0, N, t) puts group g's columns of rows r0..r0+N-1 in
// t (N <= kRowTile, a std::integral_constant). Rows go in blocks of about kRowBlockBytes of activations (row_bytes a
// row), every group of a thread's over a block before the next: the block stays in cache while the weights pass. Each
// group over all the rows at once read a 2,048-row step's activations (4.7 MiB of SmolLM2's fp32 rows) once per
// group, and made the bf16 kernel's fp32 prefill 1.8x slower than oneDNN's. The threads take their groups once and
// walk the blocks on their own: a parallel region a block (57 of them in a 2,048-row down projection) woke the other
// threads at each, which slept between them wherever libgomp saw more of its threads than CPUs (an engine thread's
// team beside the main thread's: 20-35% of a prompt's matmul time).
template <typename T, typename Tile>
void over_groups(int64_t rows, int64_t row_bytes, const QuantizedMatrix& w, T* out, Tile tile) {
  const int64_t groups = (w.out + kLanes - 1) / kLanes;
  const int64_t block = std::max<int64_t>(1, tokenmill::kRowBlockBytes / (row_bytes * kRowTile)) * kRowTile;
  at::parallel_for(0, groups, 4, [&](int64_t begin, int64_t end) {
    float t[kRowTile][kLanes];
    for (int64_t first = 0; first < rows; first += block) {
      const int64_t last = std::min(rows, first + block);
      for (int64_t g = begin; g < end; ++g) {
        const int64_t valid = std::min(kLanes, w.out - g * kLanes);
        for (int64_t r0 = first; r0 < last; r0 += kRowTile) {
          const int64_t n = std::min(kRowTile, last - r0);
          tokenmill::with_count<kRowTile>(n, [&](auto count) { tile(g, r0, count, t); });
          for (int64_t i = 0; i < n; ++i) {
            T* to = out + (r0 + i) * w.out + g * kLanes;
            if constexpr (std::is_same_v<T, float>) {
              std::memcpy(to, t[i], valid * sizeof(float));
            } else {
              for (int64_t j = 0; j < valid; ++j) to[j] = static_cast<T>(t[i][j]);
            }
          }
        }
      }
    }
  });
}

// out[rows, w.out] = x @ dequantize(w).T on the integer kernel (w of 4 to 8 bits): x fp32 or bf16, out fp32 or bf16
// (each sum rounded once).
template <typename TX, typename TO>
void integer_matmul(const TX* x, int64_t rows, const QuantizedMatrix& w, TO* out) {
  tokenmill::with_layout(w, [&](auto bits, auto sub, auto s) {
    constexpr int kBits = decltype(bits)::value;
    if constexpr (kBits != 16) {
      const QuantizedRows xq = quantize_rows(x, rows, w.in, w.sub, kernel_zero(w), w.shift != nullptr);
      over_groups(rows, w.in, w, out, [&](int64_t g, int64_t r0, auto count, float (*t)[kLanes]) {
        group_tile<kBits, decltype(sub)::value, decltype(s), decltype(count)::value>(w, g, xq, r0, t);
      });
    }
  });
}

// f(out's data as float* or at::BFloat16*): the kernels write fp32 or bf16 sums as they are, not through a copy.
template <typename F>
void with_sums(at::Tensor& out, F f) {
  if (out.scalar_type() == at::kFloat) {
    f(out.data_ptr<float>());
  } else {
    f(out.data_ptr<at::BFloat16>());
  }
}

// w = scale * (q - zero) + shift per `sub` weights, in the interleaved layout above; out_features: the matrix's rows;
// bf16_rows: fp32 rows on bf16 weights multiply as their bf16 rounding (tokenmill::quantized_matmul); float_out:
// the fp32 sums whatever x's dtype (the output head: its logits are sampled in fp32, and a rounding to bf16 and back
// was two passes over rows x vocabulary floats); pairs: bf16 rows on bf16 weights multiply as bf16 pairs
// (vdpbf16ps) where the CPU has them, else widened to fp32 (backend.py measures which is faster).
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& shift, int64_t sub, int64_t zero, int64_t out_features,
                            int64_t tiles_from_rows, bool bf16_rows, bool float_out, bool pairs) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  const at::ScalarType out_type = float_out ? at::kFloat : x.scalar_type();
  const QuantizedMatrix w = tokenmill::quantized_matrix(qweight, scales, shift, sub, zero, out_features);
  TORCH_CHECK(x.size(1) == w.in, "x has ", x.size(1), " features, the weight ", w.in);
  if (x.scalar_type() == at::kBFloat16 && tokenmill::takes_tiles(x.size(0), tiles_from_rows)) {
    // the tiles take bf16 rows as they are and give bf16 sums
    const at::Tensor xb = x.contiguous();
    at::Tensor out = at::empty({x.size(0), w.out}, x.options());
    tokenmill::tile_matmul(xb.data_ptr<at::BFloat16>(), x.size(0), w, out.data_ptr<at::BFloat16>());
    return out.to(out_type);
  }
#if defined(TOKENMILL_DPBF16)
  if (pairs && x.scalar_type() == at::kBFloat16 && w.bits == 16) {  // bf16 rows on bf16 weights: vdpbf16ps
    const at::Tensor xb = x.contiguous();
    const Array<uint32_t> paired = paired_rows(xb.data_ptr<at::BFloat16>(), x.size(0), w.in);
    at::Tensor out = at::empty({x.size(0), w.out}, x.options().dtype(out_type));
    with_sums(out, [&](auto* sums) { bf16_dot_matmul(paired.data(), x.size(0), w, sums); });
    return out;
  }
#endif
#if defined(TOKENMILL_WIDE_BF16)
  if (x.scalar_type() == at::kBFloat16 && w.bits == 16) {  // bf16 rows widened exactly, the sums written as asked
    const at::Tensor xb = x.contiguous();
    const Array<float> paired = paired_floats(xb.data_ptr<at::BFloat16>(), x.size(0), w.in, false);
    at::Tensor out = at::empty({x.size(0), w.out}, x.options().dtype(out_type));
    with_sums(out, [&](auto* sums) { bf16_wide_matmul(paired.data(), x.size(0), w, sums); });
    return out;
  }
#endif
  if (w.bits != 16 && !tokenmill::takes_tiles(x.size(0), tiles_from_rows) &&
      (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
      (out_type == at::kFloat || out_type == at::kBFloat16)) {  // the integer kernel reads and writes these as they are
    const at::Tensor xc = x.contiguous();
    at::Tensor out = at::empty({x.size(0), w.out}, x.options().dtype(out_type));
    AT_DISPATCH_SWITCH(x.scalar_type(), "quantized_linear",
        AT_DISPATCH_CASE(at::kFloat, [&] {
          with_sums(out, [&](auto* sums) { integer_matmul(xc.data_ptr<scalar_t>(), x.size(0), w, sums); });
        })
        AT_DISPATCH_CASE(at::kBFloat16, [&] {
          with_sums(out, [&](auto* sums) { integer_matmul(xc.data_ptr<scalar_t>(), x.size(0), w, sums); });
        }));
    return out;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), w.out}, x.options().dtype(at::kFloat));
  tokenmill::quantized_matmul(xf.data_ptr<float>(), x.size(0), w, out.data_ptr<float>(), tiles_from_rows, bf16_rows,
                              pairs);
  return out.to(out_type);
}

// The dense [out, in] matrix of dtype (fp32, bf16 or fp16), or its rows `rows` (count of them; nullptr: all):
// w = scale * (q - zero) + shift, each value computed in fp32 and rounded once, as layers/quantized.py's
// QuantizedWeight.dequantize does in torch ops (which take ~8 passes over the matrix where this takes one, and
// ~15 ops for an embedding's few rows). bf16 weights: their values.
template <int BITS, typename S, typename T>
void dequantize_rows(const QuantizedMatrix& w, const int64_t* rows, int64_t count, T* out) {
  const int64_t blocks = w.in / kBlock, groups = w.in / w.sub;
  const int64_t block_bytes = BITS * kLanes * 4;
  at::parallel_for(0, count, 16, [&](int64_t begin, int64_t end) {
    float values[kBlock];
    for (int64_t r = begin; r < end; ++r) {
      const int64_t o = rows ? rows[r] : r;
      const int64_t g = o / kLanes, lane = o % kLanes;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* at = w.q + (g * blocks + b) * block_bytes + lane * 4;
        T* row = out + r * w.in + b * kBlock;
        if constexpr (BITS == 16) {
          for (int c = 0; c < 16; ++c)
            for (int half = 0; half < 2; ++half)
              row[tokenmill::pair_first(c) + 2 * half] = static_cast<T>(bf16_at(at + c * kLanes * 4 + 2 * half));
        } else {
          for (int64_t j = 0; j < kBlock; ++j) values[j] = static_cast<float>(code<BITS>(at, j) - w.zero);
          for (int64_t k = 0; k < kBlock / w.sub; ++k) {  // the block's scales (one, or two of 16 weights)
            const int64_t at_scale = (g * groups + b * (kBlock / w.sub) + k) * kLanes + lane;
            const float scale = static_cast<float>(static_cast<const S*>(w.scales)[at_scale]);
            const float shift = w.shift ? static_cast<float>(static_cast<const S*>(w.shift)[at_scale]) : 0.f;
            for (int64_t j = k * w.sub; j < (k + 1) * w.sub; ++j) row[j] = static_cast<T>(values[j] * scale + shift);
          }
        }
      }
    }
  });
}

// rows: the rows to take (an embedding's lookup, each checked against the matrix), or none: all of them.
at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& shift,
                      int64_t sub, int64_t zero, int64_t out_features, at::ScalarType dtype,
                      const std::optional<at::Tensor>& rows) {
  const QuantizedMatrix w = tokenmill::quantized_matrix(qweight, scales, shift, sub, zero, out_features);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "dequantize to fp32, bf16 or fp16, not ", dtype);
  at::Tensor index;
  const int64_t* ids = nullptr;
  int64_t count = w.out;
  if (rows) {
    index = rows->to(at::kLong).contiguous();
    TORCH_CHECK(index.dim() == 1, "rows must be one dimension of row indices");
    ids = index.data_ptr<int64_t>();
    count = index.numel();
    for (int64_t r = 0; r < count; ++r)
      TORCH_CHECK(ids[r] >= 0 && ids[r] < w.out, "row ", ids[r], " is outside the matrix's ", w.out, " rows");
  }
  at::Tensor out = at::empty({count, w.in}, qweight.options().dtype(dtype));
  tokenmill::with_layout(w, [&](auto bits, auto, auto s) {
    constexpr int kBits = decltype(bits)::value;
    using S = decltype(s);
    switch (dtype) {
      case at::kFloat: dequantize_rows<kBits, S>(w, ids, count, out.data_ptr<float>()); break;
      case at::kBFloat16: dequantize_rows<kBits, S>(w, ids, count, out.data_ptr<at::BFloat16>()); break;
      default: dequantize_rows<kBits, S>(w, ids, count, out.data_ptr<at::Half>()); break;
    }
  });
  return out;
}

}  // namespace

QuantizedMatrix tokenmill::quantized_matrix(const at::Tensor& qweight, const at::Tensor& scales,
                                            const std::optional<at::Tensor>& shift, int64_t sub, int64_t zero,
                                            int64_t out_features) {
  TORCH_CHECK(qweight.dim() == 5 && qweight.is_contiguous() && qweight.size(3) == kLanes && qweight.size(4) == 4,
              "qweight must be a contiguous [groups, blocks, chunks, 16, 4] interleaving");
  const int bits = static_cast<int>(qweight.size(2));  // chunks of 4 bytes a row's block: its bits a weight
  const int64_t groups = qweight.size(0), in = qweight.size(1) * kBlock;
  TORCH_CHECK(in > 0, "a matrix of no inputs");
  TORCH_CHECK(out_features > (groups - 1) * kLanes && out_features <= groups * kLanes,
              "qweight's ", groups, " groups of 16 rows do not hold ", out_features, " rows");
  if (bits == 16) {
    TORCH_CHECK(qweight.scalar_type() == at::kByte && scales.numel() == 0 && !shift.has_value() && zero == 0,
                "bf16 weights are uint8 of 16 chunks a block, without scales, shift nor zero point");
    return {static_cast<const uint8_t*>(qweight.data_ptr()), bits, nullptr, nullptr, false, 0, kBlock, in,
            out_features};
  }
  TORCH_CHECK(qweight.scalar_type() == (bits == 8 ? at::kChar : at::kByte) && bits >= 4 && bits <= 8 && bits != 7,
              "qweight must be uint8 of 4, 5 or 6 chunks a block (its bits a weight), int8 of 8 or uint8 of 16 "
              "(bf16)");
  TORCH_CHECK(bits == 6 ? sub == 16 : sub == 32 || (sub == 16 && (bits == 8 || bits == 4)),
              "sub must be 16 for 6-bit weights, 32 or 16 for 4- and 8-bit ones, else 32");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous(),
              "scales must be contiguous fp32 or fp16");
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == groups && scales.size(1) == in / sub && scales.size(2) == kLanes,
              "scales must be [groups, in / sub, 16]");
  const void* shift_ptr = nullptr;
  if (shift.has_value()) {
    TORCH_CHECK(shift->sizes() == scales.sizes() && shift->scalar_type() == scales.scalar_type() &&
                    shift->is_contiguous(), "shift must be shaped and typed as scales");
    shift_ptr = shift->data_ptr();
  }
  TORCH_CHECK(zero >= 0 && zero < 256, "the zero point must be a weight value");
  return {static_cast<const uint8_t*>(qweight.data_ptr()), bits, scales.data_ptr(), shift_ptr,
          scales.scalar_type() == at::kHalf, zero, sub, in, out_features};
}

void tokenmill::quantized_matmul(const float* x, int64_t rows, const QuantizedMatrix& w, float* out,
                                 int64_t tiles_from_rows, bool bf16_rows, bool pairs) {
  if (takes_tiles(rows, tiles_from_rows)) {
    tile_matmul(x, rows, w, out);
    return;
  }
#if defined(TOKENMILL_DPBF16)
  if (bf16_rows && pairs && w.bits == 16) {
    bf16_dot_matmul(paired_rows(x, rows, w.in).data(), rows, w, out);
    return;
  }
#endif
#if defined(TOKENMILL_WIDE_BF16)
  if (w.bits == 16) {
    bf16_wide_matmul(paired_floats(x, rows, w.in, bf16_rows).data(), rows, w, out);
    return;
  }
#endif
  if (bf16_rows && w.bits == 16) {  // the rows as a bf16 model's ops would have them, multiplied in fp32
    std::vector<float> rounded(x, x + rows * w.in);
    for (float& v : rounded) v = static_cast<float>(at::BFloat16(v));
    quantized_matmul(rounded.data(), rows, w, out, tiles_from_rows, false, pairs);
    return;
  }
  if (w.bits == 16) {
    over_groups(rows, w.in * sizeof(float), w, out, [&](int64_t g, int64_t r0, auto count, float (*t)[kLanes]) {
      bf16_group_tile<decltype(count)::value>(w, g, x, r0, t);
    });
  } else {
    integer_matmul(x, rows, w, out);
  }
}

// The instruction sets this build's code paths were compiled for, as the compiler saw them: those that
// TOKENMILL_CPU_ISA turned off are absent (the tests check that the level asked is the level built).
std::vector<std::string> built_with() {
  std::vector<std::string> sets;
#if defined(__AVX2__) && defined(__FMA__)
  sets.emplace_back("avx2");
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
  sets.emplace_back("avx512");
#endif
#if defined(__AVX512VNNI__)
  sets.emplace_back("avx512_vnni");
#endif
#if defined(__AVX512BF16__)
  sets.emplace_back("avx512_bf16");
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  sets.emplace_back("amx");
#endif
  return sets;
}

TORCH_LIBRARY(tokenmill, m) {
  m.def("quantized_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? shift, int sub, int zero, "
        "int out_features, int tiles_from_rows=0, bool bf16_rows=False, bool float_out=False, bool pairs=True) "
        "-> Tensor");
  m.def("tiles_available() -> bool", &tokenmill::tiles_available);
  m.def("built_with() -> str[]", &built_with);
  m.def("dequantize(Tensor qweight, Tensor scales, Tensor? shift, int sub, int zero, int out_features, "
        "ScalarType dtype, Tensor? rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
  m.impl("dequantize", &dequantize);
}
