// Weight-only quantized matmul on the CPU: out = x @ dequantize(W).T, W kept in GGUF's 4- and 8-bit blocks.
//
// As llama.cpp does, each activation row is quantized to 8 bits per block of 32 (one fp32 scale per block), so a
// block's 32 products are integer multiply-adds (AVX2 maddubs: u8 x i8 pairs summed to i16, then to i32) and one
// float multiply by the two scales. Decode reads each weight byte once per step: at one row the step is bound by
// memory bandwidth, so 4.5 bits per weight instead of 32 is the gain.
//
// Where the CPU has AVX-512 VNNI (Zen 4 and 5, Sapphire Rapids and later), two blocks go through one 512-bit
// vpdpbusd (u8 x i8 products summed straight to i32), half the instructions a block of the AVX2 path.
//
// Two weight formats (tokenmill/layers/quantized.py builds them from a GGUF file):
//   4-bit: uint8 [out, in/2], block b of 32 weights in bytes 16b..16b+15, weight j in the low nibble of byte j and
//          weight 16+j in its high nibble (Q4_0, Q4_1, Q4_K);
//   8-bit: int8 [out, in] (Q8_0, Q6_K, Q5_*);
// w = scale * (q - zero) + shift, scale and shift fp32 per `sub` = 32 (or 16, 8-bit only) weights; the shift (a
// min) may be absent, the zero point (Q4_0's 8) is one integer for the matrix: computed from the scales, never
// stored (a shift array of -8 * scale was a third more bytes than Q4_0's own blocks). Without AVX2 the same
// arithmetic runs as plain loops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
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

constexpr int64_t kBlock = 32;   // weights per block (and activations per scale)
constexpr int64_t kRowTile = 4;  // activation rows that share one unpacking of a weight block

using tokenmill::QuantizedRows;
using tokenmill::dot;
#ifdef TOKENMILL_AVX2
using tokenmill::hsum;
#endif

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t in, int64_t sub) {
  const int64_t blocks = in / kBlock, groups = in / sub;
  QuantizedRows out{std::vector<int8_t>(rows * in), std::vector<float>(rows * blocks),
                    std::vector<float>(rows * groups)};
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t b = 0; b < blocks; ++b) {
        const float* src = x + r * in + b * kBlock;
        int8_t* dst = out.q.data() + r * in + b * kBlock;
        float amax = 0.f;
        for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(src[j]));
        const float d = amax / 127.f;
        const float inv = d > 0.f ? 1.f / d : 0.f;
        int32_t sums[2] = {0, 0};
        for (int64_t j = 0; j < kBlock; ++j) {
          const int32_t v = static_cast<int32_t>(std::nearbyint(src[j] * inv));
          dst[j] = static_cast<int8_t>(v);
          sums[j / 16] += v;
        }
        out.scale[r * blocks + b] = d;
        if (sub == 32) {
          out.sums[r * groups + b] = d * static_cast<float>(sums[0] + sums[1]);
        } else {
          out.sums[r * groups + 2 * b] = d * static_cast<float>(sums[0]);
          out.sums[r * groups + 2 * b + 1] = d * static_cast<float>(sums[1]);
        }
      }
    }
  });
  return out;
}

// Ask for the cache lines of a weight row (and its scales) that a later tile will read: the hardware prefetcher
// alone left single-row decode at about half the memory bandwidth (measured; 8 rows ahead was ~9% faster than none
// in 5 interleaved pairs of a 120-matrix sweep on a noisy 2-core Zen 3).
inline void prefetch_row(const uint8_t* q, int64_t bytes, const float* scales, int64_t groups) {
#ifdef TOKENMILL_AVX2
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(q + off), _MM_HINT_T0);
  for (int64_t g = 0; g < groups; g += 16) _mm_prefetch(reinterpret_cast<const char*>(scales + g), _MM_HINT_T0);
#endif
}

// M weight rows (q, scales: row m at q + m * row_bytes) dotted with N activation rows from r0; M and N are constants
// so the M x N accumulators stay in registers, and M > 1 gives independent chains while one activation block is
// loaded once. The shifts' part (mins and zero points) is added by the caller. out[m * N + i].
template <bool U4, int SUB, int M, int N>
void dot_tile(const uint8_t* wq, int64_t row_bytes, const float* wscale, int64_t groups, const QuantizedRows& x,
              int64_t r0, int64_t in, float* out) {
  const int64_t blocks = in / kBlock;
  const int8_t* xq[N];
  const float* xs[N];
  for (int i = 0; i < N; ++i) {
    xq[i] = x.q.data() + (r0 + i) * in;
    xs[i] = x.scale.data() + (r0 + i) * blocks;
  }
#if defined(TOKENMILL_VNNI512)
  // Blocks b and b + 1 in one register, 128-bit lanes [b 0-15, b 16-31, b+1 0-15, b+1 16-31]; an odd last block
  // runs with zeros in b + 1's half. int32 lanes 0-7 then hold b's products, 8-15 those of b + 1.
  __m512 acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < N; ++i) acc[m][i] = _mm512_setzero_ps();
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t b = 0; b < blocks; b += 2) {
    const bool pair = b + 1 < blocks;
    __m512i wu[M];
    __mmask64 negative[M] = {};
    __m512 ws[M];
    for (int m = 0; m < M; ++m) {
      const uint8_t* row = wq + m * row_bytes;
      const float* scale = wscale + m * groups;
      if constexpr (U4) {
        const uint8_t* at = row + b * 16;
        const __m256i packed = pair ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))
                                    : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
        const __m256i nibble = _mm256_set1_epi8(0x0F);
        const __m512i halves = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(packed, nibble)),
                                                  _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble), 1);
        wu[m] = _mm512_shuffle_i64x2(halves, halves, _MM_SHUFFLE(3, 1, 2, 0));  // [lo b, hi b, lo b+1, hi b+1]
      } else {  // vpdpbusd takes unsigned x signed: |w|, and the sign moves to x
        const uint8_t* at = row + b * kBlock;
        const __m512i w = pair ? _mm512_loadu_si512(at)
                               : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
        wu[m] = _mm512_abs_epi8(w);
        negative[m] = _mm512_movepi8_mask(w);
      }
      if constexpr (SUB == 32) {
        ws[m] = _mm512_insertf32x8(_mm512_set1_ps(scale[b]), _mm256_set1_ps(pair ? scale[b + 1] : 0.f), 1);
      } else {  // four scales of 16 weights, each over 4 int32 lanes
        const __m128 four = pair ? _mm_loadu_ps(scale + 2 * b)
                                 : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(scale + 2 * b)));
        ws[m] = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                                      _mm512_castps128_ps512(four));
      }
    }
    for (int i = 0; i < N; ++i) {
      const int8_t* at = xq[i] + b * kBlock;
      const __m512i xv = pair ? _mm512_loadu_si512(at)
                              : _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
      const __m512 xscale =
          _mm512_insertf32x8(_mm512_set1_ps(xs[i][b]), _mm256_set1_ps(pair ? xs[i][b + 1] : 0.f), 1);
      for (int m = 0; m < M; ++m) {
        __m512i xm = xv;
        if constexpr (!U4) xm = _mm512_mask_sub_epi8(xv, negative[m], zero, xv);
        const __m512i sums = _mm512_dpbusd_epi32(zero, wu[m], xm);
        acc[m][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(ws[m], xscale), acc[m][i]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < N; ++i) out[m * N + i] = _mm512_reduce_add_ps(acc[m][i]);
#elif defined(TOKENMILL_AVX2)
  __m256 acc[M][N];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < N; ++i) acc[m][i] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i wv[M], wu[M];
    __m256 ws[M];
    for (int m = 0; m < M; ++m) {
      const uint8_t* row = wq + m * row_bytes;
      const float* scale = wscale + m * groups;
      if constexpr (U4) {
        const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
        wv[m] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(0x0F));
        wu[m] = wv[m];
      } else {
        wv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
        wu[m] = _mm256_sign_epi8(wv[m], wv[m]);  // maddubs takes unsigned x signed: the sign moves to x
      }
      if constexpr (SUB == 32) {
        ws[m] = _mm256_broadcast_ss(scale + b);
      } else {  // int32 lanes 0-3 hold the products of bytes 0-15, lanes 4-7 those of bytes 16-31
        ws[m] = _mm256_set_m128(_mm_broadcast_ss(scale + 2 * b + 1), _mm_broadcast_ss(scale + 2 * b));
      }
    }
    for (int i = 0; i < N; ++i) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + b * kBlock));
      const __m256 xscale = _mm256_broadcast_ss(xs[i] + b);
      for (int m = 0; m < M; ++m) {
        const __m256i xm = U4 ? xv : _mm256_sign_epi8(xv, wv[m]);
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(wu[m], xm), ones);
        acc[m][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(ws[m], xscale), acc[m][i]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < N; ++i) out[m * N + i] = hsum(acc[m][i]);
#else
  for (int m = 0; m < M; ++m) {
    for (int i = 0; i < N; ++i) {
      float total = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        for (int64_t s = 0; s < kBlock / SUB; ++s) {
          int32_t sum = 0;
          for (int64_t j = s * SUB; j < (s + 1) * SUB; ++j) {
            int32_t q;
            if constexpr (U4) {
              const uint8_t byte = wq[m * row_bytes + b * 16 + (j & 15)];
              q = j < 16 ? (byte & 0x0F) : (byte >> 4);
            } else {
              q = static_cast<int8_t>(wq[m * row_bytes + b * kBlock + j]);
            }
            sum += q * xq[i][b * kBlock + j];
          }
          total += wscale[m * groups + b * (kBlock / SUB) + s] * xs[i][b] * static_cast<float>(sum);
        }
      }
      out[m * N + i] = total;
    }
  }
#endif
}

template <bool U4, int SUB, int M>
void dot_rows(const uint8_t* wq, int64_t row_bytes, const float* wscale, int64_t groups, const QuantizedRows& x,
              int64_t r0, int64_t n, int64_t in, float* out) {
  switch (n) {
    case 4: dot_tile<U4, SUB, M, 4>(wq, row_bytes, wscale, groups, x, r0, in, out); break;
    case 3: dot_tile<U4, SUB, M, 3>(wq, row_bytes, wscale, groups, x, r0, in, out); break;
    case 2: dot_tile<U4, SUB, M, 2>(wq, row_bytes, wscale, groups, x, r0, in, out); break;
    default: dot_tile<U4, SUB, M, 1>(wq, row_bytes, wscale, groups, x, r0, in, out); break;
  }
}

template <bool U4, int SUB>
void matmul(const QuantizedRows& x, int64_t rows, int64_t in, const uint8_t* q, const float* scales,
            const float* shift, int64_t zero, float* out, int64_t out_features) {
  const int64_t row_bytes = U4 ? in / 2 : in;
  const int64_t groups = in / SUB;
  constexpr int64_t kPair = 2;  // weight rows per tile
  at::parallel_for(0, (out_features + kPair - 1) / kPair, 8, [&](int64_t begin, int64_t end) {
    float dots[kPair * kRowTile];
    for (int64_t o = begin * kPair; o < std::min(end * kPair, out_features); o += kPair) {
      const int64_t m = std::min(kPair, out_features - o);
      constexpr int64_t kAhead = 8;  // weight rows ahead
      if (o + kAhead + m <= out_features) {
        prefetch_row(q + (o + kAhead) * row_bytes, m * row_bytes, scales + (o + kAhead) * groups, m * groups);
        if (shift) prefetch_row(nullptr, 0, shift + (o + kAhead) * groups, m * groups);
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kRowTile) {
        const int64_t n = std::min(kRowTile, rows - r0);
        if (m == 2) {
          dot_rows<U4, SUB, 2>(q + o * row_bytes, row_bytes, scales + o * groups, groups, x, r0, n, in, dots);
        } else {
          dot_rows<U4, SUB, 1>(q + o * row_bytes, row_bytes, scales + o * groups, groups, x, r0, n, in, dots);
        }
        for (int64_t w = 0; w < m; ++w) {
          for (int64_t i = 0; i < n; ++i) {
            const float* sums = x.sums.data() + (r0 + i) * groups;
            float tail = shift ? dot(shift + (o + w) * groups, sums, groups) : 0.f;
            if (zero) tail -= static_cast<float>(zero) * dot(scales + (o + w) * groups, sums, groups);
            out[(r0 + i) * out_features + o + w] = dots[w * n + i] + tail;
          }
        }
      }
    }
  });
}

// w = scale * (q - zero) + shift per `sub` weights: q 4-bit (uint8, two a byte) or int8; shift optional.
at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& shift, int64_t sub, int64_t zero) {
  TORCH_CHECK(x.dim() == 2, "x must be [rows, in]");
  const tokenmill::QuantizedMatrix w = tokenmill::quantized_matrix(qweight, scales, shift, sub, zero, x.size(1));
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), w.out}, x.options().dtype(at::kFloat));
  tokenmill::quantized_matmul(xf.data_ptr<float>(), x.size(0), w, out.data_ptr<float>());
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// The dense [out, in] matrix of dtype (fp32, bf16 or fp16): w = scale * (q - zero) + shift, each value computed
// in fp32 and rounded once, as layers/quantized.py's QuantizedWeight.dequantize does in torch ops (which take ~8
// passes over the matrix where this takes one).
template <typename T>
void dequantize_rows(const tokenmill::QuantizedMatrix& w, T* out) {
  const int64_t row_bytes = w.u4 ? w.in / 2 : w.in, groups = w.in / w.sub;
  at::parallel_for(0, w.out, 16, [&](int64_t begin, int64_t end) {
    float values[kBlock];
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* q = w.q + o * row_bytes;
      for (int64_t b = 0; b < w.in / kBlock; ++b) {
        if (w.u4) {  // block b: weight j in the low nibble of byte 16b + j, weight 16 + j in its high nibble
          for (int64_t j = 0; j < kBlock / 2; ++j) {
            values[j] = static_cast<float>((q[16 * b + j] & 0x0F) - w.zero);
            values[j + kBlock / 2] = static_cast<float>((q[16 * b + j] >> 4) - w.zero);
          }
        } else {
          for (int64_t j = 0; j < kBlock; ++j)
            values[j] = static_cast<float>(reinterpret_cast<const int8_t*>(q)[kBlock * b + j] - w.zero);
        }
        T* row = out + o * w.in + b * kBlock;
        for (int64_t k = 0; k < kBlock / w.sub; ++k) {  // the block's scales (one, or two of 16 weights)
          const int64_t g = o * groups + b * (kBlock / w.sub) + k;
          const float scale = w.scales[g], shift = w.shift ? w.shift[g] : 0.f;
          for (int64_t j = k * w.sub; j < (k + 1) * w.sub; ++j) row[j] = static_cast<T>(values[j] * scale + shift);
        }
      }
    }
  });
}

at::Tensor dequantize(const at::Tensor& qweight, const at::Tensor& scales, const std::optional<at::Tensor>& shift,
                      int64_t sub, int64_t zero, int64_t in, at::ScalarType dtype) {
  const tokenmill::QuantizedMatrix w = tokenmill::quantized_matrix(qweight, scales, shift, sub, zero, in);
  at::Tensor out = at::empty({w.out, w.in}, qweight.options().dtype(dtype));
  switch (dtype) {
    case at::kFloat: dequantize_rows(w, out.data_ptr<float>()); break;
    case at::kBFloat16: dequantize_rows(w, out.data_ptr<at::BFloat16>()); break;
    case at::kHalf: dequantize_rows(w, out.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "dequantize to fp32, bf16 or fp16, not ", dtype);
  }
  return out;
}

}  // namespace

tokenmill::QuantizedMatrix tokenmill::quantized_matrix(const at::Tensor& qweight, const at::Tensor& scales,
                                                       const std::optional<at::Tensor>& shift, int64_t sub,
                                                       int64_t zero, int64_t in) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(), "qweight must be a contiguous [out, in] matrix");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous(), "scales must be contiguous fp32");
  const bool u4 = qweight.scalar_type() == at::kByte;
  TORCH_CHECK(u4 || qweight.scalar_type() == at::kChar, "qweight must be uint8 (4-bit) or int8");
  TORCH_CHECK(sub == 32 || (sub == 16 && !u4), "sub must be 32, or 16 for int8 weights");
  const int64_t out_features = qweight.size(0);
  TORCH_CHECK(in % kBlock == 0 && qweight.size(1) == (u4 ? in / 2 : in), "x and qweight disagree on in");
  TORCH_CHECK(scales.size(0) == out_features && scales.size(1) == in / sub, "scales must be [out, in / sub]");
  const float* shift_ptr = nullptr;
  if (shift.has_value()) {
    TORCH_CHECK(shift->sizes() == scales.sizes() && shift->scalar_type() == at::kFloat && shift->is_contiguous(),
                "shift must be shaped and typed as scales");
    shift_ptr = shift->data_ptr<float>();
  }
  TORCH_CHECK(zero >= 0 && zero < 256, "the zero point must be a weight value");
  return {static_cast<const uint8_t*>(qweight.data_ptr()), u4, scales.data_ptr<float>(), shift_ptr, zero, sub, in,
          out_features};
}

void tokenmill::quantized_matmul(const float* x, int64_t rows, const QuantizedMatrix& w, float* out) {
  const QuantizedRows xq = quantize_rows(x, rows, w.in, w.sub);
  if (w.u4) {
    matmul<true, 32>(xq, rows, w.in, w.q, w.scales, w.shift, w.zero, out, w.out);
  } else if (w.sub == 32) {
    matmul<false, 32>(xq, rows, w.in, w.q, w.scales, w.shift, w.zero, out, w.out);
  } else {
    matmul<false, 16>(xq, rows, w.in, w.q, w.scales, w.shift, w.zero, out, w.out);
  }
}

TORCH_LIBRARY(tokenmill, m) {
  m.def("quantized_linear(Tensor x, Tensor qweight, Tensor scales, Tensor? shift, int sub, int zero=0) -> Tensor");
  m.def("dequantize(Tensor qweight, Tensor scales, Tensor? shift, int sub, int zero, int in_features, "
        "ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("quantized_linear", &quantized_linear);
  m.impl("dequantize", &dequantize);
}
