// What the kernels share: the fused decoder layer (layer.cpp) calls the others' fp32 loops directly, without a
// tensor or a dispatch between them; the vector reductions they all use.

#pragma once

#include <ATen/ATen.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace tokenmill {

#if defined(__AVX2__) && defined(__FMA__)
// The sum of v's eight lanes.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// The largest of v's lanes (none NaN).
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// e^x as Cephes' expf computes it: x clamped to [-87.3, 88.7] (no overflow, no denormals), x = n ln2 + r with
// |r| <= ln2 / 2 (ln2 in two parts), a degree-6 polynomial in r, times 2^n; within 2 ulp. The vector versions below
// share these constants.
namespace expf_poly {
constexpr float kLow = -87.3f, kHigh = 88.7f, kLog2e = 1.44269504f, kLn2High = 0.693359375f,
                kLn2Low = -2.12194440e-4f;
// p(r) = ((((c0 r + c1) r + c2) r + c3) r + c4) r + c5, then e^r = p(r) r^2 + r + 1
constexpr float kCoefficients[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace expf_poly

#if defined(__AVX512F__)
inline __m512 exp512(__m512 x) {
  using namespace expf_poly;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kLow)), _mm512_set1_ps(kHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kCoefficients[0]);
  for (int c = 1; c < 6; ++c) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kCoefficients[c]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
// exp512's arithmetic on 8 lanes (2^n put in the exponent bits, there being no scalef).
inline __m256 exp256(__m256 x) {
  using namespace expf_poly;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kLow)), _mm256_set1_ps(kHigh));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kCoefficients[0]);
  for (int c = 1; c < 6; ++c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kCoefficients[c]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}
#endif

#if defined(__AVX512F__)
#define TOKENMILL_VEC 1
// The attention kernels' vector arithmetic (attention.cpp, attention_prefill.cpp), on 16 lanes.
struct Vec {
  static constexpr int64_t kLanes = 16;
  static constexpr int kHeads = 4;  // decode: query heads a pass over the keys takes, 4 x 4 sums + 4 keys
  using F = __m512;
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const at::BFloat16* p) {  // a bf16 is the top half of an fp32
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  static F load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F load(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  // e4m3's sign, exponent and mantissa moved into an fp32's places: that fp32 is the value times 2^-120, exactly
  // (subnormals too), so one multiply makes it the value.
  static F load(const c10::Float8_e4m3fn* p) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24),
                                         _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7f)), 20));
    return _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
  }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static float sum(F v) { return _mm512_reduce_add_ps(v); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // e^(s - shift), and 0 where s is -inf (a masked score) or shift is (nothing seen yet)
  static F exp_or_zero(F s, F shift) {
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __mmask16 seen = _mm512_cmp_ps_mask(s, ninf, _CMP_NEQ_OQ) & _mm512_cmp_ps_mask(shift, ninf, _CMP_NEQ_OQ);
    return _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(s, shift)));
  }
  // e^(old - now): how much the sums so far shrink when the max rises from old to now; 1 while now is -inf
  static F rescale(F old, F now) {
    const __mmask16 seen = _mm512_cmp_ps_mask(now, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                              _CMP_NEQ_OQ);
    return _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.f), exp512(_mm512_sub_ps(old, now)));
  }
  // The lane sums of a, b, c and d, in that order: one transpose-and-add tree for the four.
  static __m128 sum4(F a, F b, F c, F d) {
    const F ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // a0+a2 b0+b2 a1+a3 b1+b3
    const F cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512d abd = _mm512_castps_pd(ab), cdd = _mm512_castps_pd(cd);
    const F sums = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(abd, cdd)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(abd, cdd)));  // a b c d, in each 128 bits
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(sums),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define TOKENMILL_VEC 1
// The attention kernels' vector arithmetic, on 8 lanes.
struct Vec {
  static constexpr int64_t kLanes = 8;
  static constexpr int kHeads = 2;  // 2 x 4 sums + 4 keys of the 16 registers
  using F = __m256;
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const at::BFloat16* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static F load(const at::Half* p) {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    alignas(32) float wide[8];
    for (int j = 0; j < 8; ++j) wide[j] = static_cast<float>(p[j]);
    return _mm256_load_ps(wide);
#endif
  }
  static F load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static F load(const c10::Float8_e4m3fn* p) {  // as the AVX-512 load does
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24),
                                         _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7f)), 20));
    return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
  }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static float sum(F v) { return hsum(v); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F exp_or_zero(F s, F shift) {
    const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    const __m256 seen = _mm256_and_ps(_mm256_cmp_ps(s, ninf, _CMP_NEQ_OQ), _mm256_cmp_ps(shift, ninf, _CMP_NEQ_OQ));
    return _mm256_and_ps(seen, exp256(_mm256_sub_ps(s, shift)));
  }
  static F rescale(F old, F now) {
    const __m256 seen = _mm256_cmp_ps(now, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
    return _mm256_blendv_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(old, now)), seen);
  }
  static __m128 sum4(F a, F b, F c, F d) {
    const F sums = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // a b c d, in each 128 bits
    return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
  }
};
#endif

// The largest of v's n values (none NaN; -inf where n is 0), in vector lanes: std::max_element's loop is one
// dependent chain of scalar maxes, 4 cycles a value (a third of the decode kernel's time at 256 keys a task).
inline float max_of(const float* v, int64_t n) {
  int64_t j = 0;
  float top = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 acc = _mm512_set1_ps(top);
  for (; j + 16 <= n; j += 16) acc = _mm512_max_ps(acc, _mm512_loadu_ps(v + j));
  top = _mm512_reduce_max_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_set1_ps(top);
  for (; j + 8 <= n; j += 8) acc = _mm256_max_ps(acc, _mm256_loadu_ps(v + j));
  top = hmax(acc);
#endif
  for (; j < n; ++j) top = std::max(top, v[j]);
  return top;
}

// v[j] = e^(v[j] - shift) for j < n (exp512's arithmetic on every lane, the tail too: one rounding for all); returns
// their sum. The scalar std::exp was most of the decode attention's softmax and of SiLU (measured with perf).
inline float exp_sum(float* v, int64_t n, float shift) {
  int64_t j = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; j < n; j += 16) {
    const __mmask16 m = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, v + j), _mm512_set1_ps(shift)));
    _mm512_mask_storeu_ps(v + j, m, e);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(m, e));
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (; j < n; j += 8) {
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(std::min<int64_t>(n - j, 8))), lane);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_maskload_ps(v + j, m), _mm256_set1_ps(shift)));
    _mm256_maskstore_ps(v + j, m, e);
    acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
  }
  sum = hsum(acc);
#else
  for (; j < n; ++j) {
    v[j] = std::exp(v[j] - shift);
    sum += v[j];
  }
#endif
  return sum;
}

// sum(a[j] * b[j]) for j < n, in vector registers: a compiler-vectorized reduction (`omp simd`) spilled its lanes
// to the stack and summed them one by one, most of the decode attention's time at 32 rows (measured with perf).
inline float dot(const float* a, const float* b, int64_t n) {
  int64_t j = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + j), _mm256_loadu_ps(b + j), acc);
  sum = hsum(acc);
#endif
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

// An array left uninitialized, for buffers whose every value is written before it is read: a std::vector's zero
// fill is a pass of its own (measurable at a decode step's few rows, and 1% of a long prompt's time for the rows
// a bf16 matmul widens).
template <typename T>
struct Array {
  std::unique_ptr<T[]> values;
  explicit Array(int64_t n) : values(new T[n]) {}
  T* data() { return values.get(); }
  const T* data() const { return values.get(); }
  T& operator[](int64_t i) { return values[i]; }
  T operator[](int64_t i) const { return values[i]; }
};

// Activation rows quantized to int8 per block of 32: q, the block's scale, and sum(q) per `sub` weights (the zero
// point multiplies it, and with the block's scale the weights' shifts). quant.cpp. Rows lie in tiles of 8 (the last
// one of what is left), a tile's n rows side by side (their values 4 at a time, their scales and sums one at a
// time), so that the kernel reaches all of them through one pointer and fixed offsets; one row is laid out as itself.
struct QuantizedRows {
  Array<int8_t> q;        // [tiles, in / 4, n, 4]
  Array<float> scale;     // [tiles, in / 32, n]
  Array<int32_t> isums;   // [tiles, in / sub, n]
  Array<int32_t> starts;  // [tiles, in / sub, n]: -zero * isums, where a sub-block's integer sum starts
  Array<float> xsums;     // [tiles, in / sub, n]: scale * isums, what the weights' shift multiplies (shifted only)
};

// Output rows interleaved in a quantized weight's group (quant.cpp describes the layout).
constexpr int64_t kInterleave = 16;

// f(N) for the count n clamped to 1..Max, N a std::integral_constant: the kernels that take a count of rows, heads
// or vectors as a template argument (so that their sums stay in registers) dispatch through it.
template <int Max, typename F>
void with_count(int64_t n, F&& f) {
  if constexpr (Max <= 1) {
    f(std::integral_constant<int, 1>{});
  } else if (n >= Max) {
    f(std::integral_constant<int, Max>{});
  } else {
    with_count<Max - 1>(n, f);
  }
}

// Activations a matmul of many rows keeps in cache (L2) while the weights pass: a block of rows at a time.
constexpr int64_t kRowBlockBytes = 256 << 10;

// bf16 weights (16 bits, quant.cpp) hold a row's block of 32 as 16 pairs, chunk r the weights pair_first(r) and
// pair_first(r) + 2: an AMX B tile's row r (tiles.cpp), an order cheap to unpack from 4-bit chunks.
constexpr int pair_first(int r) { return 4 * (r / 4) + ((r % 4) >> 1) + 16 * (r % 2); }

// A weight kept quantized (layers/quantized.py): w = scale * (q - zero) + shift per `sub` weights.
struct QuantizedMatrix {
  const uint8_t* q;     // [groups, in / 32, bits, 16, 4]: a row's block of 32 weights in `bits` chunks of 4 bytes
  int bits;             // 4, 5, 6 (uint8) or 8 (int8); 16: bf16 values themselves (no scales, shift nor zero)
  const void* scales;   // [groups, in / sub, 16], fp32, or fp16 where every scale is one (half_scales); 16 bits: null
  const void* shift;    // [groups, in / sub, 16] of the scales' type, or nullptr
  bool half_scales;
  int64_t zero;         // Q4_0: 8, Q5_0: 16, Q6_K: 32; else 0
  int64_t sub, in, out;
};

// 5- and 6-bit weights (quant.cpp's layout): the bits above the nibbles of chunk c, the low ones (half 0) or the
// high ones (half 1), are in chunk high_chunk(half), from bit high_shift(c, half) of the same byte, high_mask wide.
template <int BITS>
constexpr int high_chunk(int half) { return BITS == 6 ? 4 + half : 4; }
template <int BITS>
constexpr int high_shift(int c, int half) { return BITS == 6 ? 2 * c : 2 * c + half; }
template <int BITS>
constexpr int high_mask() { return BITS == 6 ? 3 : 1; }

// Calls f(BITS, SUB, S{}) for w's layout, BITS and SUB as std::integral_constant: 4- or 5-bit weights with a scale
// per 32, 6-bit ones with one per 16, or 8-bit ones with one per 32 or per 16; S the scales' type, at::Half or
// float. Each kernel is a template on the three, so the kernels that take a matrix dispatch through this one place.
// bf16 weights: f(16, 32, float).
template <typename F>
void with_layout(const QuantizedMatrix& w, F&& f) {
  const auto scales = [&](auto bits, auto sub) {
    w.half_scales ? f(bits, sub, at::Half{}) : f(bits, sub, float{});
  };
  using Sub32 = std::integral_constant<int, 32>;
  if (w.bits == 16) {
    f(std::integral_constant<int, 16>{}, Sub32{}, float{});
  } else if (w.bits == 4 && w.sub == 32) {
    scales(std::integral_constant<int, 4>{}, Sub32{});
  } else if (w.bits == 4) {  // Q2_K, Q3_K: a scale per 16
    scales(std::integral_constant<int, 4>{}, std::integral_constant<int, 16>{});
  } else if (w.bits == 5) {
    scales(std::integral_constant<int, 5>{}, Sub32{});
  } else if (w.bits == 6) {
    scales(std::integral_constant<int, 6>{}, std::integral_constant<int, 16>{});
  } else if (w.sub == 32) {
    scales(std::integral_constant<int, 8>{}, Sub32{});
  } else {
    scales(std::integral_constant<int, 8>{}, std::integral_constant<int, 16>{});
  }
}

// The matrix of these tensors, of out_features rows, checked against each other.
QuantizedMatrix quantized_matrix(const at::Tensor& qweight, const at::Tensor& scales,
                                 const std::optional<at::Tensor>& shift, int64_t sub, int64_t zero,
                                 int64_t out_features);
// out[rows, w.out] = x[rows, w.in] @ dequantize(w).T: steps of tiles_from_rows rows or more (0: none) on AMX tiles
// in bf16 where there are any (tile_matmul), the others by the integer kernel. bf16_rows (a bf16 model's rows, kept
// in fp32 by the fused layer): bf16 weights multiply the rows rounded to bf16, as the model's own ops would, with
// vdpbf16ps where the CPU has it and pairs asks for it (half the instructions of fp32 products; slower on Intel's
// cores, which issue it on one port: backend.py measures), else widened to fp32.
void quantized_matmul(const float* x, int64_t rows, const QuantizedMatrix& w, float* out, int64_t tiles_from_rows = 0,
                      bool bf16_rows = false, bool pairs = true);

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENMILL_AMX 1
// The tile registers as tiles.cpp and attention_prefill.cpp use them: all 8 of 16 rows of 64 bytes (a bf16 A or B
// tile of 16 x 32, an fp32 C tile of 16 x 16). A thread loads it before its first tile instruction.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};
inline void configure_tiles() {
  static const TileConfig config;
  _tile_loadconfig(&config);
}

// Lane i of first and of second, rounded to bf16, side by side in 32-bit lane i (first in the low half): the pairs
// a B tile holds.
inline __m512i bf16_pairs(__m512 first, __m512 second) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  // cvtne2ps puts first's 16 words below second's
  return _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first)));
}
#endif

// tiles.cpp: whether this build and process can run AMX tiles (the CPU has them, the kernel grants their state);
// the matmul above on them, weights and activations rounded to bf16, fp32 sums; x and out fp32, or both bf16 (a bf16
// model's rows, neither converted to fp32 and back).
bool tiles_available();
template <typename T>
void tile_matmul(const T* x, int64_t rows, const QuantizedMatrix& w, T* out);
// Whether a step of `rows` rows runs on the tiles: tiles_from_rows or more (0: never), where there are tiles.
inline bool takes_tiles(int64_t rows, int64_t tiles_from_rows) {
  return tiles_from_rows > 0 && rows >= tiles_from_rows && tiles_available();
}

// norm.cpp: out = rms_norm(x) * weight per row; with residual, x += residual first and the sum is normed.
void rms_norm_rows(float* x, const float* residual, const float* weight, float* out, int64_t rows, int64_t dim,
                   float eps);

// The KV pool's dtypes the fused layer reads and writes (its rows are fp32 whatever the pool): KV is one of these
// in rope_store_kv_rows and paged_decode_rows, instantiated in their files.
#define TOKENMILL_FOR_POOL_DTYPES(_) _(float) _(at::BFloat16) _(at::Half) _(int8_t) _(c10::Float8_e4m3fn)

// A quantized pool (--kv-cache-dtype int8 or fp8_e4m3): each KV head's row of a token is its `dim` numbers and
// then their fp32 scale (4 bytes, unaligned), a value being its number times the scale: the scale lives beside the
// numbers it scales, so a pool is still two tensors (k and v) whose blocks the prefix cache, preemption and the
// tensor-parallel ranks handle as they do any other, [blocks, block size, kv heads, dim + 4].
template <typename KV>
constexpr bool kQuantizedPool = std::is_same_v<KV, int8_t> || std::is_same_v<KV, c10::Float8_e4m3fn>;

// Elements from one KV head's row of a pool to the next.
template <typename KV>
constexpr int64_t row_stride(int64_t dim) {
  return kQuantizedPool<KV> ? dim + 4 : dim;
}

template <typename KV>
inline float row_scale(const KV* row, int64_t dim) {
  if constexpr (kQuantizedPool<KV>) {
    float scale;
    std::memcpy(&scale, row + dim, sizeof scale);
    return scale;
  } else {
    return 1.f;
  }
}

// x (fp32, dim values) into a pool's row: as it is, rounded to the pool's dtype, or quantized with a scale of its
// own (per token and KV head: a block is never re-scaled as tokens join it), amax / 127 for int8 (values rounded to
// nearest, ties to even) and amax / 448 for e4m3 (its largest finite). layers/attention.py's torch path
// (layers/kv_quant.py) computes the same bits.
template <typename KV>
inline void store_row(const float* x, KV* row, int64_t dim) {
  if constexpr (kQuantizedPool<KV>) {
    constexpr float kMax = std::is_same_v<KV, int8_t> ? 127.f : 448.f;
    float amax = 0.f;
    for (int64_t j = 0; j < dim; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float scale = amax / kMax;
    for (int64_t j = 0; j < dim; ++j) {
      const float v = scale > 0.f ? x[j] / scale : 0.f;  // within kMax: at most an ulp past it, which rounds back
      if constexpr (std::is_same_v<KV, int8_t>)
        row[j] = static_cast<int8_t>(std::nearbyint(v));
      else
        row[j] = c10::Float8_e4m3fn(v);
    }
    std::memcpy(row + dim, &scale, sizeof scale);
  } else {
    for (int64_t j = 0; j < dim; ++j) row[j] = static_cast<KV>(x[j]);
  }
}

// The head dim of a pool tensor [..., dim (+ 4 where quantized)].
inline int64_t pool_dim(const at::Tensor& pool) {
  const bool quantized = pool.scalar_type() == at::kChar || pool.scalar_type() == at::kFloat8_e4m3fn;
  return pool.size(-1) - (quantized ? 4 : 0);
}

// f(KV{}) for the element type of a pool that rows of T read: T's own, or a quantized one (fp32 rows also read a
// bf16 or fp16 pool: the fused layer's).
template <typename T, typename Fn>
void with_pool_type(at::ScalarType pool, Fn&& f) {
  switch (pool) {
    case at::kChar: f(int8_t{}); return;
    case at::kFloat8_e4m3fn: f(c10::Float8_e4m3fn{}); return;
    default: break;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (pool == at::kBFloat16) return f(at::BFloat16{});
    if (pool == at::kHalf) return f(at::Half{});
  }
  TORCH_CHECK(pool == c10::CppTypeToScalarType<T>::value, "the KV pool's dtype (", pool, ") is not one ",
              c10::CppTypeToScalarType<T>::value, " rows read: theirs, int8 or fp8_e4m3 (fp32 rows: bf16 and fp16 too)");
  f(T{});
}

// rope.cpp: from q|k|v rows [n, (heads + 2 kv heads) * dim], q and k rotated (cos, sin: [n, dim / 2]); q to q_out
// [n, heads, dim], k and v to their slots of one layer's pool [slots, kv heads, dim].
template <typename KV>
void rope_store_kv_rows(const float* qkv, const float* cos, const float* sin, const int64_t* slots, float* q_out,
                        KV* k_cache, KV* v_cache, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim);
// rope.cpp: out[n, inter] = act(gate) * up of gate_up [n, 2 * inter], act SiLU or (gelu) the tanh GELU
void act_mul_rows(const float* gate_up, float* out, int64_t n, int64_t inter, bool gelu);

// attention.cpp: one query per sequence against its keys in the pool, read through its block table; window > 0:
// its last `window` keys only.
template <typename KV>
void paged_decode_rows(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* tables,
                       const int64_t* lengths, float* out, int64_t seqs, int64_t heads, int64_t kv_heads,
                       int64_t dim, int64_t block_size, int64_t width, float scale, int64_t window);

// LoRA adapters' products added to a projection's fp32 rows, each row its slot's (-1: none) (lora.cpp).
void lora_add_rows(float* y, const float* x, const int64_t* slot, int64_t n, int64_t in, int64_t columns,
                   const at::Tensor& a, at::TensorList b, int64_t rank);

}  // namespace tokenmill
