// The avx2 copy of the CPU kernels: the shared hot loops compiled for this instruction set alone.
#include "common.h"

#ifdef SPECENGINE_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace se {
namespace avx2 {
#define SE_AVX2 1
#include "dequant_impl.h"
#include "dot_impl.h"
#include "x8_impl.h"
#include "attention_impl.h"
#include "silu_impl.h"
}  // namespace avx2

Kernels avx2_kernels() {
  return {"avx2", avx2::quantize_row, avx2::matmul_int, avx2::matmul_x8, avx2::dequantize, avx2::dense_matmul,
          avx2::row_attention, avx2::silu_mul};
}
}  // namespace se
#pragma GCC pop_options
#endif  // SPECENGINE_X86
