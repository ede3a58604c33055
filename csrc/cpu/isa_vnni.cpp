// The avx512vnni copy of the CPU kernels: the shared hot loops compiled for this instruction set alone.
#include "common.h"


#ifdef SPECENGINE_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own 512-bit intrinsics (their `__Y = __Y`)
namespace se {
namespace avx512vnni {
#define SE_AVX2 1
#define SE_WIDE 1
#define SE_VNNI 1
#include "dequant_impl.h"
#include "dot_impl.h"
#include "x8_impl.h"
#include "attention_impl.h"
#include "silu_impl.h"
#include "amx_impl.h"
}  // namespace avx512vnni

Kernels vnni_kernels() {
  return {"avx512vnni", avx512vnni::quantize_row, avx512vnni::matmul_int, avx512vnni::matmul_x8, avx512vnni::dequantize, avx512vnni::dense_matmul,
          avx512vnni::row_attention, avx512vnni::silu_mul};
}

Kernels amx_kernels() {
  Kernels k = vnni_kernels();
  k.isa = "avx512amx";
  k.matmul_x8 = avx512vnni::matmul_x8_amx;
  return k;
}


}  // namespace se
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif  // SPECENGINE_X86
