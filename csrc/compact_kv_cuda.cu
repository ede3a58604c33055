// CUDA compact_kv launcher: one launch for all layers, K and V and rows; no allocation,
// no host sync, current stream (so it can be captured in a CUDA graph).
#include "compact_kv.h"
#include "compact_kv_kernel.cuh"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

namespace {

template <typename scalar_t, int MAX_N>
void launch(torch::Tensor& kv, torch::Tensor& src, torch::Tensor& dst, torch::Tensor& cnt) {
  const int64_t B = kv.size(2), S = kv.size(3), E = kv.size(4) * kv.size(5);
  constexpr int threads = compact_kv_threads<scalar_t, MAX_N>();
  TORCH_CHECK(kv.size(0) * 2 * B <= 65535, "layers * 2 * batch must be <= 65535 (CUDA grid y)");
  dim3 grid((E + threads - 1) / threads, kv.size(0) * 2 * B);
  compact_kv_kernel<scalar_t, MAX_N, threads><<<grid, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      kv.data_ptr<scalar_t>(), src.data_ptr<int64_t>(), dst.data_ptr<int32_t>(), cnt.data_ptr<int32_t>(), B, S, E,
      src.size(1));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

void compact_kv_cuda(torch::Tensor kv, torch::Tensor src_pos, torch::Tensor dst_start, torch::Tensor count) {
  const c10::cuda::CUDAGuard guard(kv.device());
  const int64_t N = src_pos.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv.scalar_type(), "compact_kv_cuda", [&] {
    if (N <= 16) {
      launch<scalar_t, 16>(kv, src_pos, dst_start, count);
    } else if (N <= 64) {
      launch<scalar_t, 64>(kv, src_pos, dst_start, count);
    } else {
      launch<scalar_t, 256>(kv, src_pos, dst_start, count);  // kMaxPositions
    }
  });
}
