// The avx512vnni copy of the CPU kernels: the shared hot loops compiled for this instruction set alone.
#include "common.h"

#include <chrono>

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

int64_t interleave_group() { return avx512vnni::kGroup; }

// One timing of each loop on the same prepared input: does the tile loop beat the vector loop here?
bool amx_beats_vnni(const Act& act, int64_t M, const uint8_t* w, float* y, int64_t N, int64_t G) {
  auto best = [&](auto fn) {
    double s = 1e30;
    for (int t = 0; t < 3; ++t) {
      const auto t0 = std::chrono::steady_clock::now();
      fn(kQ4_K, act, M, w, y, N, 0, G, nullptr);
      s = std::min(s, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return s;
  };
  return best(avx512vnni::matmul_x8_amx) < best(avx512vnni::matmul_x8);
}
}  // namespace se
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif  // SPECENGINE_X86
