// Paged decode attention on the CPU: one query token per request attends over its context, read in place from
// the paged KV cache through the block table (no gather copy). One task per request; the GROUP = Hq / Hkv query
// heads that share a KV head are computed together, so each K and V row is read once.
//
//   pass 1: s[g, t] = scale * <q_g, k_t>  for t < len      (K read once)
//   pass 2: out_g = sum_t softmax(s[g])_t * v_t             (V read once)
//
// Arithmetic in fp32 whatever the cache dtype. Built by kernels/build.py (pdpool build-kernels).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

namespace {

// Eight floats in one register (AVX) or two (SSE): GCC/Clang vector extensions, so the same source compiles to
// the host's widest float unit under -march=native.
typedef float v8 __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

inline void store8(float* p, v8 x) { __builtin_memcpy(p, &x, sizeof(x)); }

inline float sum8(v8 x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

// One K or V row as fp32: the row itself for fp32 caches, a converted copy in ``buf`` otherwise.
template <typename scalar_t>
inline const float* as_float(const scalar_t* row, int64_t d, float* buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(row[i]);
    return buf;
  }
}

// A softmax weight as it multiplies V: rounded to the cache dtype first for bf16/fp16 (the normalizer keeps the
// fp32 values), as torch's CPU flash attention does, so reduced-precision decode rounds as SDPA does.
template <typename scalar_t>
inline float weight(float p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return p;
  } else {
    return static_cast<float>(static_cast<scalar_t>(p));
  }
}

constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxBlock = 256;
constexpr int64_t kAhead = 4;  // blocks prefetched ahead of use

// Ask for a block's region ahead of its use: block tables jump, so the hardware prefetcher cannot see it coming.
inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// GROUP > 0: the GQA group size at compile time, so the per-head accumulators below live in registers (a runtime
// trip count keeps them on the stack, and every FMA then waits on a store-to-load round trip). GROUP 0: any size.
template <typename scalar_t, int64_t GROUP>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                 const at::Tensor& tokens, const at::Tensor& tables, const at::Tensor& lens, double scale) {
  const int64_t rows = tokens.size(0), width = tables.size(1);
  const int64_t hq = q.size(1), hkv = k_cache.size(2), d = q.size(2), block_size = k_cache.size(1);
  const int64_t group = GROUP > 0 ? GROUP : hq / hkv, chunks = d / 8;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
  const float fscale = static_cast<float>(scale);
  // a block's K (or V) rows for one layer: [block_size, Hkv, D], contiguous in the node's layout
  const int64_t block_bytes = block_size * ks1 * static_cast<int64_t>(sizeof(scalar_t));

  // One task per request: a token's K (or V) row holds every KV head side by side ([Hkv, D], contiguous), and a
  // block's rows follow each other, so the task streams each block as one contiguous region.
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(hq * d), acc(hq * d), scores, row(d), rows_f(block_size * d);
    std::vector<float> mx(hq), denom(hq);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = len[r];
      const int64_t* blocks = tab + r * width;
      for (int64_t j = 0; j < hq; ++j) {
        const scalar_t* src = qp + tok[r] * qs0 + j * qs1;
        for (int64_t i = 0; i < d; ++i) qf[j * d + i] = static_cast<float>(src[i]) * fscale;
        mx[j] = -std::numeric_limits<float>::infinity();
      }
      scores.resize(hq * n);
      // pass 1: scores; each K row read once for its whole GQA group
      for (int64_t t = 0; t < n; ++t) {
        const scalar_t* base = kp + blocks[t / block_size] * ks0 + (t % block_size) * ks1;
        if (t % block_size == 0 && t + kAhead * block_size < n) {
          prefetch_block(kp + blocks[t / block_size + kAhead] * ks0, block_bytes);
        }
        for (int64_t h = 0; h < hkv; ++h) {
          const float* k = as_float(base + h * ks2, d, row.data());
          const float* qh = qf.data() + h * group * d;
          v8 dot[kMaxGroup];
          for (int64_t g = 0; g < group; ++g) dot[g] = v8{};
          for (int64_t c = 0; c < chunks; ++c) {
            const v8 kc = load8(k + 8 * c);
            for (int64_t g = 0; g < group; ++g) dot[g] += load8(qh + g * d + 8 * c) * kc;
          }
          for (int64_t g = 0; g < group; ++g) {
            const int64_t j = h * group + g;
            const float sc = sum8(dot[g]);
            scores[j * n + t] = sc;
            mx[j] = std::max(mx[j], sc);
          }
        }
      }
      for (int64_t j = 0; j < hq; ++j) {
        float sum = 0.f;
        float* sj = scores.data() + j * n;
        for (int64_t t = 0; t < n; ++t) {
          sj[t] = std::exp(sj[t] - mx[j]);
          sum += sj[t];
        }
        denom[j] = sum;
      }
      // pass 2: the weighted sum of V, a block at a time (its rows stay in L1), accumulating in registers
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < n; t0 += block_size) {
        const scalar_t* blk = vp + blocks[t0 / block_size] * vs0;
        if (t0 + kAhead * block_size < n) prefetch_block(vp + blocks[t0 / block_size + kAhead] * vs0, block_bytes);
        const int64_t m = std::min(block_size, n - t0);
        for (int64_t h = 0; h < hkv; ++h) {
          const float* v[kMaxBlock];
          for (int64_t t = 0; t < m; ++t) v[t] = as_float(blk + t * vs1 + h * vs2, d, rows_f.data() + t * d);
          for (int64_t c = 0; c < chunks; ++c) {
            v8 a[kMaxGroup];
            for (int64_t g = 0; g < group; ++g) a[g] = load8(acc.data() + (h * group + g) * d + 8 * c);
            for (int64_t t = 0; t < m; ++t) {
              const v8 vc = load8(v[t] + 8 * c);
              for (int64_t g = 0; g < group; ++g) a[g] += weight<scalar_t>(scores[(h * group + g) * n + t0 + t]) * vc;
            }
            for (int64_t g = 0; g < group; ++g) store8(acc.data() + (h * group + g) * d + 8 * c, a[g]);
          }
        }
      }
      for (int64_t j = 0; j < hq; ++j) {
        scalar_t* dst = op + tok[r] * os0 + j * os1;
        const float inv = 1.f / denom[j];
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<scalar_t>(acc[j * d + i] * inv);
      }
    }
  });
}

}  // namespace

// q, out: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (strided views, last dim contiguous);
// tokens: [R] int64 rows of q/out; tables: [R, W] int64 block ids; lens: [R] int64 context lengths (>= 1).
// The Python wrapper checks shapes, strides and dtypes. Errors come back as a message, not as a C++ exception:
// an exception thrown across this module's boundary crashed the process where the compiler differs from torch's.
std::string paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                         const at::Tensor& tokens, const at::Tensor& tables, const at::Tensor& lens, double scale) {
  const int64_t* len = lens.data_ptr<int64_t>();
  const int64_t limit = tables.size(1) * k_cache.size(1);
  for (int64_t r = 0; r < lens.size(0); ++r) {
    if (len[r] < 1 || len[r] > limit) {
      return "context length " + std::to_string(len[r]) + " outside [1, " + std::to_string(limit) +
             "] (the block table's width)";
    }
  }
  const int64_t group = q.size(1) / k_cache.size(2);
  if (q.size(2) % 8 != 0 || group > kMaxGroup || k_cache.size(1) > kMaxBlock) {
    return "unsupported shape: head dim must be a multiple of 8, GQA group <= " + std::to_string(kMaxGroup) +
           ", block size <= " + std::to_string(kMaxBlock);
  }
  const auto dtype = q.scalar_type();
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    switch (group) {
      case 1: return decode_impl<scalar_t, 1>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 2: return decode_impl<scalar_t, 2>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 3: return decode_impl<scalar_t, 3>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 4: return decode_impl<scalar_t, 4>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 5: return decode_impl<scalar_t, 5>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 6: return decode_impl<scalar_t, 6>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 7: return decode_impl<scalar_t, 7>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 8: return decode_impl<scalar_t, 8>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      default: return decode_impl<scalar_t, 0>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
    }
  };
  if (dtype == at::kFloat) {
    run(float{});
  } else if (dtype == at::kBFloat16) {
    run(c10::BFloat16{});
  } else if (dtype == at::kHalf) {
    run(c10::Half{});
  } else {
    return std::string("unsupported dtype ") + c10::toString(dtype);
  }
  return "";
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention, in place into out (CPU); returns an error or \"\"");
}
