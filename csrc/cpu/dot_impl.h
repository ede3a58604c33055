// The integer dot products of the CPU kernels, included once per instruction set inside its own
// namespace (SE_AVX2 defined where the copy may use AVX2 intrinsics). Self-contained: its includes are guarded, so inside an ISA's namespace they add nothing.
//
// As llama.cpp does, the activations are quantized per block to int8 (`Act`, in quant_matmul.cpp: q, a float scale d per
// block of the weight's format, and the sums of q over every 16 values), so a block's dot product is
// an integer sum of small products, scaled once: y += d_w * d_x * sum_i(w_i * q_i) (+ the block's
// minimum or zero-point times d_x * sum_i(q_i)). The torch reference of this arithmetic is
// kernels/quant_matmul.py's `quant_matmul_q8_ref`. Each weight block is unpacked once per chunk of up
// to kMaxRows activation rows; every row takes the same operations whatever the chunk holds, so a row's
// result never depends on its neighbours (batch-invariant).
#pragma once
#include "common.h"
#include "dequant_impl.h"

// x [K] (a row, or any run of whole blocks) -> q [K] (round to nearest even, |q| <= 127), d [K/block],
// bs [K/16]. The torch reference does the same float operations (amax / 127, 127 / amax, x * that, rounded).
inline void quantize_row(const float* __restrict x, int64_t K, int64_t block, int8_t* __restrict q,
                         float* __restrict d, int16_t* __restrict bs) {
  for (int64_t b = 0; b < K / block; ++b) {
    const float* xb = x + b * block;
    float amax = 0.0f;
    for (int64_t l = 0; l < block; ++l) amax = std::max(amax, std::fabs(xb[l]));
    d[b] = amax / 127.0f;
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t l = 0; l < block; ++l)
      q[b * block + l] = int8_t(std::min(127.0f, std::max(-127.0f, std::nearbyint(xb[l] * id))));
  }
  for (int64_t g = 0; g < K / 16; ++g) {
    int s = 0;
    for (int l = 0; l < 16; ++l) s += q[16 * g + l];
    bs[g] = int16_t(s);
  }
}

// Q4_K / Q5_K: 8 six-bit scales and mins from the 12 packed bytes (ggml's get_scale_min_k4).
inline void scales_mins_k4(const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 8; ++j) {
    if (j < 4) {
      sc[j] = q[j] & 63;
      mn[j] = q[j + 4] & 63;
    } else {
      sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
  }
}

// A 32-value block of Q4_0 / Q5_0 / Q8_0 as signed values w (what multiplies d).
template <int Q>
inline void unpack32(const uint8_t* b, int8_t* w) {
  if constexpr (Q == kQ8_0) {
    std::memcpy(w, b + 2, 32);
  } else if constexpr (Q == kQ4_0) {
    for (int l = 0; l < 16; ++l) {
      w[l] = int8_t((b[2 + l] & 0xF) - 8);
      w[l + 16] = int8_t((b[2 + l] >> 4) - 8);
    }
  } else {  // Q5_0
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int l = 0; l < 16; ++l) {
      w[l] = int8_t(((b[6 + l] & 0xF) | (((qh >> l) & 1) << 4)) - 16);
      w[l + 16] = int8_t(((b[6 + l] >> 4) | (((qh >> (l + 16)) & 1) << 4)) - 16);
    }
  }
}

// Q4_K / Q5_K sub-block j (32 values, 0..15 or 0..31) of the super-block at b.
template <int Q>
inline void unpack_k_sub(const uint8_t* b, int j, uint8_t* v) {
  const uint8_t* qs = (Q == kQ5_K ? b + 48 : b + 16) + 32 * (j / 2);
  for (int l = 0; l < 32; ++l) v[l] = j % 2 ? qs[l] >> 4 : qs[l] & 0xF;
  if constexpr (Q == kQ5_K)
    for (int l = 0; l < 32; ++l) v[l] |= ((b[16 + l] >> j) & 1) << 4;
}

// Q6_K: the 256 values (0..63) of the super-block at b, in order.
inline void unpack_q6k(const uint8_t* b, uint8_t* v) {
  const uint8_t *ql = b, *qh = b + 128;
  for (int h = 0; h < 2; ++h, ql += 64, qh += 32, v += 128)
    for (int l = 0; l < 32; ++l) {
      v[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
      v[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
      v[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
      v[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
    }
}

#ifdef SE_AVX2
// One line of the weight stream into the cache `prefetch_to_l2` names (L2: prefetcht1, else L1). Inline
// assembly, not _mm_prefetch: GCC 12 deleted whole groups of prefetch builtins under this branch as dead
// code (at -O2 every one of prefetch_lines' below; at -O3 the sub-blocks' of the Q4_K loop), and volatile
// assembly is never deleted.
inline void prefetch_line(const char* p) {
  if (prefetch_to_l2)
    asm volatile("prefetcht1 %0" : : "m"(*p));
  else
    asm volatile("prefetcht0 %0" : : "m"(*p));
}

// The weight stream `prefetch_distance` bytes ahead of the block being multiplied, one call per block
// (`bytes` of it). At verify widths the kernel computes long enough per block that the hardware
// prefetchers alone leave DRAM idle between requests: a 5-row down projection (1536 x 8960) cost the
// time of its memory plus its compute, now about the larger of the two.
inline void prefetch_ahead(const uint8_t* w, int64_t bytes) {
  const char* p = reinterpret_cast<const char*>(w + prefetch_distance);
#pragma GCC unroll 32  // a constant count at every call: no loop left (3 lines of a Q4_0 group)
  for (int64_t o = 0; o < bytes; o += 64) prefetch_line(p + o);
}

// N lines of the stream from byte `offset` of the block at w, as prefetch_ahead. A block of many lines
// (Q4_K's 18, Q6_K's 27 in the x8 layout) asks for a few through its loop instead of all at its top: a
// burst sat ~350 instructions behind the loads of the block before it, so while one of those waited on
// memory the core did not reach the next burst and the stream stalled.
template <int N>
inline void prefetch_lines(const uint8_t* w, int64_t offset) {
  const char* p = reinterpret_cast<const char*>(w + prefetch_distance + offset);
#pragma GCC unroll 8
  for (int n = 0; n < N; ++n) prefetch_line(p + 64 * n);
}

// v, as the compiler must assume an unknown instruction rewrote it: keeps a running integer sum in
// order. GCC reassociates integer vector sums into trees that hold every term live at once, which
// spilled most of a chunk's products to the stack past 16 registers (the avx2 copy: docs/kernels.md).
inline __m256i in_order(__m256i v) {
  asm("" : "+v"(v));
  return v;
}

// acc + madd(a, b): int16 pairs multiplied and summed into int32 lanes (AVX-512 VNNI: one
// vpdpwssd). Our operands never reach madd's one overflow case, so both give the same integers.
inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) {
#ifdef SE_VNNI
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return in_order(_mm256_add_epi32(acc, _mm256_madd_epi16(a, b)));
#endif
}

// Sums of four u8 x s8 products per int32 lane (VNNI: one vpdpbusd). maddubs' int16 pair sums
// cannot saturate here (|a| <= 128, |b| <= 127), so both give the same integers.
inline __m256i dot_u8s8(__m256i a, __m256i b) {
#ifdef SE_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

// Q4_K / Q5_K: the 8 scales (bytes 0..7) and 8 mins (bytes 8..15) from the 12 packed bytes at q,
// with 32-bit word operations (get_scale_min_k4 for all eight at once).
inline __m128i scales_mins_k4_vec(const uint8_t* q) {
  uint32_t u[3];
  std::memcpy(u, q, 12);
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, low2 = 0x03030303;
  // built in registers: four 32-bit stores read back as one vector would stall store forwarding
  return _mm_set_epi32(int(((u[2] >> 4) & low4) | (((u[1] >> 6) & low2) << 4)), int(u[1] & low6),
                       int((u[2] & low4) | (((u[0] >> 6) & low2) << 4)), int(u[0] & low6));
}

// Eight int32 lanes -> one float, summed in a fixed order.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Unsigned weights (<= 63) times signed activations: 16 int16 pair sums, never saturating.
inline __m256i mul_u8s8(__m256i w, const int8_t* x) {
  return _mm256_maddubs_epi16(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// R rows of one K-quant weight row (Q4_K, Q5_K, Q6_K): per super-block the integer sums weighted by
// the integer sub-block scales stay int32 lanes, then one float multiply-add per super-block.
template <int Q, int R>
void dot_k(const uint8_t* w, int64_t nb, const Act& a, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0xF), one = _mm256_set1_epi8(1);
  for (int64_t i = 0; i < nb; ++i, w += kBytes[Q]) {
    prefetch_ahead(w, kBytes[Q]);
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    if constexpr (Q == kQ6_K) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
      const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
      for (int h = 0; h < 2; ++h) {
        const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h));
        const __m256i qb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128 + 32 * h));
        const __m256i three = _mm256_set1_epi8(3), hi2 = _mm256_set1_epi8(0x30);
        const __m256i v[4] = {
            _mm256_or_si256(_mm256_and_si256(qa, m4), _mm256_slli_epi16(_mm256_and_si256(qh, three), 4)),
            _mm256_or_si256(_mm256_and_si256(qb, m4),
                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), three), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qa, 4), m4), _mm256_and_si256(qh, hi2)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qb, 4), m4),
                            _mm256_and_si256(_mm256_srli_epi16(qh, 2), hi2))};
        for (int k = 0; k < 4; ++k) {  // values 128h + 32k ..: groups of 16 with scales 8h + 2k, 8h + 2k + 1
          const int g = 8 * h + 2 * k;
          const __m256i s = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
          for (int r = 0; r < R; ++r) isum[r] = madd_add(isum[r], mul_u8s8(v[k], a.qr(r) + 256 * i + 128 * h + 32 * k), s);
        }
      }
      for (int r = 0; r < R; ++r) {  // the values are q - 32: subtract 32 * sum_g sc_g * bs_g
        const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsr(r) + 16 * i));
        isum[r] = _mm256_sub_epi32(isum[r], _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
        const float dd = f16(w + 208) * a.dr(r)[i];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(dd), acc[r]);
      }
    } else {
      const __m128i scmn = scales_mins_k4_vec(w + 4);
      alignas(16) uint8_t sc[16];
      _mm_store_si128(reinterpret_cast<__m128i*>(sc), scmn);
      const __m128i mn = _mm_srli_si128(scmn, 8);  // a min per 16 values, against the sums bs:
      const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn, mn));
      const uint8_t* qs = Q == kQ5_K ? w + 48 : w + 16;
      const __m256i qh = Q == kQ5_K ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16)) : __m256i{};
      for (int c = 0; c < 4; ++c) {  // 32 bytes: sub-blocks 2c (low nibbles) and 2c + 1 (high)
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if constexpr (Q == kQ5_K) {
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
        }
        const __m256i sa = _mm256_set1_epi16(sc[2 * c]), sb = _mm256_set1_epi16(sc[2 * c + 1]);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.qr(r) + 256 * i + 64 * c;
          isum[r] = madd_add(madd_add(isum[r], mul_u8s8(lo, x), sa), mul_u8s8(hi, x + 32), sb);
        }
      }
      const float d = f16(w), dmin = f16(w + 2);
      for (int r = 0; r < R; ++r) {
        const __m256i bs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.bsr(r) + 16 * i));
        const float dx = a.dr(r)[i];
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_set1_ps(d * dx), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(bs, mins)), _mm256_set1_ps(dmin * dx), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

// Q5_0's fifth bits: 32 bits -> 32 bytes, 0x10 where the bit is set.
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// R rows of one Q4_0 / Q5_0 / Q8_0 weight row: signed weights times signed activations with
// maddubs(|w|, sign(x, w)) (|w| <= 128, |x| <= 127: no saturation), one float multiply-add per block.
template <int Q, int R>
void dot_32(const uint8_t* w, int64_t nb, const Act& a, float* out) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0xF);
  for (int64_t i = 0; i < nb; ++i, w += kBytes[Q]) {
    if (i % 2 == 0) prefetch_ahead(w, 2 * kBytes[Q]);  // blocks of 18-34 bytes: one call per two (about a line)
    __m256i v;
    if constexpr (Q == kQ8_0) {
      v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 2));
    } else {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (Q == kQ5_0 ? 6 : 2)));
      const __m256i nib = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), m4);
      v = Q == kQ5_0 ? _mm256_sub_epi8(_mm256_or_si256(nib, fifth_bits(w + 2)), _mm256_set1_epi8(16))
                     : _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
    }
    const __m256i av = _mm256_sign_epi8(v, v);
    const float d = f16(w);
    for (int r = 0; r < R; ++r) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.qr(r) + 32 * i));
      const __m256i s = dot_u8s8(av, _mm256_sign_epi8(x, v));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(d * a.dr(r)[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(acc[r]);
}

template <int Q, int R>
void dot_rows(const uint8_t* w, int64_t nb, const Act& a, float* out) {
  if constexpr (Q == kQ4_K || Q == kQ5_K || Q == kQ6_K)
    dot_k<Q, R>(w, nb, a, out);
  else
    dot_32<Q, R>(w, nb, a, out);
}
#else
// Plain C++ of the same integer arithmetic: one block at a time, a float sum per row.
template <int Q, int R>
void dot_rows(const uint8_t* w, int64_t nb, const Act& a, float* out) {
  float acc[R] = {};
  for (int64_t i = 0; i < nb; ++i, w += kBytes[Q]) {
    if constexpr (Q == kQ4_K || Q == kQ5_K) {
      uint8_t sc[8], mn[8], v[32];
      scales_mins_k4(w + 4, sc, mn);
      int sumi[R] = {}, summ[R] = {};
      for (int j = 0; j < 8; ++j) {
        unpack_k_sub<Q>(w, j, v);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = a.qr(r) + 256 * i + 32 * j;
          int s = 0;
          for (int l = 0; l < 32; ++l) s += v[l] * x[l];
          sumi[r] += sc[j] * s;
          summ[r] += mn[j] * (a.bsr(r)[16 * i + 2 * j] + a.bsr(r)[16 * i + 2 * j + 1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const float dx = a.dr(r)[i];
        acc[r] += f16(w) * dx * float(sumi[r]) - f16(w + 2) * dx * float(summ[r]);
      }
    } else if constexpr (Q == kQ6_K) {
      uint8_t v[256];
      unpack_q6k(w, v);
      const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.qr(r) + 256 * i;
        int sumi = 0;
        for (int g = 0; g < 16; ++g) {
          int s = 0;
          for (int l = 0; l < 16; ++l) s += v[16 * g + l] * x[16 * g + l];
          sumi += sc[g] * (s - 32 * a.bsr(r)[16 * i + g]);
        }
        acc[r] += f16(w + 208) * a.dr(r)[i] * float(sumi);
      }
    } else {
      int8_t v[32];
      unpack32<Q>(w, v);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.qr(r) + 32 * i;
        int s = 0;
        for (int l = 0; l < 32; ++l) s += v[l] * x[l];
        acc[r] += f16(w) * a.dr(r)[i] * float(s);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}
#endif

// Activation rows per unpacked weight block, as many as stay in registers: two per row (its integer
// and float sums) beside the unpacked block, so 8 with AVX-512's 32; AVX2's 16 hold 5 with the sums
// kept in order (`in_order`: 5 rows in one chunk took 0.72-0.88x the time of 4 + 1; docs/kernels.md).
#if defined(SE_WIDE)
constexpr int64_t kMaxRows = 8;
#elif defined(SE_AVX2)
constexpr int64_t kMaxRows = 5;
#else
constexpr int64_t kMaxRows = 4;
#endif

// The next chunk's row count when `left` rows remain and a chunk holds at most `most`: balanced, so
// 8 rows at most 5 are 4 + 4, not 5 + 3. A row's operations do not depend on its chunk (speed only).
inline int64_t chunk_rows(int64_t left, int64_t most) {
  const int64_t chunks = (left + most - 1) / most;
  return (left + chunks - 1) / chunks;
}

// f(std::integral_constant<int, n>) for a chunk of n <= R rows: the count as a template argument.
template <int R, class F>
inline void with_rows(int64_t n, F&& f) {
  if constexpr (R > 1) {
    if (n < R) return with_rows<R - 1>(n, f);
  }
  f(std::integral_constant<int, R>{});
}

// y [M, N] (rows begin..end of the weight) = x @ W.T, chunks of up to kMaxRows activation rows per weight row.
template <int Q>
void matmul_q8(const Act& a, int64_t M, const uint8_t* w, int64_t row_bytes, float* y, int64_t N, int64_t begin,
               int64_t end) {
  const int64_t nb = a.K / kValues[Q];
  float out[kMaxRows];
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* wn = w + n * row_bytes;
    for (int64_t m = 0; m < M;) {
      const int64_t R = chunk_rows(M - m, kMaxRows);
      const Act c = a.from_row(m);
      with_rows<kMaxRows>(R, [&](auto rc) { dot_rows<Q, decltype(rc)::value>(wn, nb, c, out); });
      for (int64_t r = 0; r < R; ++r) y[(m + r) * N + n] = out[r];
      m += R;
    }
  }
}

inline void matmul_int(int64_t qtype, const Act& a, int64_t M, const uint8_t* w, int64_t row_bytes, float* y,
                       int64_t N, int64_t begin, int64_t end) {
  switch (qtype) {
    case kQ4_0: return matmul_q8<kQ4_0>(a, M, w, row_bytes, y, N, begin, end);
    case kQ5_0: return matmul_q8<kQ5_0>(a, M, w, row_bytes, y, N, begin, end);
    case kQ8_0: return matmul_q8<kQ8_0>(a, M, w, row_bytes, y, N, begin, end);
    case kQ4_K: return matmul_q8<kQ4_K>(a, M, w, row_bytes, y, N, begin, end);
    case kQ5_K: return matmul_q8<kQ5_K>(a, M, w, row_bytes, y, N, begin, end);
    default: return matmul_q8<kQ6_K>(a, M, w, row_bytes, y, N, begin, end);
  }
}
