// DecodeStack: a Llama-family decoder's layers for decode and verify widths, run in one call from
// Python (specengine/models/cpu_stack.py). On a CPU the ops of a small-width step are short (a few to
// a few hundred microseconds each) and a Python layer loop spends ~5 ms a step dispatching them:
// as much as a 0.5B draft's whole weight read. This is the CPU's counterpart of a CUDA graph: the
// same ops, called with the same arguments in the same order as decoder.py's layers with the "cpu"
// ops table and QuantLinear's forward, so the output is the Python loop's bit for bit (the tests
// compare them). Only what those layers do is here; anything else (trees, windows, Gemma's norms,
// float weights) stays on the Python path, which cpu_stack.py decides.
#include "cpu_ops.h"

#include <string>
#include <vector>

namespace {

struct Segment {
  torch::Tensor w;
  int64_t code, rows;
  bool interleaved;  // held by kernels/quant_pack.py's pack_x8: `rows` is its row count
};

// QuantLinear.forward: each segment's product in fp32, concatenated, + bias, in the activation dtype.
struct Projection {
  std::vector<Segment> segments;
  c10::optional<torch::Tensor> bias;  // fp32

  torch::Tensor operator()(const torch::Tensor& x2, at::ScalarType dtype) const {
    const torch::Tensor xf = x2.to(at::kFloat).contiguous();
    std::vector<torch::Tensor> outs;
    outs.reserve(segments.size());
    for (const auto& s : segments)
      outs.push_back(s.interleaved ? quant_matmul_x8(xf, s.w, s.code, s.rows) : quant_matmul(xf, s.w, s.code));
    torch::Tensor y = outs.size() == 1 ? outs[0] : torch::cat(outs, -1);
    if (bias.has_value()) y = y + *bias;
    return y.to(dtype);
  }
};

struct Layer {
  torch::Tensor ln_in, ln_post;
  Projection qkv, o, gate_up, down;
  c10::optional<torch::Tensor> q_norm, k_norm;  // Qwen3's per-head norms
};

using SegmentSpec = std::tuple<torch::Tensor, int64_t, int64_t, bool>;

Projection projection(const std::vector<SegmentSpec>& specs, const c10::optional<torch::Tensor>& bias) {
  Projection p;
  for (const auto& [w, code, rows, interleaved] : specs) p.segments.push_back({w, code, rows, interleaved});
  if (bias.has_value()) p.bias = bias->to(at::kFloat);
  return p;
}

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, double eps, double qk_eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), eps_(eps), qk_eps_(qk_eps), scale_(scale) {}

  void add_layer(const torch::Tensor& ln_in, const torch::Tensor& ln_post, const std::vector<SegmentSpec>& qkv,
                 const c10::optional<torch::Tensor>& qkv_bias, const std::vector<SegmentSpec>& o,
                 const std::vector<SegmentSpec>& gate_up, const std::vector<SegmentSpec>& down,
                 const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm) {
    layers_.push_back({ln_in, ln_post, projection(qkv, qkv_bias), projection(o, {}), projection(gate_up, {}),
                       projection(down, {}), q_norm, k_norm});
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // x [B, T, H] (the embeddings); cos / sin [B, T, D] in x's dtype, write_pos [B, T] int64, kv the cache
  // [layers, 2, B, S, Hkv, D], lens [B] int32, attn_len the positions attention reads (<= S).
  // Returns (the last layer's MLP output, the residual stream), both [B, T, H], as decoder.py's loop.
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& cos,
                                                   const torch::Tensor& sin, const torch::Tensor& write_pos,
                                                   const torch::Tensor& kv, const torch::Tensor& lens,
                                                   int64_t attn_len) const {
    TORCH_CHECK(x.dim() == 3 && kv.dim() == 6 && kv.size(0) == size() && kv.size(2) == x.size(0),
                "DecodeStack.forward: x [B, T, H] and a cache [", size(), ", 2, B, S, Hkv, D] expected, got ",
                x.sizes(), " and ", kv.sizes());
    pybind11::gil_scoped_release no_gil;
    const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = kv.size(5);
    const at::ScalarType dtype = x.scalar_type();
    const torch::Tensor lens32 = lens.to(at::kInt).contiguous();
    const torch::Tensor wpos = write_pos.to(at::kLong).contiguous();
    torch::Tensor h = x.reshape({B * T, H}).contiguous();
    c10::optional<torch::Tensor> residual;
    for (int64_t i = 0; i < size(); ++i) {
      const Layer& L = layers_[i];
      auto [normed, res] = add_rms_norm_cpu(h, residual, L.ln_in, eps_);
      const torch::Tensor qkv = L.qkv(normed, dtype).reshape({B, T, -1});
      const torch::Tensor k_cache = kv[i][0], v_cache = kv[i][1];
      const torch::Tensor q = rope_kv_write_cpu(qkv, cos, sin, wpos, k_cache, v_cache, heads_, kv_heads_, L.q_norm,
                                                L.k_norm, L.q_norm.has_value() ? qk_eps_ : 0.0);
      const torch::Tensor att = row_attention(q, k_cache.narrow(1, 0, attn_len), v_cache.narrow(1, 0, attn_len),
                                              lens32, c10::nullopt, scale_, c10::nullopt);
      const torch::Tensor o = L.o(att.reshape({B * T, heads_ * D}), dtype);
      auto [normed2, res2] = add_rms_norm_cpu(o, res, L.ln_post, eps_);
      h = L.down(silu_and_mul_cpu(L.gate_up(normed2, dtype)), dtype);
      residual = res2;
    }
    return {h.reshape({B, T, H}), residual->reshape({B, T, H})};
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_;
  double eps_, qk_eps_, scale_;
};

}  // namespace

void register_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack",
                                "A decoder's layers at decode / verify widths in one call (specengine/models/cpu_stack.py)")
      .def(pybind11::init<int64_t, int64_t, double, double, double>(), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("eps"), pybind11::arg("qk_eps"), pybind11::arg("scale"))
      .def("add_layer", &DecodeStack::add_layer)
      .def("__len__", &DecodeStack::size)
      .def("forward", &DecodeStack::forward);
}
