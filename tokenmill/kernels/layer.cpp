// A whole decoder layer for a decode step (one new token per sequence, a few sequences), fp32 rows (a bf16 or fp16
// KV pool is read and written as such), weights kept quantized: norm, q|k|v projection, per-head q/k norms (Qwen3,
// Gemma 3), RoPE and the KV write, paged attention (a sliding window, Gemma 3), output projection, norm, gate|up
// projection, SiLU or the tanh GELU, down projection, and Gemma's norms of the attention's and the MLP's outputs,
// all in one call. The per-op path costs ~12 dispatches and their allocations a layer, ~30% of a one-stream step on
// a 2-core CPU (measured); here the steps are the other kernels' own loops (cpu.h) over scratch buffers kept
// between calls. decode_layers runs every layer of the step in one call: one dispatch a step, not one a layer.
// models/llama.py runs them where they apply; the tests check them against the per-op layers.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "cpu.h"

namespace {

using tokenmill::QuantizedMatrix;

// weights[first..first+2]: qweight, scales, shift (empty: none); layouts[i], layouts[4 + i]: its sub and zero point;
// out: its rows, in: its inputs.
QuantizedMatrix matrix(at::TensorList weights, size_t first, at::IntArrayRef layouts, size_t i, int64_t out,
                       int64_t in) {
  const at::Tensor& shift = weights[first + 2];
  const QuantizedMatrix m = tokenmill::quantized_matrix(
      weights[first], weights[first + 1], shift.numel() ? std::optional<at::Tensor>(shift) : std::nullopt,
      layouts[i], layouts[4 + i], out);
  TORCH_CHECK(m.in == in, "a projection of ", m.in, " inputs where the layer has ", in);
  return m;
}

const float* f32(const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == numel, what,
              " must be contiguous fp32 of ", numel, " values");
  return t.data_ptr<float>();
}

// RoPE with the KV write, then attention, on a pool of KV.
template <typename KV>
void attend(const float* qkv, const float* cos, const float* sin, const int64_t* slots, float* q,
            const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* tables, const int64_t* lengths,
            float* out, int64_t n, int64_t heads, int64_t kv_heads, int64_t width, float scale, int64_t window) {
  KV* kc = static_cast<KV*>(k_cache.data_ptr());
  KV* vc = static_cast<KV*>(v_cache.data_ptr());
  const int64_t block_size = k_cache.size(1), dim = tokenmill::pool_dim(k_cache);
  tokenmill::rope_store_kv_rows<KV>(qkv, cos, sin, slots, q, kc, vc, n, heads, kv_heads, dim);
  tokenmill::paged_decode_rows<KV>(q, kc, vc, tables, lengths, out, n, heads, kv_heads, dim, block_size, width, scale,
                                   window);
}

// RMSNorm in place over `count` rows of `cols` values, where there is a weight (per-head q/k norms: a token's heads
// are consecutive rows).
void norm_in_place(float* rows, const float* weight, int64_t count, int64_t cols, float eps) {
  if (weight) tokenmill::rms_norm_rows(rows, nullptr, weight, rows, count, cols, eps);
}

// x: the residual stream [n, hidden], updated in place (+ pending, + attention output); pending: the previous
// layer's MLP output not yet added, or empty in the first layer. weights: input norm; qkv qweight, scales, shift,
// bias; o qweight, scales, shift; the norm before the MLP; gate_up qweight, scales, shift; down qweight, scales,
// shift; then the per-head q and k norms, and the norms of the attention's and of the MLP's outputs (Gemma's
// "sandwich") (an empty shift, bias or norm: none). layouts: the four matrices' weights per scale, then their zero
// points. window > 0: attention to the last `window` keys; gelu: the tanh GELU for SiLU. tiles_from_rows: steps of
// this many rows or more multiply on AMX tiles (quant.cpp; 0: never). bf16_rows: a bf16 model's, whose bf16 weights
// multiply its rows rounded to bf16 (quantized_matmul). tp_slots, tp_flags: a tensor-parallel rank's shared
// segment (parallel/collectives.py), through which the o and down projections' partial sums are all-reduced, as
// exchanges tp_generation + 1 and + 2. lora_rank > 0: weights go on with each row's LoRA slot and the adapters'
// factors (lora.cpp). pairs: bf16 weights multiply bf16 rows as bf16 pairs (quantized_matmul). out: [n, hidden], gets
// this layer's MLP output (normed, with an output norm).
void layer_into(const at::Tensor& x, const at::Tensor& pending, at::TensorList weights, at::IntArrayRef layouts,
                const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lengths, int64_t heads,
                int64_t kv_heads, double eps, double scale, int64_t tiles_from_rows, int64_t window, bool gelu,
                bool bf16_rows, const std::optional<at::Tensor>& tp_slots, const std::optional<at::Tensor>& tp_flags,
                int64_t tp_rank, int64_t tp_world, int64_t tp_generation, double tp_timeout, int64_t lora_rank,
                bool pairs, at::Tensor& out) {
  TORCH_CHECK((weights.size() == 19 || (weights.size() == 31 && lora_rank > 0)) && layouts.size() == 8,
              "19 weight tensors (and with a LoRA rank, each row's slot and 11 factors), 4 subs and 4 zero points");
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, hidden]");
  const int64_t n = x.size(0), hidden = x.size(1);
  float* xs = const_cast<float*>(f32(x, n * hidden, "x"));
  const float* pend = pending.numel() ? f32(pending, n * hidden, "pending") : nullptr;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "the caches must be [blocks, block, kv, dim]");
  const int64_t block_size = k_cache.size(1), dim = tokenmill::pool_dim(k_cache);
  TORCH_CHECK(k_cache.size(2) == kv_heads && heads % kv_heads == 0, "heads and the pool disagree");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "the caches must be contiguous, of one dtype");
  TORCH_CHECK(weights[12].dim() == 5, "the down projection's qweight must be an interleaving");
  const int64_t inter = weights[12].size(1) * 32;  // the down projection's inputs
  const QuantizedMatrix qkv_w = matrix(weights, 1, layouts, 0, (heads + 2 * kv_heads) * dim, hidden);
  const QuantizedMatrix o_w = matrix(weights, 5, layouts, 1, hidden, heads * dim);
  const QuantizedMatrix gu_w = matrix(weights, 9, layouts, 2, 2 * inter, hidden);
  const QuantizedMatrix down_w = matrix(weights, 12, layouts, 3, hidden, inter);
  const float* norm1 = f32(weights[0], hidden, "the input norm");
  const float* norm2 = f32(weights[8], hidden, "the norm before the MLP");
  const float* bias = weights[4].numel() ? f32(weights[4], qkv_w.out, "the qkv bias") : nullptr;
  const auto optional = [&](size_t i, int64_t size, const char* what) {
    return weights[i].numel() ? f32(weights[i], size, what) : nullptr;
  };
  const float* q_norm = optional(15, dim, "the q norm");
  const float* k_norm = optional(16, dim, "the k norm");
  const float* attn_out_norm = optional(17, hidden, "the attention output's norm");
  const float* mlp_out_norm = optional(18, hidden, "the MLP output's norm");
  const float* c = f32(cos, n * dim / 2, "cos");
  const float* s = f32(sin, n * dim / 2, "sin");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n, "one slot a token");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2 && tables.size(0) == n,
              "one block table a token");
  TORCH_CHECK(lengths.scalar_type() == at::kLong && lengths.is_contiguous() && lengths.numel() == n,
              "one length a token");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  const int64_t width = tables.size(1), num_slots = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "a slot outside the pool");
    TORCH_CHECK(len[t] > 0 && len[t] <= width * block_size, "a length outside its block table");
  }

  // Scratch kept between calls (this thread's; the engine runs the model on one thread).
  thread_local std::vector<float> h, qkv, q, attn, o, gate_up, act;
  h.resize(n * hidden);
  qkv.resize(n * qkv_w.out);
  q.resize(n * heads * dim);
  attn.resize(n * heads * dim);
  o.resize(n * hidden);
  gate_up.resize(n * gu_w.out);
  act.resize(n * inter);
  TORCH_CHECK(n == 0 || (out.data_ptr() != xs && out.data_ptr() != pend), "out must not be x or pending");
  f32(out, n * hidden, "out");

  // LoRA adapters (layers/lora.py), after the 19 weights: each row's slot, and the q|k|v, o, gate|up and down
  // projections' factors, a then each part's b; every projection's product added to its rows, before its bias and
  // norms.
  const bool adapted = weights.size() == 31;
  TORCH_CHECK(!adapted || (weights[19].scalar_type() == at::kLong && weights[19].numel() == n), "a LoRA slot a row");
  const int64_t* lora_slot = adapted ? weights[19].data_ptr<int64_t>() : nullptr;
  const at::TensorList lora = adapted ? weights.slice(20, 11) : at::TensorList();
  const auto adapt = [&](float* y, const float* rows, int64_t in, int64_t columns, size_t first, size_t parts) {
    if (adapted)
      tokenmill::lora_add_rows(y, rows, lora_slot, n, in, columns, lora[first], lora.slice(first + 1, parts),
                               lora_rank);
  };

  const float ep = static_cast<float>(eps);
  tokenmill::rms_norm_rows(xs, pend, norm1, h.data(), n, hidden, ep);
  tokenmill::quantized_matmul(h.data(), n, qkv_w, qkv.data(), tiles_from_rows, bf16_rows, pairs);
  adapt(qkv.data(), h.data(), hidden, qkv_w.out, 0, 3);
  if (bias)
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < qkv_w.out; ++j) qkv[t * qkv_w.out + j] += bias[j];
  for (int64_t t = 0; t < n; ++t) {
    norm_in_place(qkv.data() + t * qkv_w.out, q_norm, heads, dim, ep);
    norm_in_place(qkv.data() + t * qkv_w.out + heads * dim, k_norm, kv_heads, dim, ep);
  }
  const int64_t* table = tables.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const auto run = [&](auto pool_type) {  // pool_type: a value of the pool's element type
    attend<decltype(pool_type)>(qkv.data(), c, s, slot, q.data(), k_cache, v_cache, table, len, attn.data(), n,
                                heads, kv_heads, width, sc, window);
  };
  tokenmill::with_pool_type<float>(k_cache.scalar_type(), run);  // the rows are fp32: any pool dtype
  const auto all_reduce = [&](float* values, int64_t exchange) {
    if (tp_slots && tp_flags)
      tokenmill::all_reduce_values(values, at::kFloat, n * hidden, *tp_slots, *tp_flags, tp_rank, tp_world,
                                   tp_generation + exchange, tp_timeout);
  };
  tokenmill::quantized_matmul(attn.data(), n, o_w, o.data(), tiles_from_rows, bf16_rows, pairs);
  adapt(o.data(), attn.data(), heads * dim, hidden, 4, 1);
  all_reduce(o.data(), 1);
  norm_in_place(o.data(), attn_out_norm, n, hidden, ep);
  tokenmill::rms_norm_rows(xs, o.data(), norm2, h.data(), n, hidden, ep);
  tokenmill::quantized_matmul(h.data(), n, gu_w, gate_up.data(), tiles_from_rows, bf16_rows, pairs);
  adapt(gate_up.data(), h.data(), hidden, gu_w.out, 6, 2);
  tokenmill::act_mul_rows(gate_up.data(), act.data(), n, inter, gelu);
  tokenmill::quantized_matmul(act.data(), n, down_w, out.data_ptr<float>(), tiles_from_rows, bf16_rows, pairs);
  adapt(out.data_ptr<float>(), act.data(), inter, hidden, 9, 1);
  all_reduce(out.data_ptr<float>(), 2);
  norm_in_place(out.data_ptr<float>(), mlp_out_norm, n, hidden, ep);
}

at::Tensor decode_layer(at::Tensor& x, const at::Tensor& pending, at::TensorList weights, at::IntArrayRef layouts,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& slots, const at::Tensor& tables, const at::Tensor& lengths, int64_t heads,
                        int64_t kv_heads, double eps, double scale, int64_t tiles_from_rows, int64_t window, bool gelu,
                        bool bf16_rows, const std::optional<at::Tensor>& tp_slots,
                        const std::optional<at::Tensor>& tp_flags, int64_t tp_rank, int64_t tp_world,
                        int64_t tp_generation, double tp_timeout, int64_t lora_rank, bool pairs) {
  at::Tensor out = at::empty_like(x);  // layer_into checks x, then out
  layer_into(x, pending, weights, layouts, cos, sin, k_cache, v_cache, slots, tables, lengths, heads, kv_heads, eps,
             scale, tiles_from_rows, window, gelu, bf16_rows, tp_slots, tp_flags, tp_rank, tp_world, tp_generation,
             tp_timeout, lora_rank, pairs, out);
  return out;
}

// Every layer of a decode step in one call (no LoRA adapters): the loop over the layers that models/llama.py would
// otherwise run, one dispatch a layer. Layer i takes weights[19 i, 19 i + 19), layouts[8 i, 8 i + 8), cos[i],
// sin[i], k_caches[i], v_caches[i], the pool pools[i] (slots[pools[i]], tables[pools[i]]: Gemma 3's sliding
// layers keep their KV in a pool of their own) and windows[i]; a tensor-parallel rank's layer i all-reduces as
// exchanges tp_generation + 2 i + 1 and + 2. Returns the last layer's MLP output.
at::Tensor decode_layers(at::Tensor& x, at::TensorList weights, at::IntArrayRef layouts, at::TensorList cos,
                         at::TensorList sin, at::TensorList k_caches, at::TensorList v_caches, at::TensorList slots,
                         at::TensorList tables, const at::Tensor& lengths, at::IntArrayRef pools,
                         at::IntArrayRef windows, int64_t heads, int64_t kv_heads, double eps, double scale,
                         int64_t tiles_from_rows, bool gelu, bool bf16_rows, const std::optional<at::Tensor>& tp_slots,
                         const std::optional<at::Tensor>& tp_flags, int64_t tp_rank, int64_t tp_world,
                         int64_t tp_generation, double tp_timeout, bool pairs) {
  const int64_t layers = static_cast<int64_t>(windows.size());
  TORCH_CHECK(layers > 0 && weights.size() == 19 * static_cast<size_t>(layers) &&
                  layouts.size() == 8 * static_cast<size_t>(layers) && cos.size() == windows.size() &&
                  sin.size() == windows.size() && k_caches.size() == windows.size() &&
                  v_caches.size() == windows.size() && pools.size() == windows.size(),
              "19 weights, 8 layouts, a cos, a sin, a k and a v cache, a pool and a window a layer");
  TORCH_CHECK(slots.size() == tables.size() && !slots.empty(), "a slot mapping and a block table a pool");
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, hidden]");
  at::Tensor pending = at::empty({0}, x.options());
  at::Tensor outs[2] = {at::empty_like(x), at::empty_like(x)};
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t pool = pools[i];
    TORCH_CHECK(pool >= 0 && pool < static_cast<int64_t>(slots.size()), "a layer's pool out of range");
    at::Tensor& out = outs[i % 2];
    layer_into(x, pending, weights.slice(19 * i, 19), layouts.slice(8 * i, 8), cos[i], sin[i], k_caches[i],
               v_caches[i], slots[pool], tables[pool], lengths, heads, kv_heads, eps, scale, tiles_from_rows,
               windows[i], gelu, bf16_rows, tp_slots, tp_flags, tp_rank, tp_world, tp_generation + 2 * i, tp_timeout,
               0, pairs, out);
    pending = out;
  }
  return pending;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("decode_layer(Tensor(a!) x, Tensor pending, Tensor[] weights, int[] layouts, Tensor cos, Tensor sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor tables, Tensor lengths, int heads, "
        "int kv_heads, float eps, float scale, int tiles_from_rows=0, int window=0, bool gelu=False, "
        "bool bf16_rows=False, Tensor? tp_slots=None, Tensor? tp_flags=None, int tp_rank=0, int tp_world=1, "
        "int tp_generation=0, float tp_timeout=10.0, int lora_rank=0, bool pairs=True) -> Tensor");
  m.def("decode_layers(Tensor(a!) x, Tensor[] weights, int[] layouts, Tensor[] cos, Tensor[] sin, "
        "Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor[] slots, Tensor[] tables, Tensor lengths, int[] pools, "
        "int[] windows, int heads, int kv_heads, float eps, float scale, int tiles_from_rows=0, bool gelu=False, "
        "bool bf16_rows=False, Tensor? tp_slots=None, Tensor? tp_flags=None, int tp_rank=0, int tp_world=1, "
        "int tp_generation=0, float tp_timeout=10.0, bool pairs=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
}
