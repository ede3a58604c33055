// DecodeStack: a decoder's layers for decode and verify widths, run in one call from Python
// (specengine/models/cpu_stack.py). On a CPU the ops of a small-width step are short (a few to a few
// hundred microseconds each) and a Python layer loop spends ~5 ms a step dispatching them: as much as
// a 0.5B draft's whole weight read. This is the CPU's counterpart of a CUDA graph. It does not know
// the layer's order: it walks the layer program of specengine/models/layer_program.py, the one
// decoder.py's Python loop walks, calling for each op the function the "cpu" ops table calls there
// (and QuantLinear's forward for "linear"), with the same arguments, so the output is the Python
// loop's bit for bit (the tests compare them). A program with an op not in kOps stays on the Python
// loop, as do trees and float weights: cpu_stack.py decides.
#include "cpu_ops.h"

#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

namespace {

struct Segment {
  torch::Tensor w;
  int64_t code, rows;
  bool interleaved;  // held by pack_x8 (cpu/x8_layout.h): `rows` is its row count
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

// The ops this executor knows, by their names in layer_program.py.
enum class Op { AddNorm, Norm, Linear, RopeKvWrite, Attention, SiluAndMul, GeluTanhAndMul };
const std::vector<std::pair<std::string, Op>> kOps = {
    {"add_norm", Op::AddNorm},     {"norm", Op::Norm},
    {"linear", Op::Linear},        {"rope_kv_write", Op::RopeKvWrite},
    {"attention", Op::Attention},  {"silu_and_mul", Op::SiluAndMul},
    {"gelu_tanh_and_mul", Op::GeluTanhAndMul}};

Op op_named(const std::string& name) {
  for (const auto& [n, op] : kOps)
    if (n == name) return op;
  TORCH_CHECK(false, "DecodeStack: no op '", name, "' (specengine/models/layer_program.py's ops it knows: ",
              "DecodeStack.OPS)");
  return Op::AddNorm;  // not reached
}

struct Layer {
  std::vector<Op> program;
  std::vector<torch::Tensor> norms;     // one per norm / add_norm, in program order
  std::vector<Projection> projections;  // one per linear, in program order
  c10::optional<torch::Tensor> q_norm, k_norm;  // Qwen3's and Gemma's per-head norms
  int64_t window;  // index of its sliding window in forward's `windows` (Gemma 3's local layers), or -1
};

using SegmentSpec = std::tuple<torch::Tensor, int64_t, int64_t, bool>;
using ProjectionSpec = std::tuple<std::vector<SegmentSpec>, c10::optional<torch::Tensor>>;

Projection projection(const ProjectionSpec& spec) {
  const auto& [specs, bias] = spec;
  Projection p;
  for (const auto& [w, code, rows, interleaved] : specs) p.segments.push_back({w, code, rows, interleaved});
  if (bias.has_value()) p.bias = bias->to(at::kFloat);
  return p;
}

class DecodeStack {
 public:
  DecodeStack(int64_t heads, int64_t kv_heads, double eps, double qk_eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), eps_(eps), qk_eps_(qk_eps), scale_(scale) {}

  // program: the layer's op names; norms and projections: the weights its norm / add_norm and
  // linear steps take, in program order.
  void add_layer(const std::vector<std::string>& program, const std::vector<torch::Tensor>& norms,
                 const std::vector<ProjectionSpec>& projections, const c10::optional<torch::Tensor>& q_norm,
                 const c10::optional<torch::Tensor>& k_norm, int64_t window) {
    Layer layer{{}, norms, {}, q_norm, k_norm, window};
    int64_t n_norms = 0, n_linears = 0;
    for (const auto& name : program) {
      const Op op = op_named(name);
      n_norms += op == Op::AddNorm || op == Op::Norm;
      n_linears += op == Op::Linear;
      layer.program.push_back(op);
    }
    TORCH_CHECK(n_norms == static_cast<int64_t>(norms.size()) && n_linears == static_cast<int64_t>(projections.size()),
                "DecodeStack.add_layer: the program takes ", n_norms, " norms and ", n_linears,
                " projections; got ", norms.size(), " and ", projections.size());
    for (const auto& p : projections) layer.projections.push_back(projection(p));
    layers_.push_back(std::move(layer));
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // x [B, T, H] (the embeddings); cos / sin [B, T, D] in x's dtype, write_pos [B, T] int64, kv the cache
  // [layers, 2, B, S, Hkv, D], lens [B] int32, attn_len the positions attention reads (<= S);
  // local_cos / local_sin: the sliding-window layers' own RoPE tables where they differ (Gemma 3);
  // windows: per sliding window, [B, T] int32, the first position each token sees.
  // Returns (the last layer's output, the residual stream), both [B, T, H], as decoder.py's loop.
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& cos,
                                                   const torch::Tensor& sin, const torch::Tensor& write_pos,
                                                   const torch::Tensor& kv, const torch::Tensor& lens, int64_t attn_len,
                                                   const c10::optional<torch::Tensor>& local_cos,
                                                   const c10::optional<torch::Tensor>& local_sin,
                                                   const std::vector<torch::Tensor>& windows) const {
    TORCH_CHECK(x.dim() == 3 && kv.dim() == 6 && kv.size(0) == size() && kv.size(2) == x.size(0),
                "DecodeStack.forward: x [B, T, H] and a cache [", size(), ", 2, B, S, Hkv, D] expected, got ",
                x.sizes(), " and ", kv.sizes());
    TORCH_CHECK(local_cos.has_value() == local_sin.has_value(), "DecodeStack.forward: local_cos and local_sin go together");
    for (const Layer& L : layers_)
      TORCH_CHECK(L.window < static_cast<int64_t>(windows.size()), "DecodeStack.forward: a layer reads window ",
                  L.window, " of ", windows.size());
    pybind11::gil_scoped_release no_gil;
    const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = kv.size(5);
    const at::ScalarType dtype = x.scalar_type();
    const torch::Tensor lens32 = lens.to(at::kInt).contiguous();
    const torch::Tensor wpos = write_pos.to(at::kLong).contiguous();
    torch::Tensor h = x.reshape({B * T, H}).contiguous();  // [B * T, width] between steps
    c10::optional<torch::Tensor> residual;
    for (int64_t i = 0; i < size(); ++i) {
      const Layer& L = layers_[i];
      const torch::Tensor k_cache = kv[i][0], v_cache = kv[i][1];
      size_t norm = 0, linear = 0;
      for (const Op op : L.program) {
        switch (op) {
          case Op::AddNorm: {
            auto [normed, res] = add_rms_norm_cpu(h, residual, L.norms[norm++], eps_);
            h = normed;
            residual = res;
            break;
          }
          case Op::Norm:
            h = std::get<0>(add_rms_norm_cpu(h, c10::nullopt, L.norms[norm++], eps_));
            break;
          case Op::Linear:
            h = L.projections[linear++](h, dtype);
            break;
          case Op::RopeKvWrite: {
            const bool local = L.window >= 0 && local_cos.has_value();
            h = rope_kv_write_cpu(h.reshape({B, T, -1}), local ? *local_cos : cos, local ? *local_sin : sin, wpos,
                                  k_cache, v_cache, heads_, kv_heads_, L.q_norm, L.k_norm,
                                  L.q_norm.has_value() ? qk_eps_ : 0.0);
            break;
          }
          case Op::Attention: {
            const c10::optional<torch::Tensor> window =
                L.window >= 0 ? c10::optional<torch::Tensor>(windows[L.window]) : c10::nullopt;
            h = row_attention(h, k_cache.narrow(1, 0, attn_len), v_cache.narrow(1, 0, attn_len), lens32,
                              c10::nullopt, scale_, window)
                    .reshape({B * T, heads_ * D});
            break;
          }
          case Op::SiluAndMul:
            h = silu_and_mul_cpu(h);
            break;
          case Op::GeluTanhAndMul: {  // decoder.py's gelu_tanh_and_mul: the same ATen calls
            const auto gate_up = h.chunk(2, -1);
            h = at::gelu(gate_up[0], "tanh") * gate_up[1];
            break;
          }
        }
      }
    }
    return {h.reshape({B, T, H}), residual->reshape({B, T, H})};
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_;
  double eps_, qk_eps_, scale_;
};

std::vector<std::string> op_names() {
  std::vector<std::string> names;
  for (const auto& [n, op] : kOps) names.push_back(n);
  return names;
}

}  // namespace

void register_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack",
                                "A decoder's layer program at decode / verify widths in one call (specengine/models/cpu_stack.py)")
      .def(pybind11::init<int64_t, int64_t, double, double, double>(), pybind11::arg("heads"),
           pybind11::arg("kv_heads"), pybind11::arg("eps"), pybind11::arg("qk_eps"), pybind11::arg("scale"))
      .def("add_layer", &DecodeStack::add_layer, pybind11::arg("program"), pybind11::arg("norms"),
           pybind11::arg("projections"), pybind11::arg("q_norm"), pybind11::arg("k_norm"), pybind11::arg("window") = -1)
      .def("__len__", &DecodeStack::size)
      .def("forward", &DecodeStack::forward, pybind11::arg("x"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("write_pos"), pybind11::arg("kv"), pybind11::arg("lens"), pybind11::arg("attn_len"),
           pybind11::arg("local_cos") = c10::nullopt, pybind11::arg("local_sin") = c10::nullopt,
           pybind11::arg("windows") = std::vector<torch::Tensor>{})
      .def_property_readonly_static("OPS", [](pybind11::object) { return op_names(); });
}
