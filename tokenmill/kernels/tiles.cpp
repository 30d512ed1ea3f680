// The quantized matmul on AMX tiles (Sapphire Rapids and later), for steps of many rows: each thread dequantizes a
// panel of 32 output rows to bf16 in its cache, once, and the tile unit multiplies every activation row by it.
//
// The integer kernel of quant.cpp spends a few vector instructions per weight and activation row: at 32 rows and
// more it is bound by them (~50 multiply-adds a cycle a core on Sapphire Rapids). Here the vector work is the
// dequantization, ~10 instructions per 32 weights whatever the rows, and the products run on the tile unit (a bf16
// 16x16x32 product a tile instruction). What bounds it on a 2-core Sapphire Rapids VM is loading the tiles: ~16 ns a
// tile (three products' time, measured) and one load a product with 2 x 2 accumulators, the most 8 tiles allow.
// There a 1.1B model's gate|up took 2.0 ms at 32 rows against the integer kernel's 2.7, 26 ms at 512 against 51.
// The weights are rounded to bf16 as a dense bf16 copy's would be (w = scale * (q - zero) + shift in fp32, rounded
// once), the activations to bf16 too: the numbers of a bf16 model's dense matmul, without the copy in memory.
//
// A B tile holds 16 pairs of weights for each of 16 output rows (a 32-bit lane each); the pairs are chosen to be
// cheap to unpack from the interleaved layout (quant.cpp), and the activations are permuted within each block of 32
// to match: B tile row r = 4c + i holds weights first(r) and first(r) + 2 of the block, with
// first(r) = 4c + (i >> 1) + 16 (i & 1) (cpu.h's pair_first). bf16 weights (16 bits) are stored as those tiles
// already: the products read them where they lie.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu.h"

#if defined(TOKENMILL_AMX)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(TOKENMILL_AMX)
constexpr int64_t kBlock = 32;   // weights per quantization block: one tile's depth in bf16
constexpr int64_t kLanes = tokenmill::kInterleave;  // output rows of a group: one B tile's width
constexpr int64_t kTile = 16;    // activation rows of an A or C tile
constexpr int64_t kTileBytes = kTile * 64;

// Tile registers (cpu.h's TileConfig): C 0..3 (activation tile m, group n at 2m + n), A 4..5, B 6..7.

// Tile row `row` = bf16(scale * q + offset) of E (the pairs' first weights) and O (their second ones) of the 16
// output rows, as int32 lanes; a lane's two bf16 values side by side.
struct PairWriter {
  uint16_t* tile;
  void operator()(int row, __m512i e, __m512i o, __m512 scale, __m512 offset) const {
    const __m512 ef = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), scale, offset);
    const __m512 of = _mm512_fmadd_ps(_mm512_cvtepi32_ps(o), scale, offset);
    _mm512_storeu_si512(tile + row * 32, tokenmill::bf16_pairs(ef, of));
  }
};

inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 4-bit chunk c's tile rows 4c..4c+3: lane byte j holds weight 4c + j in its low nibble, 16 + 4c + j in its high one;
// row 4c + i pairs the nibbles of bytes i >> 1 and (i >> 1) + 2, low ones for i even, high ones for i odd.
// 5- and 6-bit: the bits above those nibbles (cpu.h's high_chunk and high_shift; in bytes i >> 1 and (i >> 1) + 2
// of the plane) join them from bit 4.
template <int BITS, int I>
inline void nibble_row(const PairWriter& put, int c, __m512i v, const __m512i (&planes)[2], __m512 scale,
                       __m512 offset) {
  __m512i both = _mm512_and_si512(_mm512_srli_epi32(v, 4 * (I & 1) + 8 * (I >> 1)), _mm512_set1_epi32(0x000F000F));
  if constexpr (BITS > 4) {
    const int from = 8 * (I >> 1) + tokenmill::high_shift<BITS>(c, I & 1);
    const __m512i high = _mm512_srl_epi32(planes[I & 1], _mm_cvtsi32_si128(from));
    const __m512i mask = _mm512_set1_epi32(tokenmill::high_mask<BITS>() * 0x00010001);
    both = _mm512_or_si512(both, _mm512_slli_epi32(_mm512_and_si512(high, mask), 4));
  }
  put(4 * c + I, _mm512_and_si512(both, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(both, 16), scale, offset);
}

// 8-bit: tile row 4c + 2j + high pairs signed bytes j and j + 2 of chunk c + 4 high (weights (16 high) + 4c + j, + 2).
template <int J>
inline void byte_row(const PairWriter& put, int row, __m512i v, __m512 scale, __m512 offset) {
  put(row + 2 * J, _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * J), 24),
      _mm512_srai_epi32(_mm512_slli_epi32(v, 8 - 8 * J), 24), scale, offset);
}

// Block b of group g as one B tile (16 rows of 64 bytes at tile).
template <int BITS, int SUB, typename S>
void dequantize_block(const tokenmill::QuantizedMatrix& w, int64_t g, int64_t b, const PairWriter& put) {
  constexpr int64_t kPerBlock = kBlock / SUB;
  const uint8_t* q = w.q + (g * (w.in / kBlock) + b) * BITS * kLanes * 4;  // BITS chunks a block
  const int64_t k0 = (g * (w.in / SUB) + b * kPerBlock) * kLanes;
  __m512 scale[kPerBlock], offset[kPerBlock];
  for (int64_t h = 0; h < kPerBlock; ++h) {
    scale[h] = load_scales(static_cast<const S*>(w.scales) + k0 + h * kLanes);
    const __m512 shift = w.shift ? load_scales(static_cast<const S*>(w.shift) + k0 + h * kLanes) : _mm512_setzero_ps();
    offset[h] = _mm512_fnmadd_ps(scale[h], _mm512_set1_ps(static_cast<float>(w.zero)), shift);  // shift - scale*zero
  }
  __m512i planes[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  if constexpr (BITS > 4 && BITS < 8) {
    for (int half = 0; half < 2; ++half)
      planes[half] = _mm512_loadu_si512(q + tokenmill::high_chunk<BITS>(half) * kLanes * 4);
  }
  // Rows 4c + i of odd i hold high nibbles: with a scale per 16 (Q6_K), the block's second half.
  const int odd = kPerBlock == 2 ? 1 : 0;
  for (int c = 0; c < 4; ++c) {
    if constexpr (BITS != 8) {
      const __m512i v = _mm512_loadu_si512(q + c * kLanes * 4);
      nibble_row<BITS, 0>(put, c, v, planes, scale[0], offset[0]);
      nibble_row<BITS, 1>(put, c, v, planes, scale[odd], offset[odd]);
      nibble_row<BITS, 2>(put, c, v, planes, scale[0], offset[0]);
      nibble_row<BITS, 3>(put, c, v, planes, scale[odd], offset[odd]);
    } else {
      for (int high = 0; high < 2; ++high) {
        const __m512i v = _mm512_loadu_si512(q + (c + 4 * high) * kLanes * 4);
        const int h = kPerBlock == 2 ? high : 0;
        byte_row<0>(put, 4 * c + high, v, scale[h], offset[h]);
        byte_row<1>(put, 4 * c + high, v, scale[h], offset[h]);
      }
    }
  }
}

// A block of 32 activations as bf16 words, in order: fp32 rounded (to nearest even), bf16 as it is.
inline __m512i bf16_words(const float* src) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src)));
}
inline __m512i bf16_words(const at::BFloat16* src) { return _mm512_loadu_si512(src); }

// x [rows, in] fp32 or bf16 -> bf16 A tiles [padded / 16][in / 32][16 rows][32], each block of 32 in the B tiles'
// pair order; padding rows zero. Tile by tile rather than row by row: 16 rows a whole row apart would share one set
// of the L1 cache (in * 2 bytes is a multiple of 4 KiB for most models) and evict each other.
template <typename T>
at::Tensor activation_tiles(const T* x, int64_t rows, int64_t padded, int64_t in) {
  alignas(64) int16_t order[32];
  for (int r = 0; r < 16; ++r) order[2 * r] = tokenmill::pair_first(r), order[2 * r + 1] = order[2 * r] + 2;
  const __m512i perm = _mm512_load_si512(order);
  const int64_t blocks = in / kBlock;
  at::Tensor tiles = at::empty({padded * in}, at::kBFloat16);
  uint16_t* a = reinterpret_cast<uint16_t*>(tiles.data_ptr());
  at::parallel_for(0, padded, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        uint16_t* dst = a + ((r / kTile * blocks + b) * kTile + r % kTile) * kBlock;
        if (r >= rows) {
          _mm512_storeu_si512(dst, _mm512_setzero_si512());
          continue;
        }
        _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(perm, bf16_words(x + r * in + b * kBlock)));
      }
  });
  return tiles;
}

// out's columns of groups g0..g0+N-1 (N: 1 or 2), every activation row: tiles(b) gives block b's first B tile, the
// second `next` words on. out: fp32, or bf16 (each sum rounded to nearest even, as torch's conversion of the fp32
// result would).
template <int N, typename Tiles, typename T>
void panel_product(const uint16_t* a, int64_t padded, int64_t blocks, Tiles tiles, int64_t next, int64_t g0,
                   const tokenmill::QuantizedMatrix& w, int64_t rows, T* out) {
  alignas(64) float partial[kTile * kLanes];
  for (int64_t m0 = 0; m0 < padded; m0 += 2 * kTile) {
    const bool two = m0 + kTile < padded;
    const uint16_t* a0 = a + m0 / kTile * blocks * kTileBytes / 2;
    const uint16_t* a1 = a0 + blocks * kTileBytes / 2;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* bt = tiles(b);
      _tile_loadd(4, a0 + b * kTileBytes / 2, 64);
      _tile_loadd(6, bt, 64);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (N == 2) {
        _tile_loadd(7, bt + next, 64);
        _tile_dpbf16ps(1, 4, 7);
      }
      if (two) {
        _tile_loadd(5, a1 + b * kTileBytes / 2, 64);
        _tile_dpbf16ps(2, 5, 6);
        if constexpr (N == 2) _tile_dpbf16ps(3, 5, 7);
      }
    }
    // C tiles to out: fp32 straight where all 16 x 16 are out's, else (and bf16 always) through `partial`.
    const auto put = [&](int64_t m, int64_t n, auto store) {
      const int64_t r0 = m0 + m * kTile, col = (g0 + n) * kLanes;
      const int64_t valid_rows = std::min(kTile, rows - r0), valid_cols = std::min(kLanes, w.out - col);
      if (valid_rows <= 0) return;
      if constexpr (std::is_same_v<T, float>) {
        if (valid_rows == kTile && valid_cols == kLanes) {
          store(out + r0 * w.out + col, w.out * 4);
          return;
        }
      }
      store(partial, kLanes * 4);
      for (int64_t r = 0; r < valid_rows; ++r) {
        if constexpr (std::is_same_v<T, float>) {
          std::memcpy(out + (r0 + r) * w.out + col, partial + r * kLanes, valid_cols * sizeof(float));
        } else {
          const __m256i words = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_load_ps(partial + r * kLanes)));
          _mm256_mask_storeu_epi16(out + (r0 + r) * w.out + col, (1u << valid_cols) - 1, words);
        }
      }
    };
    put(0, 0, [](float* p, int64_t s) { _tile_stored(0, p, s); });
    if constexpr (N == 2) put(0, 1, [](float* p, int64_t s) { _tile_stored(1, p, s); });
    if (two) {
      put(1, 0, [](float* p, int64_t s) { _tile_stored(2, p, s); });
      if constexpr (N == 2) put(1, 1, [](float* p, int64_t s) { _tile_stored(3, p, s); });
    }
  }
}

template <int BITS, int SUB, typename S, typename T>
void tile_matmul_typed(const T* x, int64_t rows, const tokenmill::QuantizedMatrix& w, T* out) {
  const int64_t padded = (rows + kTile - 1) / kTile * kTile, blocks = w.in / kBlock;
  const int64_t groups = (w.out + kLanes - 1) / kLanes, panels = (groups + 1) / 2;
  // At most 32 rows, one pass over the blocks: each is dequantized just before its products, so the vector unit
  // unpacks the next block while the tile unit multiplies this one. More rows take several passes over a panel
  // dequantized first (up to a few hundred KiB, in L2).
  const bool one_pass = padded <= 2 * kTile;
  const at::Tensor a_tiles = activation_tiles(x, rows, padded, w.in);
  const uint16_t* a = reinterpret_cast<const uint16_t*>(a_tiles.data_ptr());
  // bf16 weights, nothing to dequantize: the rows go in blocks of about kRowBlockBytes of activation tiles, every
  // panel over a block before the next, so that the block stays in cache while the weights pass (each panel over
  // all the rows read a 2,048-row step's tiles once per panel). A quantized panel is dequantized once for all rows:
  // one block of them.
  const int64_t row_block = BITS == 16 ? std::max<int64_t>(1, tokenmill::kRowBlockBytes / (w.in * 2 * 2 * kTile))
                                             * 2 * kTile
                                       : padded;
  for (int64_t first = 0; first < padded; first += row_block) {
    const int64_t block_rows = std::min(row_block, padded - first);
    const uint16_t* a_block = a + first * w.in;
    T* out_block = out + first * w.out;
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      tokenmill::configure_tiles();
      thread_local std::vector<uint16_t> panel;  // [blocks][groups of the panel][16 tile rows][32 bf16]
      for (int64_t p = begin; p < end; ++p) {
        const int64_t g0 = 2 * p, n = std::min<int64_t>(2, groups - g0);
        // the panel's products, block b's first B tile at tiles(b) and its second `next` words on
        const auto product = [&](auto tiles, int64_t next) {
          n == 2 ? panel_product<2>(a_block, block_rows, blocks, tiles, next, g0, w, rows - first, out_block)
                 : panel_product<1>(a_block, block_rows, blocks, tiles, next, g0, w, rows - first, out_block);
        };
        if constexpr (BITS == 16) {  // the weights are the tiles
          const uint16_t* q = reinterpret_cast<const uint16_t*>(w.q) + g0 * blocks * kTileBytes / 2;
          product([&](int64_t b) { return q + b * kTileBytes / 2; }, blocks * kTileBytes / 2);
        } else {
          panel.resize(blocks * 2 * kTileBytes / 2);
          const auto dequantized = [&](int64_t b) { return panel.data() + b * n * kTileBytes / 2; };  // its n tiles
          const auto dequantize = [&](int64_t b) {
            PairWriter put;
            for (int64_t j = 0; j < n; ++j) {
              put.tile = dequantized(b) + j * kTileBytes / 2;
              dequantize_block<BITS, SUB, S>(w, g0 + j, b, put);
            }
            return dequantized(b);
          };
          if (one_pass) {
            product(dequantize, kTileBytes / 2);
          } else {
            for (int64_t b = 0; b < blocks; ++b) dequantize(b);
            product(dequantized, kTileBytes / 2);
          }
        }
      }
      _tile_release();
    });
  }
}
#endif

}  // namespace

bool tokenmill::tiles_available() {
#if defined(TOKENMILL_AMX)
  // Linux hands a process the tile registers' state only when asked (arch_prctl, XFEATURE_XTILEDATA = 18).
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return granted;
#else
  return false;
#endif
}

template <typename T>
void tokenmill::tile_matmul(const T* x, int64_t rows, const QuantizedMatrix& w, T* out) {
#if defined(TOKENMILL_AMX)
  TORCH_CHECK(tiles_available(), "AMX tiles are unavailable here");
  tokenmill::with_layout(w, [&](auto bits, auto sub, auto s) {
    tile_matmul_typed<decltype(bits)::value, decltype(sub)::value, decltype(s)>(x, rows, w, out);
  });
#else
  (void)x, (void)rows, (void)w, (void)out;
  TORCH_CHECK(false, "the kernels were built without AMX tiles");
#endif
}

template void tokenmill::tile_matmul(const float*, int64_t, const QuantizedMatrix&, float*);
template void tokenmill::tile_matmul(const at::BFloat16*, int64_t, const QuantizedMatrix&, at::BFloat16*);
