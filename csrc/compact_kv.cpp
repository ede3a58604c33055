// pybind11 module `specengine._kvext`: compact_kv on CPU (here) and CUDA (compact_kv_cuda.cu).
#include "compact_kv.h"

#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>
#include <vector>

namespace {

void check_inputs(const torch::Tensor& kv, const torch::Tensor& src_pos, const torch::Tensor& dst_start,
                  const torch::Tensor& count) {
  TORCH_CHECK(kv.dim() == 6, "kv_buffer must be [layers, 2, batch, max_seq_len, kv_heads, head_dim]");
  TORCH_CHECK(kv.size(1) == 2, "kv_buffer dim 1 must hold K and V (size 2)");
  TORCH_CHECK(kv.is_contiguous(), "kv_buffer must be contiguous");
  TORCH_CHECK(kv.scalar_type() == at::kFloat || kv.scalar_type() == at::kHalf || kv.scalar_type() == at::kBFloat16,
              "kv_buffer dtype must be float32, float16 or bfloat16");
  const int64_t B = kv.size(2);
  TORCH_CHECK(src_pos.dim() == 2 && src_pos.size(0) == B && src_pos.scalar_type() == at::kLong && src_pos.is_contiguous(),
              "src_pos must be a contiguous int64 tensor [batch, N]");
  TORCH_CHECK(src_pos.size(1) <= kMaxPositions, "src_pos holds at most ", kMaxPositions, " positions per row");
  TORCH_CHECK(dst_start.dim() == 1 && dst_start.size(0) == B && dst_start.scalar_type() == at::kInt,
              "dst_start must be an int32 tensor [batch]");
  TORCH_CHECK(count.dim() == 1 && count.size(0) == B && count.scalar_type() == at::kInt,
              "count must be an int32 tensor [batch]");
  TORCH_CHECK(src_pos.device() == kv.device() && dst_start.device() == kv.device() && count.device() == kv.device(),
              "kv_buffer, src_pos, dst_start and count must be on the same device");
}

template <typename scalar_t>
void compact_rows(scalar_t* kv, const int64_t* src, const int32_t* dst, const int32_t* cnt, int64_t rows, int64_t B,
                  int64_t S, int64_t E, int64_t N) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> tmp;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r % B;
      const int64_t c = std::min<int64_t>(std::max<int32_t>(cnt[b], 0), N);
      scalar_t* base = kv + r * S * E;
      tmp.resize(c * E);
      for (int64_t i = 0; i < c; ++i) {  // gather first: sources may overlap destinations
        const int64_t p = src[b * N + i];
        if (p >= 0 && p < S) std::memcpy(&tmp[i * E], base + p * E, E * sizeof(scalar_t));
      }
      for (int64_t i = 0; i < c; ++i) {
        const int64_t p = src[b * N + i], q = static_cast<int64_t>(dst[b]) + i;
        if (p >= 0 && p < S && q >= 0 && q < S) std::memcpy(base + q * E, &tmp[i * E], E * sizeof(scalar_t));
      }
    }
  });
}

}  // namespace

void compact_kv_cpu(torch::Tensor kv, torch::Tensor src_pos, torch::Tensor dst_start, torch::Tensor count) {
  const int64_t L2 = kv.size(0) * 2, B = kv.size(2), S = kv.size(3), E = kv.size(4) * kv.size(5);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, kv.scalar_type(), "compact_kv_cpu", [&] {
    compact_rows<scalar_t>(kv.data_ptr<scalar_t>(), src_pos.data_ptr<int64_t>(), dst_start.data_ptr<int32_t>(),
                           count.data_ptr<int32_t>(), L2 * B, B, S, E, src_pos.size(1));
  });
}

void compact_kv(torch::Tensor kv, torch::Tensor src_pos, torch::Tensor dst_start, torch::Tensor count) {
  check_inputs(kv, src_pos, dst_start, count);
  if (kv.is_cuda()) {
#ifdef WITH_CUDA
    compact_kv_cuda(kv, src_pos, dst_start, count);
#else
    TORCH_CHECK(false, "specengine._kvext was built without CUDA");
#endif
  } else {
    compact_kv_cpu(kv, src_pos, dst_start, count);
  }
}

bool built_with_cuda() {
#ifdef WITH_CUDA
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "specengine KV-cache compaction (gather-then-scatter of accepted tree paths, all layers at once)";
  m.def("compact_kv", &compact_kv, "compact_kv(kv_buffer, src_pos, dst_start, count)");
  m.def("built_with_cuda", &built_with_cuda);
  m.attr("max_positions") = kMaxPositions;
}
