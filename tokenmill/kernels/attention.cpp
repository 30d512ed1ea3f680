// Decode attention straight from the paged KV pool: each decoding sequence's one query per head against its keys,
// read block by block through its block table. torch's path gathers every sequence's whole history into a new
// tensor per layer and step (index_select), masks the padding and runs SDPA: at one decode row that was ~100 us a
// layer, most of it overhead.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu.h"

namespace {

using tokenmill::dot;

#if defined(__AVX512F__)
// 16 values of the pool as fp32, in a register.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // a bf16 is the top half of an fp32
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// A row of the pool as fp32: the pool's own memory where it is fp32, else widened into buf (a bf16 is the top half
// of an fp32: a shift, in vector registers).
template <typename KV>
const float* widen(const KV* row, float* buf, int64_t n) {
  for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<float>(row[j]);
  return buf;
}

inline const float* widen(const float* row, float*, int64_t) { return row; }

inline const float* widen(const at::BFloat16* row, float* buf, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(buf + j, load16(row + j));
#elif defined(__AVX2__) && defined(__FMA__)
  for (; j + 8 <= n; j += 8) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf + j), _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
#endif
  for (; j < n; ++j) {
    const uint32_t wide = static_cast<uint32_t>(bits[j]) << 16;
    std::memcpy(buf + j, &wide, sizeof(float));
  }
  return buf;
}

// One task: a sequence's `group` query heads (fp32, scaled, [group, dim]) against the keys of one KV head at
// positions 0..length-1, whose rows row_of(p) gives; out: [group, dim] fp32. scores: room for group * length;
// row: for dim, total: for group.
template <typename KV, typename RowOf>
void attend_generic(const float* query, int64_t group, const KV* k_cache, const KV* v_cache, int64_t length,
                    int64_t dim, const RowOf& row_of, float* scores, float* row, float* total, float* out) {
  for (int64_t p = 0; p < length; ++p) {
    const float* key = widen(k_cache + row_of(p), row, dim);
    for (int64_t g = 0; g < group; ++g) scores[g * length + p] = dot(query + g * dim, key, dim);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* weights = scores + g * length;
    total[g] = tokenmill::exp_sum(weights, length, *std::max_element(weights, weights + length));
  }
  std::fill(out, out + group * dim, 0.f);
  for (int64_t p = 0; p < length; ++p) {
    const float* value = widen(v_cache + row_of(p), row, dim);
    for (int64_t g = 0; g < group; ++g) {
      const float weight = scores[g * length + p];
      float* a = out + g * dim;
#pragma omp simd
      for (int64_t j = 0; j < dim; ++j) a[j] += weight * value[j];
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < dim; ++j) out[g * dim + j] /= total[g];
}


#if defined(__AVX512F__)
// attend_generic's arithmetic for dim = 16 * D16, over positions first..length-1, one query head at a time: its
// D16 vectors, and those of its output, stay in registers while the keys and values stream by, read straight from
// the pool (a pool row widened in registers, no copy), block by block. The loops over each position's row through
// a buffer, with a division per position for its block, took ~400 cycles a position at 32 rows (measured on Zen 4).
template <int D16, typename KV>
void attend(const float* query, int64_t group, const KV* k_cache, const KV* v_cache, int64_t first,
            int64_t length, const int64_t* table, int64_t block_size, int64_t stride, int64_t head, float* scores,
            float* out) {
  constexpr int64_t dim = 16 * D16;
  const int64_t keys = length - first;
  for (int64_t g = 0; g < group; ++g) {
    __m512 q[D16];
    for (int d = 0; d < D16; ++d) q[d] = _mm512_loadu_ps(query + g * dim + 16 * d);
    float* weights = scores + g * keys;  // position p's at p - first
    for (int64_t b = first / block_size; b * block_size < length; ++b) {
      const int64_t lo = std::max(first - b * block_size, int64_t{0});
      const int64_t hi = std::min(block_size, length - b * block_size);
      const KV* key = k_cache + (table[b] * block_size + lo) * stride + head * dim;
      for (int64_t p = lo; p < hi; ++p, key += stride) {
        __m512 acc = _mm512_mul_ps(q[0], load16(key));
        for (int d = 1; d < D16; ++d) acc = _mm512_fmadd_ps(q[d], load16(key + 16 * d), acc);
        weights[b * block_size + p - first] = _mm512_reduce_add_ps(acc);
      }
    }
    const float total = tokenmill::exp_sum(weights, keys, *std::max_element(weights, weights + keys));
    __m512 acc[D16];
    for (int d = 0; d < D16; ++d) acc[d] = _mm512_setzero_ps();
    for (int64_t b = first / block_size; b * block_size < length; ++b) {
      const int64_t lo = std::max(first - b * block_size, int64_t{0});
      const int64_t hi = std::min(block_size, length - b * block_size);
      const KV* value = v_cache + (table[b] * block_size + lo) * stride + head * dim;
      for (int64_t p = lo; p < hi; ++p, value += stride) {
        const __m512 w = _mm512_set1_ps(weights[b * block_size + p - first]);
        for (int d = 0; d < D16; ++d) acc[d] = _mm512_fmadd_ps(w, load16(value + 16 * d), acc[d]);
      }
    }
    const __m512 inv = _mm512_set1_ps(1.f / total);
    for (int d = 0; d < D16; ++d) _mm512_storeu_ps(out + g * dim + 16 * d, _mm512_mul_ps(acc[d], inv));
  }
}
#endif

// attend where it applies (AVX-512; head dims 64, 128 and 256; fp32, bf16 or fp16 pools), else attend_generic; over
// positions first..length-1 (first > 0: a sliding window).
template <typename KV>
void attend_task(const float* query, int64_t group, const KV* k_cache, const KV* v_cache, int64_t first, int64_t length,
                 const int64_t* table, int64_t block_size, int64_t kv_heads, int64_t h, int64_t dim, float* scores,
                 float* row, float* total, float* out) {
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<KV, float> || std::is_same_v<KV, at::BFloat16> || std::is_same_v<KV, at::Half>) {
    // 256 (Gemma 3): the query's 16 vectors live in the scores' pass and the output's 16 in the values' pass.
    const auto kernel = dim == 64 ? attend<4, KV> : dim == 128 ? attend<8, KV> : dim == 256 ? attend<16, KV> : nullptr;
    if (kernel != nullptr) {
      kernel(query, group, k_cache, v_cache, first, length, table, block_size, kv_heads * dim, h, scores, out);
      return;
    }
  }
#endif
  // Position p's row of this KV head in the pool.
  const auto row_of = [&](int64_t i) {
    const int64_t p = first + i;
    return ((table[p / block_size] * block_size + p % block_size) * kv_heads + h) * dim;
  };
  attend_generic(query, group, k_cache, v_cache, length - first, dim, row_of, scores, row, total, out);
}

// q and out of T, the pool of KV (the fused layer's fp32 rows read a bf16 or fp16 pool). window > 0: each query
// sees its last `window` keys only (Gemma's sliding layers: 0 <= i - j < window).
template <typename T, typename KV>
void decode(const T* q, const KV* k_cache, const KV* v_cache, const int64_t* tables, const int64_t* lengths, T* out,
            int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, int64_t width,
            float scale, int64_t window) {
  const int64_t group = heads / kv_heads;
  // One task per (sequence, KV head): the group's query heads read its keys and values while they are in cache.
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * dim), result(group * dim), row(dim), total(group), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads, length = lengths[s];
      const int64_t first = window > 0 ? std::max(length - window, int64_t{0}) : 0;
      const int64_t* table = tables + s * width;
      scores.resize(group * length);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < dim; ++j)
          query[g * dim + j] = static_cast<float>(q[(s * heads + h * group + g) * dim + j]) * scale;
      attend_task(query.data(), group, k_cache, v_cache, first, length, table, block_size, kv_heads, h, dim,
                  scores.data(), row.data(), total.data(), result.data());
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < dim; ++j)
          out[(s * heads + h * group + g) * dim + j] = static_cast<T>(result[g * dim + j]);
    }
  });
}

// q: [seqs, heads, dim]; caches: [blocks, block size, kv heads, dim]; tables: [seqs, width] block ids;
// lengths: [seqs] keys per sequence (its new token's included, already written to the pool).
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables_in, const at::Tensor& lengths_in, double scale,
                                  int64_t window) {
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = tables_in.to(at::kLong).contiguous();
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "q and the pool must share a dtype");
  const int64_t seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "heads and the pool disagree");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == seqs && lengths.numel() == seqs, "one table and length a query");
  const int64_t width = tables.size(1);
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs; ++s)
    TORCH_CHECK(len[s] > 0 && len[s] <= width * block_size, "a length outside its block table");
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t, scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     tables.data_ptr<int64_t>(), len, out.data_ptr<scalar_t>(), seqs, heads, kv_heads, dim,
                     block_size, width, static_cast<float>(scale), window);
  });
  return out;
}

}  // namespace

template <typename KV>
void tokenmill::paged_decode_rows(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* tables,
                                  const int64_t* lengths, float* out, int64_t seqs, int64_t heads, int64_t kv_heads,
                                  int64_t dim, int64_t block_size, int64_t width, float scale, int64_t window) {
  decode<float, KV>(q, k_cache, v_cache, tables, lengths, out, seqs, heads, kv_heads, dim, block_size, width, scale,
                    window);
}

#define TOKENMILL_PAGED_DECODE_ROWS(KV)                                                                            \
  template void tokenmill::paged_decode_rows<KV>(const float*, const KV*, const KV*, const int64_t*, const int64_t*, \
                                                 float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, \
                                                 int64_t);
TOKENMILL_FOR_POOL_DTYPES(TOKENMILL_PAGED_DECODE_ROWS)

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lengths, "
        "float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
