// Decode attention straight from the paged KV pool: each decoding row's query heads against its sequence's keys,
// read block by block through its block table (torch's path gathers every sequence's history into a new tensor
// per layer and step, masks the padding and runs SDPA).
//
// As flash-decoding does, a sequence's keys are split in even chunks of at most kChunk (kLongChunk past kLongRow
// keys): each (sequence, chunk, KV head) is a task of its own, so that one long context keeps every thread busy (one
// task per KV head left one of two threads idle a third of the time on SmolLM2's three KV heads), and the chunks'
// partial softmaxes merge after. While a thread works on a chunk its loops fetch the next chunk it will take into
// the caches (Ahead), so that reading the pool overlaps the arithmetic instead of following it.
// In a task the KV head's query heads read each key and value once, from the pool as it lies (bf16 widened in
// registers), and the dot products of four keys are summed across lanes together. A quantized pool (int8 or fp8,
// cpu.h) is read as it lies too: a key's scale multiplies its scores, a value's its weight.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu.h"

namespace {

using tokenmill::dot;

// Keys a task reads at most. Fixed, never from the thread count or the batch: a row's chunks, and so its result's
// bits, follow from its own length alone, whatever else the step runs (the deterministic mode rests on it). Rows of
// more than kLongRow keys take chunks of kLongChunk: two of those (every KV head's keys and values) fit in L2, the
// one the thread works on and the next one it fetches (docs/performance/tuning.md); short rows keep the longer
// chunks, whose fewer tasks and merges cost less than the overlap gains there.
constexpr int64_t kChunk = 256, kLongChunk = 64, kLongRow = 512;
// The next chunk is fetched only where it is at most this many bytes (keys and values), so that it fits in L2 beside
// the one being worked on.
constexpr int64_t kAheadBytes = 256 * 1024;
// Whether it is fetched at all (--no-decode-fetch-ahead, for A/B): one switch for the process, as its thread count is.
std::atomic<bool> fetch_ahead{true};

// Keys a chunk of a row of `keys` keys holds: as few chunks as hold them, all of one size (the last one short).
inline int64_t chunk_keys_of(int64_t keys) {
  const int64_t most = keys > kLongRow ? kLongChunk : kChunk;
  const int64_t chunks = (keys + most - 1) / most;
  return chunks > 0 ? (keys + chunks - 1) / chunks : 0;
}

// The cache lines of the next chunk a thread will work on, fetched a few at a time from inside the loops over the
// present one's keys (a burst of them at a task's start stalled it as long as reading them did).
struct Ahead {
  std::vector<const char*> lines;
  size_t at = 0;

  void fetch(int64_t count) {
    for (const size_t last = std::min(lines.size(), at + static_cast<size_t>(count)); at < last; ++at)
      __builtin_prefetch(lines[at], 0, 2);  // into L2 (x86's prefetcht1), on every instruction set
  }
};

// A row of the pool as fp32: the pool's own memory where it is fp32, else widened into buf (a bf16 is the top half
// of an fp32).
template <typename KV>
const float* widen(const KV* row, float* buf, int64_t n) {
  for (int64_t j = 0; j < n; ++j) buf[j] = static_cast<float>(row[j]);
  return buf;
}

inline const float* widen(const float* row, float*, int64_t) { return row; }

#if defined(TOKENMILL_VEC)
using tokenmill::Vec;
#endif

// What a task computes for each of its KV head's query heads over its chunk of keys: the chunk's largest score,
// its weights' sum (e^(score - max)) and their weighted sum of values, not yet divided by it.
struct Chunk {
  const float* query;  // [group, dim] fp32, scaled
  int64_t group, dim;
  const int64_t* rows;  // each key's row in the pool (elements), n of them
  int64_t n;
  float* scores;  // [group, stride]: room for the scores, then the weights
  int64_t stride;  // a multiple of 4, >= n
  int64_t span;  // bytes of each key's and value's row to fetch ahead from rows[i]: its KV head's, or every head's
  Ahead* ahead;  // the next chunk's lines, some fetched each step of the loops
};

#if defined(TOKENMILL_VEC)
// The scores of G query heads from `head` on: four keys at a time, each vector of a key read once for the G heads.
template <int G, typename KV>
void scores_of(const Chunk& c, int64_t head, const KV* k_cache, const KV* v_cache) {
  using F = Vec::F;
  const int64_t vectors = c.dim / Vec::kLanes;
  const float* q = c.query + head * c.dim;
  const int64_t row_bytes = c.dim * static_cast<int64_t>(sizeof(KV));
  if (head == 0 && c.span > row_bytes) {  // the first keys' other heads (span: below), which the loop fetches not
    for (int64_t p = 0; p < std::min<int64_t>(16, c.n); ++p)
      for (int64_t b = row_bytes; b < c.span; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(k_cache + c.rows[p]) + b, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(v_cache + c.rows[p]) + b, _MM_HINT_T1);
      }
  }
  for (int64_t i = 0; i < c.n; i += 4) {
    c.ahead->fetch(8);
    const KV* key[4];
    for (int p = 0; p < 4; ++p) key[p] = k_cache + c.rows[std::min(i + p, c.n - 1)];  // past n: repeats, unused
    // Rows a few keys ahead from memory: each key's row is a KV head's slice of a position's, so the rows a task
    // reads are strided, which the hardware prefetchers followed late (the pool is larger than the caches at long
    // contexts). The values' rows too, for values_of's pass. Where span covers every KV head's rows of a position
    // (decode's first head of a chunk), the next tasks' rows come with them: memory read densely, once.
    if (head == 0 && i + 16 < c.n) {
      for (int p = 0; p < 4; ++p) {
        const char* k = reinterpret_cast<const char*>(k_cache + c.rows[i + 16 + p]);
        const char* v = reinterpret_cast<const char*>(v_cache + c.rows[i + 16 + p]);
        for (int64_t b = 0; b < c.span; b += 64) {
          _mm_prefetch(k + b, _MM_HINT_T0);
          _mm_prefetch(v + b, _MM_HINT_T1);
        }
      }
    }
    F acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int p = 0; p < 4; ++p) acc[g][p] = Vec::zero();
    for (int64_t d = 0; d < vectors; ++d) {
      F k[4];
      for (int p = 0; p < 4; ++p) k[p] = Vec::load(key[p] + d * Vec::kLanes);
      for (int g = 0; g < G; ++g) {
        const F qv = Vec::load(q + g * c.dim + d * Vec::kLanes);
        for (int p = 0; p < 4; ++p) acc[g][p] = Vec::fma(qv, k[p], acc[g][p]);
      }
    }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(c.scores + (head + g) * c.stride + i, Vec::sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
}

// out[g] (fp32, [G, dim] from `head`) = the weights of G query heads times the values, over P vectors of each
// value row from vector d0: each value vector read once for the G heads.
template <int G, int P, typename KV>
void values_of(const Chunk& c, int64_t head, int64_t d0, const KV* v_cache, float* out) {
  using F = Vec::F;
  F acc[G][P];
  for (int g = 0; g < G; ++g)
    for (int p = 0; p < P; ++p) acc[g][p] = Vec::zero();
  for (int64_t i = 0; i < c.n; ++i) {
    c.ahead->fetch(2);
    const KV* value = v_cache + c.rows[i] + d0 * Vec::kLanes;
    F v[P];
    for (int p = 0; p < P; ++p) v[p] = Vec::load(value + p * Vec::kLanes);
    for (int g = 0; g < G; ++g) {
      const F w = Vec::set1(c.scores[(head + g) * c.stride + i]);
      for (int p = 0; p < P; ++p) acc[g][p] = Vec::fma(w, v[p], acc[g][p]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int p = 0; p < P; ++p) Vec::store(out + (head + g) * c.dim + (d0 + p) * Vec::kLanes, acc[g][p]);
}

// f(G) for the next G of `left` heads (G <= Vec::kHeads, a std::integral_constant); returns G.
template <typename F>
int64_t with_heads(int64_t left, F&& f) {
  tokenmill::with_count<Vec::kHeads>(left, f);
  return std::min<int64_t>(left, Vec::kHeads);
}
#endif

// The pools the vector paths read (an fp64 one, which the op takes too, runs the plain loops).
template <typename KV>
constexpr bool kVectorPool = std::is_same_v<KV, float> || std::is_same_v<KV, at::BFloat16> ||
                             std::is_same_v<KV, at::Half> || tokenmill::kQuantizedPool<KV>;

// One task's chunk: fills max[g], total[g] and out[g] ([group, dim], the weighted values not yet divided).
template <typename KV>
void attend_chunk(const Chunk& c, const KV* k_cache, const KV* v_cache, float* row, float* max, float* total,
                  float* out) {
  bool scored = false;
#if defined(TOKENMILL_VEC)
  if constexpr (kVectorPool<KV>) {
    if (c.dim % Vec::kLanes == 0) {
      for (int64_t g = 0; g < c.group;)
        g += with_heads(c.group - g, [&](auto heads) { scores_of<decltype(heads)::value>(c, g, k_cache, v_cache); });
      scored = true;
    }
  }
#endif
  if (!scored) {
    for (int64_t i = 0; i < c.n; ++i) {
      const float* key = widen(k_cache + c.rows[i], row, c.dim);
      for (int64_t g = 0; g < c.group; ++g) c.scores[g * c.stride + i] = dot(c.query + g * c.dim, key, c.dim);
    }
  }
  // A quantized pool: the scores of the keys' numbers times each key's scale; then, the totals taken, each weight
  // times its value's scale.
  const auto times_scales = [&](const KV* cache) {
    if constexpr (tokenmill::kQuantizedPool<KV>) {
      for (int64_t i = 0; i < c.n; ++i) {
        const float scale = tokenmill::row_scale(cache + c.rows[i], c.dim);
        for (int64_t g = 0; g < c.group; ++g) c.scores[g * c.stride + i] *= scale;
      }
    }
  };
  times_scales(k_cache);
  for (int64_t g = 0; g < c.group; ++g) {
    float* weights = c.scores + g * c.stride;
    max[g] = tokenmill::max_of(weights, c.n);
    total[g] = tokenmill::exp_sum(weights, c.n, max[g]);
  }
  times_scales(v_cache);
#if defined(TOKENMILL_VEC)
  if constexpr (kVectorPool<KV>) {
    if (scored) {
      const int64_t vectors = c.dim / Vec::kLanes;
      for (int64_t g = 0; g < c.group;) {
        g += with_heads(c.group - g, [&](auto heads) {
          constexpr int G = decltype(heads)::value;
          int64_t d = 0;
          for (; d + 4 <= vectors; d += 4) values_of<G, 4>(c, g, d, v_cache, out);
          for (; d < vectors; ++d) values_of<G, 1>(c, g, d, v_cache, out);
        });
      }
      return;
    }
  }
#endif
  std::fill(out, out + c.group * c.dim, 0.f);
  for (int64_t i = 0; i < c.n; ++i) {
    const float* value = widen(v_cache + c.rows[i], row, c.dim);
    for (int64_t g = 0; g < c.group; ++g) {
      const float weight = c.scores[g * c.stride + i];
      float* a = out + g * c.dim;
#pragma omp simd
      for (int64_t j = 0; j < c.dim; ++j) a[j] += weight * value[j];
    }
  }
}

// q and out of T, the pool of KV (the fused layer's fp32 rows read a bf16 or fp16 pool). window > 0: each query
// sees its last `window` keys only (Gemma's sliding layers: 0 <= i - j < window).
template <typename T, typename KV>
void decode(const T* q, const KV* k_cache, const KV* v_cache, const int64_t* tables, const int64_t* lengths, T* out,
            int64_t seqs, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, int64_t width,
            float scale, int64_t window) {
  const int64_t group = heads / kv_heads, stride_of_row = tokenmill::row_stride<KV>(dim);
  const auto first_of = [&](int64_t s) { return window > 0 ? std::max(lengths[s] - window, int64_t{0}) : 0; };
  // Tasks by sequence, then chunk, then KV head: task_of[s] is sequence s's first. A chunk's KV heads run one after
  // another on a thread: the first fetches every head's rows of its positions (a position's heads lie side by side
  // in the pool; one head's rows alone are a third of SmolLM2's, at a stride, read at ~40% of the machine's read
  // bandwidth), the others find theirs in the cache.
  // Even chunks (chunk_keys_of): 300 keys as 150 and 150, not 256 and 44, which left one of two threads a sixth of
  // the work.
  std::vector<int64_t> task_of(seqs + 1, 0), chunks(seqs), chunk_keys(seqs);
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t keys = lengths[s] - first_of(s);
    chunk_keys[s] = chunk_keys_of(keys);
    chunks[s] = chunk_keys[s] > 0 ? (keys + chunk_keys[s] - 1) / chunk_keys[s] : 0;
    task_of[s + 1] = task_of[s] + kv_heads * chunks[s];
  }
  const int64_t tasks = task_of[seqs];
  const bool split = std::any_of(chunks.begin(), chunks.end(), [](int64_t c) { return c > 1; });
  // Each split task's partial result: per query head its max, total and weighted values.
  std::vector<float> partial(split ? tasks * group * (dim + 2) : 0);
  const auto write = [&](int64_t s, int64_t h, int64_t g, const float* values, float total) {
    T* o = out + (s * heads + h * group + g) * dim;
    const float inv = 1.f / total;
    for (int64_t j = 0; j < dim; ++j) o[j] = static_cast<T>(values[j] * inv);
  };
  // The lines a task of (sequence s, chunk, KV head h) fetches ahead: its share (by KV head) of the positions of the
  // next chunk its thread takes (tasks up to `end`), every KV head's keys and values of each, so that a chunk's
  // tasks fetch all of the next one while they work; nothing where that chunk would not fit in L2 beside this one.
  const int64_t position_bytes = kv_heads * stride_of_row * static_cast<int64_t>(sizeof(KV));
  const auto plan_ahead = [&](Ahead& ahead, int64_t s, int64_t chunk, int64_t h, int64_t end) {
    ahead.lines.clear(), ahead.at = 0;
    if (!fetch_ahead.load(std::memory_order_relaxed)) return;
    const bool last = chunk + 1 == chunks[s];
    const int64_t next = last ? s + 1 : s, next_chunk = last ? 0 : chunk + 1;
    if (next == seqs || task_of[next] + next_chunk * kv_heads >= end) return;
    const int64_t lo = first_of(next) + next_chunk * chunk_keys[next];
    const int64_t n = std::min(chunk_keys[next], lengths[next] - lo);
    if (n <= 0 || 2 * n * position_bytes > kAheadBytes) return;
    const int64_t* table = tables + next * width;
    const int64_t from = lo + h * n / kv_heads, to = lo + (h + 1) * n / kv_heads;
    for (int64_t p = from, block = from / block_size, at = from % block_size; p < to; ++p) {
      const int64_t row = (table[block] * block_size + at) * kv_heads * stride_of_row;
      for (int64_t b = 0; b < position_bytes; b += 64) {
        ahead.lines.push_back(reinterpret_cast<const char*>(k_cache + row) + b);
        ahead.lines.push_back(reinterpret_cast<const char*>(v_cache + row) + b);
      }
      if (++at == block_size) at = 0, ++block;
    }
  };
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    constexpr int64_t stride = kChunk;  // a multiple of 4
    std::vector<float> query(group * dim), result(group * dim), row(dim), max(group), total(group),
        scores(group * stride);
    std::vector<int64_t> rows(kChunk);
    Ahead ahead;
    int64_t s = std::upper_bound(task_of.begin(), task_of.end(), begin) - task_of.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= task_of[s + 1]) ++s;
      const int64_t chunk = (task - task_of[s]) / kv_heads, h = (task - task_of[s]) % kv_heads;
      const int64_t lo = first_of(s) + chunk * chunk_keys[s], n = std::min(chunk_keys[s], lengths[s] - lo);
      const int64_t* table = tables + s * width;
      // Each key's row, block by block: no division a key (a 64-bit divide costs as much as the key's products).
      for (int64_t i = 0, block = lo / block_size, at = lo % block_size; i < n; ++i) {
        rows[i] = ((table[block] * block_size + at) * kv_heads + h) * stride_of_row;
        if (++at == block_size) at = 0, ++block;
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < dim; ++j)
          query[g * dim + j] = static_cast<float>(q[(s * heads + h * group + g) * dim + j]) * scale;
      const bool all_heads = h == 0 && task + kv_heads <= end;  // this thread runs the chunk's other heads next
      const int64_t span = (all_heads ? kv_heads : 1) * stride_of_row * static_cast<int64_t>(sizeof(KV));
      plan_ahead(ahead, s, chunk, h, end);
      const Chunk c{query.data(), group, dim, rows.data(), n, scores.data(), stride, span, &ahead};
      attend_chunk(c, k_cache, v_cache, row.data(), max.data(), total.data(), result.data());
      ahead.fetch(static_cast<int64_t>(ahead.lines.size()));  // what the loops left (the plain ones fetch none)
      if (chunks[s] == 1) {
        for (int64_t g = 0; g < group; ++g) write(s, h, g, result.data() + g * dim, total[g]);
        continue;
      }
      float* part = partial.data() + (task_of[s] + h * chunks[s] + chunk) * group * (dim + 2);
      for (int64_t g = 0; g < group; ++g) {
        part[g * (dim + 2)] = max[g];
        part[g * (dim + 2) + 1] = total[g];
        std::memcpy(part + g * (dim + 2) + 2, result.data() + g * dim, dim * sizeof(float));
      }
    }
  });
  if (!split) return;
  // Merge each split (sequence, KV head)'s chunks, in their order: the softmax over all its keys.
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(dim);
    for (int64_t sh = begin; sh < end; ++sh) {
      const int64_t s = sh / kv_heads, h = sh % kv_heads;
      if (chunks[s] == 1) continue;
      const float* first = partial.data() + (task_of[s] + h * chunks[s]) * group * (dim + 2);
      for (int64_t g = 0; g < group; ++g) {
        const auto at = [&](int64_t c) { return first + (c * group + g) * (dim + 2); };
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks[s]; ++c) top = std::max(top, at(c)[0]);
        float total = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t c = 0; c < chunks[s]; ++c) {
          const float weight = std::exp(at(c)[0] - top);
          total += weight * at(c)[1];
          for (int64_t j = 0; j < dim; ++j) merged[j] += weight * at(c)[2 + j];
        }
        write(s, h, g, merged.data(), total);
      }
    }
  });
}

// The attention ops' queries q [rows, heads, dim] against a pool of caches [blocks, block size, kv heads, dim
// (+ 4: a quantized pool's scale)]: their shapes, layout and dtype agree.
void check_pool(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV pool must be contiguous");
  // which pool dtypes q's rows read: cpu.h's with_pool_type says, as it dispatches
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the k and v pools must share a dtype");
  TORCH_CHECK(tokenmill::pool_dim(k_cache) == q.size(2) && q.size(1) % k_cache.size(2) == 0,
              "heads and the pool disagree");
}

// q: [seqs, heads, dim]; caches: [blocks, block size, kv heads, dim]; tables: [seqs, width] block ids;
// lengths: [seqs] keys per sequence (its new token's included, already written to the pool).
at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& tables_in, const at::Tensor& lengths_in, double scale,
                                  int64_t window) {
  const at::Tensor q = q_in.contiguous();
  const at::Tensor tables = tables_in.to(at::kLong).contiguous();
  const at::Tensor lengths = lengths_in.to(at::kLong).contiguous();
  check_pool(q, k_cache, v_cache);
  const int64_t seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == seqs && lengths.numel() == seqs, "one table and length a query");
  const int64_t width = tables.size(1);
  const int64_t* len = lengths.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs; ++s)
    TORCH_CHECK(len[s] > 0 && len[s] <= width * block_size, "a length outside its block table");
  at::Tensor out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    tokenmill::with_pool_type<scalar_t>(k_cache.scalar_type(), [&](auto pool_type) {
      using KV = decltype(pool_type);
      decode<scalar_t, KV>(q.data_ptr<scalar_t>(), static_cast<const KV*>(k_cache.data_ptr()),
                           static_cast<const KV*>(v_cache.data_ptr()), tables.data_ptr<int64_t>(), len,
                           out.data_ptr<scalar_t>(), seqs, heads, kv_heads, dim, block_size, width,
                           static_cast<float>(scale), window);
    });
  });
  return out;
}

// Sets the switch; returns what it was.
bool set_decode_fetch_ahead(bool on) { return fetch_ahead.exchange(on); }

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
  m.def("set_decode_fetch_ahead(bool on) -> bool", &set_decode_fetch_ahead);
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
