// The matvec of the CPU kernels on weights interleaved 8 rows at a time (the lanes: x8_lanes_impl.h):
// the scale unpacking, the float conversions and the final sum are shared by eight rows, and each
// row's sum ends in its own lane. Included once per instruction set inside its own namespace; its
// includes are guarded (no-ops there). The integer sums are those of dot_rows (dot_impl.h) exactly;
// only the float order differs. Every activation row takes the same operations whatever the chunk
// holds: batch-invariant.
#pragma once
#include "common.h"
#include "dot_impl.h"
#include "x8_lanes_impl.h"
#include "x8_zmm_impl.h"

#ifdef SE_AVX2
// R activation rows times one group of 8 Q4_K rows -> out [R][8].
template <int R>
void dot_q4k_x8(const uint8_t* w, int64_t nb, const Act& a, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0xF);
  for (int64_t i = 0; i < nb; ++i, w += kGroup * kBytes[kQ4_K]) {
    __m256i sc[2], mn[2];
    prefetch_lines<2>(w, 0);  // the scales; each sub-block asks for its 128 bytes (prefetch_lines)
    q4k_scales_mins(w, sc, mn);
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    const uint8_t* qs = w + kQ4KValues;
    // The low (j even) or high nibbles of chunk j / 2. Up to 3 rows unrolled whole: j is a constant in
    // each copy, so each fold's byte pattern is too and no branch is left on j's parity (one row +19-21%
    // compute rate on Zen 4; 2-3 rows 0.71-1.0x the time on Zen 3); 4-5 rows lost up to 7% unrolled,
    // streamed (docs/design.md, "Experiments", CPU kernels).
    auto sub_block = [&](int j) __attribute__((always_inline)) {
      prefetch_lines<2>(w, kQ4KValues + 128 * j);
      __m256i p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {  // values 32j + 4t .. 32j + 4t + 3 of each row
        const __m256i q = load256(qs + 256 * (j / 2) + 32 * t);
        const __m256i v = j % 2 ? _mm256_and_si256(_mm256_srli_epi16(q, 4), m4) : _mm256_and_si256(q, m4);
        for (int r = 0; r < R; ++r) p[r] = dot_acc(p[r], v, bcast4(a.qr(r) + 256 * i + 32 * j + 4 * t));
      }  // int16 pairs: 8 x 2 x 15 x 127 fits
      for (int r = 0; r < R; ++r) isum[r] = fold<false>(isum[r], p[r], sc[j / 4], j % 4);
    };
    if constexpr (R <= 3) {
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
        const __m256i qh = load256(w + kQ5High);
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

// isum[r] += the sums of sub-blocks 8h + 2k + s, k = 0..3, of values 128h + 32k + 16s + 0..15.
#ifdef SE_VNNI
// int32 lanes: each load of low-nibble and high-bit bytes serves all four k, one fold per sub-block.
template <int R>
inline void q6_half(const uint8_t* w, int h, int s, int64_t i, const Act& a, const __m256i* words, __m256i* isum) {
  const uint8_t* vb = w + kQ6Values + 96 * 8 * h;  // per t: the 32 bytes of A, of B, of C
  const int8_t* x0 = a.qr(0) + 256 * i + 128 * h;
  __m256i p0[R], p1[R], p2[R], p3[R];  // one per k: named, so they stay in registers
  for (int r = 0; r < R; ++r) p0[r] = p1[r] = p2[r] = p3[r] = _mm256_setzero_si256();
  for (int t = 4 * s; t < 4 * s + 4; ++t) {
    const __m256i A = load256(vb + 96 * t), B = load256(vb + 96 * t + 32), C = load256(vb + 96 * t + 64);
    const __m256i v0 = q6_values<0>(A, C), v1 = q6_values<1>(B, C), v2 = q6_values<2>(A, C), v3 = q6_values<3>(B, C);
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
  const uint8_t* vb = w + kQ6Values + 96 * 8 * h;
  const int8_t* x0 = a.qr(0) + 256 * i + 128 * h;
  const int g = 8 * h + s;
  auto one_k = [&](auto kc) __attribute__((always_inline)) {
    constexpr int k = decltype(kc)::value;
    if constexpr (k < 3) prefetch_lines<2>(w, kQ6Values + 96 * 8 * h + 384 * s + 128 * k);
    for (int t0 = 4 * s; t0 < 4 * s + 4; t0 += 2) {
      __m256i p[R];
      for (int r = 0; r < R; ++r) p[r] = _mm256_setzero_si256();
      for (int t = t0; t < t0 + 2; ++t) {
        const __m256i ab = load256(vb + 96 * t + 32 * (k % 2));  // C only where k needs it
        const __m256i v = q6_values<k>(ab, k < 2 ? ab : load256(vb + 96 * t + 64));
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
#ifdef SE_VNNI
    prefetch_ahead(w, kGroup * kBytes[kQ6_K]);
#else
    prefetch_lines<3>(w, 0);  // d and the scales; each q6_half asks for its 384 bytes (prefetch_lines)
#endif
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    __m256i words[4];
    for (int k = 0; k < 4; ++k) words[k] = load256(w + kQ6Scales + 32 * k);
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
// per row, so 8 fit. AVX2's 16 hold kMaxRows' 5: five rows in one chunk cost 0.70-0.74x of 3 + 2 with
// the sums kept in order (`in_order`; docs/kernels.md).
#if defined(SE_WIDE) && !defined(SE_VNNI)
template <int Q>
constexpr int64_t kX8Rows = Q == kQ6_K ? 5 : kMaxRows;
#else
template <int Q>
constexpr int64_t kX8Rows = kMaxRows;
#endif

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
      const int64_t R = chunk_rows(M - m, kX8Rows<Q>);
      const Act c = a.from_row(m);
      with_rows<kX8Rows<Q>>(R, [&](auto rc) { dot_group<Q, decltype(rc)::value>(wg, nb, c, out, rows); });
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
