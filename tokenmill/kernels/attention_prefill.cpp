// Prefill attention straight from the paged KV pool, flash-attention's loop on the CPU: a task takes a tile of a
// prompt chunk's rows for one KV head (its group of query heads together) and walks the keys they see, the cached
// prefix and the chunk itself, a tile of keys at a time, widened into scratch once for the whole group; scores of a
// tile of keys are an outer product in registers, and the softmax is carried from tile to tile (running max and
// sum), so no [rows, keys] matrix, gathered copy of the keys or mask is ever built (torch's path does all three).
// Causal, and a sliding window (Gemma 3) which skips the key tiles no row of the task sees. bf16 rows on a CPU with
// AVX512-BF16 multiply as bf16 pairs (vdpbf16ps): the queries and keys as they are, the softmax's weights rounded to
// bf16 for the values' products, as torch's own CPU flash attention rounds them for a bf16 model; fp32 sums. Where
// the pairs are slower than fp32 multiply-adds (Intel's cores run vdpbf16ps on one port, FMAs on two; backend.py
// measures it once), the caller asks for the fp32 tiles instead (pairs=false). On a CPU with AMX (tiles=true) the
// same products run on the tile unit (tdpbf16ps, 16 x 16 x 32 a instruction), the softmax lane-wise between them as
// on the pairs, its max moved lazily. A quantized pool's rows (cpu.h) are widened with their scales into the fp32
// tiles.

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

#if defined(TOKENMILL_VEC)
using tokenmill::Vec;
using F = Vec::F;

constexpr int64_t kKeys = 64;  // keys a tile
// On AMX tiles: the values' products load and store their sums' tiles once a key tile, so a longer tile means less
// of that traffic (docs/performance has the measurement).
constexpr int64_t kTileKeys = 128;
constexpr int64_t kRows = 32;  // prompt rows a task
// A step of the products: kStep keys (or dims of the values) by up to kSlab vectors of queries, their sums in
// registers; each vector loaded feeds kStep multiply-adds and each broadcast kSlab (a load a multiply-add, at
// most, on CPUs that load one 512-bit vector a cycle).
#if defined(__AVX512F__)
constexpr int kStep = 8, kSlab = 3;  // 24 sums, 3 queries and a broadcast of the 32 registers
#else
constexpr int kStep = 4, kSlab = 2;  // 8 sums of the 16
#endif

// What one task works in (a thread's, reused from task to task). The task's queries, its rows' heads, lie across the
// vector lanes (query m: row m / group, head m % group, up to a padded count): the softmax's max, sums and rescaling
// are then lane-wise, in vector registers, for every query at once.
struct Scratch {
  int64_t lanes;              // queries, padded to whole vectors
  std::vector<float> query;   // [dim, lanes], scaled
  std::vector<float> out;     // [dim, lanes]: the weighted values so far
  std::vector<float> keys;    // [kKeys, dim]: the key tile, widened (zeros past its last key, to a multiple of kStep)
  std::vector<float> values;  // [kKeys, dim]
  std::vector<float> scores;  // [kKeys (kTileKeys on tiles), lanes]: scores, then weights
  std::vector<float> max, total;  // [lanes]
  std::vector<float> shrink;      // [lanes]: how much this tile's new max shrinks the weighted values so far
  // bf16 rows on a CPU with vdpbf16ps (pairs of bf16 as one 32-bit lane, summed two products at a time):
  std::vector<uint32_t> query_pairs;  // [dim / 2, lanes]: dims 2d and 2d + 1 of each query, unscaled
  std::vector<uint32_t> key_pairs;    // [kKeys (kTileKeys), dim / 2]: the key tile's rows as the pool holds them
  std::vector<uint32_t> value_pairs;  // [kKeys / 2, dim]: dim d of keys 2j and 2j + 1
  std::vector<uint32_t> weight_pairs; // [kKeys (kTileKeys) / 2, lanes]: the weights of keys 2j and 2j + 1, in bf16
  // On AMX tiles: the value tile transposed, [dim, kTileKeys] bf16 (an A tile's rows are dims, its columns keys).
  std::vector<uint16_t> values_t;

  // lane_multiple: the queries are padded to a multiple of it (16 lanes a vector; 32 for the tiles' pairs of tiles)
  Scratch(int64_t queries, int64_t dim, int64_t lane_multiple)
      : lanes((queries + lane_multiple - 1) / lane_multiple * lane_multiple), query(dim * lanes), out(dim * lanes),
        keys(kKeys * dim), values(kKeys * dim), scores(kTileKeys * lanes), max(lanes), total(lanes), shrink(lanes),
        query_pairs(dim / 2 * lanes), key_pairs(kTileKeys * dim / 2), value_pairs(kKeys / 2 * dim),
        weight_pairs(kTileKeys / 2 * lanes), values_t(dim * kTileKeys) {}
};

// What a task multiplies on: fp32 multiply-adds (any pool), bf16 pairs (vdpbf16ps), or AMX tiles (tdpbf16ps).
enum class On { fp32, pairs, tiles };

// v stays in a register: GCC otherwise folds a vector used by kStep multiply-adds into each as a memory operand,
// kStep loads where one does, and on AVX2 the products' loops were bound by those loads (docs/performance: Zen 3,
// 2026-12-07). Not measured with AVX-512's 32 registers: left to the compiler there.
inline void in_register(F& v) {
#if defined(__GNUC__) && !defined(__AVX512F__)
  asm("" : "+x"(v));
#else
  (void)v;
#endif
}

// scores[j, V vectors of queries from v0] for keys j0..j0+kStep-1: per dim, kStep broadcast key values against the
// queries.
template <int V>
void score(Scratch& w, int64_t j0, int64_t v0, int64_t dim) {
  F acc[kStep][V];
  for (int k = 0; k < kStep; ++k)
    for (int v = 0; v < V; ++v) acc[k][v] = Vec::zero();
  const float* key = w.keys.data() + j0 * dim;
  for (int64_t d = 0; d < dim; ++d) {
    F q[V];
    for (int v = 0; v < V; ++v) {
      q[v] = Vec::load(w.query.data() + d * w.lanes + (v0 + v) * Vec::kLanes);
      in_register(q[v]);
    }
    for (int k = 0; k < kStep; ++k) {
      const F b = Vec::set1(key[k * dim + d]);
      for (int v = 0; v < V; ++v) acc[k][v] = Vec::fma(b, q[v], acc[k][v]);
    }
  }
  for (int k = 0; k < kStep; ++k)
    for (int v = 0; v < V; ++v) Vec::store(w.scores.data() + (j0 + k) * w.lanes + (v0 + v) * Vec::kLanes, acc[k][v]);
}

// out[dims d0..d0+kStep-1, V vectors of queries from v0] = out x shrink + the weights of `keys` keys times their
// values.
template <int V>
void add_values(Scratch& w, int64_t d0, int64_t v0, int64_t keys, int64_t dim) {
  F acc[kStep][V];
  for (int k = 0; k < kStep; ++k)
    for (int v = 0; v < V; ++v)
      acc[k][v] = Vec::mul(Vec::load(w.out.data() + (d0 + k) * w.lanes + (v0 + v) * Vec::kLanes),
                           Vec::load(w.shrink.data() + (v0 + v) * Vec::kLanes));
  for (int64_t j = 0; j < keys; ++j) {
    F p[V];
    for (int v = 0; v < V; ++v) {
      p[v] = Vec::load(w.scores.data() + j * w.lanes + (v0 + v) * Vec::kLanes);
      in_register(p[v]);
    }
    for (int k = 0; k < kStep; ++k) {
      const F b = Vec::set1(w.values[j * dim + d0 + k]);
      for (int v = 0; v < V; ++v) acc[k][v] = Vec::fma(b, p[v], acc[k][v]);
    }
  }
  for (int k = 0; k < kStep; ++k)
    for (int v = 0; v < V; ++v) Vec::store(w.out.data() + (d0 + k) * w.lanes + (v0 + v) * Vec::kLanes, acc[k][v]);
}

#if defined(__AVX512BF16__)
#define TOKENMILL_DPBF16_ATTENTION 1
// The same products as score and add_values on bf16 pairs, each vdpbf16ps two multiply-adds a lane (the products
// of two bf16 exact in fp32, summed in fp32): half the instructions, and the keys read as the pool holds them.

// scores[j, V vectors of queries from v0] for keys j0..j0+kStep-1, times scale (the queries are not prescaled: a
// scaled query would round again to bf16).
template <int V>
void score_pairs(Scratch& w, int64_t j0, int64_t v0, int64_t dim, float scale) {
  __m512 acc[kStep][V];
  for (int k = 0; k < kStep; ++k)
    for (int v = 0; v < V; ++v) acc[k][v] = _mm512_setzero_ps();
  const uint32_t* key = w.key_pairs.data() + j0 * (dim / 2);
  for (int64_t d = 0; d < dim / 2; ++d) {
    __m512bh q[V];
    for (int v = 0; v < V; ++v)
      q[v] = (__m512bh)_mm512_loadu_si512(w.query_pairs.data() + d * w.lanes + (v0 + v) * Vec::kLanes);
    for (int k = 0; k < kStep; ++k) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(key[k * (dim / 2) + d]));
      for (int v = 0; v < V; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], b, q[v]);
    }
  }
  for (int k = 0; k < kStep; ++k)
    for (int v = 0; v < V; ++v)
      _mm512_storeu_ps(w.scores.data() + (j0 + k) * w.lanes + (v0 + v) * Vec::kLanes,
                       _mm512_mul_ps(acc[k][v], _mm512_set1_ps(scale)));
}

// out[dims d0..d0+kStep-1, V vectors of queries from v0] = out x shrink + the weights of `pairs` pairs of keys times
// their values.
template <int V>
void add_value_pairs(Scratch& w, int64_t d0, int64_t v0, int64_t pairs, int64_t dim) {
  __m512 acc[kStep][V];
  for (int k = 0; k < kStep; ++k)
    for (int v = 0; v < V; ++v)
      acc[k][v] = Vec::mul(Vec::load(w.out.data() + (d0 + k) * w.lanes + (v0 + v) * Vec::kLanes),
                           Vec::load(w.shrink.data() + (v0 + v) * Vec::kLanes));
  for (int64_t j = 0; j < pairs; ++j) {
    __m512bh p[V];
    for (int v = 0; v < V; ++v)
      p[v] = (__m512bh)_mm512_loadu_si512(w.weight_pairs.data() + j * w.lanes + (v0 + v) * Vec::kLanes);
    for (int k = 0; k < kStep; ++k) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w.value_pairs[j * dim + d0 + k]));
      for (int v = 0; v < V; ++v) acc[k][v] = _mm512_dpbf16_ps(acc[k][v], b, p[v]);
    }
  }
  for (int k = 0; k < kStep; ++k)
    for (int v = 0; v < V; ++v) Vec::store(w.out.data() + (d0 + k) * w.lanes + (v0 + v) * Vec::kLanes, acc[k][v]);
}

// The bits of v's 16 lanes rounded to bf16 (to nearest, ties to even), each in the low half of a 32-bit lane.
inline __m512i bf16_lanes(__m512 v) { return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)); }
#endif

#if defined(TOKENMILL_AMX)
// The same products on AMX tiles (16 x 16 x 32 bf16 products a tdpbf16ps, fp32 sums), the operands in the layouts the
// pairs use: scores^T = the key rows (A) x query_pairs (B), out^T += values^T (A) x weight_pairs (B). C tiles go 2 x 2
// (tiles 0..3: C[2a + b] of A a and B b), A tiles 4..5, B tiles 6..7, so each tile loaded feeds two products.

// A step of the 2 x 2 products: A tiles at a0 and a1 (16 rows each, a_stride bytes apart), B tiles at b and 16
// lanes on (b_stride bytes a row).
inline void products_2x2(const void* a0, const void* a1, int64_t a_stride, const uint32_t* b, int64_t b_stride) {
  _tile_loadd(4, a0, a_stride);
  _tile_loadd(5, a1, a_stride);
  _tile_loadd(6, b, b_stride);
  _tile_loadd(7, b + 16, b_stride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// The C tiles of c[32 rows, 32 lanes] (a row `lanes` floats long): stored there, or loaded from there (kLoad).
template <bool kLoad>
inline void sums_2x2(float* c, int64_t lanes) {
  const int64_t stride = lanes * 4, below = 16 * lanes;
  if constexpr (kLoad) {
    _tile_loadd(0, c, stride);
    _tile_loadd(1, c + 16, stride);
    _tile_loadd(2, c + below, stride);
    _tile_loadd(3, c + below + 16, stride);
  } else {
    _tile_stored(0, c, stride);
    _tile_stored(1, c + 16, stride);
    _tile_stored(2, c + below, stride);
    _tile_stored(3, c + below + 16, stride);
  }
}

// scores[keys, lanes] (unscaled) of the key tile's first `keys` rows (key_pairs; a multiple of 32) and the queries.
void tile_scores(Scratch& w, int64_t keys, int64_t dim) {
  const int64_t pairs = dim / 2, lanes = w.lanes;
  for (int64_t j = 0; j < keys; j += 32)
    for (int64_t m = 0; m < lanes; m += 32) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t d = 0; d < pairs; d += 16)  // 16 pairs of dims a step
        products_2x2(w.key_pairs.data() + j * pairs + d, w.key_pairs.data() + (j + 16) * pairs + d, dim * 2,
                     w.query_pairs.data() + d * lanes + m, lanes * 4);
      sums_2x2<false>(w.scores.data() + j * lanes + m, lanes);
    }
}

// out[dim, lanes] += values_t[dim, keys] x weight_pairs[keys / 2, lanes] (keys a multiple of 32).
void tile_values(Scratch& w, int64_t keys, int64_t dim) {
  const int64_t lanes = w.lanes;
  const uint16_t* vt = w.values_t.data();
  for (int64_t d = 0; d < dim; d += 32)
    for (int64_t m = 0; m < lanes; m += 32) {
      float* out = w.out.data() + d * lanes + m;
      sums_2x2<true>(out, lanes);
      for (int64_t j = 0; j < keys; j += 32)
        products_2x2(vt + d * kTileKeys + j, vt + (d + 16) * kTileKeys + j, kTileKeys * 2,
                     w.weight_pairs.data() + (j / 2) * lanes + m, lanes * 4);
      sums_2x2<false>(out, lanes);
    }
}

// A lane's max rises only when a tile's exceeds it by more than this (natural log): its weights stay below e^8, and
// most tiles leave every lane's max, and so the values so far, as they are (flash-attention 4's lazy rescaling).
constexpr float kLazyRise = 8.f;

// The online softmax of the key tile's scores (unscaled, `keys` of them), lane-wise, lazily; the weights rounded to
// bf16 straight into weight_pairs (keys 2j and 2j + 1 a pair; zeros to `padded` keys): whether any lane's max rose
// (then the values so far shrink by w.shrink).
bool tile_softmax(Scratch& w, int64_t keys, int64_t padded, float scale) {
  const F factor = Vec::set1(scale), ninf = Vec::set1(-std::numeric_limits<float>::infinity());
  const auto weight = [&](int64_t j, int64_t at, F now) {
    return j < keys ? Vec::exp_or_zero(Vec::mul(Vec::load(w.scores.data() + j * w.lanes + at), factor), now)
                    : Vec::zero();
  };
  __mmask16 rose = 0;
  for (int64_t at = 0; at < w.lanes; at += Vec::kLanes) {
    const F old = Vec::load(w.max.data() + at);
    F tops[4] = {ninf, ninf, ninf, ninf};  // four chains of maxes, of unscaled scores
    int64_t i = 0;
    for (; i + 4 <= keys; i += 4)
      for (int k = 0; k < 4; ++k) tops[k] = Vec::max(tops[k], Vec::load(w.scores.data() + (i + k) * w.lanes + at));
    for (; i < keys; ++i) tops[0] = Vec::max(tops[0], Vec::load(w.scores.data() + i * w.lanes + at));
    const F top = Vec::mul(Vec::max(Vec::max(tops[0], tops[1]), Vec::max(tops[2], tops[3])), factor);
    const __mmask16 rise = _mm512_cmp_ps_mask(top, Vec::add(old, Vec::set1(kLazyRise)), _CMP_GT_OQ);
    const F now = _mm512_mask_blend_ps(rise, old, top);
    rose |= rise;
    F sum = Vec::zero();
    for (int64_t j = 0; j < padded; j += 2) {
      const F first = weight(j, at, now), second = weight(j + 1, at, now);
      sum = Vec::add(sum, Vec::add(first, second));
      _mm512_storeu_si512(w.weight_pairs.data() + j / 2 * w.lanes + at, tokenmill::bf16_pairs(first, second));
    }
    const F shrink = Vec::rescale(old, now);
    Vec::store(w.max.data() + at, now);
    Vec::store(w.total.data() + at, Vec::fma(Vec::load(w.total.data() + at), shrink, sum));
    Vec::store(w.shrink.data() + at, shrink);
  }
  return rose != 0;
}

// r[0..15], 16 rows of 16 32-bit lanes, transposed in place: unpacks of 32 and 64 bits transpose the 4 x 4 blocks
// within each 128-bit lane, then shuffles of 128-bit lanes put the blocks in place.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int g = 0; g < 16; g += 4) {
    t[g] = _mm512_unpacklo_epi32(r[g], r[g + 1]);
    t[g + 1] = _mm512_unpackhi_epi32(r[g], r[g + 1]);
    t[g + 2] = _mm512_unpacklo_epi32(r[g + 2], r[g + 3]);
    t[g + 3] = _mm512_unpackhi_epi32(r[g + 2], r[g + 3]);
  }
  for (int g = 0; g < 16; g += 4) {  // r[g + e]: lane L holds rows g..g+3 of column 4L + e
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {  // column 4L + e: lane L of r[e], r[4 + e], r[8 + e], r[12 + e]
    const __m512i low_ab = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44);
    const __m512i high_ab = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
    const __m512i low_cd = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
    const __m512i high_cd = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
    t[e] = _mm512_shuffle_i32x4(low_ab, low_cd, 0x88);
    t[4 + e] = _mm512_shuffle_i32x4(low_ab, low_cd, 0xDD);
    t[8 + e] = _mm512_shuffle_i32x4(high_ab, high_cd, 0x88);
    t[12 + e] = _mm512_shuffle_i32x4(high_ab, high_cd, 0xDD);
  }
  for (int c = 0; c < 16; ++c) r[c] = t[c];
}

// values_t[dim, kTileKeys] = the tile's values transposed: key j's value row at v_cache + row_of(j) for j < keys, zeros
// from there to `padded` (a multiple of 32). Rows of 16 pairs of dims are transposed as 32-bit lanes, then each pair's
// two dims split into rows of their own.
template <typename RowOf>
void transpose_values(Scratch& w, const at::BFloat16* v_cache, RowOf row_of, int64_t keys, int64_t padded,
                      int64_t dim) {
  static const auto words = [] {
    struct { uint16_t even[32], odd[32]; } index{};
    for (int i = 0; i < 32; ++i) index.even[i] = 2 * i, index.odd[i] = 2 * i + 1;
    return index;
  }();
  const __m512i even = _mm512_loadu_si512(words.even), odd = _mm512_loadu_si512(words.odd);
  for (int64_t j = 0; j < padded; j += 32)
    for (int64_t p = 0; p < dim / 2; p += 16) {  // the pairs of dims 2p..2p+31
      __m512i first[16], second[16];  // keys j.. and j + 16..
      for (int r = 0; r < 16; ++r) {
        first[r] = j + r < keys ? _mm512_loadu_si512(v_cache + row_of(j + r) + 2 * p) : _mm512_setzero_si512();
        second[r] = j + 16 + r < keys ? _mm512_loadu_si512(v_cache + row_of(j + 16 + r) + 2 * p)
                                      : _mm512_setzero_si512();
      }
      transpose16(first);
      transpose16(second);
      for (int c = 0; c < 16; ++c) {
        uint16_t* row = w.values_t.data() + 2 * (p + c) * kTileKeys + j;
        _mm512_storeu_si512(row, _mm512_permutex2var_epi16(first[c], even, second[c]));
        _mm512_storeu_si512(row + kTileKeys, _mm512_permutex2var_epi16(first[c], odd, second[c]));
      }
    }
}
#endif

// f(v0, V) over the task's vectors of queries in slabs of at most kSlab, as even as they split (4: 2 and 2, not 3
// and 1, whose single vector was bound by the key broadcasts); V a std::integral_constant.
template <typename Fn>
void by_slabs(int64_t vectors, Fn&& f) {
  const int64_t slabs = (vectors + kSlab - 1) / kSlab;
  for (int64_t s = 0, v0 = 0; s < slabs; ++s) {
    const int64_t size = (vectors - v0) / (slabs - s);
    tokenmill::with_count<kSlab>(size, [&](auto v) { f(v0, v); });
    v0 += size;
  }
}

// A row of the pool as fp32 into dst (dim a multiple of the vector's lanes), times its scale where it has one.
template <typename KV>
void widen_row(const KV* src, float* dst, int64_t dim) {
  if constexpr (tokenmill::kQuantizedPool<KV>) {
    const F scale = Vec::set1(tokenmill::row_scale(src, dim));
    for (int64_t d = 0; d < dim; d += Vec::kLanes) Vec::store(dst + d, Vec::mul(Vec::load(src + d), scale));
  } else {
    for (int64_t d = 0; d < dim; d += Vec::kLanes) Vec::store(dst + d, Vec::load(src + d));
  }
}

// One task: rows r0..r0+n of the chunk (positions start + r0 ...), KV head h, its group of query heads.
template <On kOn, typename T, typename KV>
void prefill_task(Scratch& w, const T* q, const KV* k_cache, const KV* v_cache, const int64_t* table, int64_t r0,
                  int64_t n, int64_t start, int64_t h, int64_t heads, int64_t kv_heads, int64_t dim,
                  int64_t block_size, float scale, int64_t window, T* out) {
  const int64_t group = heads / kv_heads, queries = n * group, vectors = w.lanes / Vec::kLanes;
  const float ninf = -std::numeric_limits<float>::infinity();
  constexpr bool kPairs = kOn == On::pairs, kTiles = kOn == On::tiles;
  if constexpr (kPairs || kTiles) {
    std::fill(w.query_pairs.begin(), w.query_pairs.end(), 0u);
    for (int64_t m = 0; m < queries; ++m) {
      const T* src = q + ((r0 + m / group) * heads + h * group + m % group) * dim;
      for (int64_t d = 0; d < dim / 2; ++d)
        w.query_pairs[d * w.lanes + m] = src[2 * d].x | static_cast<uint32_t>(src[2 * d + 1].x) << 16;
    }
  } else {
    std::fill(w.query.begin(), w.query.end(), 0.f);  // the padding lanes: zero queries, discarded
    for (int64_t m = 0; m < queries; ++m) {
      const T* src = q + ((r0 + m / group) * heads + h * group + m % group) * dim;
      for (int64_t d = 0; d < dim; ++d) w.query[d * w.lanes + m] = static_cast<float>(src[d]) * scale;
    }
  }
  std::fill(w.out.begin(), w.out.end(), 0.f);
  std::fill(w.max.begin(), w.max.end(), ninf);
  std::fill(w.total.begin(), w.total.end(), 0.f);
  const int64_t first_row = start + r0, last_row = start + r0 + n - 1;  // positions
  const int64_t first_key = window > 0 ? std::max<int64_t>(first_row - window + 1, 0) : 0;
  constexpr int64_t kTile = kTiles ? kTileKeys : kKeys;
  for (int64_t k0 = first_key; k0 <= last_row; k0 += kTile) {
    const int64_t keys = std::min(kTile, last_row + 1 - k0), padded = (keys + kStep - 1) / kStep * kStep;
    // the tiles take keys 32 at a time (a tile's depth in bf16): zero keys and values past the last
    const int64_t padded_32 = (keys + 31) / 32 * 32;
    const auto row_of = [&](int64_t j) {
      const int64_t p = k0 + j;
      return ((table[p / block_size] * block_size + p % block_size) * kv_heads + h) * dim;
    };
    if constexpr (kPairs || kTiles) {  // the keys' rows as they are, zeros past the last
      for (int64_t j = 0; j < keys; ++j)
        std::memcpy(w.key_pairs.data() + j * (dim / 2), k_cache + row_of(j), dim * sizeof(KV));
      std::fill(w.key_pairs.begin() + keys * (dim / 2), w.key_pairs.begin() + (kTiles ? padded_32 : padded) * (dim / 2),
                0u);
    }
    if constexpr (kTiles) {
#if defined(TOKENMILL_AMX)
      transpose_values(w, v_cache, row_of, keys, padded_32, dim);
      tile_scores(w, padded_32, dim);
#endif
    } else if constexpr (kPairs) {
#if defined(TOKENMILL_DPBF16_ATTENTION)
      // the values' dims paired across keys 2j and 2j + 1 (a last odd key's partner 0)
      for (int64_t j = 0; j < keys; j += 2) {
        const KV* first = v_cache + row_of(j);
        const KV* second = j + 1 < keys ? v_cache + row_of(j + 1) : nullptr;
        for (int64_t d = 0; d < dim; d += Vec::kLanes) {
          const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + d)));
          const __m512i high = second ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                            reinterpret_cast<const __m256i*>(second + d)))
                                      : _mm512_setzero_si512();
          _mm512_storeu_si512(w.value_pairs.data() + (j / 2) * dim + d,
                              _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
        }
      }
      for (int64_t j = 0; j < padded; j += kStep)
        by_slabs(vectors, [&](int64_t v0, auto v) { score_pairs<decltype(v)::value>(w, j, v0, dim, scale); });
#endif
    } else {
      for (int64_t j = 0; j < keys; ++j) {
        const int64_t p = k0 + j;
        const int64_t row =
            ((table[p / block_size] * block_size + p % block_size) * kv_heads + h) * tokenmill::row_stride<KV>(dim);
        widen_row(k_cache + row, w.keys.data() + j * dim, dim);
        widen_row(v_cache + row, w.values.data() + j * dim, dim);
      }
      std::fill(w.keys.begin() + keys * dim, w.keys.begin() + padded * dim, 0.f);
      for (int64_t j = 0; j < padded; j += kStep)
        by_slabs(vectors, [&](int64_t v0, auto v) { score<decltype(v)::value>(w, j, v0, dim); });
    }
    // Scores a query may not see: keys after its row, or (a window) too far before it. Every query of the task sees
    // all of a tile that ends at or before its first row and, with a window, starts within it of its last row.
    const bool whole = k0 + keys - 1 <= first_row && (window <= 0 || last_row - k0 < window);
    if (!whole) {  // by row, then its group of heads (query m = row * group + head): no division a score
      for (int64_t j = 0; j < keys; ++j)
        for (int64_t r = 0; r < n; ++r) {
          const int64_t position = first_row + r, key = k0 + j;
          if (key > position || (window > 0 && position - key >= window))
            std::fill_n(w.scores.data() + j * w.lanes + r * group, group, ninf);
        }
    }
    // The online softmax, lane-wise: the tile's max, the sums so far rescaled to it, the tile's weights.
    bool rescale = false;  // whether any lane's values so far shrink (on tiles: a pass over them)
    if constexpr (kTiles) {
#if defined(TOKENMILL_AMX)
      rescale = tile_softmax(w, keys, padded_32, scale);
#endif
    } else {
      for (int64_t v = 0; v < vectors; ++v) {
        const int64_t at = v * Vec::kLanes;
        const F old = Vec::load(w.max.data() + at);
        // Four running maxes: one was a chain of dependent maxes, a key each (the max is exact whatever the order).
        F tops[4] = {old, old, old, old};
        int64_t i = 0;
        for (; i + 4 <= keys; i += 4)
          for (int k = 0; k < 4; ++k) tops[k] = Vec::max(tops[k], Vec::load(w.scores.data() + (i + k) * w.lanes + at));
        for (; i < keys; ++i) tops[0] = Vec::max(tops[0], Vec::load(w.scores.data() + i * w.lanes + at));
        const F top = Vec::max(Vec::max(tops[0], tops[1]), Vec::max(tops[2], tops[3]));
        const F shrink = Vec::rescale(old, top);
        F sum = Vec::zero();
        for (int64_t j = 0; j < keys; ++j) {
          const F p = Vec::exp_or_zero(Vec::load(w.scores.data() + j * w.lanes + at), top);
          Vec::store(w.scores.data() + j * w.lanes + at, p);
          sum = Vec::fma(Vec::set1(1.f), p, sum);
        }
        Vec::store(w.max.data() + at, top);
        Vec::store(w.total.data() + at, Vec::fma(Vec::load(w.total.data() + at), shrink, sum));
        Vec::store(w.shrink.data() + at, shrink);  // the values' pass scales what it loads (a pass over out saved)
      }
    }
    if constexpr (kTiles) {
#if defined(TOKENMILL_AMX)
      for (int64_t d = 0; rescale && k0 > first_key && d < dim; ++d)  // the values so far, to the new max
        for (int64_t v = 0; v < vectors; ++v) {
          float* at = w.out.data() + d * w.lanes + v * Vec::kLanes;
          Vec::store(at, Vec::mul(Vec::load(at), Vec::load(w.shrink.data() + v * Vec::kLanes)));
        }
      tile_values(w, padded_32, dim);
#endif
    } else if constexpr (kPairs) {
#if defined(TOKENMILL_DPBF16_ATTENTION)
      const int64_t pairs = (keys + 1) / 2;
      for (int64_t j = 0; j < pairs; ++j)
        for (int64_t v = 0; v < vectors; ++v) {
          const int64_t at = v * Vec::kLanes;
          const __m512i first = bf16_lanes(Vec::load(w.scores.data() + 2 * j * w.lanes + at));
          const __m512i second = 2 * j + 1 < keys
                                     ? bf16_lanes(Vec::load(w.scores.data() + (2 * j + 1) * w.lanes + at))
                                     : _mm512_setzero_si512();
          _mm512_storeu_si512(w.weight_pairs.data() + j * w.lanes + at,
                              _mm512_or_si512(first, _mm512_slli_epi32(second, 16)));
        }
      for (int64_t d = 0; d < dim; d += kStep)
        by_slabs(vectors, [&](int64_t v0, auto v) { add_value_pairs<decltype(v)::value>(w, d, v0, pairs, dim); });
#endif
    } else {
      for (int64_t d = 0; d < dim; d += kStep)
        by_slabs(vectors, [&](int64_t v0, auto v) { add_values<decltype(v)::value>(w, d, v0, keys, dim); });
    }
  }
  for (int64_t m = 0; m < queries; ++m) {
    const float inv = 1.f / w.total[m];
    T* o = out + ((r0 + m / group) * heads + h * group + m % group) * dim;
    for (int64_t d = 0; d < dim; ++d) o[d] = static_cast<T>(w.out[d * w.lanes + m] * inv);
  }
}

// Tasks (KV head, tile of rows), the costliest first (the last rows see the most keys), taken by the threads as
// they free up: causal tiles differ in cost, and an even split of them in order left one thread idle.
// kOn: pairs and tiles for bf16 rows and pool, on a CPU with AVX512-BF16 or AMX.
template <On kOn, typename T, typename KV>
void prefill(const T* q, const KV* k_cache, const KV* v_cache, const int64_t* table, int64_t n, int64_t start,
             T* out, int64_t heads, int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window) {
  const int64_t tiles = (n + kRows - 1) / kRows, tasks = tiles * kv_heads;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    // dim: a multiple of the lanes and of kStep (of 32 on tiles)
    Scratch w(kRows * (heads / kv_heads), dim, kOn == On::tiles ? 32 : Vec::kLanes);
#if defined(TOKENMILL_AMX)
    if constexpr (kOn == On::tiles) tokenmill::configure_tiles();
#endif
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t tile = tiles - 1 - task / kv_heads, h = task % kv_heads;
      const int64_t r0 = tile * kRows;
      prefill_task<kOn>(w, q, k_cache, v_cache, table, r0, std::min(kRows, n - r0), start, h, heads, kv_heads, dim,
                        block_size, scale, window, out);
    }
#if defined(TOKENMILL_AMX)
    if constexpr (kOn == On::tiles) _tile_release();
#endif
  });
}
#endif

// q: [n, heads, dim], a prompt chunk's rows at positions start..start+n-1, their K/V already in the pool; caches:
// [blocks, block size, kv heads, dim]; table: the sequence's block ids. window > 0: row i sees key j where
// 0 <= i - j < window. Each row sees its keys up to itself. pairs: bf16 rows and pool multiply as bf16 pairs where
// the CPU has AVX512-BF16 (else, and for other dtypes, fp32 tiles); tiles: bf16 rows and pool (of a head dim of a
// multiple of 32) on AMX tiles where this build and process have them (else as pairs says).
at::Tensor paged_prefill_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& table_in, int64_t start, double scale, int64_t window,
                                   bool pairs, bool tiles) {
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = table_in.to(at::kLong).contiguous();
  check_pool(q, k_cache, v_cache);  // attention.cpp's
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(table.dim() == 1 && start >= 0 && start + n <= table.numel() * block_size,
              "the rows' positions run past their block table");
  const int64_t* blocks = table.data_ptr<int64_t>();
  const int64_t needed = (start + n + block_size - 1) / block_size;
  for (int64_t b = 0; b < needed; ++b)
    TORCH_CHECK(blocks[b] >= 0 && blocks[b] < k_cache.size(0), "a block outside the pool");
#if defined(TOKENMILL_VEC)
  const at::ScalarType type = q.scalar_type();
  if (dim % Vec::kLanes == 0 && (type == at::kFloat || type == at::kBFloat16 || type == at::kHalf)) {
    at::Tensor out = at::empty_like(q);
    if (n == 0) return out;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "paged_prefill_attention", [&] {
      if constexpr (!std::is_same_v<scalar_t, double>) {
        tokenmill::with_pool_type<scalar_t>(k_cache.scalar_type(), [&](auto pool_type) {
          using KV = decltype(pool_type);
          const auto run = [&](auto on) {
            prefill<decltype(on)::value>(q.data_ptr<scalar_t>(), static_cast<const KV*>(k_cache.data_ptr()),
                                               static_cast<const KV*>(v_cache.data_ptr()), blocks, n, start,
                                               out.data_ptr<scalar_t>(), heads, kv_heads, dim, block_size,
                                               static_cast<float>(scale), window);
          };
          if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<KV, at::BFloat16>) {
#if defined(TOKENMILL_AMX)
            if (tiles && dim % 32 == 0 && tokenmill::tiles_available())
              return run(std::integral_constant<On, On::tiles>{});
#endif
#if defined(TOKENMILL_DPBF16_ATTENTION)
            if (pairs) return run(std::integral_constant<On, On::pairs>{});
#endif
          }
          run(std::integral_constant<On, On::fp32>{});
        });
      }
    });
    return out;
  }
#endif
  // Without vector registers (or of a head dim they do not divide): each row as a decode row over its keys.
  const at::Tensor tables = table.narrow(0, 0, needed).unsqueeze(0).expand({n, needed}).contiguous();
  const at::Tensor lengths = at::arange(start + 1, start + n + 1, table.options());
  return paged_decode_attention(q, k_cache, v_cache, tables, lengths, scale, window);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, int start, float scale, "
        "int window=0, bool pairs=True, bool tiles=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("paged_prefill_attention", &paged_prefill_attention); }
