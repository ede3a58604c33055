// The compact_kv CUDA kernel, free of torch headers so it can be compiled on its own
// (tests compile it with nvcc on machines whose torch has no CUDA headers).
// Each thread owns one element column e of one (layer, k|v, row) and first gathers the
// `count` source values, then scatters them: overlap-safe by construction. The gathered
// values live in shared memory, one column per thread ([MAX_N][THREADS], so a warp's
// accesses hit distinct banks): a per-thread array indexed by a run-time count would be
// placed in local memory. Positions outside [0, S) are skipped, never written.
#pragma once
#include <cstdint>

// Threads per block for a buffer of MAX_N values: at most 32 KiB of shared memory per block
// (under the 48 KiB static limit) and at most 128 threads.
template <typename scalar_t, int MAX_N>
constexpr int compact_kv_threads() {
  constexpr int fit = 32768 / (MAX_N * static_cast<int>(sizeof(scalar_t)));
  return fit < 128 ? fit : 128;
}

template <typename scalar_t, int MAX_N, int THREADS>
__global__ void __launch_bounds__(THREADS) compact_kv_kernel(scalar_t* __restrict__ kv,
                                                             const int64_t* __restrict__ src,
                                                             const int32_t* __restrict__ dst,
                                                             const int32_t* __restrict__ cnt, int64_t B, int64_t S,
                                                             int64_t E, int64_t N) {
  // raw bytes: scalar types with constructors (half, bfloat16) cannot be __shared__ arrays
  __shared__ alignas(16) unsigned char smem[MAX_N * THREADS * sizeof(scalar_t)];
  scalar_t* buf = reinterpret_cast<scalar_t*>(smem) + threadIdx.x;
  const int64_t r = blockIdx.y;  // (layer * 2 + k|v) * B + b
  const int64_t b = r % B;
  const int64_t e = static_cast<int64_t>(blockIdx.x) * THREADS + threadIdx.x;
  if (e >= E) return;  // no __syncthreads below: each thread only touches its own column
  int64_t c = cnt[b] < 0 ? 0 : cnt[b];
  c = c < N ? c : N;
  c = c < MAX_N ? c : MAX_N;
  scalar_t* base = kv + r * S * E + e;
  for (int64_t i = 0; i < c; ++i) {
    const int64_t p = src[b * N + i];
    if (p >= 0 && p < S) buf[i * THREADS] = base[p * E];
  }
  const int64_t d = dst[b];
  for (int64_t i = 0; i < c; ++i) {
    const int64_t p = src[b * N + i], q = d + i;
    if (p >= 0 && p < S && q >= 0 && q < S) base[q * E] = buf[i * THREADS];
  }
}
