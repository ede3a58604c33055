// The avx512 copy of the CPU kernels: the shared hot loops compiled for this instruction set alone.
#include "common.h"

#ifdef SPECENGINE_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace se {
namespace avx512 {
#define SE_AVX2 1
#define SE_WIDE 1
#include "dequant_impl.h"
#include "dot_impl.h"
#include "x8_impl.h"
#include "attention_impl.h"
#include "silu_impl.h"
}  // namespace avx512

Kernels avx512_kernels() {
  return {"avx512", avx512::quantize_row, avx512::matmul_int, avx512::matmul_x8, avx512::dequantize, avx512::dense_matmul,
          avx512::row_attention, avx512::silu_mul};
}
}  // namespace se
#pragma GCC pop_options
#endif  // SPECENGINE_X86
