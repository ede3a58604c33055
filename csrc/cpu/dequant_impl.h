// Dequantization for the CPU kernels (prefill and embedding rows), included once per instruction set
// inside its own namespace (with `#pragma GCC target` around it), so each copy is vectorized for that
// ISA. Self-contained: its includes are guarded, so inside an ISA's namespace they add nothing. It is ggml-quants.c's, operation for operation (kernels/quant_matmul.py is
// the spec).
#pragma once
#include "common.h"

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef SE_AVX2
  return _cvtsh_ss(h);  // F16C: one instruction, the same value
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

inline void scale_min_k4(int j, const uint8_t* q, float d, float dmin, float* sc, float* mn) {
  int s, m;
  if (j < 4) {
    s = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    s = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
  *sc = d * float(s);
  *mn = dmin * float(m);
}

// One row of nb blocks of format Q at b -> y.
template <int Q>
void dequant_row(const uint8_t* __restrict b, float* __restrict y, int64_t nb) {
  for (int64_t i = 0; i < nb; ++i, b += kBytes[Q], y += kValues[Q]) {
    if constexpr (Q == kQ4_0) {
      const float d = f16(b);
      for (int l = 0; l < 16; ++l) y[l] = d * (float(b[2 + l] & 0xF) - 8.0f);
      for (int l = 0; l < 16; ++l) y[l + 16] = d * (float(b[2 + l] >> 4) - 8.0f);
    } else if constexpr (Q == kQ5_0) {
      const float d = f16(b);
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      int32_t q[32];  // 32-bit lanes throughout: one vectorized loop (variable shifts) for all 32 values
      for (int l = 0; l < 16; ++l) {
        q[l] = b[6 + l] & 0xF;
        q[l + 16] = b[6 + l] >> 4;
      }
      for (int l = 0; l < 32; ++l) y[l] = d * (float(q[l] | int32_t(((qh >> l) & 1u) << 4)) - 16.0f);
    } else if constexpr (Q == kQ8_0) {
      const float d = f16(b);
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int l = 0; l < 32; ++l) y[l] = d * float(q[l]);
    } else if constexpr (Q == kQ4_K || Q == kQ5_K) {
      const float d = f16(b), dmin = f16(b + 2);
      const uint8_t* qh = b + 16;
      const uint8_t* qs = Q == kQ5_K ? b + 48 : b + 16;
      for (int c = 0; c < 4; ++c) {  // 64 values: sub-blocks 2c (low nibbles) and 2c + 1 (high)
        float d1, m1, d2, m2;
        scale_min_k4(2 * c, b + 4, d, dmin, &d1, &m1);
        scale_min_k4(2 * c + 1, b + 4, d, dmin, &d2, &m2);
        const uint8_t* q = qs + 32 * c;
        float* o = y + 64 * c;
        int32_t lo[32], hi[32];  // 32-bit lanes: the conversions below vectorize cleanly
        for (int l = 0; l < 32; ++l) {
          lo[l] = q[l] & 0xF;
          hi[l] = q[l] >> 4;
        }
        if constexpr (Q == kQ5_K) {
          for (int l = 0; l < 32; ++l) {
            lo[l] |= ((qh[l] >> (2 * c)) & 1) << 4;
            hi[l] |= ((qh[l] >> (2 * c + 1)) & 1) << 4;
          }
        }
        for (int l = 0; l < 32; ++l) o[l] = d1 * float(lo[l]) - m1;
        for (int l = 0; l < 32; ++l) o[l + 32] = d2 * float(hi[l]) - m2;
      }
    } else {  // Q6_K: two halves of 128 values, each 8 runs of 16 with one scale
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = f16(b + 208);
      float* o = y;
      for (int h = 0; h < 2; ++h, o += 128, ql += 64, qh += 32, sc += 8) {
        for (int r = 0; r < 2; ++r) {  // l in [16r, 16r + 16): scale index is = r
          const float s1 = d * float(sc[r]), s2 = d * float(sc[r + 2]), s3 = d * float(sc[r + 4]),
                      s4 = d * float(sc[r + 6]);
          for (int j = 0; j < 16; ++j) {
            const int l = 16 * r + j;
            o[l] = s1 * float(int((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
            o[l + 32] = s2 * float(int((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
            o[l + 64] = s3 * float(int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            o[l + 96] = s4 * float(int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
          }
        }
      }
    }
  }
}

inline void dequantize(int64_t qtype, const uint8_t* w, int64_t nb, float* y) {
  switch (qtype) {
    case kQ4_0: return dequant_row<kQ4_0>(w, y, nb);
    case kQ5_0: return dequant_row<kQ5_0>(w, y, nb);
    case kQ8_0: return dequant_row<kQ8_0>(w, y, nb);
    case kQ4_K: return dequant_row<kQ4_K>(w, y, nb);
    case kQ5_K: return dequant_row<kQ5_K>(w, y, nb);
    default: return dequant_row<kQ6_K>(w, y, nb);
  }
}

// ---------------------------------------------------------------- dense bf16 / fp32 weights, few rows
// y[m] = sum_k x[m, k] * w[k] for R activation rows: 16 lanes of accumulators per row, held as this
// instruction set's own vectors (one zmm, two ymm or four xmm), lanes summed in a fixed order (0..15).
// Every row takes the same operations whatever R is, so its result never depends on its neighbours,
// and every copy the same per-lane sums. Native widths: as one 64-byte GCC vector the AVX2 copy kept
// its accumulators on the stack and rebuilt them lane by lane each step (bf16 at one row 4 GB/s of
// weights, 5x slower than F.linear; 2-core AVX2 EPYC, 2026-12-04).
#if defined(SE_WIDE)
typedef float vlane __attribute__((vector_size(64)));
#elif defined(SE_AVX2)
typedef float vlane __attribute__((vector_size(32)));
#else
typedef float vlane __attribute__((vector_size(16)));
#endif
constexpr int kLanes = sizeof(vlane) / sizeof(float), kParts = 16 / kLanes;

// One vector from unaligned floats, as one load (a 64-byte memcpy into an array of vectors went through
// the stack in 16-byte pieces, and reading them back as one vector stalled on store forwarding).
inline vlane load_lane(const float* p) {
  vlane v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int R>
void dot_rows_f32(const float* __restrict x, int64_t K, const float* __restrict w, float* out) {
  vlane acc[R][kParts] = {};
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    for (int p = 0; p < kParts; ++p) {
      const vlane wv = load_lane(w + k + p * kLanes);
      for (int r = 0; r < R; ++r) acc[r][p] += load_lane(x + r * K + k + p * kLanes) * wv;
    }
  }
  for (int r = 0; r < R; ++r) {
    float tail = 0.0f;
    for (int64_t t = k; t < K; ++t) tail += x[r * K + t] * w[t];
    float s = 0.0f;
    for (int p = 0; p < kParts; ++p)
      for (int j = 0; j < kLanes; ++j) s += acc[r][p][j];
    out[r] = s + tail;
  }
}

// Rows begin..end of y [M, N] = x [M, K] @ W.T for a dense weight (bf16: each row widened once into
// `row`, in L1, then multiplied with every activation row; fp32: read in place). One read of the
// weights serves all M rows: what a verify needs where the BLAS costs ~M decodes.
inline void dense_matmul(bool bf16, const float* x, int64_t M, int64_t K, const void* w, float* y, int64_t N,
                         int64_t begin, int64_t end, float* row) {
  float out[4];
  for (int64_t n = begin; n < end; ++n) {
    const float* wr;
    if (bf16) {
      const uint16_t* src = static_cast<const uint16_t*>(w) + n * K;
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t bits = uint32_t(src[k]) << 16;
        std::memcpy(row + k, &bits, 4);
      }
      wr = row;
    } else {
      wr = static_cast<const float*>(w) + n * K;
    }
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      dot_rows_f32<4>(x + m * K, K, wr, out);
      for (int r = 0; r < 4; ++r) y[(m + r) * N + n] = out[r];
    }
    for (; m < M; ++m) {
      dot_rows_f32<1>(x + m * K, K, wr, out);
      y[m * N + n] = out[0];
    }
  }
}
