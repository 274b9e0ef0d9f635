// The decoder's layer loop for a step of decode rows, as one call (services/engine/layer_loop.py builds it).
//
// A decode step at one or a few rows is short (a 135M model in int4: ~4 ms on one core), and each layer's
// nine operations (qkv, rotary + cache write, attention, o, residual + norm, gate_up, SiLU * up, down,
// residual + norm) cost ~20 us of Python and argument conversion on top of their arithmetic: ~0.6 ms a step
// over 30 layers. Here the loop calls the same kernels (cpu_ops.cpp, quant_ops.cpp, oneDNN's packed linear)
// directly, with the weights held from load, and without the GIL (the engine service's event loop runs
// meanwhile). Each kernel is the one the Python loop calls, so the results are the same bit for bit.

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <vector>

// cpu_ops.cpp
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps);
torch::Tensor silu_mul(const torch::Tensor& x);
void rope_store(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& positions,
                torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, int64_t num_heads,
                int64_t num_kv_heads, int64_t head_dim);
void rope_store_q8(torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                   const torch::Tensor& positions, torch::Tensor& k_cache, torch::Tensor& v_cache,
                   torch::Tensor& k_scale, torch::Tensor& v_scale, const torch::Tensor& slots, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim);
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& lens, int64_t block_size,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale);
torch::Tensor paged_decode_q8(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& k_scale, const torch::Tensor& v_scale,
                              const torch::Tensor& block_tables, const torch::Tensor& lens, int64_t block_size,
                              int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale);
// quant_ops.cpp
torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s, bool int8_activations);
torch::Tensor q4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m);
torch::Tensor q4p_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, torch::Tensor m, int64_t n);

namespace {

enum Kind : int64_t { Q8 = 0, Q4 = 1, Q4P = 2, ONEDNN = 3 };

// One projection as the Python layer holds it (quant.Q8Linear / Q4Linear, linears.PackedLinear).
struct Linear {
  int64_t kind;
  std::vector<torch::Tensor> w;  // Q8: q, s; Q4 / Q4P: q, d, m; ONEDNN: the packed weight
  int64_t n;                     // output features
  bool int8_activations;         // Q8 only
  std::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x) const {
    torch::Tensor y;
    switch (kind) {
      case Q8: y = q8_linear(x, w[0], w[1], int8_activations); break;
      case Q4: y = q4_linear(x, w[0], w[1], w[2]); break;
      case Q4P: y = q4p_linear(x, w[0], w[1], w[2], n); break;
      default: return onednn(x);
    }
    if (bias) y.add_(bias->to(y.scalar_type()));  // as QuantLinear.forward adds it
    return y;
  }

  torch::Tensor onednn(const torch::Tensor& x) const {  // mkldnn::_linear_pointwise(x, w, bias, "none", [], None)
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    torch::jit::Stack stack{x, w[0], bias ? c10::IValue(*bias) : c10::IValue(), c10::IValue(std::string("none")),
                            c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue()};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  torch::Tensor middle, after;  // the norms' weights: after attention, after the layer (the next one's input norm)
  double middle_eps, after_eps;
  torch::Tensor k, v, k_scale, v_scale;  // the layer's cache (scales undefined: not int8)
};

Linear linear_of(const pybind11::tuple& t) {
  return Linear{t[0].cast<int64_t>(), t[1].cast<std::vector<torch::Tensor>>(), t[2].cast<int64_t>(),
                t[3].cast<bool>(), t[4].cast<std::optional<torch::Tensor>>()};
}

}  // namespace

class LayerLoop {
 public:
  // layers: per layer (qkv, o, gate_up, down, (middle weight, eps), (after weight, eps), (k, v, k_scale, v_scale)),
  // each linear (kind, tensors, out_features, int8_activations, bias or None), the scales None for a float cache.
  LayerLoop(const std::vector<pybind11::tuple>& layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
            int64_t block_size, double scale)
      : heads_(num_heads), kv_heads_(num_kv_heads), head_dim_(head_dim), block_size_(block_size), scale_(scale) {
    for (const auto& t : layers) {
      auto middle = t[4].cast<pybind11::tuple>(), after = t[5].cast<pybind11::tuple>();
      auto cache = t[6].cast<pybind11::tuple>();
      auto optional = [](pybind11::handle h) { return h.is_none() ? torch::Tensor() : h.cast<torch::Tensor>(); };
      layers_.push_back(Layer{linear_of(t[0].cast<pybind11::tuple>()), linear_of(t[1].cast<pybind11::tuple>()),
                              linear_of(t[2].cast<pybind11::tuple>()), linear_of(t[3].cast<pybind11::tuple>()),
                              middle[0].cast<torch::Tensor>(), after[0].cast<torch::Tensor>(),
                              middle[1].cast<double>(), after[1].cast<double>(), cache[0].cast<torch::Tensor>(),
                              cache[1].cast<torch::Tensor>(), optional(cache[2]), optional(cache[3])});
    }
  }

  // x: the rows normed by layer 0's input norm; residual [T, H] updated in place. Returns the rows normed by
  // the model's final norm, as ModelRunner.forward's loop over ModelRunner._layer does.
  torch::Tensor run(torch::Tensor x, torch::Tensor residual, const torch::Tensor& cos, const torch::Tensor& sin,
                    const torch::Tensor& positions, const torch::Tensor& slots, const torch::Tensor& tables,
                    const torch::Tensor& lens) const {
    const int64_t width = heads_ * head_dim_;
    for (const Layer& l : layers_) {
      torch::Tensor qkv = l.qkv(x);
      torch::Tensor q = qkv.narrow(1, 0, width), o;
      if (l.k_scale.defined()) {
        torch::Tensor k = l.k, v = l.v, ks = l.k_scale, vs = l.v_scale;
        rope_store_q8(qkv, cos, sin, positions, k, v, ks, vs, slots, heads_, kv_heads_, head_dim_);
        o = paged_decode_q8(q, l.k, l.v, l.k_scale, l.v_scale, tables, lens, block_size_, heads_, kv_heads_,
                            head_dim_, scale_);
      } else {
        torch::Tensor k = l.k, v = l.v;
        rope_store(qkv, cos, sin, positions, k, v, slots, heads_, kv_heads_, head_dim_);
        o = paged_decode(q, l.k, l.v, tables, lens, block_size_, heads_, kv_heads_, head_dim_, scale_);
      }
      x = add_rms_norm(l.o(o), residual, l.middle, l.middle_eps);
      x = add_rms_norm(l.down(silu_mul(l.gate_up(x))), residual, l.after, l.after_eps);
    }
    return x;
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_, kv_heads_, head_dim_, block_size_;
  double scale_;
};

void register_layer_loop(pybind11::module& m) {
  pybind11::class_<LayerLoop>(m, "LayerLoop")
      .def(pybind11::init<const std::vector<pybind11::tuple>&, int64_t, int64_t, int64_t, int64_t, double>())
      .def("run", &LayerLoop::run, pybind11::call_guard<pybind11::gil_scoped_release>());
}
