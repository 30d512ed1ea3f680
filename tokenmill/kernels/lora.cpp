// LoRA adapters beside a projection (layers/lora.py), each row with its own adapter's slot (-1: none), as Punica's
// BGMV does on GPUs: y[i] += B_p[s] (A_p[s] x[i]) for each stacked part p of the projection, nothing for the other
// slots' rows. In torch the same takes two matmuls over every slot and a mask, so each row pays for every adapter
// loaded, and a few ops a projection; here a row pays for its own adapter only, in one op.
//   a:    [slots * parts * rank, in]  (slot s, part p: rows (s * parts + p) * rank ...)
//   b[p]: [slots * rank, out_p]      (slot s: rows s * rank ...), the scale folded in
//   y:    [n, sum out_p], the base projection's output, added to in place
// Arithmetic in fp32 whatever the dtype; each y element rounded once.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu.h"

namespace {

constexpr int64_t kLoRARows = 4;     // rows of one slot a task takes together: each factor read once for them
constexpr int64_t kLoRAChunk = 256;  // outputs a task of the expansion takes

// out[m][j] = a[j] . x[m] for the chunk's rows m and the rank's j: each row of a read once for all the rows.
template <typename T, typename R>
void lora_shrink(const T* a, const R* const* x, float* const* out, int64_t rows, int64_t rank, int64_t in) {
  for (int64_t j = 0; j < rank; ++j) {
    const T* aj = a + j * in;
    float sums[kLoRARows] = {};
    int64_t k = 0;
#if defined(TOKENMILL_VEC)
    if constexpr (!std::is_same_v<T, double> && !std::is_same_v<R, double>) {
      using V = tokenmill::Vec;
      V::F acc[kLoRARows];
      for (int64_t m = 0; m < rows; ++m) acc[m] = V::zero();
      for (; k + V::kLanes <= in; k += V::kLanes) {
        const V::F va = V::load(aj + k);
        for (int64_t m = 0; m < rows; ++m) acc[m] = V::fma(va, V::load(x[m] + k), acc[m]);
      }
      alignas(64) float lanes[V::kLanes];
      for (int64_t m = 0; m < rows; ++m) {
        V::store(lanes, acc[m]);
        for (int64_t l = 0; l < V::kLanes; ++l) sums[m] += lanes[l];
      }
    }
#endif
    for (; k < in; ++k)
      for (int64_t m = 0; m < rows; ++m) sums[m] += static_cast<float>(aj[k]) * static_cast<float>(x[m][k]);
    for (int64_t m = 0; m < rows; ++m) out[m][j] = sums[m];
  }
}

// acc[m][o] += sum_j t[m][j] * b[j * stride + o] for the chunk's rows m and o < n: each b element read once.
template <typename T>
void lora_expand(float (*acc)[kLoRAChunk], const float* const* t, const T* b, int64_t rows, int64_t rank,
                 int64_t stride, int64_t n) {
  int64_t o = 0;
#if defined(TOKENMILL_VEC)
  if constexpr (!std::is_same_v<T, double>) {
    using V = tokenmill::Vec;
    for (; o + V::kLanes <= n; o += V::kLanes) {
      V::F sum[kLoRARows];
      for (int64_t m = 0; m < rows; ++m) sum[m] = V::load(acc[m] + o);
      for (int64_t j = 0; j < rank; ++j) {
        const V::F vb = V::load(b + j * stride + o);
        for (int64_t m = 0; m < rows; ++m) sum[m] = V::fma(V::set1(t[m][j]), vb, sum[m]);
      }
      for (int64_t m = 0; m < rows; ++m) V::store(acc[m] + o, sum[m]);
    }
  }
#endif
  for (; o < n; ++o)
    for (int64_t m = 0; m < rows; ++m) {
      float sum = acc[m][o];
      for (int64_t j = 0; j < rank; ++j) sum += t[m][j] * static_cast<float>(b[j * stride + o]);
      acc[m][o] = sum;
    }
}

// y, x: rows of R (the model's dtype, or the fused layer's fp32); a, b: the factors, of T. The rows of each slot
// go in chunks of kLoRARows; one parallel region, the shrink's tasks then the expansion's.
template <typename R, typename T>
void lora_add_of(R* y, const R* x, const int64_t* slot, const T* a, const std::vector<const T*>& b,
                 const std::vector<int64_t>& outs, int64_t n, int64_t in, int64_t rank) {
  const int64_t parts = static_cast<int64_t>(b.size()), width = parts * rank;
  int64_t total = 0;
  std::vector<int64_t> offsets;
  for (int64_t out : outs) {
    offsets.push_back(total);
    total += out;
  }
  std::vector<int64_t> order;  // the adapted rows, by slot
  for (int64_t i = 0; i < n; ++i)
    if (slot[i] >= 0) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) { return slot[i] < slot[j]; });
  std::vector<std::pair<int64_t, int64_t>> chunks;  // [first, end) of order: rows of one slot
  for (size_t i = 0; i < order.size();) {
    size_t end = i + 1;
    while (end < order.size() && end - i < kLoRARows && slot[order[end]] == slot[order[i]]) ++end;
    chunks.emplace_back(i, end);
    i = end;
  }
  std::vector<float> shrunk(n * width);  // each row's A x, of its slot
  std::vector<std::array<int64_t, 3>> expand;  // (chunk, part, first output)
  for (size_t c = 0; c < chunks.size(); ++c)
    for (int64_t p = 0; p < parts; ++p)
      for (int64_t o = 0; o < outs[p]; o += kLoRAChunk) expand.push_back({static_cast<int64_t>(c), p, o});
  const int64_t shrink_tasks = static_cast<int64_t>(chunks.size()) * parts;
  const int64_t expand_tasks = static_cast<int64_t>(expand.size());
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                                std::max(shrink_tasks, expand_tasks))));
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < shrink_tasks; ++task) {
      const auto [first, end] = chunks[task / parts];
      const int64_t p = task % parts, rows = static_cast<int64_t>(end - first), s = slot[order[first]];
      const R* xs[kLoRARows];
      float* outs_m[kLoRARows];
      for (int64_t m = 0; m < rows; ++m) {
        xs[m] = x + order[first + m] * in;
        outs_m[m] = shrunk.data() + order[first + m] * width + p * rank;
      }
      lora_shrink(a + ((s * parts + p) * rank) * in, xs, outs_m, rows, rank, in);
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < expand_tasks; ++task) {
      const auto [c, p, o0] = expand[task];
      const auto [first, end] = chunks[c];
      const int64_t rows = static_cast<int64_t>(end - first), s = slot[order[first]];
      const int64_t count = std::min(kLoRAChunk, outs[p] - o0);
      float acc[kLoRARows][kLoRAChunk];
      const float* ts[kLoRARows];
      for (int64_t m = 0; m < rows; ++m) {
        const R* dest = y + order[first + m] * total + offsets[p] + o0;
        for (int64_t o = 0; o < count; ++o) acc[m][o] = static_cast<float>(dest[o]);
        ts[m] = shrunk.data() + order[first + m] * width + p * rank;
      }
      lora_expand(acc, ts, b[p] + s * rank * outs[p] + o0, rows, rank, outs[p], count);
      for (int64_t m = 0; m < rows; ++m) {
        R* dest = y + order[first + m] * total + offsets[p] + o0;
        for (int64_t o = 0; o < count; ++o) dest[o] = static_cast<R>(acc[m][o]);
      }
    }
  }
}

// The factors' shapes for rows of `in` inputs and `columns` outputs: the parts' outputs, and the slots.
std::vector<int64_t> lora_parts(const at::Tensor& a, at::TensorList b, int64_t rank, int64_t in, int64_t columns,
                                int64_t* num_slots) {
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && a.size(1) == in && rank > 0 && !b.empty(),
              "a must be [slots * parts * rank, in]");
  const int64_t parts = static_cast<int64_t>(b.size());
  *num_slots = a.size(0) / (parts * rank);
  TORCH_CHECK(a.size(0) == *num_slots * parts * rank, "a's rows are slots * parts * rank");
  std::vector<int64_t> outs;
  int64_t total = 0;
  for (const at::Tensor& part : b) {
    TORCH_CHECK(part.dim() == 2 && part.is_contiguous() && part.size(0) == *num_slots * rank &&
                    part.scalar_type() == a.scalar_type(), "each b must be [slots * rank, out] of a's dtype");
    outs.push_back(part.size(1));
    total += part.size(1);
  }
  TORCH_CHECK(total == columns, "the projection's outputs are its parts'");
  return outs;
}

void check_slots(const int64_t* slot, int64_t n, int64_t num_slots) {
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slot[i] >= -1 && slot[i] < num_slots, "a slot out of range");
}

// fp32 rows (the fused layer's), factors of any dtype
void lora_add_float_rows(float* y, const float* x, const int64_t* slot, const at::Tensor& a, at::TensorList b,
                         const std::vector<int64_t>& outs, int64_t n, int64_t in, int64_t rank) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "lora_add_rows", [&] {
    std::vector<const scalar_t*> parts_b;
    for (const at::Tensor& part : b) parts_b.push_back(part.data_ptr<scalar_t>());
    lora_add_of<float, scalar_t>(y, x, slot, a.data_ptr<scalar_t>(), parts_b, outs, n, in, rank);
  });
}

void lora_add(at::Tensor& y, const at::Tensor& x_in, const at::Tensor& slots, const at::Tensor& a,
              at::TensorList b, int64_t rank) {
  const at::Tensor x = x_in.contiguous();
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous() && x.dim() == 2 && x.size(0) == y.size(0),
              "y must be [rows, out] and contiguous, x [rows, in]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == x.size(0), "one slot a row");
  int64_t num_slots = 0;
  const std::vector<int64_t> outs = lora_parts(a, b, rank, x.size(1), y.size(1), &num_slots);
  TORCH_CHECK(x.scalar_type() == a.scalar_type() && y.scalar_type() == a.scalar_type(),
              "x, y and the factors share a dtype");
  const int64_t* slot = slots.data_ptr<int64_t>();
  check_slots(slot, x.size(0), num_slots);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, a.scalar_type(), "lora_add", [&] {
    std::vector<const scalar_t*> parts_b;
    for (const at::Tensor& part : b) parts_b.push_back(part.data_ptr<scalar_t>());
    lora_add_of<scalar_t, scalar_t>(y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), slot, a.data_ptr<scalar_t>(),
                                    parts_b, outs, x.size(0), x.size(1), rank);
  });
}

}  // namespace

// The fused decoder layer's (layer.cpp): fp32 rows y [n, columns] += their slots' products of x [n, in].
void tokenmill::lora_add_rows(float* y, const float* x, const int64_t* slot, int64_t n, int64_t in, int64_t columns,
                              const at::Tensor& a, at::TensorList b, int64_t rank) {
  int64_t num_slots = 0;
  const std::vector<int64_t> outs = lora_parts(a, b, rank, in, columns, &num_slots);
  check_slots(slot, n, num_slots);
  lora_add_float_rows(y, x, slot, a, b, outs, n, in, rank);
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("lora_add(Tensor(a!) y, Tensor x, Tensor slots, Tensor a, Tensor[] b, int rank) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("lora_add", &lora_add); }
