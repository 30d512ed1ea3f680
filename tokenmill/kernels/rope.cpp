// The small elementwise steps around a decoder layer's matmuls, each in one pass: at a few rows a step they are all
// overhead in torch (RoPE alone is ~8 ops per tensor, the split, views and KV writes several more, per layer).
//   rope_store_kv: from the fused q|k|v projection, q and k rotated (rotate-half RoPE), k and v written to their
//                  slots in the paged pool, q returned;
//   silu_mul:      silu(gate) * up from the fused gate|up projection.
// Arithmetic in fp32 whatever the dtype, each result rounded once (or, into a quantized pool, quantized once).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "cpu.h"

namespace {

template <typename T, typename U>
void rotate(const T* x, const float* cos, const float* sin, U* out, int64_t half) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = static_cast<float>(x[j]), b = static_cast<float>(x[j + half]);
    out[j] = static_cast<U>(a * cos[j] - b * sin[j]);
    out[j + half] = static_cast<U>(b * cos[j] + a * sin[j]);
  }
}

// qkv and q_out of T, the pool of KV.
template <typename T, typename KV>
void rope_store(const T* qkv, const float* cos, const float* sin, const int64_t* slots, T* q_out, KV* k_cache,
                KV* v_cache, int64_t n, int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, n * (heads + kv_heads), 64, [&](int64_t begin, int64_t end) {
    std::vector<float> wide(dim);  // a K/V row in fp32, before it is rounded or quantized into the pool
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / (heads + kv_heads), h = task % (heads + kv_heads);
      const T* row = qkv + t * width;
      if (h < heads) {
        rotate(row + h * dim, cos + t * half, sin + t * half, q_out + (t * heads + h) * dim, half);
        continue;
      }
      const int64_t kv = h - heads, at = (slots[t] * kv_heads + kv) * tokenmill::row_stride<KV>(dim);
      const T* value = row + (heads + kv_heads + kv) * dim;
      rotate(row + (heads + kv) * dim, cos + t * half, sin + t * half, wide.data(), half);
      tokenmill::store_row(wide.data(), k_cache + at, dim);
      for (int64_t j = 0; j < dim; ++j) wide[j] = static_cast<float>(value[j]);
      tokenmill::store_row(wide.data(), v_cache + at, dim);
    }
  });
}

// act(gate) * up, act SiLU or (gelu) the tanh GELU: both are gate / (1 + e^-a), a = gate for SiLU and
// 2 sqrt(2 / pi) (gate + 0.044715 gate^3) for the GELU (0.5 (1 + tanh(a / 2)) = 1 / (1 + e^-a)).
template <typename T>
void act_mul_of(const T* gate_up, T* out, int64_t n, int64_t inter, bool gelu = false) {
  constexpr int64_t kChunk = 256;  // e^-a of this many at a time, in vector registers (cpu.h's exp_sum)
  constexpr float kGelu = 1.5957691216057308f;  // 2 sqrt(2 / pi)
  at::parallel_for(0, n * ((inter + kChunk - 1) / kChunk), 16, [&](int64_t begin, int64_t end) {
    float e[kChunk];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / ((inter + kChunk - 1) / kChunk), j0 = task % ((inter + kChunk - 1) / kChunk) * kChunk;
      const int64_t len = std::min(kChunk, inter - j0);
      const T* gate = gate_up + r * 2 * inter + j0;
      const T* up = gate + inter;
      if (gelu) {
        for (int64_t j = 0; j < len; ++j) {
          const float g = static_cast<float>(gate[j]);
          e[j] = -kGelu * (g + 0.044715f * g * g * g);
        }
      } else {
        for (int64_t j = 0; j < len; ++j) e[j] = -static_cast<float>(gate[j]);
      }
      tokenmill::exp_sum(e, len, 0.f);
      T* dst = out + r * inter + j0;
      for (int64_t j = 0; j < len; ++j)
        dst[j] = static_cast<T>(static_cast<float>(gate[j]) / (1.f + e[j]) * static_cast<float>(up[j]));
    }
  });
}

// qkv: [n, (heads + 2 kv heads) * dim]; cos, sin: fp32 [n, dim / 2] (any shape of that many values);
// caches: one layer's [blocks, block size, kv heads, dim]; slots: [n] flat slot of each token.
at::Tensor rope_store_kv(const at::Tensor& qkv_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots_in, int64_t heads,
                         int64_t kv_heads) {
  const at::Tensor qkv = qkv_in.contiguous();
  const at::Tensor cos = cos_in.to(at::kFloat).contiguous(), sin = sin_in.to(at::kFloat).contiguous();
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(), "the caches must be one layer's contiguous [blocks, block size, kv, dim]");
  const int64_t n = qkv.size(0), dim = tokenmill::pool_dim(k_cache);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * dim && k_cache.size(2) == kv_heads,
              "qkv must be [tokens, (heads + 2 kv heads) * dim] of the cache's dim and kv heads");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the k and v pools must share a dtype");
  TORCH_CHECK(cos.numel() == n * dim / 2 && sin.numel() == n * dim / 2 && slots.numel() == n,
              "one angle row, one slot a token");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "a slot outside the pool");
  at::Tensor q = at::empty({n, heads, dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_store_kv", [&] {
    tokenmill::with_pool_type<scalar_t>(k_cache.scalar_type(), [&](auto pool_type) {
      using KV = decltype(pool_type);
      rope_store<scalar_t, KV>(qkv.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(), slot,
                               q.data_ptr<scalar_t>(), static_cast<KV*>(k_cache.data_ptr()),
                               static_cast<KV*>(v_cache.data_ptr()), n, heads, kv_heads, dim);
    });
  });
  return q;
}

// gate_up: [n, 2 * inter] -> [n, inter]
at::Tensor act_mul(const at::Tensor& gate_up_in, bool gelu) {
  const at::Tensor gate_up = gate_up_in.contiguous();
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * intermediate]");
  const int64_t n = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({n, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "act_mul", [&] {
    act_mul_of<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), n, inter, gelu);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return act_mul(gate_up, false); }

at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return act_mul(gate_up, true); }

}  // namespace

template <typename KV>
void tokenmill::rope_store_kv_rows(const float* qkv, const float* cos, const float* sin, const int64_t* slots,
                                   float* q_out, KV* k_cache, KV* v_cache, int64_t n, int64_t heads,
                                   int64_t kv_heads, int64_t dim) {
  rope_store<float, KV>(qkv, cos, sin, slots, q_out, k_cache, v_cache, n, heads, kv_heads, dim);
}

#define TOKENMILL_ROPE_STORE_KV_ROWS(KV)                                                                          \
  template void tokenmill::rope_store_kv_rows<KV>(const float*, const float*, const float*, const int64_t*, float*, \
                                                  KV*, KV*, int64_t, int64_t, int64_t, int64_t);
TOKENMILL_FOR_POOL_DTYPES(TOKENMILL_ROPE_STORE_KV_ROWS)

void tokenmill::act_mul_rows(const float* gate_up, float* out, int64_t n, int64_t inter, bool gelu) {
  act_mul_of<float>(gate_up, out, n, inter, gelu);
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rope_store_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "int heads, int kv_heads) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("rope_store_kv", &rope_store_kv);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
}
