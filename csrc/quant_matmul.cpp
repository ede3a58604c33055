// pybind11 module `specengine._quantext`: y = x @ dequantize(W).T with W kept as GGUF blocks, on CPU.
//
// Each weight row is dequantized once into a small fp32 buffer (it stays in L1) and multiplied with
// every activation row, so a verify of k rows reads the quantized weights once: the cost of k rows
// stays close to one until the multiply-adds, not the memory, bound it. The dequantization is
// ggml-quants.c's (the same float operations as the torch reference, kernels/quant_matmul.py); the
// dot products use 16 independent accumulators summed in a fixed order, so a row's result never
// depends on how many rows share the call (batch-invariant). The hot loops (quant_matmul_impl.h) are
// compiled for AVX-512, AVX2+FMA and baseline x86-64; CPUID picks one at run time (`isa()`).
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstring>
#include <string>
#include <vector>

namespace {

enum QType : int64_t { kQ4_0 = 0, kQ5_0 = 1, kQ8_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5 };
constexpr int64_t kValues[] = {32, 32, 32, 256, 256, 256};
constexpr int64_t kBytes[] = {18, 22, 34, 144, 176, 210};

namespace baseline {
#include "quant_matmul_impl.h"
}  // namespace baseline

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#include "quant_matmul_impl.h"
}  // namespace avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace avx512 {
#include "quant_matmul_impl.h"
}  // namespace avx512
#pragma GCC pop_options
#define SPECENGINE_X86 1
#endif

// One instruction set's copy of the hot loops.
struct Kernels {
  const char* isa;
  void (*matmul)(int64_t, const float*, int64_t, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t,
                 float*);
  void (*dequantize)(int64_t, const uint8_t*, int64_t, float*);
};

// The widest copy this CPU runs, chosen by CPUID once: never a per-machine constant.
const Kernels& kernels() {
  static const Kernels chosen = [] {
#ifdef SPECENGINE_X86
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
      return Kernels{"avx512", avx512::matmul, avx512::dequantize};
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return Kernels{"avx2", avx2::matmul, avx2::dequantize};
#endif
    return Kernels{"baseline", baseline::matmul, baseline::dequantize};
  }();
  return chosen;
}

std::string isa_name() { return kernels().isa; }

void check(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype) {
  TORCH_CHECK(qtype >= 0 && qtype <= kQ6_K, "unknown GGUF block format code ", qtype);
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "quant_matmul runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "the weight must be a contiguous uint8 [N, row_bytes] tensor of GGUF blocks");
  TORCH_CHECK(x.size(1) % kValues[qtype] == 0 && w.size(1) == x.size(1) / kValues[qtype] * kBytes[qtype],
              "x has ", x.size(1), " columns but a weight row holds ", w.size(1), " bytes of blocks of ",
              kValues[qtype], " values / ", kBytes[qtype], " bytes");
}

}  // namespace

torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype) {
  check(x, w, qtype);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), row_bytes = w.size(1);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const auto fn = kernels().matmul;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);  // one dequantized weight row: stays in L1
    fn(qtype, xp, M, K, wp, row_bytes, yp, N, begin, end, row.data());
  });
  return y;
}

torch::Tensor dequantize(const torch::Tensor& w, int64_t qtype, int64_t cols) {
  TORCH_CHECK(qtype >= 0 && qtype <= kQ6_K, "unknown GGUF block format code ", qtype);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "the weight must be a contiguous uint8 CPU tensor [N, row_bytes]");
  TORCH_CHECK(cols % kValues[qtype] == 0 && w.size(1) == cols / kValues[qtype] * kBytes[qtype],
              "row_bytes does not match ", cols, " columns");
  const int64_t N = w.size(0), nb = cols / kValues[qtype], row_bytes = w.size(1);
  auto y = torch::empty({N, cols}, torch::kFloat);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const auto fn = kernels().dequantize;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) fn(qtype, wp + n * row_bytes, nb, yp + n * cols);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_matmul", &quant_matmul, "x [M, K] fp32 @ dequantize(w [N, row_bytes] GGUF blocks).T -> [M, N]");
  m.def("dequantize", &dequantize, "w [N, row_bytes] GGUF blocks -> fp32 [N, cols]");
  m.def("isa", &isa_name, "the instruction set the kernels run with here (CPUID)");
}
