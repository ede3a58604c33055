// The small per-layer ops of a decoder step, compiled for CPU (part of `specengine._quantext`): the
// residual add + RMSNorm, RoPE + KV-cache write and SiLU-and-mul. In eager torch each is 5-15 ops of
// 2-10 us; a decode step on GGUF blocks spent ~9 ms of ~50 in them (2-core EPYC, Qwen2.5-1.5B).
//
// Each follows its torch reference's roundings (kernels/add_rms_norm.py, rope_kv_write.py,
// silu_and_mul.py): the same products and sums rounded to the model dtype in the same places.
// This file is compiled for baseline x86-64, which has no multiply-add instruction to fuse into, so fp32
// RoPE is the reference's bit for bit. A row is always computed by one thread in one order: the ops are batch-invariant.
#include "cpu_ops.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>
#include <vector>

namespace {

template <typename T>
inline T rnd(float v) {  // round to the model dtype (identity for fp32)
  return static_cast<T>(v);
}

void check_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
              name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
}

}  // namespace

// (weight * rmsnorm(s), s) with s = x + residual (or x): x, residual [R, N] contiguous, weight [N], one dtype.
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm_cpu(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual,
                                                          const torch::Tensor& weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, N] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "the norm weight must be a contiguous [", x.size(1), "] tensor of x's dtype");
  const bool has_res = residual.has_value();
  if (has_res)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type() && residual->is_contiguous(),
                "the residual must be contiguous and match x ", x.sizes());
  const int64_t R = x.size(0), N = x.size(1);
  auto y = torch::empty_like(x);
  auto s = has_res ? torch::empty_like(x) : x;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = has_res ? residual->data_ptr<scalar_t>() : nullptr;
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* sp = s.data_ptr<scalar_t>();
    at::parallel_for(0, R, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* srow = sp + r * N;
        float sq = 0.f;
        for (int64_t i = 0; i < N; ++i) {
          const scalar_t v = rp ? rnd<scalar_t>(float(xp[r * N + i]) + float(rp[r * N + i])) : xp[r * N + i];
          if (rp) srow[i] = v;
          sq += float(v) * float(v);
        }
        const float inv = 1.f / std::sqrt(sq / float(N) + float(eps));
        for (int64_t i = 0; i < N; ++i)
          yp[r * N + i] = rnd<scalar_t>(float(wp[i]) * float(rnd<scalar_t>(float(srow[i]) * inv)));
      }
    });
  });
  return {y, s};
}

// silu(gate) * up for gu [R, 2I] = [gate | up] (contiguous rows) -> [R, I].
torch::Tensor silu_and_mul_cpu(const torch::Tensor& gu) {
  check_cpu(gu, "gate_up");
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 2 == 0,
              "gate_up must be a contiguous [rows, 2 * I] tensor (gate | up)");
  const int64_t R = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({R, I}, gu.options());
  if (gu.scalar_type() == at::kFloat) {  // a register of lanes at a time, with our own exp (cpu/silu_impl.h)
    silu_mul_f32_rows(gu.data_ptr<float>(), out.data_ptr<float>(), R, I);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_and_mul_cpu", [&] {
    const scalar_t* g = gu.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, R * I, 4096, [&](int64_t begin, int64_t end) {
      int64_t r = begin / I, i = begin % I;  // walked, not divided per element (a 64-bit division each)
      for (int64_t k = begin; k < end; ++k) {
        const float x = float(g[r * 2 * I + i]);
        const scalar_t act = rnd<scalar_t>(x / (1.f + std::exp(-x)));
        o[k] = rnd<scalar_t>(float(act) * float(g[r * 2 * I + I + i]));
        if (++i == I) i = 0, ++r;
      }
    });
  });
  return out;
}

// Rotate q and k of qkv [B, T, (Hq + 2 Hkv) D] (rotate-half; cos / sin [B, T, D] in qkv's dtype), store k
// and v at k_cache / v_cache [B, S, Hkv, D] position wpos[b, t] (int64, clamped by the caller); returns
// the rotated q [B, T, Hq, D]. The reference's roundings: x*cos and rotated*sin each rounded, then their sum.
// q_w / k_w [D] (Qwen3's q/k norm): each q / k head RMS-normed first, rounded as add_rms_norm rounds.
torch::Tensor rope_kv_write_cpu(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                                const torch::Tensor& wpos, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                int64_t Hq, int64_t Hkv, const c10::optional<torch::Tensor>& q_w,
                                const c10::optional<torch::Tensor>& k_w, double eps) {
  check_cpu(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(0) == qkv.size(1) * qkv.stride(1),
              "qkv must be [B, T, width] with contiguous rows");
  const int64_t B = qkv.size(0), T = qkv.size(1), W = qkv.size(2), D = W / (Hq + 2 * Hkv), half = D / 2;
  TORCH_CHECK(Hq > 0 && Hkv > 0 && D * (Hq + 2 * Hkv) == W && D % 2 == 0, "qkv width ", W, " is not (Hq=", Hq,
              " + 2*Hkv=", Hkv, ") * an even head_dim");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type() && t->dim() == 3 && t->size(0) == B && t->size(1) == T &&
                    t->size(2) == D && t->is_contiguous(),
                "cos / sin must be contiguous [B, T, head_dim] in qkv's dtype");
  TORCH_CHECK(wpos.scalar_type() == at::kLong && wpos.dim() == 2 && wpos.size(0) == B && wpos.size(1) == T &&
                  wpos.is_contiguous(),
              "wpos must be a contiguous int64 [B, T] tensor");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && k_cache.dim() == 4 && k_cache.size(0) == B &&
                  k_cache.size(2) == Hkv && k_cache.size(3) == D && k_cache.stride(3) == 1 &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must share one [B, S, Hkv, head_dim] layout in qkv's dtype");
  const bool norm = q_w.has_value();
  TORCH_CHECK(norm == k_w.has_value(), "give both q and k norm weights, or neither");
  if (norm)
    for (const auto* w : {&*q_w, &*k_w})
      TORCH_CHECK(w->dim() == 1 && w->size(0) == D && w->scalar_type() == qkv.scalar_type() && w->is_contiguous(),
                  "q / k norm weights must be contiguous [head_dim] tensors of qkv's dtype");
  const int64_t S = k_cache.size(1);
  auto q = torch::empty({B, T, Hq, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_kv_write_cpu", [&] {
    const scalar_t* x = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* sp = sin.data_ptr<scalar_t>();
    const int64_t* pp = wpos.data_ptr<int64_t>();
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k_cache.data_ptr<scalar_t>();
    scalar_t* vp = v_cache.data_ptr<scalar_t>();
    const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
    const scalar_t* qn = norm ? q_w->data_ptr<scalar_t>() : nullptr;
    const scalar_t* kn = norm ? k_w->data_ptr<scalar_t>() : nullptr;
    // the head as floats, RMS-normed when w is given (each rounding where the reference rounds)
    auto load = [&](const scalar_t* src, const scalar_t* w, float* out) {
      float sq = 0.f;
      for (int64_t j = 0; j < D; ++j) out[j] = float(src[j]), sq += out[j] * out[j];
      if (!w) return;
      const float inv = 1.f / std::sqrt(sq / float(D) + float(eps));
      for (int64_t j = 0; j < D; ++j) out[j] = float(rnd<scalar_t>(float(w[j]) * float(rnd<scalar_t>(out[j] * inv))));
    };
    auto rotate = [&](const float* src, const scalar_t* c, const scalar_t* s, scalar_t* dst) {
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = src[j], x2 = src[half + j];
        dst[j] = rnd<scalar_t>(float(rnd<scalar_t>(x1 * float(c[j]))) + float(rnd<scalar_t>(-x2 * float(s[j]))));
        dst[half + j] = rnd<scalar_t>(float(rnd<scalar_t>(x2 * float(c[half + j]))) +
                                      float(rnd<scalar_t>(x1 * float(s[half + j]))));
      }
    };
    // a thread per batch row, its tokens in order: a clamped slot keeps the row's last token, as the
    // reference's index_put does
    at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
      std::vector<float> head(D);
      for (int64_t tok = b0 * T; tok < b1 * T; ++tok) {
        const int64_t b = tok / T, pos = pp[tok];
        TORCH_CHECK(pos >= 0 && pos < S, "write position ", pos, " is outside the cache (", S, " slots)");
        const scalar_t* row = x + tok * qkv.stride(1);
        const scalar_t *c = cp + tok * D, *s = sp + tok * D;
        for (int64_t h = 0; h < Hq; ++h) {
          load(row + h * D, qn, head.data());
          rotate(head.data(), c, s, qp + (tok * Hq + h) * D);
        }
        for (int64_t h = 0; h < Hkv; ++h) {
          const int64_t at = b * ks0 + pos * ks1 + h * ks2;
          load(row + (Hq + h) * D, kn, head.data());
          rotate(head.data(), c, s, kp + at);
          const scalar_t* v = row + (Hq + Hkv + h) * D;
          for (int64_t j = 0; j < D; ++j) vp[at + j] = v[j];
        }
      }
    });
  });
  return q;
}

// Registered with torch's dispatcher (torch.ops.specengine.*), not only as Python functions: tracing
// (make_fx, torch.compile; kernels/cpu_ext.py gives their shapes) records them like any aten op. The
// dispatcher costs ~2 us a call, a fraction of what the eager torch ops they replace cost.
TORCH_LIBRARY_FRAGMENT(specengine, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("rope_kv_write(Tensor qkv, Tensor cos, Tensor sin, Tensor wpos, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "int num_heads, int num_kv_heads, Tensor? q_norm, Tensor? k_norm, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(specengine, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm_cpu);
  m.impl("silu_and_mul", &silu_and_mul_cpu);
  m.impl("rope_kv_write", &rope_kv_write_cpu);
}
