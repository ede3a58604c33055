// The interleaved Q4_K kernel (x8_impl.h) on AMX tiles, for CPUs with AMX-INT8 (Sapphire Rapids
// and later), at prefill widths. Included inside namespace avx512vnni, after x8_impl.h, whose
// helpers it reuses.
//
// Why: at hundreds of rows the vector loop is compute-bound, and a prefill was 20-38% of `ar`'s time
// on a 2-core Xeon VM. One tile multiply (TDPBSUD) forms 16 activation rows x 16 weight rows x 64
// products. Q4_K scales every 32 values by a 6-bit scale per row, which a tile cannot apply; storing
// each sub-block's sums to scale them with vector code cost most of the time (bench/amx_tiles_probe.cpp),
// so the scales are folded into the weight bytes instead (dot_q4k_amx). Building those bytes is vector
// work per 16 weight rows whatever the row count, so fewer than 16 rows would lose to the vector loop:
// only full 16-row chunks come here (bench/README.md, "AMX").
//
// Exactness: the tiles' int32 sums are the vector loop's integer sums exactly, and the super-block's
// float step is q4k_accumulate itself. So every output equals dot_q4k_z's bit for bit: which loop a
// row takes never changes a token, and a row's result never depends on its neighbours.
//
// Tiles: A = activations [16 rows][64 int8] of a chunk, loaded straight from the quantized rows (stride
// K); B = the 16 weight rows' bytes as [16][16 x 4] (the VNNI layout: row t holds values 4t..4t+3 of
// each weight row), which is what two interleaved groups' 32-byte steps already are, side by side,
// once the nibbles are split; C = [16][16] int32.
#pragma once
#include "common.h"
#include "x8_impl.h"

#ifdef SE_VNNI
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")

constexpr int kAmxRows = 16;  // a tile's rows: activation rows per chunk

struct AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// GCC 12's tile intrinsics are asm statements that declare no memory operands: without a compiler
// barrier, vector stores of a tile's scratch may be moved past the tile load that reads them, and loads
// of a tile's sums before the tile store that writes them (seen at -O3 in a variant of
// bench/amx_tiles_probe.cpp: wrong sums).
inline void amx_memory_barrier() { asm volatile("" ::: "memory"); }

// Tile registers: 0, 1 the super-block's sums against the low / high parts of the scales; 2 a chunk's
// activations (16 rows x 64 values); 4, 5 its weights times those parts. Tile state is per thread.
inline void amx_configure() {
  AmxTileConfig c;
  for (int t : {0, 1, 2, 4, 5}) c.rows[t] = kAmxRows, c.colsb[t] = 64;
  // not _tile_loadconfig: GCC 12's declares an 8-byte operand, and the stores of rows and colsb die
  asm volatile("ldtilecfg %0" : : "m"(c));
}

// Sub-block j's 6-bit scales of the 16 rows of groups w0, w1 as int32 lanes (row n in lane n).
inline __m512i amx_scales16(const __m256i* sc0, const __m256i* sc1, int j) {
  const __m256i ff = _mm256_set1_epi32(0xFF);
  const __m256i s0 = _mm256_and_si256(_mm256_srli_epi32(sc0[j / 4], 8 * (j % 4)), ff);
  const __m256i s1 = _mm256_and_si256(_mm256_srli_epi32(sc1[j / 4], 8 * (j % 4)), ff);
  return _mm512_inserti64x4(_mm512_castsi256_si512(s0), s1, 1);
}

// v (an int32 lane per weight row, < 2^16) in both int16 halves of its lane: a vpmullw factor.
inline __m512i amx_pair16(__m512i v) { return _mm512_or_si512(v, _mm512_slli_epi32(v, 16)); }

// 16 activation rows times groups w0 and w1 (16 Q4_K weight rows; w1 null: w0 alone) -> out [16][16].
//
// A sub-block's scale s (6 bits) is split as s = l + 16 h (l < 16, h < 4), and the weights' 4-bit
// values q are multiplied by each part inside their bytes (q l <= 225, q h <= 45: one vpmullw per 32
// bytes, no byte carries into the next). Then the scales ride in the B tiles, a super-block's 256
// values accumulate in two tiles, and its sums leave them once: sum_j s_j dot_j = L + 16 H, the
// vector loop's integer exactly.
inline void dot_q4k_amx(const uint8_t* w0, const uint8_t* w1, int64_t nb, const Act& a, float* out) {
  constexpr int R = kAmxRows;
  alignas(64) uint8_t bl[16 * 64], bh[16 * 64];
  alignas(64) int32_t cl[R * 16], ch[R * 16];
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0xF), low4 = _mm512_set1_epi32(0xF);
  const int64_t step = kGroup * kBytes[kQ4_K];
  for (int64_t i = 0; i < nb; ++i) {
    const uint8_t* g0 = w0 + i * step;
    const uint8_t* g1 = w1 ? w1 + i * step : nullptr;
    prefetch_ahead(g0, step);
    __m256i sc0[2], mn0[2], sc1[2] = {}, mn1[2] = {};
    q4k_scales_mins(g0, sc0, mn0);
    if (g1) {
      prefetch_ahead(g1, step);
      q4k_scales_mins(g1, sc1, mn1);
    }
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < 4; ++c) {  // values 64c..64c+63: sub-blocks 2c (low nibbles), 2c + 1 (high)
      __m512i l[2], h[2];
      for (int k = 0; k < 2; ++k) {
        const __m512i s = amx_scales16(sc0, sc1, 2 * c + k);
        l[k] = amx_pair16(_mm512_and_si512(s, low4));
        h[k] = amx_pair16(_mm512_srli_epi32(s, 4));
      }
      amx_memory_barrier();  // the last chunk's tile loads read bl / bh before they are rewritten
      for (int t = 0; t < 8; ++t) {  // B row t: values 4t.. of sub-block 2c; row 8 + t: of 2c + 1
        const __m256i q0 = load256(g0 + kQ4KValues + 256 * c + 32 * t);
        const __m256i q1 = g1 ? load256(g1 + kQ4KValues + 256 * c + 32 * t) : _mm256_setzero_si256();
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
        const __m512i vl = _mm512_and_si512(q, m4), vh = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        _mm512_store_si512(bl + 64 * t, _mm512_mullo_epi16(vl, l[0]));
        _mm512_store_si512(bl + 64 * (8 + t), _mm512_mullo_epi16(vh, l[1]));
        _mm512_store_si512(bh + 64 * t, _mm512_mullo_epi16(vl, h[0]));
        _mm512_store_si512(bh + 64 * (8 + t), _mm512_mullo_epi16(vh, h[1]));
      }
      amx_memory_barrier();  // bl / bh written before the tiles read them
      _tile_loadd(2, a.q + 256 * i + 64 * c, a.K);
      _tile_loadd(4, bl, 64);
      _tile_loadd(5, bh, 64);
      _tile_dpbsud(0, 2, 4);
      _tile_dpbsud(1, 2, 5);
    }
    _tile_stored(0, cl, 64);
    _tile_stored(1, ch, 64);
    amx_memory_barrier();  // cl / ch read after the tiles wrote them
    __m256i rows[R];
    __m512i isum[R];
    for (int r = 0; r < R; ++r)
      isum[r] = _mm512_add_epi32(_mm512_load_si512(cl + 16 * r), _mm512_slli_epi32(_mm512_load_si512(ch + 16 * r), 4));
    for (int r = 0; r < R; ++r) rows[r] = _mm512_castsi512_si256(isum[r]);
    q4k_accumulate<R>(g0, i, a, mn0, rows, acc0);
    if (g1) {
      for (int r = 0; r < R; ++r) rows[r] = _mm512_extracti64x4_epi64(isum[r], 1);
      q4k_accumulate<R>(g1, i, a, mn1, rows, acc1);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + 16 * r, acc0[r]);
    _mm256_storeu_ps(out + 16 * r + 8, acc1[r]);
  }
}

// y [16, N] for groups begin..end: pairs of groups, the bytes of each built per super-block (in L1).
// A variant that built a pair's bytes once for all of a call's chunks was slower (bench/README.md, "AMX").
inline void q4k_amx_rows(const Act& a, const uint8_t* w, float* y, int64_t N, int64_t begin, int64_t end) {
  const int64_t nb = a.K / kValues[kQ4_K], group_bytes = nb * kBytes[kQ4_K] * kGroup;
  float out[kAmxRows * 16];
  for (int64_t g = begin; g < end; g += 2) {
    const bool pair = g + 1 < end;
    dot_q4k_amx(w + g * group_bytes, pair ? w + (g + 1) * group_bytes : nullptr, nb, a, out);
    const int64_t lanes = std::min<int64_t>(pair ? 2 * kGroup : kGroup, N - kGroup * g);
    for (int64_t r = 0; r < kAmxRows; ++r)
      for (int64_t l = 0; l < lanes; ++l) y[r * N + kGroup * g + l] = out[16 * r + l];
  }
}

// matmul_x8 with Q4_K's full 16-row chunks on tiles (prefill widths); the rows left over, and other
// formats, take the vector loop: the same sums bit for bit, so where a row goes never shows.
inline void matmul_x8_amx(int64_t qtype, const Act& a, int64_t M, const uint8_t* w, float* y, int64_t N,
                          int64_t begin, int64_t end, uint8_t* rows) {
  const int64_t tiled = qtype == kQ4_K ? M / kAmxRows * kAmxRows : 0;
  if (tiled) amx_configure();  // once per call and thread
  for (int64_t m = 0; m < tiled; m += kAmxRows) q4k_amx_rows(a.from_row(m), w, y + m * N, N, begin, end);
  if (tiled) _tile_release();
  if (tiled < M) matmul_x8(qtype, a.from_row(tiled), M - tiled, w, y + tiled * N, N, begin, end, rows);
}

#pragma GCC pop_options
#endif  // SE_VNNI
