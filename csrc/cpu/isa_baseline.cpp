// The baseline copy of the CPU kernels: the shared hot loops compiled for this instruction set alone.
#include "common.h"

// -O1 for the loops below on x86: there the baseline copy is the reference the tests compare every
// other copy with and the fallback of CPUs without AVX2 (Intel before Haswell, some later Pentium,
// Celeron and Atom parts), never a hot path, and at the build's -O3 it was the longest compile of the
// extension (40 s of one core on a 2-core AVX2 EPYC, 6 s at -O1; its one-row stream 2.3 -> 0.7 GB/s).
// Elsewhere it is the only copy and keeps -O3. The same bits: no -ffast-math, and without FMA in
// this copy's instruction set nothing is contracted.
#ifdef SPECENGINE_X86
#pragma GCC optimize("O1")
#endif

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
