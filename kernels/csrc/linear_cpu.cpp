// Linear layers with few rows (decode steps) on the CPU: out[m, n] = <x[m], w[n]> (+ bias[n]), w in nn.Linear's
// [N, K] layout, read in place (no packed copy). At decode sizes the GEMM is a stream over the weight: every weight
// row is read from memory once for all M input rows, while the inputs (M x K, a few KiB) stay in L1/L2.
//
//   for each tile of NR = 4 weight rows (the tiles of [N] split into one contiguous range per thread):
//     for each group of up to MR = 3 input rows:
//       acc[m][j] += x[m][k:k+8] * w[n+j][k:k+8]     (MR x NR vector accumulators in registers)
//     out[m][n+j] = hsum(acc[m][j]) + bias[n+j]
//
// The first input group reads the tile from memory, later groups find it in L1; over all of them the next tile's
// lines are prefetched a few per step (as the decode attention kernel does). Arithmetic is fp32: bf16/fp16 weights
// and inputs are widened as they are loaded, the sums rounded once to the output dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_vec.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pdpool_cpu {
namespace {

constexpr int NR = 4;            // weight rows per tile
constexpr int MR = 3;            // input rows per register block (3 x 4 accumulators + 4 weight vectors)
constexpr int64_t kGrain = 16;   // tiles per thread at least: a small weight stays on one thread

// Eight weights as fp32.
inline v8 wide8(const float* p) { return load8(p); }

inline v8 wide8(const c10::BFloat16* p) {
  uint16_t raw[8];
  std::memcpy(raw, p, sizeof(raw));
  typedef uint16_t v8u16 __attribute__((vector_size(16)));
  typedef uint32_t v8u32 __attribute__((vector_size(32)));
  v8u16 h;
  std::memcpy(&h, raw, sizeof(h));
  const v8u32 bits = __builtin_convertvector(h, v8u32) << 16;
  v8 out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline v8 wide8(const c10::Half* p) {
#if defined(__F16C__)
  v8 out;
  const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&out, &f, sizeof(out));
  return out;
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<float>(p[i]);
  return out;
#endif
}

// The next tile's cache lines, issued a few per k step over all of this tile's input groups: issued in a burst
// (or over the first group only) they fill the core's miss buffers and stall it, so that the reads and the later
// groups' arithmetic took turns instead of overlapping.
struct Prefetch {
  const char* next = nullptr;
  int64_t lines = 0, issued = 0, per_step = 0;
  inline void issue() {
    for (int64_t p = 0; p < per_step && issued < lines; ++p, ++issued) __builtin_prefetch(next + 64 * issued, 0, 3);
  }
};

// One tile: MB input rows (fp32, row stride k) against NB weight rows (row stride k) -> sums[m][j].
template <typename scalar_t, int MB, int NB>
inline void tile(const float* x, const scalar_t* w, int64_t k, float (*sums)[NR], Prefetch& pf) {
  v8 acc[MB][NB];
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = v8{};
  const int64_t steps = k / 8;
  for (int64_t s = 0; s < steps; ++s) {
    pf.issue();
    v8 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = wide8(w + j * k + 8 * s);
    for (int m = 0; m < MB; ++m) {
      const v8 xv = load8(x + m * k + 8 * s);
      for (int j = 0; j < NB; ++j) acc[m][j] += xv * wv[j];
    }
  }
  for (int m = 0; m < MB; ++m) {
    if constexpr (NB == NR) {
      const v8 h = hsum4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
      for (int j = 0; j < NR; ++j) sums[m][j] = h[j];
    } else {
      for (int j = 0; j < NB; ++j) sums[m][j] = sum8(acc[m][j]);
    }
  }
  for (int64_t e = steps * 8; e < k; ++e)  // K not a multiple of 8
    for (int m = 0; m < MB; ++m)
      for (int j = 0; j < NB; ++j) sums[m][j] += x[m * k + e] * static_cast<float>(w[j * k + e]);
}

// rows (1..MR) input rows, dispatched to a compile-time row count.
template <typename scalar_t, int NB>
inline void tile_rows(const float* x, const scalar_t* w, int64_t k, float (*sums)[NR], Prefetch& pf, int64_t rows) {
  switch (rows) {
    case 3: tile<scalar_t, 3, NB>(x, w, k, sums, pf); break;
    case 2: tile<scalar_t, 2, NB>(x, w, k, sums, pf); break;
    default: tile<scalar_t, 1, NB>(x, w, k, sums, pf); break;
  }
}

template <typename scalar_t>
void linear_impl(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  // x: [M, K] (rows strided, last dim contiguous); w: [N, K] contiguous; bias: [N]; out: [M, N] contiguous
  const int64_t m_rows = x.size(0), k = x.size(1), n = w.size(0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* wp = w.data_ptr<scalar_t>();
  const scalar_t* bp = bias ? bias->data_ptr<scalar_t>() : nullptr;
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t xs = x.stride(0);
  // the inputs as fp32 rows of K (a few KiB: they stay in cache for every tile)
  std::vector<float> xf;
  const float* xrows;
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (xs == k) {
      xrows = xp;
    } else {
      xf.resize(m_rows * k);
      for (int64_t m = 0; m < m_rows; ++m) std::memcpy(xf.data() + m * k, xp + m * xs, k * sizeof(float));
      xrows = xf.data();
    }
  } else {
    xf.resize(m_rows * k);
    for (int64_t m = 0; m < m_rows; ++m)
      for (int64_t e = 0; e < k; ++e) xf[m * k + e] = static_cast<float>(xp[m * xs + e]);
    xrows = xf.data();
  }
  const int64_t tiles = (n + NR - 1) / NR, groups = (m_rows + MR - 1) / MR;
  const int64_t tile_lines = (NR * k * static_cast<int64_t>(sizeof(scalar_t)) + 63) / 64;
  at::parallel_for(0, tiles, kGrain, [&](int64_t begin, int64_t end) {
    float sums[MR][NR];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * NR, nb = std::min<int64_t>(NR, n - n0);
      const scalar_t* wt = wp + n0 * k;
      Prefetch pf;  // the next tile of this thread's range
      if (t + 1 < end) {
        pf.next = reinterpret_cast<const char*>(wt + NR * k);
        pf.lines = std::min<int64_t>(tile_lines, ((n - n0 - NR) * k * static_cast<int64_t>(sizeof(scalar_t))) / 64);
        const int64_t steps = std::max<int64_t>(1, groups * nb * (k / 8) / NR);
        pf.per_step = (pf.lines + steps - 1) / steps;
      }
      for (int64_t m0 = 0; m0 < m_rows; m0 += MR) {
        const int64_t mb = std::min<int64_t>(MR, m_rows - m0);
        if (nb == NR) {
          tile_rows<scalar_t, NR>(xrows + m0 * k, wt, k, sums, pf, mb);
        } else {
          for (int64_t j = 0; j < nb; ++j) {
            float one[MR][NR];
            tile_rows<scalar_t, 1>(xrows + m0 * k, wt + j * k, k, one, pf, mb);
            for (int64_t m = 0; m < mb; ++m) sums[m][j] = one[m][0];
          }
        }
        for (int64_t m = 0; m < mb; ++m) {
          scalar_t* dst = op + (m0 + m) * n + n0;
          for (int64_t j = 0; j < nb; ++j) {
            const float b = bp != nullptr ? static_cast<float>(bp[n0 + j]) : 0.f;
            dst[j] = static_cast<scalar_t>(sums[m][j] + b);
          }
        }
      }
    }
  });
}

}  // namespace

std::string small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                         at::Tensor& out) {
  if (x.dim() != 2 || w.dim() != 2 || out.dim() != 2) return "x, w and out must be 2-d";
  if (x.size(1) != w.size(1)) return "x [M, K] and w [N, K] differ in K";
  if (out.size(0) != x.size(0) || out.size(1) != w.size(0)) return "out must be [M, N]";
  if (x.scalar_type() != w.scalar_type() || out.scalar_type() != w.scalar_type())
    return "x, w and out must have one dtype";
  if (!w.is_contiguous() || !out.is_contiguous() || (x.numel() && x.stride(1) != 1))
    return "w and out must be contiguous, x's rows contiguous";
  if (bias) {
    if (bias->dim() != 1 || bias->size(0) != w.size(0) || !bias->is_contiguous() ||
        bias->scalar_type() != w.scalar_type())
      return "bias must be contiguous [N] of w's dtype";
  }
  if (out.numel() == 0) return "";
  if (x.size(1) == 0) {  // no products: the bias, or zeros
    if (bias) out.copy_(bias->unsqueeze(0).expand_as(out)); else out.zero_();
    return "";
  }
  switch (w.scalar_type()) {
    case at::kFloat: linear_impl<float>(x, w, bias, out); break;
    case at::kBFloat16: linear_impl<c10::BFloat16>(x, w, bias, out); break;
    case at::kHalf: linear_impl<c10::Half>(x, w, bias, out); break;
    default: return "dtype must be float32, bfloat16 or float16";
  }
  return "";
}

}  // namespace pdpool_cpu
