// RMSNorm in one pass over each row, optionally adding the residual first (in place): torch's rms_norm runs as
// about eight small ops, ~25 us for a 576-wide row on a 2-core Zen 3, which at one decode row is all overhead.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>
#include <vector>

#include "cpu.h"

namespace {

#if defined(TOKENMILL_VEC)
// rms_rows on fp32 rows of whole vectors: each lane sums its share of the squares (the scalar loop's one running
// sum, a chain of dependent adds, was most of a few-row decode step's norms).
void vector_rows(float* x, const float* residual, const float* weight, float* out, int64_t begin, int64_t end,
                 int64_t dim, float eps) {
  using tokenmill::Vec;
  for (int64_t r = begin; r < end; ++r) {
    float* xr = x + r * dim;
    Vec::F squares = Vec::zero();
    for (int64_t j = 0; j < dim; j += Vec::kLanes) {
      Vec::F v = Vec::load(xr + j);
      if (residual) {
        v = Vec::add(v, Vec::load(residual + r * dim + j));
        Vec::store(xr + j, v);
      }
      squares = Vec::fma(v, v, squares);
    }
    const Vec::F inv = Vec::set1(1.f / std::sqrt(Vec::sum(squares) / static_cast<float>(dim) + eps));
    for (int64_t j = 0; j < dim; j += Vec::kLanes)
      Vec::store(out + r * dim + j, Vec::mul(Vec::mul(Vec::load(xr + j), inv), Vec::load(weight + j)));
  }
}
#endif

// The squares of n fp32 values summed, in vector lanes where the build has them (one running sum is a chain of
// dependent adds: a 2,048-row prompt chunk's bf16 norms took 0.6 ms each on it).
inline float sum_of_squares(const float* v, int64_t n) {
  int64_t j = 0;
  float squares = 0.f;
#if defined(TOKENMILL_VEC)
  using tokenmill::Vec;
  Vec::F lanes = Vec::zero();
  for (; j + Vec::kLanes <= n; j += Vec::kLanes) {
    const Vec::F x = Vec::load(v + j);
    lanes = Vec::fma(x, x, lanes);
  }
  squares = Vec::sum(lanes);
#endif
  for (; j < n; ++j) squares += v[j] * v[j];
  return squares;
}

// out = x / rms(x) * weight per row, statistics in fp32; with residual, x += residual first (rounded to x's dtype,
// as x + residual would be) and the sum is what is normalized.
template <typename T>
void rms_rows(T* x, const T* residual, const T* weight, T* out, int64_t rows, int64_t dim, float eps) {
  at::parallel_for(0, rows, 32, [&](int64_t begin, int64_t end) {
#if defined(TOKENMILL_VEC)
    if constexpr (std::is_same_v<T, float>) {  // the fused decode layer's rows: the sums in vector lanes
      if (dim % tokenmill::Vec::kLanes == 0) {
        vector_rows(x, residual, weight, out, begin, end, dim, eps);
        return;
      }
    }
#endif
    std::vector<float> row(dim);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * dim;
      for (int64_t j = 0; j < dim; ++j) {
        float v = static_cast<float>(xr[j]);
        if (residual) {
          xr[j] = static_cast<T>(v + static_cast<float>(residual[r * dim + j]));
          v = static_cast<float>(xr[j]);
        }
        row[j] = v;
      }
      const float inv = 1.f / std::sqrt(sum_of_squares(row.data(), dim) / static_cast<float>(dim) + eps);
      for (int64_t j = 0; j < dim; ++j) out[r * dim + j] = static_cast<T>(row[j] * inv * static_cast<float>(weight[j]));
    }
  });
}

at::Tensor norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight_in,
                double eps) {
  const at::Tensor weight = weight_in.to(x.scalar_type()).contiguous();
  TORCH_CHECK(x.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0),
              "x must be contiguous with rows of weight's size");
  const int64_t dim = weight.size(0), rows = x.numel() / dim;
  at::Tensor res;
  if (residual.has_value()) {
    res = residual->contiguous();
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(), "residual must be shaped as x");
  }
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), res.defined() ? res.data_ptr<scalar_t>() : nullptr,
                       weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, dim, static_cast<float>(eps));
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm(x.contiguous(), std::nullopt, weight, eps);
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  return norm(x, residual, weight, eps);
}

}  // namespace

void tokenmill::rms_norm_rows(float* x, const float* residual, const float* weight, float* out, int64_t rows,
                              int64_t dim, float eps) {
  rms_rows<float>(x, residual, weight, out, rows, dim, eps);
}

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
