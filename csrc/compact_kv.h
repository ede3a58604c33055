// KV-cache compaction: the contract shared by the CPU and CUDA implementations.
#pragma once
#include <torch/types.h>  // not torch/extension.h: ~13 s more to parse (cpu_ops.h)

// For every layer, K and V, and row b: copy positions src_pos[b, :count[b]] to
// dst_start[b] .. dst_start[b] + count[b] - 1, as a gather-then-scatter (overlap-safe).
// Positions outside [0, S) are skipped (never written), so bad indices cannot corrupt memory.
constexpr int64_t kMaxPositions = 256;

void compact_kv_cpu(torch::Tensor kv, torch::Tensor src_pos, torch::Tensor dst_start, torch::Tensor count);
#ifdef WITH_CUDA
void compact_kv_cuda(torch::Tensor kv, torch::Tensor src_pos, torch::Tensor dst_start, torch::Tensor count);
#endif
