// The compiled CPU ops that csrc/decode_stack.cpp chains: defined in quant_matmul.cpp (GGUF matmuls,
// the per-row attention) and fused_ops_cpu.cpp (the fused step), each also exposed on its own.
#pragma once
// torch/types.h, not torch/extension.h: the whole C++ frontend costs ~13 s more to parse per unit
// (23.7 against 10.5 s on a 2-core Zen 5), paid by each of the three units that include this header
#include <torch/library.h>
#include <torch/types.h>

#include <tuple>

torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype);
torch::Tensor quant_matmul_x8(const torch::Tensor& x, const torch::Tensor& wp, int64_t qtype, int64_t N);
torch::Tensor row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& lens, const c10::optional<torch::Tensor>& tree, double scale,
                            const c10::optional<torch::Tensor>& window);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_cpu(const torch::Tensor& x,
                                                          const c10::optional<torch::Tensor>& residual,
                                                          const torch::Tensor& weight, double eps);
torch::Tensor silu_and_mul_cpu(const torch::Tensor& gu);
void silu_mul_f32_rows(const float* gu, float* out, int64_t R, int64_t I);  // its fp32 lanes (cpu/silu_impl.h)
torch::Tensor rope_kv_write_cpu(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                const torch::Tensor& wpos, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                int64_t Hq, int64_t Hkv, const c10::optional<torch::Tensor>& q_w,
                                const c10::optional<torch::Tensor>& k_w, double eps);

