// The sampler's passes over rows x vocabulary fp32 logits (engine/sampler.py), shared among the threads:
// - argmax_rows: the greedy pick, as torch.argmax gives it (the first index of the largest value; a row with a NaN:
//   its first NaN), in one pass; torch's argmax took four times its own amax.
// - sample_rows: a draw under temperature, top-k, top-p and min-p, as the sampler's torch ops draw it (the filters
//   on the temperature's logits; inverse-CDF sampling in vocabulary order with one uniform number a row), without
//   sorting the vocabulary: top-k keeps a buffer of candidates whose bar rises as it fills, top-p sorts only the
//   tokens that can be in the nucleus. The torch ops sort every row whole for top-k or top-p, which on a 262,144-token
//   vocabulary took longer than the model's step (docs/performance/2026-11-29-sampling-large-vocabularies.md).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "cpu.h"

namespace {

constexpr int64_t kArgmaxChunk = 2048;  // logits a chunk: 8 KiB, in L1 when a chunk's better maximum is looked up again
constexpr int kMaxLanes = 16;  // independent maxima a chunk, which the compiler keeps in vector lanes
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Best {
  float value;
  int64_t index;
  bool nan;
};

// The best of x[0..n) (n >= 1): chunk by chunk, each chunk's maximum over lanes (and whether it holds a NaN), its
// index looked up only where it beats the best so far (strictly: the first of equal values stays).
Best best_of(const float* x, int64_t n, int64_t offset) {
  Best best{x[0], offset, false};
  for (int64_t start = 0; start < n; start += kArgmaxChunk) {
    const int64_t len = std::min(kArgmaxChunk, n - start);
    const float* c = x + start;
    float lanes[kMaxLanes];
    bool nan_lanes[kMaxLanes];
    for (int l = 0; l < kMaxLanes; ++l) {
      lanes[l] = kNegInf;
      nan_lanes[l] = false;
    }
    const int64_t whole = len / kMaxLanes * kMaxLanes;
    for (int64_t j = 0; j < whole; j += kMaxLanes) {
      for (int l = 0; l < kMaxLanes; ++l) {
        const float v = c[j + l];
        lanes[l] = v > lanes[l] ? v : lanes[l];
        nan_lanes[l] |= v != v;
      }
    }
    float top = kNegInf;
    bool nan = false;
    for (int l = 0; l < kMaxLanes; ++l) {
      top = std::max(top, lanes[l]);
      nan |= nan_lanes[l];
    }
    for (int64_t j = whole; j < len; ++j) {
      top = c[j] > top ? c[j] : top;
      nan |= c[j] != c[j];
    }
    if (nan) {
      for (int64_t j = 0; j < len; ++j)
        if (c[j] != c[j]) return {c[j], offset + start + j, true};
    }
    if (top > best.value) {
      for (int64_t j = 0; j < len; ++j) {
        if (c[j] == top) {
          best = {top, offset + start + j, false};
          break;
        }
      }
    }
  }
  return best;
}

// [rows] int64: each row's argmax. A row is cut into as many parts as it takes to give every thread work (one part
// a row when rows are many), and the parts merge in order.
at::Tensor argmax_rows(const at::Tensor& logits_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat && logits_in.size(1) > 0,
              "logits must be [rows, vocab] fp32 with vocab > 0");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::clamp<int64_t>((threads + rows - 1) / std::max<int64_t>(rows, 1), 1,
                                            std::max<int64_t>(1, vocab / (16 * kArgmaxChunk)));
  const int64_t span = (vocab + parts - 1) / parts;
  std::vector<Best> found(rows * parts);
  const float* x = logits.data_ptr<float>();
  at::parallel_for(0, rows * parts, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / parts, first = task % parts * span;
      const int64_t n = std::min(span, vocab - first);
      found[task] = n > 0 ? best_of(x + row * vocab + first, n, first)
                          : Best{kNegInf, first, false};
    }
  });
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* index = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    Best best = found[row * parts];
    for (int64_t p = 1; p < parts && !best.nan; ++p) {
      const Best& next = found[row * parts + p];
      if (next.nan || next.value > best.value) best = next;
    }
    index[row] = best.index;
  }
  return out;
}

using Candidate = std::pair<float, int64_t>;  // a logit and its token

// The order the filters rank tokens in: larger logit first, then the smaller token (ties keep vocabulary order).
inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

constexpr int64_t kSumBlock = 1024;  // tokens a partial sum of the draw's mass covers
constexpr int64_t kMaxBlocks = 4096;  // vocabularies up to 4M tokens (sample_rows checks)

// The largest logit of a row (NaNs passed over), over lanes the compiler keeps in a vector register.
float row_max(const float* x, int64_t n) {
  float lanes[kMaxLanes];
  std::fill(lanes, lanes + kMaxLanes, kNegInf);
  int64_t j = 0;
  for (; j + kMaxLanes <= n; j += kMaxLanes)
    for (int l = 0; l < kMaxLanes; ++l) lanes[l] = x[j + l] > lanes[l] ? x[j + l] : lanes[l];
  float m = kNegInf;
  for (; j < n; ++j) m = x[j] > m ? x[j] : m;
  for (int l = 0; l < kMaxLanes; ++l) m = lanes[l] > m ? lanes[l] : m;
  return m;
}

// The k best tokens of x, ranked: a buffer of the tokens at or above a bar, cut back to k and the bar raised to
// the k-th whenever it reaches twice the size (one pass; the bar soon passes all but a few tokens).
void top_k_of(const float* x, int64_t vocab, int64_t k, std::vector<Candidate>& out) {
  const size_t cap = 2 * static_cast<size_t>(std::max<int64_t>(k, 64));
  out.clear();
  float bar = kNegInf;
  for (int64_t j = 0; j < vocab; ++j) {
    if (x[j] >= bar) {
      out.emplace_back(x[j], j);
      if (out.size() >= cap) {
        std::nth_element(out.begin(), out.begin() + (k - 1), out.end(), ranks_before);
        out.resize(k);
        bar = out[k - 1].first;
      }
    }
  }
  std::sort(out.begin(), out.end(), ranks_before);
  if (static_cast<int64_t>(out.size()) > k) out.resize(k);
}

// What a draw keeps: the tokens ranked up to (value, token) (value -inf, token vocab: all), of logits x with
// x - max >= min_shift, never a -inf one (banned; exp_sum's clamped arithmetic gives it ~1e-38, not 0).
struct Kept {
  float value;
  int64_t token;
  float max;
  float min_shift;
};

// e^(x[j] - max) for the n <= kSumBlock logits from first into e, 0 where `kept` says no (filter false: every
// one kept); returns their sum. The block's logits and e stay in L1, and the loop is one the compiler vectorizes
// (the only index compare is within the block, in 32 bits).
float kept_exps(const float* x, int64_t first, int64_t n, const Kept& kept, bool filter, float* e) {
  const float* xb = x + first;
  std::copy(xb, xb + n, e);
  float sum = tokenmill::exp_sum(e, n, kept.max);
  if (!filter) return sum;
  const float value = kept.value, min_shift = kept.min_shift, m = kept.max;
  const int32_t last = static_cast<int32_t>(std::clamp<int64_t>(kept.token - first, -1, kSumBlock));
  // e[j] kept or zeroed; bitwise, not short-circuit: no branch, so the loop vectorizes (the branches were most of
  // a draw's time)
  const auto keep = [&](int64_t j) {
    const float v = xb[j];
    const bool kept_here = ((v > value) | ((v == value) & (static_cast<int32_t>(j) <= last))) &
                           (v - m >= min_shift) & (v != kNegInf);
    return e[j] = kept_here ? e[j] : 0.f;
  };
  float lanes[kMaxLanes] = {};
  int64_t j = 0;
  for (; j + kMaxLanes <= n; j += kMaxLanes)
    for (int l = 0; l < kMaxLanes; ++l) lanes[l] += keep(j + l);
  sum = 0.f;
  for (; j < n; ++j) sum += keep(j);
  for (int l = 0; l < kMaxLanes; ++l) sum += lanes[l];
  return sum;
}

// One row's draw. x: its logits after temperature; k: top-k (0: none); top_p (>= 1: none); min_p (0: none); u: the
// row's uniform number in [0, 1). ranked: the candidates' buffer.
int64_t sample_row(const float* x, int64_t vocab, int64_t k, float top_p, float min_p, float u,
                   std::vector<Candidate>& ranked) {
  const float m = row_max(x, vocab);
  if (m == kNegInf) return 0;  // nothing can be drawn (a row of -inf or NaN)
  const int64_t blocks = (vocab + kSumBlock - 1) / kSumBlock;
  float e[kSumBlock];
  const auto block_size = [&](int64_t b) { return std::min(kSumBlock, vocab - b * kSumBlock); };
  // The nucleus: the kept tokens are those ranked up to (last_value, last_token).
  float last_value = kNegInf;
  int64_t last_token = vocab;
  const bool top_k = k > 0 && k < vocab, nucleus = top_p < 1.f;
  if (top_k || nucleus) {
    double total = 0.;  // the normalizer of top-p's probabilities: over the top k, else the whole row
    if (top_k) {
      top_k_of(x, vocab, k, ranked);
      for (const Candidate& c : ranked) total += std::exp(c.first - m);
    } else {
      const Kept all{kNegInf, vocab, m, kNegInf};
      for (int64_t b = 0; b < blocks; ++b) total += kept_exps(x, b * kSumBlock, block_size(b), all, false, e);
      // Tokens of probability under (1 - top_p) / vocab together hold less than 1 - top_p: the nucleus is among
      // the others.
      float bar = m + static_cast<float>(std::log((1. - top_p) / static_cast<double>(vocab) * total));
      bar = bar <= m ? bar : m;  // the best token always (and a NaN's sum: it alone)
      ranked.clear();
      for (int64_t j = 0; j < vocab; ++j)
        if (x[j] >= bar) ranked.emplace_back(x[j], j);
      std::sort(ranked.begin(), ranked.end(), ranks_before);
    }
    int64_t kept = static_cast<int64_t>(ranked.size());
    if (nucleus) {  // as the torch ops cut: a token goes where the mass before it, (sum to it) - it, reaches top_p
      const float norm = static_cast<float>(total);
      float sum = 0.f;
      for (int64_t i = 0; i < kept; ++i) {
        const float p = std::exp(ranked[i].first - m) / norm;
        const float through = sum + p;
        if (i > 0 && through - p >= top_p) {
          kept = i;
          break;
        }
        sum = through;
      }
    }
    last_value = ranked[kept - 1].first;
    last_token = ranked[kept - 1].second;
  }
  // The draw: the kept tokens' mass by blocks of kSumBlock, the block the draw falls in found from those sums, then
  // the token within it. -inf (a banned token) is never kept: exp_sum's clamped arithmetic gives it ~1e-38, not 0.
  const Kept keep{last_value, last_token, m, min_p > 0.f ? std::log(min_p) : kNegInf};  // min-p: x - m >= log(min_p)
  float block_sums[kMaxBlocks];
  double total = 0.;
  for (int64_t b = 0; b < blocks; ++b)
    total += block_sums[b] = kept_exps(x, b * kSumBlock, block_size(b), keep, true, e);
  const double target = static_cast<double>(u) * total;
  double sum = 0.;
  int64_t last = -1;  // the last token that can be drawn: where rounding leaves the draw past every sum
  for (int64_t b = 0; b < blocks; ++b) {
    if (block_sums[b] > 0.f) last = b;
    if (sum + block_sums[b] <= target) {
      sum += block_sums[b];
      continue;
    }
    const int64_t n = block_size(b);
    kept_exps(x, b * kSumBlock, n, keep, true, e);
    for (int64_t j = 0; j < n; ++j) {
      sum += e[j];
      if (sum > target && e[j] > 0.f) return b * kSumBlock + j;
    }
  }
  if (last < 0) return 0;
  kept_exps(x, last * kSumBlock, block_size(last), keep, true, e);
  for (int64_t j = block_size(last) - 1; j >= 0; --j)
    if (e[j] > 0.f) return last * kSumBlock + j;
  return 0;
}

// [rows] int64: each row's draw (sample_row), rows shared among the threads.
at::Tensor sample_rows(const at::Tensor& logits_in, const at::Tensor& top_k, const at::Tensor& top_p,
                       const at::Tensor& min_p, const at::Tensor& uniform) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat && logits_in.size(1) > 0,
              "logits must be [rows, vocab] fp32 with vocab > 0");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const at::Tensor k = top_k.to(at::kLong).contiguous(), p = top_p.to(at::kFloat).contiguous(),
                   mp = min_p.to(at::kFloat).contiguous(), u = uniform.to(at::kFloat).contiguous();
  for (const at::Tensor* t : {&k, &p, &mp, &u}) TORCH_CHECK(t->numel() == rows, "one parameter a row");
  TORCH_CHECK(vocab <= kSumBlock * kMaxBlocks, "a vocabulary of at most ", kSumBlock * kMaxBlocks, " tokens");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const int64_t* ks = k.data_ptr<int64_t>();
  const float *ps = p.data_ptr<float>(), *mps = mp.data_ptr<float>(), *us = u.data_ptr<float>();
  int64_t* token = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<Candidate> ranked;
    for (int64_t r = begin; r < end; ++r)
      token[r] = sample_row(x + r * vocab, vocab, ks[r], ps[r], mps[r], us[r], ranked);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("sample_rows(Tensor logits, Tensor top_k, Tensor top_p, Tensor min_p, Tensor uniform) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("sample_rows", &sample_rows);
}
