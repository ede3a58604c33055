// The interleaved Q4_K kernel (quant_x8_impl.h) on AMX tiles, for CPUs with AMX-INT8 (Sapphire Rapids
// and later), at prefill widths. Included inside namespace avx512vnni, after quant_x8_impl.h, whose
// helpers it reuses.
//
// Why: at hundreds of rows the vector loop is compute-bound, and a prefill was 20-38% of `ar`'s time
// on a 2-core Xeon VM. One tile multiply (TDPBSUD) forms the 16 x 16 x 32 products of a sub-block for
// 16 weight rows and 16 activation rows. Q4_K scales every 32 values, so each multiply's sums must be
// stored and scaled before the next: that store dominates (bench/amx_tiles_probe.cpp), and fewer than
// 16 rows lose to the vector loop. So only full 16-row chunks come here (bench/README.md, "AMX").
//
// Exactness: a tile's int32 sums are the vector loop's products summed exactly; each sub-block's
// sums are scaled by its 6-bit scale as integers (vpmulld), and the super-block's float step is
// q4k_accumulate itself. So every output equals dot_q4k_z's bit for bit: which loop a row takes
// never changes a token, and a row's result never depends on its neighbours.
//
// Tiles: A = activations [R rows][32 int8] of one sub-block, loaded straight from the quantized rows
// (stride K); B = the 16 weight rows' 4-bit values as [8][16 x 4] uint8 (the VNNI layout: row t
// holds values 4t..4t+3 of each weight row), which is what two interleaved groups' 32-byte steps
// already are, side by side, once the nibbles are split; C = [R][16] int32.

#ifdef SE_VNNI
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,amx-tile,amx-int8")

struct AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tile registers: 0, 1 the sums of a chunk's low / high-nibble sub-blocks; 2, 3 their activations; 4, 5
// their weights. Set per thread (tile state is per thread) for R activation rows.
inline void amx_configure(int R) {
  AmxTileConfig c;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = R, c.colsb[t] = 64;
    c.rows[2 + t] = R, c.colsb[2 + t] = 32;
    c.rows[4 + t] = 8, c.colsb[4 + t] = 64;
  }
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

// R activation rows times groups w0 and w1 (16 Q4_K weight rows; w1 null: w0 alone) -> out [R][16].
template <int R>
void dot_q4k_amx(const uint8_t* w0, const uint8_t* w1, int64_t nb, const Act& a, float* out) {
  alignas(64) uint8_t lo[8 * 64], hi[8 * 64];
  alignas(64) int32_t clo[R * 16], chi[R * 16];
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0xF);
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
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles)
      for (int t = 0; t < 8; ++t) {
        const __m256i q0 = load256(g0 + 128 + 256 * c + 32 * t);
        const __m256i q1 = g1 ? load256(g1 + 128 + 256 * c + 32 * t) : _mm256_setzero_si256();
        const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q0), q1, 1);
        _mm512_store_si512(lo + 64 * t, _mm512_and_si512(q, m4));
        _mm512_store_si512(hi + 64 * t, _mm512_and_si512(_mm512_srli_epi16(q, 4), m4));
      }
      const int8_t* x = a.q + 256 * i + 64 * c;
      _tile_loadd(2, x, a.K);
      _tile_loadd(3, x + 32, a.K);
      _tile_loadd(4, lo, 64);
      _tile_loadd(5, hi, 64);
      _tile_zero(0);
      _tile_zero(1);
      _tile_dpbsud(0, 2, 4);
      _tile_dpbsud(1, 3, 5);
      _tile_stored(0, clo, 64);
      _tile_stored(1, chi, 64);
      const __m512i slo = amx_scales16(sc0, sc1, 2 * c), shi = amx_scales16(sc0, sc1, 2 * c + 1);
      for (int r = 0; r < R; ++r)
        isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(clo + 16 * r), slo),
                                                             _mm512_mullo_epi32(_mm512_load_si512(chi + 16 * r), shi)));
    }
    __m256i rows[R];
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

constexpr int64_t kAmxRows = 16;  // a tile's rows

template <int R>
void q4k_amx_rows(const Act& a, const uint8_t* w, float* y, int64_t N, int64_t begin, int64_t end) {
  const int64_t nb = a.K / kValues[kQ4_K], group_bytes = nb * kBytes[kQ4_K] * kGroup;
  float out[R * 16];
  amx_configure(R);
  for (int64_t g = begin; g < end; g += 2) {
    const bool pair = g + 1 < end;
    dot_q4k_amx<R>(w + g * group_bytes, pair ? w + (g + 1) * group_bytes : nullptr, nb, a, out);
    const int64_t lanes = std::min<int64_t>(pair ? 2 * kGroup : kGroup, N - kGroup * g);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t l = 0; l < lanes; ++l) y[r * N + kGroup * g + l] = out[16 * r + l];
  }
}

// matmul_x8 with Q4_K's full 16-row chunks on tiles (prefill widths); the rows left over, and other
// formats, take the vector loop: the same sums bit for bit, so where a row goes never shows.
inline void matmul_x8_amx(int64_t qtype, const Act& a, int64_t M, const uint8_t* w, float* y, int64_t N,
                          int64_t begin, int64_t end, uint8_t* rows) {
  const int64_t tiled = qtype == kQ4_K ? M / kAmxRows * kAmxRows : 0;
  for (int64_t m = 0; m < tiled; m += kAmxRows) q4k_amx_rows<kAmxRows>(a.from_row(m), w, y + m * N, N, begin, end);
  if (tiled) _tile_release();
  if (tiled < M) matmul_x8(qtype, a.from_row(tiled), M - tiled, w, y + tiled * N, N, begin, end, rows);
}

#pragma GCC pop_options
#endif  // SE_VNNI
