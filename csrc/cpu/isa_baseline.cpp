// The baseline copy of the CPU kernels: the shared hot loops compiled for this instruction set alone.
#include "common.h"

// -O1 for the loops below: the baseline copy is the reference the tests compare every other copy with
// and the fallback of x86-64 CPUs without AVX2, never a hot path, and at the build's -O3 it was the
// longest compile of the extension (40 s of one core on a 2-core AVX2 EPYC; -O1 6 s). The same
// bits: no -ffast-math, and without FMA in this copy's instruction set nothing is contracted.
#pragma GCC optimize("O1")

namespace se {
namespace baseline {
#include "dequant_impl.h"
#include "dot_impl.h"
#include "x8_impl.h"
#include "attention_impl.h"
#include "silu_impl.h"
}  // namespace baseline

Kernels baseline_kernels() {
  return {"baseline", baseline::quantize_row, baseline::matmul_int, baseline::matmul_x8, baseline::dequantize, baseline::dense_matmul,
          baseline::row_attention, baseline::silu_mul};
}
}  // namespace se
