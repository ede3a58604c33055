// The CPU kernels' shared definitions (llama.cpp's ggml-cpu layout, learned from, not copied): the GGUF
// block formats (the one table of them: Python reads it from the binding, `formats()`), the argument
// structs of the hot loops, and the kernel table each instruction set's translation unit fills
// (isa_baseline.cpp, isa_avx2.cpp, isa_avx512.cpp, isa_vnni.cpp; each compiled on its own, in parallel).
// dispatch.cpp picks one table by CPUID; quant_matmul.cpp registers the ops.
#pragma once
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#define SPECENGINE_X86 1
#endif

namespace se {

enum QType : int64_t { kQ4_0 = 0, kQ5_0 = 1, kQ8_0 = 2, kQ4_K = 3, kQ5_K = 4, kQ6_K = 5 };
constexpr const char* kNames[] = {"Q4_0", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"};  // GGUF's names, by code
constexpr int64_t kValues[] = {32, 32, 32, 256, 256, 256};
constexpr int64_t kBytes[] = {18, 22, 34, 144, 176, 210};
// Software prefetch distance of the weight stream in bytes (dot_impl.h's prefetch_ahead): the machine's,
// not the kernel's. 4 KiB held on a 2-core EPYC in 4 KiB pages (2-8 KiB alike); in 2 MiB pages on the AMX
// Xeon 2 KiB streamed 4-13% faster than 4 KiB and 1 KiB or 8 KiB slower, so the planner times a few
// distances with the level below on the model's own weights and sets it for the process
// (models/quant_plan.py, choose_prefetch); 4 KiB until it has. Never changes a result.
inline int64_t prefetch_distance = 4096;
// Which cache that prefetch fills: L1 (prefetcht0) or L2 (prefetcht1). The faster one is the machine's,
// not the kernel's (one row streamed, 2-vCPU AMX Xeon: L2 +12-47% for Q4_K / Q6_K, while AMD's K8-era
// guide had both hints fill L1), so the planner times both on the model's own weights and
// sets it for the process (models/quant_plan.py, choose_prefetch); L1 until it has. Never changes a result.
inline bool prefetch_to_l2 = false;

// Activation rows quantized for one weight format: row m's values q[m*K ...], its block scales
// d[m*K/block ...], its sums of 16 values bs[m*K/16 ...] and of 32 values b32[m*K/32 ...] (Q4_K's mins
// take pairs of these: half the multiplies of pairs of sums of 16).
struct Act {
  const int8_t* q;
  const float* d;
  const int16_t *bs, *b32;
  int64_t K, block;
  const int8_t* qr(int64_t r) const { return q + r * K; }
  const float* dr(int64_t r) const { return d + r * (K / block); }
  const int16_t* bsr(int64_t r) const { return bs + r * (K / 16); }
  const int16_t* b32r(int64_t r) const { return b32 + r * (K / 32); }
  Act from_row(int64_t m) const { return {qr(m), dr(m), bsr(m), b32r(m), K, block}; }  // rows m, m + 1, ...
};

// One call of the batch-invariant attention (row_attention_impl.h): tensors as [dim0, dim1, dim2, D].
// Query heads row_attention takes together over one pass of their KV head's keys (attention_impl.h's
// attention_heads); its scratch holds up to that many rows of scores.
constexpr int64_t kAttnGroup = 8;

struct AttnArgs {
  const void *q, *k, *v;
  void* out;
  const int32_t* lens;
  const bool* tree;  // [B|1, Q, Q] or null (chain)
  const int32_t* window;  // [B, Q]: each query's first visible position (a sliding window), or null
  int64_t B, Q, Hq, Hkv, D, L;
  int64_t qs[3], ks[3], vs[3], os[3];  // strides of dims 0..2 (the last dim is contiguous)
  int64_t tree_bs;  // 0 when the mask is shared by every row
  float scale;
  bool plain;  // the scalar loops even where a vectorized copy exists (tests compare the two)
};

// The block sizes as ggml lays the blocks out (ggml-common.h): fp16 scales and packed values.
static_assert(kBytes[kQ4_0] == 2 + 32 / 2, "Q4_0: d, 32 nibbles");
static_assert(kBytes[kQ5_0] == 2 + 4 + 32 / 2, "Q5_0: d, 32 high bits, 32 nibbles");
static_assert(kBytes[kQ8_0] == 2 + 32, "Q8_0: d, 32 int8");
static_assert(kBytes[kQ4_K] == 2 + 2 + 12 + 256 / 2, "Q4_K: d, dmin, 6-bit scales, 256 nibbles");
static_assert(kBytes[kQ5_K] == 2 + 2 + 12 + 256 / 8 + 256 / 2, "Q5_K: d, dmin, scales, high bits, nibbles");
static_assert(kBytes[kQ6_K] == 256 / 2 + 256 / 4 + 256 / 16 + 2, "Q6_K: low nibbles, high 2 bits, int8 scales, d");
static_assert(sizeof(kValues) / sizeof(kValues[0]) == kQ6_K + 1 && sizeof(kBytes) == sizeof(kValues), "one row per format");

// One instruction set's copy of the hot loops.
struct Kernels {
  const char* isa;
  void (*quantize)(const float*, int64_t, int64_t, int8_t*, float*, int16_t*);  // quantize_row
  void (*matmul)(int64_t, const Act&, int64_t, const uint8_t*, int64_t, float*, int64_t, int64_t, int64_t);
  void (*matmul_x8)(int64_t, const Act&, int64_t, const uint8_t*, float*, int64_t, int64_t, int64_t, uint8_t*);
  void (*dequantize)(int64_t, const uint8_t*, int64_t, float*);
  void (*dense)(bool, const float*, int64_t, int64_t, const void*, float*, int64_t, int64_t, int64_t, float*);
  void (*attention)(bool, const AttnArgs&, int64_t, int64_t, float*, float*, float*);
  void (*silu_mul)(const float*, const float*, float*, int64_t);
};

// Each instruction set's table (isa_*.cpp); the x86 ones exist where SPECENGINE_X86 is defined.
Kernels baseline_kernels();
#ifdef SPECENGINE_X86
Kernels avx2_kernels();
Kernels avx512_kernels();
Kernels vnni_kernels();
Kernels amx_kernels();  // vnni's, with the AMX tile loop at prefill widths (amx_impl.h)
#endif

// The one dispatch (dispatch.cpp): the table the ops run with (CPUID's widest), its name, every copy
// this CPU runs (widest first), and the tests' switch to another of them.
Kernels& kernels();
std::string isa_name();
std::vector<std::string> isas();
void set_isa(const std::string& name);

}  // namespace se

// The hot-loop headers name these unqualified: inside an ISA's namespace (nested in se) and, when a
// header is compiled on its own to check it is self-contained, at the top level.
using namespace se;  // NOLINT(google-global-names-in-headers): a private header of one extension

// The formats' interleaved layout, here so that every includer has it at namespace se (an ISA's unit
// includes the hot-loop headers inside its own namespace, where an include would land in that one).
#include "x8_layout.h"
