// pybind11 module `specengine._quantext`: y = x @ dequantize(W).T with W kept as GGUF blocks, on CPU,
// and the batch-invariant attention that a GGUF target's exactness relies on (cpu/attention_impl.h).
//
// Decode and verify widths (quant_matmul): the activation rows are quantized per block to int8, as
// llama.cpp does, and each weight block is unpacked once into registers and multiplied with up to 8
// activation rows as integers (cpu/dot_impl.h; its torch reference is kernels/quant_matmul.py's
// `quant_matmul_q8_ref`), so a verify of k rows reads the weights once and costs a fraction of k
// decodes. A row's result never depends on how many rows share the call (batch-invariant).
// Prefill widths (dequantize): whole rows back to fp32 for one BLAS matmul, ggml-quants.c's
// dequantization operation for operation (cpu/dequant_impl.h).
// The hot loops are compiled for AVX-512 with VNNI, AVX-512, AVX2+FMA and baseline x86-64; CPUID picks one at run time
// (`isa()`), and `set_isa` lets the tests run every copy this CPU can.
#include "cpu_ops.h"
#include "cpu/common.h"

#include <torch/csrc/utils/pybind.h>  // the module's bindings, tensors included

#include <atomic>
#include <memory>
#include <string>

using namespace se;

namespace {


// The activations as both quant_matmul entry points take them: CPU tensors, x a contiguous fp32 [M, K].
void check_x(const torch::Tensor& x, const torch::Tensor& w, const char* op) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), op, " runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
}

void check(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype) {
  TORCH_CHECK(qtype >= 0 && qtype <= kQ6_K, "unknown GGUF block format code ", qtype);
  check_x(x, w, "quant_matmul");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "the weight must be a contiguous uint8 [N, row_bytes] tensor of GGUF blocks");
  TORCH_CHECK(x.size(1) % kValues[qtype] == 0 && w.size(1) == x.size(1) / kValues[qtype] * kBytes[qtype],
              "x has ", x.size(1), " columns but a weight row holds ", w.size(1), " bytes of blocks of ",
              kValues[qtype], " values / ", kBytes[qtype], " bytes");
}

// The activation rows quantized once for every weight row (int8 values, a scale per block of the weight's
// format, sums per 16): the tensors own the memory `act` points into.
struct QuantizedRows {
  torch::Tensor q, d, bs, b32;
  Act act;
};

QuantizedRows quantize_rows_for(const Kernels& k, const torch::Tensor& x, int64_t block) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedRows r{torch::empty({M, K}, x.options().dtype(torch::kInt8)), torch::empty({M, K / block}, x.options()),
                  torch::empty({M, K / 16}, x.options().dtype(torch::kInt16)),
                  torch::empty({M, K / 32}, x.options().dtype(torch::kInt16)), {}};
  const float* xp = x.data_ptr<float>();
  int8_t* q = r.q.data_ptr<int8_t>();
  float* d = r.d.data_ptr<float>();
  int16_t* bs = r.bs.data_ptr<int16_t>();
  int16_t* b32 = r.b32.data_ptr<int16_t>();
  // Every block is quantized on its own and the rows lie end to end, so the M * K / block blocks are
  // one flat range that threads split (a verify's rows would otherwise wait on one thread).
  at::parallel_for(0, M * K / block, std::max<int64_t>(1, 2048 / block), [&](int64_t u0, int64_t u1) {
    k.quantize(xp + u0 * block, (u1 - u0) * block, block, q + u0 * block, d + u0, bs + u0 * block / 16);
    for (int64_t g = u0 * block / 32; g < u1 * block / 32; ++g)
      b32[g] = int16_t(bs[2 * g] + bs[2 * g + 1]);  // |sum| <= 32 x 127
  });
  r.act = Act{r.q.data_ptr<int8_t>(), r.d.data_ptr<float>(), bs, b32, K, block};
  return r;
}


}  // namespace

torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t qtype) {
  check(x, w, qtype);
  const int64_t M = x.size(0), N = w.size(0), row_bytes = w.size(1);
  const Kernels& k = kernels();
  const QuantizedRows xq = quantize_rows_for(k, x, kValues[qtype]);
  const Act& act = xq.act;
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    k.matmul(qtype, act, M, wp, row_bytes, yp, N, begin, end);
  });
  return y;
}

void check_x8(int64_t qtype) {
  TORCH_CHECK(qtype >= 0 && qtype <= kQ6_K && has_x8(qtype), "no interleaved layout for GGUF block format code ", qtype,
              " (there is one for Q4_0, Q5_0, Q4_K and Q6_K)");
}

// fn(std::integral_constant<int, Q>) for the interleaved format `qtype` (checked).
template <typename F>
void with_x8(int64_t qtype, F&& fn) {
  check_x8(qtype);
  if (qtype == kQ4_0) fn(std::integral_constant<int, kQ4_0>{});
  else if (qtype == kQ5_0) fn(std::integral_constant<int, kQ5_0>{});
  else if (qtype == kQ4_K) fn(std::integral_constant<int, kQ4_K>{});
  else fn(std::integral_constant<int, kQ6_K>{});
}

// fn(Q's constant, g) for every group g < G of a weight in the interleaved format `qtype`, across threads.
template <typename F>
void each_group(int64_t qtype, int64_t G, F&& fn) {
  with_x8(qtype, [&](auto q) {
    at::parallel_for(0, G, 16, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) fn(q, g);
    });
  });
}

// GGUF rows w [N, row_bytes] -> their interleaved groups [ceil(N / 8), 8 * row_bytes] (cpu/x8_layout.h).
torch::Tensor pack_x8(const torch::Tensor& w, int64_t qtype) {
  check_x8(qtype);
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(1) % kBytes[qtype] == 0,
              "pack_x8 takes a contiguous uint8 CPU tensor [N, row_bytes] of ", kNames[qtype], " blocks; got ", w.sizes());
  const int64_t N = w.size(0), rb = w.size(1), G = (N + kGroup - 1) / kGroup;
  auto out = torch::empty({G, kGroup * rb}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  each_group(qtype, G, [&](auto q, int64_t g) {
    constexpr int Q = decltype(q)::value;
    pack_group<Q>(src + g * kGroup * rb, rb, std::min(kGroup, N - g * kGroup), rb / kBytes[Q], dst + g * kGroup * rb);
  });
  return out;
}

// The inverse of pack_x8: the first N rows [N, row_bytes], byte for byte.
torch::Tensor unpack_x8(const torch::Tensor& wp, int64_t qtype, int64_t N) {
  check_x8(qtype);
  TORCH_CHECK(wp.device().is_cpu() && wp.dim() == 2 && wp.scalar_type() == at::kByte && wp.is_contiguous() &&
                  wp.size(1) % (kGroup * kBytes[qtype]) == 0 && N >= 0 && N <= kGroup * wp.size(0),
              "unpack_x8 takes a contiguous uint8 CPU tensor [groups, 8 * row_bytes] of ", kNames[qtype],
              " groups holding the ", N, " rows asked for; got ", wp.sizes());
  const int64_t rb = wp.size(1) / kGroup, G = (N + kGroup - 1) / kGroup;
  auto out = torch::empty({N, rb}, wp.options());
  const uint8_t* src = wp.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  each_group(qtype, G, [&](auto q, int64_t g) {
    constexpr int Q = decltype(q)::value;
    unpack_group<Q>(src + g * kGroup * rb, rb / kBytes[Q], dst + g * kGroup * rb, std::min(kGroup, N - g * kGroup));
  });
  return out;
}

// The same product on a weight interleaved 8 rows at a time (cpu/x8_layout.h; Q4_0, Q5_0, Q4_K, Q6_K):
// wp [ceil(N / 8), 8 * row_bytes] -> y [M, N].
torch::Tensor quant_matmul_x8(const torch::Tensor& x, const torch::Tensor& wp, int64_t qtype, int64_t N) {
  check_x8(qtype);
  check_x(x, wp, "quant_matmul_x8");
  const int64_t K = x.size(1), M = x.size(0), G = (N + 7) / 8;
  TORCH_CHECK(K % kValues[qtype] == 0, "x has ", K, " columns, not a multiple of the format's ", kValues[qtype],
              "-value blocks");
  TORCH_CHECK(wp.dim() == 2 && wp.scalar_type() == at::kByte && wp.is_contiguous() && wp.size(0) == G &&
                  K % kValues[qtype] == 0 && wp.size(1) == K / kValues[qtype] * kBytes[qtype] * 8,
              "the weight must be a contiguous uint8 [", G, ", ", K / kValues[qtype] * kBytes[qtype] * 8,
              "] tensor of interleaved groups for ", N, " rows of ", K, " values; got ", wp.sizes());
  const Kernels& k = kernels();
  const QuantizedRows xq = quantize_rows_for(k, x, kValues[qtype]);
  const Act& act = xq.act;
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wpp = wp.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = K / kValues[qtype] * kBytes[qtype];
  at::parallel_for(0, G, 2, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> rows(std::string(k.isa) == "baseline" ? 8 * row_bytes : 0);  // the baseline's unpacked group
    k.matmul_x8(qtype, act, M, wpp, yp, N, begin, end, rows.data());
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
  const auto fn = kernels().dequantize;  // read once: set_isa may not change it mid-call
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) fn(qtype, wp + n * row_bytes, nb, yp + n * cols);
  });
  return y;
}

// fp32 rows -> Q4_0 blocks by ggml's reference rule (quantize_row_q4_0_ref; models/requant.py's
// quantize_q4_0_ref is the spec): per 32 values the first of largest magnitude, signed, is -8 d, and
// q = min(15, trunc(x / d + 8.5)). Here, not in an ISA's unit: this file builds without FMA, so
// x * id + 8.5 rounds twice, as the reference does (a fused multiply-add would move ties).
torch::Tensor quantize_q4_0(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [N, K]");
  TORCH_CHECK(x.size(1) % 32 == 0, "Q4_0 rows hold whole blocks of 32 values; ", x.size(1), " is not a multiple");
  const int64_t N = x.size(0), nb = x.size(1) / 32;
  auto y = torch::empty({N, nb * kBytes[kQ4_0]}, torch::kByte);
  const float* xp = x.data_ptr<float>();
  uint8_t* yp = y.data_ptr<uint8_t>();
  at::parallel_for(0, N * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* v = xp + 32 * b;
      uint8_t* out = yp + kBytes[kQ4_0] * b;
      float amax = std::fabs(v[0]), peak = v[0];  // all zeros: the first, signed (the gguf package's d)
      for (int j = 1; j < 32; ++j)
        if (amax < std::fabs(v[j])) amax = std::fabs(v[j]), peak = v[j];
      const float d = peak / -8.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
      const uint16_t h = c10::detail::fp16_ieee_from_fp32_value(d);
      std::memcpy(out, &h, 2);
      for (int j = 0; j < 16; ++j) {
        const int lo = std::min(15, int(int8_t(v[j] * id + 8.5f))), hi = std::min(15, int(int8_t(v[16 + j] * id + 8.5f)));
        out[2 + j] = uint8_t(lo | hi << 4);
      }
    }
  });
  return y;
}

// Dense bf16 / fp32 weights for decode and verify widths: each weight row read once for all rows.
torch::Tensor dense_matmul(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "dense_matmul runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat) && w.is_contiguous(),
              "the weight must be a contiguous bfloat16 or float32 [N, K] tensor");
  TORCH_CHECK(w.size(1) == x.size(1), "x has ", x.size(1), " columns but the weight has ", w.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const bool bf16 = w.scalar_type() == at::kBFloat16;
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const void* wp = w.data_ptr();
  float* yp = y.data_ptr<float>();
  const auto fn = kernels().dense;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(bf16 ? K : 0);  // one widened weight row: stays in L1
    fn(bf16, xp, M, K, wp, yp, N, begin, end, row.data());
  });
  return y;
}

// Every byte of w read once, the way the matmuls stream their weights (contiguous ranges split across
// the threads, the kernels' software prefetch ahead): the machine's read bandwidth that a one-row
// matvec is held to (bench/gguf_cpu.py --streams). Returns a checksum, so no read can be dropped.
int64_t read_stream(const torch::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.nbytes() % 64 == 0 && w.nbytes() > 0,
              "read_stream takes a contiguous CPU tensor of whole 64-byte lines");
  const uint64_t* p = static_cast<const uint64_t*>(w.data_ptr());
  std::atomic<uint64_t> sum{0};
  at::parallel_for(0, int64_t(w.nbytes() / 64), 1024, [&](int64_t begin, int64_t end) {
    uint64_t s[8] = {};
    for (int64_t l = begin; l < end; ++l) {
      const char* ahead = reinterpret_cast<const char*>(p + 8 * l) + prefetch_distance;
      if (prefetch_to_l2) __builtin_prefetch(ahead, 0, 2); else __builtin_prefetch(ahead, 0, 3);
      for (int k = 0; k < 8; ++k) s[k] ^= p[8 * l + k];
    }
    uint64_t t = 0;
    for (int k = 0; k < 8; ++k) t ^= s[k];
    sum.fetch_xor(t);
  });
  return int64_t(sum.load());
}

// Whether row_attention runs its scalar loops only (a test switch: the vectorized ones must equal them).
bool& plain_attention() {
  static bool plain = false;
  return plain;
}

// Batch-invariant verification attention (cpu/attention_impl.h): q [B, Q, Hq, D], k / v [B, L, Hkv, D]
// (views of the cache: any strides but a contiguous last dim), lens [B] int32, tree [B|1, Q, Q] bool or
// None; fp32 or bf16, all one dtype.
torch::Tensor row_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& lens, const c10::optional<torch::Tensor>& tree, double scale,
                            const c10::optional<torch::Tensor>& window) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "row_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && k.sizes() == v.sizes(),
              "q must be [B, Q, Hq, D] and k, v the same [B, L, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q, k and v must share one dtype, float32 or bfloat16");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3) && k.size(2) > 0 && q.size(2) % k.size(2) == 0,
              "q ", q.sizes(), " does not fit k ", k.sizes(), " (batch, head_dim, query heads a multiple of KV heads)");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dimension must be contiguous");
  TORCH_CHECK(lens.scalar_type() == at::kInt && lens.dim() == 1 && lens.size(0) == q.size(0) && lens.is_contiguous(),
              "lens must be a contiguous int32 [B] tensor");
  const int64_t B = q.size(0), Q = q.size(1), Hq = q.size(2), D = q.size(3), L = k.size(1);
  torch::Tensor tm;
  if (tree.has_value()) {
    tm = tree->to(torch::kBool).contiguous();
    TORCH_CHECK(tm.dim() == 3 && (tm.size(0) == 1 || tm.size(0) == B) && tm.size(1) == Q && tm.size(2) == Q,
                "the tree mask must be [B or 1, Q, Q]");
  }
  if (window.has_value())
    TORCH_CHECK(window->scalar_type() == at::kInt && window->dim() == 2 && window->size(0) == B &&
                    window->size(1) == Q && window->is_contiguous(),
                "the window starts must be a contiguous int32 [B, Q] tensor");
  auto out = torch::empty_like(q, at::MemoryFormat::Contiguous);
  AttnArgs a{q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lens.data_ptr<int32_t>(),
             tm.defined() ? tm.data_ptr<bool>() : nullptr, window.has_value() ? window->data_ptr<int32_t>() : nullptr,
             B, Q, Hq, k.size(2), D, L,
             {q.stride(0), q.stride(1), q.stride(2)}, {k.stride(0), k.stride(1), k.stride(2)},
             {v.stride(0), v.stride(1), v.stride(2)}, {out.stride(0), out.stride(1), out.stride(2)},
             tm.defined() && tm.size(0) > 1 ? Q * Q : 0, float(scale), plain_attention()};
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  const auto fn = kernels().attention;
  // scores (a row per query head a group takes: never more than share a KV head), the output
  // accumulator, the scaled query; never read before written
  const int64_t rows = std::min<int64_t>(kAttnGroup, Hq / a.Hkv) * L;
  at::parallel_for(0, B * Q * Hq, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> scratch(new float[rows + 2 * D]);
    fn(bf16, a, begin, end, scratch.get(), scratch.get() + rows, scratch.get() + rows + D);
  });
  return out;
}

// silu(gate) * up for fp32 gu [R, 2I] = [gate | up] rows -> out [R, I] (fused_ops_cpu.cpp's fp32 case):
// split over threads by spans of one row; a value's bits depend on nothing but its gate and up.
void silu_mul_f32_rows(const float* gu, float* out, int64_t R, int64_t I) {
  const auto fn = kernels().silu_mul;
  at::parallel_for(0, R * I, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end;) {
      const int64_t r = k / I, i = k % I, n = std::min(end - k, I - i);
      fn(gu + r * 2 * I + i, gu + r * 2 * I + I + i, out + k, n);
      k += n;
    }
  });
}

// Also a dispatcher op (torch.ops.specengine.row_attention), as the fused step's ops are: tracing
// (make_fx, torch.compile) records it instead of baking one call's result into the trace.
TORCH_LIBRARY_FRAGMENT(specengine, m) {
  m.def("row_attention(Tensor q, Tensor k, Tensor v, Tensor lens, Tensor? tree, float scale, Tensor? window) -> Tensor");
}

TORCH_LIBRARY_IMPL(specengine, CPU, m) { m.impl("row_attention", &row_attention); }

void register_decode_stack(pybind11::module& m);  // decode_stack.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_matmul", &quant_matmul, "x [M, K] fp32 (quantized per block to int8) @ dequantize(w [N, row_bytes] GGUF blocks).T -> [M, N]");
  m.def("quant_matmul_x8", &quant_matmul_x8, "quant_matmul on a weight interleaved 8 rows at a time "
        "(pack_x8; Q4_0, Q5_0, Q4_K, Q6_K): x [M, K] fp32, wp [ceil(N/8), 8 * row_bytes], N -> [M, N]");
  m.def("pack_x8", &pack_x8, "GGUF rows w [N, row_bytes] -> interleaved groups [ceil(N/8), 8 * row_bytes] "
        "(zero rows pad the last; csrc/cpu/x8_layout.h)");
  m.def("unpack_x8", &unpack_x8, "interleaved groups wp, format code, N -> the first N GGUF rows, byte for byte");
  m.def("x8_formats", [] {
        py::list out;
        for (int64_t c = 0; c <= kQ6_K; ++c) if (has_x8(c)) out.append(kNames[c]);
        return py::tuple(out);
      }, "the GGUF block formats with an interleaved layout (and a kernel for it)");
  m.def("dequantize", &dequantize, "w [N, row_bytes] GGUF blocks -> fp32 [N, cols]");
  m.def("quantize_q4_0", &quantize_q4_0, "x [N, K] fp32 -> Q4_0 blocks uint8 [N, K / 32 * 18] (ggml's reference rule)");
  m.def("dense_matmul", &dense_matmul, "x [M, K] fp32 @ w [N, K] (bf16 or fp32).T -> [M, N] fp32, few rows");
  m.def("set_prefetch", [](const std::string& level) {
        TORCH_CHECK(level == "l1" || level == "l2", "set_prefetch takes 'l1' or 'l2' (the cache the weight "
                    "stream is prefetched into), got '", level, "'");
        prefetch_to_l2 = level == "l2";
      }, "prefetch the weight stream into 'l1' or 'l2' (the planner times both: models/quant_plan.py)");
  m.def("prefetch", [] { return std::string(prefetch_to_l2 ? "l2" : "l1"); },
        "the cache the weight stream is prefetched into ('l1' or 'l2')");
  m.def("set_prefetch_distance", [](int64_t bytes) {
        TORCH_CHECK(bytes >= 64 && bytes <= 65536 && bytes % 64 == 0, "set_prefetch_distance takes whole 64-byte "
                    "lines from 64 to 65536 bytes (how far ahead the weight stream is prefetched), got ", bytes);
        prefetch_distance = bytes;
      }, "prefetch the weight stream this many bytes ahead (the planner times a few: models/quant_plan.py)");
  m.def("prefetch_distance", [] { return prefetch_distance; }, "how many bytes ahead the weight stream is prefetched");
  m.def("read_stream", &read_stream, "every byte of w read once as the matmuls stream weights -> a checksum "
        "(time it for the machine's read bandwidth)");
  m.def("row_attention", &row_attention, "batch-invariant verification attention: q [B, Q, Hq, D] over k, v "
        "[B, L, Hkv, D] up to lens[b] + (chain or tree), from window[b, i] when given -> [B, Q, Hq, D]",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("lens"), py::arg("tree"), py::arg("scale"),
        py::arg("window") = py::none());
  m.def("set_plain_attention", [](bool plain) { plain_attention() = plain; },
        "row_attention with its scalar loops only (tests compare them with the vectorized ones)");
  m.def("formats", [] {
        py::dict out;
        for (int64_t c = 0; c <= kQ6_K; ++c) out[kNames[c]] = py::make_tuple(c, kValues[c], kBytes[c]);
        return out;
      }, "the GGUF block formats the kernels read: name -> (code, values per block, bytes per block)");
  m.def("isa", &isa_name, "the instruction set the kernels run with here (CPUID)");
  m.def("isas", &isas, "every instruction set this CPU can run the kernels with, widest first");
  m.def("set_isa", &set_isa, "run the kernels with another instruction set this CPU supports (tests)");
  register_decode_stack(m);
}
