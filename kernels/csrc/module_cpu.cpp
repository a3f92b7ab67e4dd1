// The CPU extension's Python module: paged decode attention (paged_decode_cpu.cpp), the decoder layer's fused
// elementwise ops (fused_ops_cpu.cpp), the small-row linear layer (linear_cpu.cpp) and the sampler's one pass
// (sample_cpu.cpp). Built by kernels/build.py
// (pdpool build-kernels); called through the checked wrappers in kernels/cpu_decode.py, kernels/cpu_ops.py and
// pdpool/models/cpu_linear.py. Each returns an error message, or "" on success.
#include <torch/extension.h>

#include <string>

namespace pdpool_cpu {
std::string paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                         const at::Tensor& tokens, const at::Tensor& tables, const at::Tensor& lens, double scale);
std::string store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                     const at::Tensor& slots);
std::string rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                     at::Tensor& out, c10::optional<at::Tensor> residual_out, double eps);
std::string rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
std::string silu_and_mul(const at::Tensor& x, at::Tensor& out);
std::string small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                         at::Tensor& out);
std::string gumbel_argmax(const at::Tensor& logits, const at::Tensor& temperature, at::Tensor& out, int64_t seed);
std::string sample_uniforms(at::Tensor& out, int64_t seed);
}  // namespace pdpool_cpu

// Each call releases the GIL (the kernels touch no Python object): a node's front end (HTTP, detokenization) runs
// on other threads of the same process, and a kernel holding the GIL stalled it for the step's whole kernel time.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &pdpool_cpu::paged_decode, "paged decode attention, in place into out", no_gil);
  m.def("store_kv", &pdpool_cpu::store_kv, "the step's K and V rows into the paged cache by slot", no_gil);
  m.def("rms_norm", &pdpool_cpu::rms_norm, "RMSNorm, with the residual add when given, into out (and residual_out)",
        no_gil);
  m.def("rotary", &pdpool_cpu::rotary, "rotary embedding of q and k in place, from cos/sin [T, D/2] fp32", no_gil);
  m.def("silu_and_mul", &pdpool_cpu::silu_and_mul, "silu(gate) * up into out", no_gil);
  m.def("small_linear", &pdpool_cpu::small_linear, "x [M, K] @ w [N, K]^T (+ bias) into out, for few rows",
        no_gil);
  m.def("gumbel_argmax", &pdpool_cpu::gumbel_argmax,
        "one token per row: Gumbel-max at the row's temperature, argmax at 0, into out [R] int64", no_gil);
  m.def("sample_uniforms", &pdpool_cpu::sample_uniforms, "the uniforms gumbel_argmax draws under a seed", no_gil);
}
