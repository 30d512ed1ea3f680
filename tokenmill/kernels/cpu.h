// What the kernels share: the fused decoder layer (layer.cpp) calls the others' fp32 loops directly, without a
// tensor or a dispatch between them; the vector reductions they all use.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
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
#endif

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

// Activation rows quantized to int8 per block of 32: q, the block's scale, and per `sub` weights sum(q) (the zero
// point multiplies it) and scale * sum(q) (the weights' shifts multiply these). quant.cpp.
struct QuantizedRows {
  std::vector<int8_t> q;        // [rows, in]
  std::vector<float> scale;     // [rows, in / 32]
  std::vector<float> sums;      // [rows, in / sub]
  std::vector<int32_t> isums;   // [rows, in / sub]
};

// Output rows interleaved in a quantized weight's group (quant.cpp describes the layout).
constexpr int64_t kInterleave = 16;

// A weight kept quantized (layers/quantized.py): w = scale * (q - zero) + shift per `sub` weights.
struct QuantizedMatrix {
  const uint8_t* q;     // 4-bit: uint8 [groups, in / 32, 4, 16, 4]; else int8 [groups, in / 32, 8, 16, 4]
  bool u4;
  const float* scales;  // [groups, in / sub, 16]
  const float* shift;   // [groups, in / sub, 16] or nullptr
  int64_t zero;         // Q4_0: 8; else 0
  int64_t sub, in, out;
};

// The matrix of these tensors, of out_features rows, checked against each other.
QuantizedMatrix quantized_matrix(const at::Tensor& qweight, const at::Tensor& scales,
                                 const std::optional<at::Tensor>& shift, int64_t sub, int64_t zero,
                                 int64_t out_features);
// out[rows, w.out] = x[rows, w.in] @ dequantize(w).T
void quantized_matmul(const float* x, int64_t rows, const QuantizedMatrix& w, float* out);

// norm.cpp: out = rms_norm(x) * weight per row; with residual, x += residual first and the sum is normed.
void rms_norm_rows(float* x, const float* residual, const float* weight, float* out, int64_t rows, int64_t dim,
                   float eps);

// The KV pool's dtypes the fused layer reads and writes (its rows are fp32 whatever the pool): KV is one of these
// in rope_store_kv_rows and paged_decode_rows, instantiated in their files.
#define TOKENMILL_FOR_POOL_DTYPES(_) _(float) _(at::BFloat16) _(at::Half)

// rope.cpp: from q|k|v rows [n, (heads + 2 kv heads) * dim], q and k rotated (cos, sin: [n, dim / 2]); q to q_out
// [n, heads, dim], k and v to their slots of one layer's pool [slots, kv heads, dim].
template <typename KV>
void rope_store_kv_rows(const float* qkv, const float* cos, const float* sin, const int64_t* slots, float* q_out,
                        KV* k_cache, KV* v_cache, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim);
// rope.cpp: out[n, inter] = silu(gate) * up of gate_up [n, 2 * inter]
void silu_mul_rows(const float* gate_up, float* out, int64_t n, int64_t inter);

// attention.cpp: one query per sequence against its keys in the pool, read through its block table.
template <typename KV>
void paged_decode_rows(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* tables,
                       const int64_t* lengths, float* out, int64_t seqs, int64_t heads, int64_t kv_heads,
                       int64_t dim, int64_t block_size, int64_t width, float scale);

}  // namespace tokenmill
