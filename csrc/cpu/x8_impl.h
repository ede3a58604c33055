// The matvec of the CPU kernels on weights interleaved 8 rows at a time (kernels/quant_pack.py is the
// layout's spec): lane r of every 256-bit vector holds weight row r, so the scale unpacking, the float
// conversions and the final sum are shared by eight rows, and each row's sum ends in its own lane.
// Included once per instruction set inside its own namespace; its includes are guarded (no-ops there).
// The integer sums are those of dot_rows (dot_impl.h) exactly; only the float order differs.
// Every activation row takes the same operations whatever the chunk holds: batch-invariant.
#pragma once
#include "common.h"
#include "dot_impl.h"

constexpr int64_t kGroup = 8;

// Q4_0 / Q5_0: where a group's value bytes start in its block (after the scales and Q5_0's high bits).
template <int Q>
constexpr int64_t kX8Values = Q == kQ5_0 ? 48 : 16;

// Group g's rows of the file's layout back from the interleaved bytes (the baseline path and tests).
template <int Q>
void unpack_group(const uint8_t* p, int64_t nb, uint8_t* rows /* [8][nb * kBytes[Q]] */) {
  const int64_t rb = nb * kBytes[Q];
  for (int64_t i = 0; i < nb; ++i, p += kGroup * kBytes[Q])
    for (int r = 0; r < kGroup; ++r) {
      uint8_t* o = rows + r * rb + i * kBytes[Q];
      if constexpr (Q == kQ4_0 || Q == kQ5_0) {
        std::memcpy(o, p + 2 * r, 2);
        if constexpr (Q == kQ5_0) std::memcpy(o + 2, p + 16 + 4 * r, 4);
        for (int t = 0; t < 4; ++t) std::memcpy(o + kBytes[Q] - 16 + 4 * t, p + kX8Values<Q> + 32 * t + 4 * r, 4);
      } else if constexpr (Q == kQ4_K) {
        std::memcpy(o, p + 2 * r, 2);
        std::memcpy(o + 2, p + 16 + 2 * r, 2);
        for (int wd = 0; wd < 3; ++wd) std::memcpy(o + 4 + 4 * wd, p + 32 + 32 * wd + 4 * r, 4);
        for (int c = 0; c < 4; ++c)
          for (int t = 0; t < 8; ++t) std::memcpy(o + 16 + 32 * c + 4 * t, p + 128 + 256 * c + 32 * t + 4 * r, 4);
      } else {  // Q6_K
        std::memcpy(o + 208, p + 2 * r, 2);
        for (int wd = 0; wd < 4; ++wd) std::memcpy(o + 192 + 4 * wd, p + 16 + 32 * wd + 4 * r, 4);
        for (int h = 0; h < 2; ++h)
          for (int t = 0; t < 8; ++t) {
            const uint8_t* v = p + 144 + 96 * (8 * h + t) + 4 * r;  // low nibbles (c 0, 1), high bits
            std::memcpy(o + 64 * h + 4 * t, v, 4);
            std::memcpy(o + 64 * h + 32 + 4 * t, v + 32, 4);
            std::memcpy(o + 128 + 32 * h + 4 * t, v + 64, 4);
          }
      }
    }
}

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
  const __m256i u0 = load256(w + 32), u1 = load256(w + 64), u2 = load256(w + 96);
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
  const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
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

// R activation rows times one group of 8 Q4_K rows -> out [R][8].
template <int R>
void dot_q4k_x8(const uint8_t* w, int64_t nb, const Act& a, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0xF);
  for (int64_t i = 0; i < nb; ++i, w += kGroup * kBytes[kQ4_K]) {
    __m256i sc[2], mn[2];
    prefetch_ahead(w, kGroup * kBytes[kQ4_K]);
    q4k_scales_mins(w, sc, mn);
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    const uint8_t* qs = w + 128;
    auto sub_block = [&](int j) __attribute__((always_inline)) {  // the low (j even) or high nibbles of chunk j / 2
      __m256i p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {  // values 32j + 4t .. 32j + 4t + 3 of each row
        const __m256i q = load256(qs + 256 * (j / 2) + 32 * t);
        const __m256i v = j % 2 ? _mm256_and_si256(_mm256_srli_epi16(q, 4), m4) : _mm256_and_si256(q, m4);
        for (int r = 0; r < R; ++r) p[r] = dot_acc(p[r], v, bcast4(a.qr(r) + 256 * i + 32 * j + 4 * t));
      }  // int16 pairs: 8 x 2 x 15 x 127 fits
      for (int r = 0; r < R; ++r) isum[r] = fold<false>(isum[r], p[r], sc[j / 4], j % 4);
    };
    if constexpr (R == 1) {
      // a decode: unrolled whole, each fold's byte pattern is a constant and no branch is left on
      // j's parity (+21% one-row compute rate, avx2 copy on Zen 4; with more rows the unrolled
      // loop ran out of registers and lost 7-12%: docs/design.md, "Experiments", CPU kernels)
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) sub_block(j);
    } else {
      for (int j = 0; j < 8; ++j) sub_block(j);
    }
    q4k_accumulate<R>(w, i, a, mn, isum, acc);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// Bytes 0x10 where Q5_0's high bit of value v0 + b is set (byte b = 0..3 of each lane; v0 % 4 == 0):
// the lane's byte v0 / 8 of its 32 high bits in all four bytes, each tested against its own bit.
inline __m256i q5_high(__m256i qh, int v0) {
  const __m256i m = _mm256_set1_epi32(v0 % 8 ? int(0x80402010u) : 0x08040201);
  const __m256i bytes = pick(qh, 0x01010101u * uint32_t(v0 / 8));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, m), m), _mm256_set1_epi8(0x10));
}

// R activation rows times one group of 8 Q4_0 / Q5_0 rows -> out [R][8]. The values are unsigned
// (q, 0..15 / 0..31) in the products; the zero point comes off as off * (the block's sum of x), from
// the two sums of 16 the activations carry, so the integer sum is dot_rows' exactly.
template <int Q, int R>
void dot_32_x8(const uint8_t* w, int64_t nb, const Act& a, float* out) {
  constexpr int16_t off = Q == kQ5_0 ? 16 : 8;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0xF), offs = _mm256_set1_epi16(off);
  for (int64_t i = 0; i < nb; ++i, w += kGroup * kBytes[Q]) {
    prefetch_ahead(w, kGroup * kBytes[Q]);
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    __m256i lo_sum[R], hi_sum[R];  // values 0..15 and 16..31 (int16 pairs without VNNI: 8 x 31 x 127 fits)
    for (int r = 0; r < R; ++r) lo_sum[r] = hi_sum[r] = _mm256_setzero_si256();
    for (int t = 0; t < 4; ++t) {  // byte 4t + b of a row holds values 4t + b (low nibble), 16 + 4t + b (high)
      const __m256i q = load256(w + kX8Values<Q> + 32 * t);
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if constexpr (Q == kQ5_0) {
        const __m256i qh = load256(w + 16);
        lo = _mm256_or_si256(lo, q5_high(qh, 4 * t));
        hi = _mm256_or_si256(hi, q5_high(qh, 16 + 4 * t));
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.qr(r) + 32 * i + 4 * t;
        lo_sum[r] = dot_acc(lo_sum[r], lo, bcast4(x));
        hi_sum[r] = dot_acc(hi_sum[r], hi, bcast4(x + 16));
      }
    }
    for (int r = 0; r < R; ++r) {
#ifdef SE_VNNI
      __m256i isum = _mm256_add_epi32(lo_sum[r], hi_sum[r]);
#else
      const __m256i ones = _mm256_set1_epi16(1);
      __m256i isum = madd_add(_mm256_madd_epi16(lo_sum[r], ones), hi_sum[r], ones);
#endif
      isum = _mm256_sub_epi32(isum, _mm256_madd_epi16(bcast4(a.bsr(r) + 2 * i), offs));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d8, _mm256_set1_ps(a.dr(r)[i])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

#ifdef SE_VNNI
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
    const uint8_t* qs = w + 128;
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
  const __m512i m4 = _mm512_set1_epi8(0xF), three = _mm512_set1_epi8(3), hi2 = _mm512_set1_epi8(0x30);
  __m512i isum[R];
  for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    for (int tt = 0; tt < 4; ++tt) {  // steps t = 2tt, 2tt + 1: values 128h + 32k + 8tt + 0..7, sub-block 8h + 2k + tt / 2
      const uint8_t* vb = w + 144 + 96 * (8 * h + 2 * tt);
      const __m512i l0 = pair_steps(vb), l1 = pair_steps(vb + 32), hb = pair_steps(vb + 64);
      const __m512i v0 = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_slli_epi16(_mm512_and_si512(hb, three), 4));
      const __m512i v1 = _mm512_or_si512(_mm512_and_si512(l1, m4),
                                         _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2), three), 4));
      const __m512i v2 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_and_si512(hb, hi2));
      const __m512i v3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                                         _mm512_and_si512(_mm512_srli_epi16(hb, 2), hi2));
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
#endif

// Q6_K values 128h + 32k + 4t + 0..3 of eight rows (0..63) from their low-nibble and high-bit bytes.
template <int k>
inline __m256i q6_values(__m256i l, __m256i hb) {
  const __m256i m4 = _mm256_set1_epi8(0xF), three = _mm256_set1_epi8(3), hi2 = _mm256_set1_epi8(0x30);
  if constexpr (k == 0) return _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_slli_epi16(_mm256_and_si256(hb, three), 4));
  if constexpr (k == 1)
    return _mm256_or_si256(_mm256_and_si256(l, m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), three), 4));
  if constexpr (k == 2) return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m4), _mm256_and_si256(hb, hi2));
  return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m4),
                         _mm256_and_si256(_mm256_srli_epi16(hb, 2), hi2));
}

// isum[r] += the sums of sub-blocks 8h + 2k + s, k = 0..3, of values 128h + 32k + 16s + 0..15.
#ifdef SE_VNNI
// int32 lanes: each load of low-nibble and high-bit bytes serves all four k, one fold per sub-block.
template <int R>
inline void q6_half(const uint8_t* w, int h, int s, int64_t i, const Act& a, const __m256i* words, __m256i* isum) {
  const uint8_t* vb = w + 144 + 96 * 8 * h;  // per t: 32 bytes of low nibbles (c 0), of c 1, of high bits
  const int8_t* x0 = a.qr(0) + 256 * i + 128 * h;
  __m256i p0[R], p1[R], p2[R], p3[R];  // one per k: named, so they stay in registers
  for (int r = 0; r < R; ++r) p0[r] = p1[r] = p2[r] = p3[r] = _mm256_setzero_si256();
  for (int t = 4 * s; t < 4 * s + 4; ++t) {
    const __m256i l0 = load256(vb + 96 * t), l1 = load256(vb + 96 * t + 32), hb = load256(vb + 96 * t + 64);
    const __m256i v0 = q6_values<0>(l0, hb), v1 = q6_values<1>(l1, hb), v2 = q6_values<2>(l0, hb),
                  v3 = q6_values<3>(l1, hb);
    for (int r = 0; r < R; ++r) {
      const int8_t* x = x0 + r * a.K + 4 * t;
      p0[r] = dot_acc(p0[r], v0, bcast4(x));
      p1[r] = dot_acc(p1[r], v1, bcast4(x + 32));
      p2[r] = dot_acc(p2[r], v2, bcast4(x + 64));
      p3[r] = dot_acc(p3[r], v3, bcast4(x + 96));
    }
  }
  const int g = 8 * h + s;  // sub-blocks g, g + 2, g + 4, g + 6 (k = 0..3): bytes s, s + 2 of words 2h, 2h + 1
  for (int r = 0; r < R; ++r) {
    isum[r] = fold<true>(isum[r], p0[r], words[g / 4], g % 4);
    isum[r] = fold<true>(isum[r], p1[r], words[(g + 2) / 4], (g + 2) % 4);
    isum[r] = fold<true>(isum[r], p2[r], words[(g + 4) / 4], (g + 4) % 4);
    isum[r] = fold<true>(isum[r], p3[r], words[(g + 6) / 4], (g + 6) % 4);
  }
}
#else
// int16 pairs, folded every two steps (2 x 2 x 63 x 127 fits, 4 would not), one k at a time: four
// sums per row at once (the loop above) outgrew AVX2's 16 registers past one row and spilled; this
// costs 0.80-0.89x of it at 2-8 rows (avx2 copy, docs/kernels.md) for L1 reloads of the bytes per k.
// The same integer sums, so the same result.
template <int R>
inline void q6_half(const uint8_t* w, int h, int s, int64_t i, const Act& a, const __m256i* words, __m256i* isum) {
  const uint8_t* vb = w + 144 + 96 * 8 * h;
  const int8_t* x0 = a.qr(0) + 256 * i + 128 * h;
  const int g = 8 * h + s;
  auto one_k = [&](auto kc) __attribute__((always_inline)) {
    constexpr int k = decltype(kc)::value;
    for (int t0 = 4 * s; t0 < 4 * s + 4; t0 += 2) {
      __m256i p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
      for (int t = t0; t < t0 + 2; ++t) {
        const __m256i v = q6_values<k>(load256(vb + 96 * t + 32 * (k % 2)), load256(vb + 96 * t + 64));
        for (int r = 0; r < R; ++r) p[r] = dot_acc(p[r], v, bcast4(x0 + r * a.K + 32 * k + 4 * t));
      }
      for (int r = 0; r < R; ++r) isum[r] = fold<true>(isum[r], p[r], words[(g + 2 * k) / 4], (g + 2 * k) % 4);
    }
  };
  one_k(std::integral_constant<int, 0>{});
  one_k(std::integral_constant<int, 1>{});
  one_k(std::integral_constant<int, 2>{});
  one_k(std::integral_constant<int, 3>{});
}
#endif

// R activation rows times one group of 8 Q6_K rows -> out [R][8].
template <int R>
void dot_q6k_x8(const uint8_t* w, int64_t nb, const Act& a, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t i = 0; i < nb; ++i, w += kGroup * kBytes[kQ6_K]) {
    prefetch_ahead(w, kGroup * kBytes[kQ6_K]);
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    __m256i words[4];
    for (int k = 0; k < 4; ++k) words[k] = load256(w + 16 + 32 * k);
    __m256i isum[R];
#ifdef SE_VNNI
    if constexpr (R > 1) {  // one row: the 256-bit loop, whose weight-side work is smaller (decode is memory-bound)
      q6k_z_super_block<R>(w, i, a, words, isum);
    } else
#endif
    {
      for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
      for (int h = 0; h < 2; ++h) {
        q6_half<R>(w, h, 0, i, a, words, isum);
        q6_half<R>(w, h, 1, i, a, words, isum);
      }
    }
    __m256i spair[8];  // the values are q - 32: subtract 32 * sum_g sc_g * (sum of x over group g)
    for (int j = 0; j < 8; ++j) spair[j] = pair_s(words[j / 2], 2 * (j % 2));
    for (int r = 0; r < R; ++r) {
      const int16_t* bs = a.bsr(r) + 16 * i;
      __m256i off = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) off = madd_add(off, spair[j], bcast4(bs + 2 * j));
      isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(off, 5));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d8, _mm256_set1_ps(a.dr(r)[i])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

template <int Q, int R>
void dot_group(const uint8_t* w, int64_t nb, const Act& a, float* out, uint8_t*) {
  if constexpr (Q == kQ4_K) {
#ifdef SE_VNNI
    dot_q4k_z<R>(w, nb, a, out);
#else
    dot_q4k_x8<R>(w, nb, a, out);
#endif
  } else if constexpr (Q == kQ6_K) {
    dot_q6k_x8<R>(w, nb, a, out);
  } else {
    dot_32_x8<Q, R>(w, nb, a, out);
  }
}
#else
// Plain C++: the group's rows unpacked to the file's layout, then dot_rows' arithmetic per row.
template <int Q, int R>
void dot_group(const uint8_t* w, int64_t nb, const Act& a, float* out, uint8_t* rows) {
  unpack_group<Q>(w, nb, rows);
  float o[R];
  for (int l = 0; l < kGroup; ++l) {
    dot_rows<Q, R>(rows + l * nb * kBytes[Q], nb, a, o);
    for (int r = 0; r < R; ++r) out[8 * r + l] = o[r];
  }
}
#endif

// Rows per chunk, as many as stay in registers. AVX-512's 32: the 256-bit Q6_K loop, when it kept a
// sum per row and k, ran out past 5 rows (8 rows cost 7.2x one row in one chunk, 5.0x as 4 + 4; 2-core
// EPYC VM at 6c5d246; one chunk of 8 is within noise of 5 + 3 since); the 512-bit VNNI loop keeps one
// per row, so 8 fit. AVX2's 16: five rows in one chunk cost 0.70-0.74x of 3 + 2 with the sums kept in
// order (`in_order`; docs/kernels.md).
#if defined(SE_VNNI)
template <int Q>
constexpr int64_t kX8Rows = kMaxRows;
#elif defined(SE_WIDE)
template <int Q>
constexpr int64_t kX8Rows = Q == kQ6_K ? 5 : kMaxRows;
#elif defined(SE_AVX2)
template <int Q>
constexpr int64_t kX8Rows = 5;
#else
template <int Q>
constexpr int64_t kX8Rows = kMaxRows;
#endif

// dot_group for a chunk of n <= R rows, R known at compile time.
template <int Q, int R = kX8Rows<Q>>
inline void dot_chunk(int64_t n, const uint8_t* w, int64_t nb, const Act& a, float* out, uint8_t* rows) {
  if constexpr (R > 1) {
    if (n < R) return dot_chunk<Q, R - 1>(n, w, nb, a, out, rows);
  }
  dot_group<Q, R>(w, nb, a, out, rows);
}

// y [M, N] for groups begin..end of an interleaved weight (row 8g + l of group g), chunks of up to
// kX8Rows activation rows per group. `rows`: scratch of 8 rows of the file's layout (baseline only).
template <int Q>
void matmul_x8_q(const Act& a, int64_t M, const uint8_t* w, float* y, int64_t N, int64_t begin, int64_t end,
                 uint8_t* rows) {
  const int64_t nb = a.K / kValues[Q], group_bytes = nb * kBytes[Q] * kGroup;
  float out[kX8Rows<Q> * kGroup];
  for (int64_t g = begin; g < end; ++g) {
    const uint8_t* wg = w + g * group_bytes;
    const int64_t lanes = std::min<int64_t>(kGroup, N - kGroup * g);
    for (int64_t m = 0; m < M;) {
      const Act c = a.from_row(m);
      // balanced chunks of at most kX8Rows<Q> (9 rows: 5 + 4, not 8 + 1); a row's operations do not
      // depend on its chunk, so this changes the speed only
      const int64_t chunks = (M - m + kX8Rows<Q> - 1) / kX8Rows<Q>;
      const int64_t R = (M - m + chunks - 1) / chunks;
      dot_chunk<Q>(R, wg, nb, c, out, rows);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t l = 0; l < lanes; ++l) y[(m + r) * N + kGroup * g + l] = out[kGroup * r + l];
      m += R;
    }
  }
}

inline void matmul_x8(int64_t qtype, const Act& a, int64_t M, const uint8_t* w, float* y, int64_t N, int64_t begin,
                      int64_t end, uint8_t* rows) {
  switch (qtype) {
    case kQ4_0: return matmul_x8_q<kQ4_0>(a, M, w, y, N, begin, end, rows);
    case kQ5_0: return matmul_x8_q<kQ5_0>(a, M, w, y, N, begin, end, rows);
    case kQ4_K: return matmul_x8_q<kQ4_K>(a, M, w, y, N, begin, end, rows);
    default: return matmul_x8_q<kQ6_K>(a, M, w, y, N, begin, end, rows);
  }
}
