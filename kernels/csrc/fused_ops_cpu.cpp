// The decoder layer's elementwise ops on the CPU, each one pass over its rows (torch runs each as 3 to 6 separate
// kernels with a temporary between each), in the order and rounding of the torch ops they replace:
//
//   rms_norm:     r' = round(x + r);  out = round(w * round(r' * rsqrt(mean(r'^2) + eps)))   (HF's order)
//   rotary:       x1' = x1 cos - x2 sin,  x2' = x2 cos + x1 sin   (neox halves; cos/sin [T, D/2] fp32, in place;
//                 in bf16/fp16, cos, sin and each product rounded to the dtype first, as the torch ops are)
//   silu_and_mul: out = round(silu(gate) * up)   (gate | up = the fused projection's halves)
//
// Arithmetic in fp32, rounded to the tensor dtype where torch rounds. Rows are split over torch's threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <string>
#include <vector>

#include "cpu_vec.h"

namespace pdpool_cpu {
namespace {

// Rows per task: enough work per thread hand-off for rows of a few hundred floats.
inline int64_t grain(int64_t row_floats) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_floats)); }

template <typename scalar_t>
void rms_norm_impl(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                   at::Tensor& out, c10::optional<at::Tensor>& residual_out, double eps) {
  // x, out: [T, H] or [T, heads, H] rows (strided); residual, residual_out: [T, H]
  const int64_t t_rows = x.size(0), heads = x.dim() == 3 ? x.size(1) : 1, h = x.size(-1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* wp = weight.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const scalar_t* rp = residual ? residual->data_ptr<scalar_t>() : nullptr;
  scalar_t* rop = residual_out ? residual_out->data_ptr<scalar_t>() : nullptr;
  const int64_t xs0 = x.stride(0), xs1 = x.dim() == 3 ? x.stride(1) : 0;
  const int64_t os0 = out.stride(0), os1 = out.dim() == 3 ? out.stride(1) : 0;
  const int64_t rs0 = residual ? residual->stride(0) : 0, ros0 = residual_out ? residual_out->stride(0) : 0;
  at::parallel_for(0, t_rows * heads, grain(h), [&](int64_t begin, int64_t end) {
    std::vector<float> row(h), w(h);
    for (int64_t i = 0; i < h; ++i) w[i] = static_cast<float>(wp[i]);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t t = idx / heads, hd = idx % heads;
      const scalar_t* src = xp + t * xs0 + hd * xs1;
      if (rp != nullptr) {
        const scalar_t* res = rp + t * rs0;
        scalar_t* res_out = rop + t * ros0;
        for (int64_t i = 0; i < h; ++i) {
          const scalar_t sum = static_cast<scalar_t>(static_cast<float>(src[i]) + static_cast<float>(res[i]));
          res_out[i] = sum;
          row[i] = static_cast<float>(sum);
        }
      } else {
        for (int64_t i = 0; i < h; ++i) row[i] = static_cast<float>(src[i]);
      }
      v8 sq = v8{};
      int64_t i = 0;
      for (; i + 8 <= h; i += 8) {
        const v8 xv = load8(row.data() + i);
        sq += xv * xv;
      }
      float ss = sum8(sq);
      for (; i < h; ++i) ss += row[i] * row[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + static_cast<float>(eps));
      scalar_t* dst = op + t * os0 + hd * os1;
      for (int64_t e = 0; e < h; ++e) dst[e] = static_cast<scalar_t>(w[e] * round_to<scalar_t>(row[e] * inv));
    }
  });
}

template <typename scalar_t>
void rotary_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  // x: [T, heads, D] (strided rows, rotated in place); cos, sin: [T, D/2] fp32 contiguous
  const int64_t t_rows = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  scalar_t* xp = x.data_ptr<scalar_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, t_rows, grain(heads * half * 2), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int64_t hd = 0; hd < heads; ++hd) {
        scalar_t* a = xp + t * s0 + hd * s1;
        scalar_t* b = a + half;
        if constexpr (std::is_same_v<scalar_t, float>) {
          int64_t i = 0;
          for (; i + 8 <= half; i += 8) {
            const v8 x1 = load8(a + i), x2 = load8(b + i), cv = load8(c + i), sv = load8(s + i);
            store8(a + i, x1 * cv - x2 * sv);
            store8(b + i, x2 * cv + x1 * sv);
          }
          for (; i < half; ++i) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * c[i] - x2 * s[i];
            b[i] = x2 * c[i] + x1 * s[i];
          }
        } else {
          // as the model's torch ops round: cos and sin in the model dtype, each product, then the sum
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(a[i]), x2 = static_cast<float>(b[i]);
            const float ci = round_to<scalar_t>(c[i]), si = round_to<scalar_t>(s[i]);
            a[i] = static_cast<scalar_t>(round_to<scalar_t>(x1 * ci) - round_to<scalar_t>(x2 * si));
            b[i] = static_cast<scalar_t>(round_to<scalar_t>(x2 * ci) + round_to<scalar_t>(x1 * si));
          }
        }
      }
    }
  });
}

template <typename scalar_t>
void silu_and_mul_impl(const at::Tensor& x, at::Tensor& out) {
  // x: [T, 2I] (strided rows) = gate | up -> out: [T, I]
  const int64_t t_rows = x.size(0), inter = out.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t xs0 = x.stride(0), os0 = out.stride(0);
  at::parallel_for(0, t_rows, grain(3 * inter), [&](int64_t begin, int64_t end) {
    std::vector<float> gate(inter), up(inter);
    for (int64_t t = begin; t < end; ++t) {
      const float* g = as_float(xp + t * xs0, inter, gate.data());
      const float* u = as_float(xp + t * xs0 + inter, inter, up.data());
      scalar_t* dst = op + t * os0;
      int64_t i = 0;
      if constexpr (std::is_same_v<scalar_t, float>) {
        for (; i + 8 <= inter; i += 8) {
          const v8 gv = load8(g + i);
          store8(dst + i, gv / (splat(1.f) + exp8(-gv)) * load8(u + i));
        }
      }
      for (; i < inter; ++i) {
        const float silu = round_to<scalar_t>(g[i] / (1.f + std::exp(-g[i])));
        dst[i] = static_cast<scalar_t>(silu * u[i]);
      }
    }
  });
}

template <typename F>
std::string dispatch(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else if (dtype == at::kBFloat16) {
    f(c10::BFloat16{});
  } else if (dtype == at::kHalf) {
    f(c10::Half{});
  } else {
    return std::string("unsupported dtype ") + c10::toString(dtype);
  }
  return "";
}

}  // namespace

// The Python wrappers (kernels/cpu_ops.py) check shapes, strides and dtypes; errors come back as a message.
std::string rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual, const at::Tensor& weight,
                     at::Tensor& out, c10::optional<at::Tensor> residual_out, double eps) {
  return dispatch(x.scalar_type(), [&](auto zero) {
    rms_norm_impl<decltype(zero)>(x, residual, weight, out, residual_out, eps);
  });
}

std::string rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  return dispatch(q.scalar_type(), [&](auto zero) {
    rotary_impl<decltype(zero)>(q, cos, sin);
    rotary_impl<decltype(zero)>(k, cos, sin);
  });
}

std::string silu_and_mul(const at::Tensor& x, at::Tensor& out) {
  return dispatch(x.scalar_type(), [&](auto zero) { silu_and_mul_impl<decltype(zero)>(x, out); });
}

}  // namespace pdpool_cpu
