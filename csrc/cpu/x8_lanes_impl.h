// The interleaved layout's lanes (x8_layout.h defines the layout): weights interleaved 8 rows at a
// time, lane r of every 256-bit vector holding weight row r. The 256-bit helpers every interleaved
// loop shares (x8_impl.h, x8_zmm_impl.h): broadcasts, byte picks, the integer sums and their folds.
// Included once per instruction set inside its own namespace; its includes are guarded (no-ops there).
#pragma once
#include "common.h"
#include "dot_impl.h"

#ifdef SE_AVX2
inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Four activation bytes (or two int16) at p, in every lane.
inline __m256i bcast4(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Bytes of each lane of `words` rearranged by `pattern` (four byte indices 0..3, 0x80 for a zero
// byte, little end first): the same shuffle in all eight lanes.
inline __m256i pick(__m256i words, uint32_t pattern) {
  const __m256i lane = _mm256_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C, 0, 0x04040404, 0x08080808, 0x0C0C0C0C);
  return _mm256_shuffle_epi8(words, _mm256_add_epi8(_mm256_set1_epi32(int(pattern)), lane));
}

// Byte j of each lane twice, as an int16 pair (unsigned), or bytes j, j2 (signed; j2 = j + 1 unless given).
inline __m256i pair_u(__m256i words, int j) { return pick(words, 0x80008000u | (j << 16) | j); }
inline __m256i pair_s(__m256i words, int j, int j2 = -1) {
  return _mm256_srai_epi16(pick(words, 0x00800080u | ((j2 < 0 ? j + 1 : j2) << 24) | (j << 8)), 8);
}

// p + the 4-product sums of unsigned weights v (<= 63) and signed activations x, per lane: int32 lanes
// with VNNI (vpdpbusd); else int16 pairs (maddubs), which the callers fold (`fold`) before they could
// overflow (kFold values of 4t).
inline __m256i dot_acc(__m256i p, __m256i v, __m256i x) {
#ifdef SE_VNNI
  return _mm256_dpbusd_epi32(p, v, x);
#else
  return in_order(_mm256_add_epi16(p, _mm256_maddubs_epi16(v, x)));
#endif
}

// isum + p * the lane's scale, byte j of `words` (sign-extended for Q6_K).
template <bool Signed>
inline __m256i fold(__m256i isum, __m256i p, __m256i words, int j) {
#ifdef SE_VNNI
  const __m256i s = Signed ? _mm256_srai_epi32(pick(words, 0x00808080u | (j << 24)), 24)
                           : pick(words, 0x80808000u | j);
  return _mm256_add_epi32(isum, _mm256_mullo_epi32(p, s));
#else
  const __m256i s = Signed ? pair_s(words, j, j) : pair_u(words, j);
  return madd_add(isum, p, s);
#endif
}

// Q4_K super-block of a group: get_scale_min_k4 for eight rows at once, scales 0..3 / 4..7 in sc and
// mins 0..3 / 4..7 in mn, a byte each.
inline void q4k_scales_mins(const uint8_t* w, __m256i* sc, __m256i* mn) {
  const __m256i low6 = _mm256_set1_epi8(0x3f), low4 = _mm256_set1_epi8(0xF), low2 = _mm256_set1_epi8(3);
  const __m256i u0 = load256(w + kQ4KScales), u1 = load256(w + kQ4KScales + 32), u2 = load256(w + kQ4KScales + 64);
  sc[0] = _mm256_and_si256(u0, low6);
  sc[1] = _mm256_or_si256(_mm256_and_si256(u2, low4), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), low2), 4));
  mn[0] = _mm256_and_si256(u1, low6);
  mn[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), low4),
                          _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), low2), 4));
}

// acc[r] += d dx isum[r] - dmin dx (the mins against row r's sums of 32 activations), super-block i.
template <int R>
inline void q4k_accumulate(const uint8_t* w, int64_t i, const Act& a, const __m256i* mn, const __m256i* isum,
                           __m256* acc) {
  const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kQ4KMins)));
  __m256i mpair[4];  // mins 2j, 2j + 1 as an int16 pair, against the sums of values 64j..64j+31, +32..+63
  for (int j = 0; j < 4; ++j) mpair[j] = pick(mn[j / 2], 0x80008000u | ((2 * j + 1) % 4) << 16 | (2 * j) % 4);
  for (int r = 0; r < R; ++r) {
    const int16_t* b32 = a.b32r(r) + 8 * i;
    __m256i msum = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) msum = madd_add(msum, mpair[j], bcast4(b32 + 2 * j));
    const __m256 dx = _mm256_set1_ps(a.dr(r)[i]);
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d8, dx), acc[r]);
    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(m8, dx), acc[r]);
  }
}

// Q6_K values 128h + 32k + 4t + 0..3 of eight rows (0..63) from the layout's A (k 0, 2) or B (k 1, 3)
// and C: 1 instruction for k 0, 1 and 4-5 for k 2, 3 (the file's order took 4-5 for each).
template <int k>
inline __m256i q6_values(__m256i ab, __m256i c) {
  const __m256i low6 = _mm256_set1_epi8(0x3F), m4 = _mm256_set1_epi8(0xF), hi2 = _mm256_set1_epi8(0x30);
  if constexpr (k < 2) return _mm256_and_si256(ab, low6);
  const __m256i lo = k == 2 ? _mm256_and_si256(c, m4) : _mm256_and_si256(_mm256_srli_epi16(c, 4), m4);
  return _mm256_or_si256(lo, _mm256_and_si256(_mm256_srli_epi16(ab, 2), hi2));  // bits 6-7 of ab -> 4-5
}
#endif  // SE_AVX2
