// The baseline copy of the CPU kernels: the shared hot loops compiled for this instruction set alone.
#include "common.h"

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
