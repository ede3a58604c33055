// The interleaved loops on 512-bit vectors (the VNNI copy): Q4_K and Q6_K, two steps of the group's
// rows per load, so one activation broadcast feeds both. The same integer sums as the 256-bit loops
// (x8_impl.h), so the same result. Included once per instruction set inside its own namespace.
#pragma once
#include "common.h"
#include "x8_lanes_impl.h"

#if defined(SE_AVX2) && defined(SE_VNNI)
// Q4_K on 512-bit vectors. One 64-byte load holds two consecutive steps t, t + 1 of the group's 8
// rows; vpermd puts row r's two steps in lanes 2r, 2r + 1 (once per load, shared by every activation
// row), so one 8-byte broadcast of activations feeds both: half the instructions per product of the
// 256-bit loop. A lane then sums 16 products (|sum| <= 16 x 15 x 127 < 2^15), so the low- and
// high-nibble sums pack to int16 (vpackssdw, exact) and one vpdpwssd applies both sub-blocks' scales
// and adds each row's two steps. The integer sums, and the result, are dot_q4k_x8's exactly.
inline __m512i bcast8(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}

// vpackssdw(lo, hi) leaves, in 128-bit lane L, int32 lanes 4L..4L+3 = the pairs of lo's lanes 4L, 4L + 1
// (row 2L's two steps), lo's 4L + 2, 4L + 3 (row 2L + 1), then hi's same two: the scales to match, an
// int16 pair per lane, from plo / phi (lane r = row r's scale twice).
inline __m512i packed_scales(__m256i plo, __m256i phi) {
  const __m512i idx = _mm512_setr_epi32(0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
  return _mm512_permutex2var_epi32(_mm512_zextsi256_si512(plo), idx, _mm512_zextsi256_si512(phi));
}

// Lanes 4L + 2, 4L + 3 (the high-nibble sums) onto 4L, 4L + 1, which then hold rows 2L, 2L + 1 -> lane r.
inline __m256i rows_of(__m512i v) {
  const __m512i s = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, _MM_PERM_BADC));
  return _mm512_castsi512_si256(
      _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13), s));
}

template <int R>
void dot_q4k_z(const uint8_t* w, int64_t nb, const Act& a, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m512i m4 = _mm512_set1_epi8(0xF);
  const __m512i steps = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  for (int64_t i = 0; i < nb; ++i, w += kGroup * kBytes[kQ4_K]) {
    __m256i sc[2], mn[2];
    prefetch_ahead(w, kGroup * kBytes[kQ4_K]);
    q4k_scales_mins(w, sc, mn);
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    const uint8_t* qs = w + kQ4KValues;
    for (int c = 0; c < 4; ++c) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles) of chunk c
      __m512i lo[R], hi[R];
      for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
      for (int tt = 0; tt < 4; ++tt) {  // steps t = 2tt, 2tt + 1
        const __m512i q = _mm512_permutexvar_epi32(steps, _mm512_loadu_si512(qs + 256 * c + 64 * tt));
        const __m512i vl = _mm512_and_si512(q, m4), vh = _mm512_and_si512(_mm512_srli_epi16(q, 4), m4);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.qr(r) + 256 * i + 64 * c + 8 * tt;
          lo[r] = _mm512_dpbusd_epi32(lo[r], vl, bcast8(x));
          hi[r] = _mm512_dpbusd_epi32(hi[r], vh, bcast8(x + 32));
        }
      }
      const __m512i s = packed_scales(pair_u(sc[c / 2], (2 * c) % 4), pair_u(sc[c / 2], (2 * c + 1) % 4));
      for (int r = 0; r < R; ++r) isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_packs_epi32(lo[r], hi[r]), s);
    }
    __m256i rows[R];
    for (int r = 0; r < R; ++r) rows[r] = rows_of(isum[r]);
    q4k_accumulate<R>(w, i, a, mn, rows, acc);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// Q6_K on 512-bit vectors, as dot_q4k_z: each load pairs two steps t, t + 1 (their bytes are 96 apart,
// so two 256-bit halves), vpermd puts row r's in lanes 2r, 2r + 1, and one 8-byte broadcast feeds both
// steps. A vpdpbusd from zero sums 4 products per lane (|sum| <= 4 x 63 x 127 < 2^15), so two k's pack
// to int16 exactly and one vpdpwssd applies both sub-blocks' signed scales. Per row and super-block:
// 32 vpdpbusd and 16 vpdpwssd, against dot_q6k_x8's 64 vpdpbusd and 16 scale folds (vpmulld), with a
// third of the accumulator registers, so a chunk holds kMaxRows rows. Same integer sums, same result.
inline __m512i pair_steps(const uint8_t* p) {  // the 32 bytes at p (step t) and at p + 96 (step t + 1)
  const __m512i steps = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  return _mm512_permutexvar_epi32(steps, _mm512_inserti64x4(_mm512_castsi256_si512(load256(p)), load256(p + 96), 1));
}

inline __m256i scale_pair(const __m256i* words, int g) {  // lane r: row r's signed scale g as an int16 pair
  return pair_s(words[g / 4], g % 4, g % 4);
}

template <int R>
inline void q6k_z_super_block(const uint8_t* w, int64_t i, const Act& a, const __m256i* words, __m256i* rows) {
  const __m512i m4 = _mm512_set1_epi8(0xF), low6 = _mm512_set1_epi8(0x3F), hi2 = _mm512_set1_epi8(0x30);
  __m512i isum[R];
  for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    for (int tt = 0; tt < 4; ++tt) {  // steps t = 2tt, 2tt + 1: values 128h + 32k + 8tt + 0..7, sub-block 8h + 2k + tt / 2
      const uint8_t* vb = w + kQ6Values + 96 * (8 * h + 2 * tt);
      const __m512i A = pair_steps(vb), B = pair_steps(vb + 32), C = pair_steps(vb + 64);  // q6_values, 512 bits
      const __m512i v0 = _mm512_and_si512(A, low6), v1 = _mm512_and_si512(B, low6);
      const __m512i v2 = _mm512_or_si512(_mm512_and_si512(C, m4), _mm512_and_si512(_mm512_srli_epi16(A, 2), hi2));
      const __m512i v3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(C, 4), m4),
                                         _mm512_and_si512(_mm512_srli_epi16(B, 2), hi2));
      const int g = 8 * h + tt / 2;
      const __m512i s01 = packed_scales(scale_pair(words, g), scale_pair(words, g + 2));
      const __m512i s23 = packed_scales(scale_pair(words, g + 4), scale_pair(words, g + 6));
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.qr(r) + 256 * i + 128 * h + 8 * tt;
        const __m512i zero = _mm512_setzero_si512();
        const __m512i p0 = _mm512_dpbusd_epi32(zero, v0, bcast8(x)), p1 = _mm512_dpbusd_epi32(zero, v1, bcast8(x + 32));
        const __m512i p2 = _mm512_dpbusd_epi32(zero, v2, bcast8(x + 64)), p3 = _mm512_dpbusd_epi32(zero, v3, bcast8(x + 96));
        isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_packs_epi32(p0, p1), s01);
        isum[r] = _mm512_dpwssd_epi32(isum[r], _mm512_packs_epi32(p2, p3), s23);
      }
    }
  }
  for (int r = 0; r < R; ++r) rows[r] = rows_of(isum[r]);
}
#endif  // SE_AVX2 && SE_VNNI
