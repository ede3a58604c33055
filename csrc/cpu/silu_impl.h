// fp32 SiLU-and-mul a vector register of lanes at a time (16 with AVX-512, 8 with AVX2, 4 with SSE2),
// for the CPU kernels: included once per instruction set inside its own namespace (with `#pragma GCC
// target` around it). Self-contained: its includes are guarded, so inside an ISA's namespace they add
// nothing. The lanes are the register's own width: GCC lowered a 16-lane vector's compares and
// selects to scalar code on AVX2 (32 vcmpnltss and 95 vmovss a chunk; 3.3 ns a value on 2 threads).
//
// Why: the scalar loop (glibc expf and a division per value) took ~8% of a verify's time on a 1.5B
// GGUF target, more than the attention. This exp is our own: a Cody-Waite reduction to 2^n e^r and
// Cephes' degree-6 polynomial, every step one IEEE operation in float with multiply-adds never fused
// (fp-contract off below), so every copy (baseline SSE2 to AVX-512) and every lane, the tail's
// included, gives the same bits. Its spec is kernels/silu_and_mul.py's `silu_lanes_ref`. The SiLU is within
// 2.2 ulp of the exact value over 2M points of [-88.37, 90] (torch's own differs from it by 1-2).
#pragma once
#include "common.h"
#include "dequant_impl.h"
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

typedef vlane silu_vf;  // this instruction set's own float vector (dequant_impl.h)
typedef int32_t silu_vi __attribute__((vector_size(sizeof(vlane))));
constexpr int64_t kSiluLanes = kLanes;

// exp(a) lane by lane: a > 88.37 gives +inf (2^n would leave the float range), a < -87.3 is taken as
// -87.3 (exp under 2^-125: 1 + exp(a) rounds to 1 there, which is all SiLU needs), NaN stays NaN.
inline silu_vf exp_lanes(silu_vf a) {
  const silu_vf zero = {};
  const silu_vi over = a > 88.37f;
  a = a > 88.37f ? zero + 88.37f : a;
  a = a < -87.3f ? zero - 87.3f : a;
  const silu_vf n = (a * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(a / ln 2), ties to even
  silu_vf r = a - n * 0.693359375f;  // ln 2 in two parts: n * 0.693359375 is exact for |n| <= 127
  r = r - n * -2.12194440e-4f;
  silu_vf p = zero + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const silu_vf e = p * (r * r) + r + 1.0f;
  const silu_vi bits = (__builtin_convertvector(n, silu_vi) + 127) << 23;  // 2^n, n in [-126, 127]
  const silu_vf y = e * (silu_vf)bits;
  return over ? zero + __builtin_inff() : y;
}

inline silu_vf silu_mul_lanes(silu_vf x, silu_vf y) { return x / (1.0f + exp_lanes(-x)) * y; }

// o[i] = silu(g[i]) * u[i] for n values: x / (1 + exp(-x)), then the product, each rounded in fp32.
// The tail runs through the same lanes (zero-padded), so a value's bits never depend on where it sits.
inline void silu_mul(const float* g, const float* u, float* o, int64_t n) {
  silu_vf x, y, out;
  int64_t i = 0;
  for (; i + kSiluLanes <= n; i += kSiluLanes) {
    __builtin_memcpy(&x, g + i, sizeof x);
    __builtin_memcpy(&y, u + i, sizeof y);
    out = silu_mul_lanes(x, y);
    __builtin_memcpy(o + i, &out, sizeof out);
  }
  if (i == n) return;
  x = y = silu_vf{};
  __builtin_memcpy(&x, g + i, (n - i) * sizeof(float));
  __builtin_memcpy(&y, u + i, (n - i) * sizeof(float));
  out = silu_mul_lanes(x, y);
  __builtin_memcpy(o + i, &out, (n - i) * sizeof(float));
}

#pragma GCC pop_options
