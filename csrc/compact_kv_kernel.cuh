// The compact_kv CUDA kernel, free of torch headers so it can be compiled on its own
// (tests compile it with nvcc on machines whose torch has no CUDA headers).
// Each thread owns one element column e of one (layer, k|v, row) and first gathers the
// `count` source values into registers, then scatters them: overlap-safe by construction.
// Positions outside [0, S) are skipped, never written.
#pragma once
#include <cstdint>

template <typename scalar_t, int MAX_N>
__global__ void compact_kv_kernel(scalar_t* __restrict__ kv, const int64_t* __restrict__ src,
                                  const int32_t* __restrict__ dst, const int32_t* __restrict__ cnt, int64_t B,
                                  int64_t S, int64_t E, int64_t N) {
  const int64_t r = blockIdx.y;  // (layer * 2 + k|v) * B + b
  const int64_t b = r % B;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= E) return;
  int64_t c = cnt[b] < 0 ? 0 : cnt[b];
  c = c < N ? c : N;
  scalar_t* base = kv + r * S * E + e;
  scalar_t v[MAX_N];
#pragma unroll 8
  for (int64_t i = 0; i < c; ++i) {
    const int64_t p = src[b * N + i];
    if (p >= 0 && p < S) v[i] = base[p * E];
  }
  const int64_t d = dst[b];
#pragma unroll 8
  for (int64_t i = 0; i < c; ++i) {
    const int64_t p = src[b * N + i], q = d + i;
    if (p >= 0 && p < S && q >= 0 && q < S) base[q * E] = v[i];
  }
}
