// The sampler's common case in one pass over the logits, on the CPU (the counterpart of kernels/sample.py's Triton
// kernel): temperature or greedy rows, no top-k/top-p/min-p, no per-request seed.
//
//   random row (T > 0): argmax(x / T + G),  G = -log(-log U)   (Gumbel-max: a draw from softmax(x / T))
//   greedy row (T = 0): argmax(x), first index on ties (torch.argmax's)
//
// U is a hash of (seed, row * V + col) mapped into (0, 1): a row's draw depends on the seed and its own row only,
// never on how the columns are split over threads. The torch sampler does ~10 passes over [R, V] for this case and
// draws its exponentials one element at a time from a Mersenne twister (8.5 ms for 8 x 49152 here); this reads the
// logits once. Each row is cut into column chunks (one task each, split over torch's threads); the chunks' maxima
// are combined in column order, keeping the first maximum.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu_vec.h"

namespace pdpool_cpu {
namespace {

typedef uint32_t v8u __attribute__((vector_size(32)));

constexpr int64_t kChunk = 4096;  // columns per task

// murmur3's 32-bit finalizer: every input bit flips each output bit with probability about 1/2.
template <typename T>
inline T fmix32(T h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// The uniform of element `counter` under key (k0, k1): 23 hash bits + 1/2, times 2^-23, in [2^-24, 1 - 2^-24] and
// exact in fp32 (24 bits + 1/2 would round the top value to 1.0: -log(-log 1) = +inf would win the row).
template <typename T>
inline T hash_bits(T counter, uint32_t k0, uint32_t k1) {
  return fmix32((fmix32(counter ^ k0) ^ k1) * 0x9e3779b1u);
}

inline float uniform1(uint32_t counter, uint32_t k0, uint32_t k1) {
  return (static_cast<float>(hash_bits<uint32_t>(counter, k0, k1) >> 9) + 0.5f) * (1.f / 8388608.f);
}

inline v8 uniform8(v8u counter, uint32_t k0, uint32_t k1) {
  const v8u h = hash_bits<v8u>(counter, k0, k1) >> 9;
  return (__builtin_convertvector(h, v8) + splat(0.5f)) * splat(1.f / 8388608.f);
}

// log(x) for normal x > 0, lane by lane: x = m 2^e with m in [sqrt(1/2), sqrt(2)), log(m) by the classic minimax
// polynomial in f = m - 1 (within about an ulp), ln2 split in two for an exact e ln2.
inline v8 log8(v8 x) {
  v8i bits;
  __builtin_memcpy(&bits, &x, sizeof(bits));
  v8i e = ((bits >> 23) & 0xff) - 127;
  const v8i mbits = (bits & 0x007fffff) | 0x3f800000;  // m in [1, 2)
  v8 m;
  __builtin_memcpy(&m, &mbits, sizeof(m));
  const v8i high = m > splat(1.41421356f);
  m = high ? m * splat(0.5f) : m;
  e = high ? e + 1 : e;
  const v8 f = m - splat(1.f);
  const v8 z = f * f;
  v8 p = splat(7.0376836292e-2f);
  p = p * f + splat(-1.1514610310e-1f);
  p = p * f + splat(1.1676998740e-1f);
  p = p * f + splat(-1.2420140846e-1f);
  p = p * f + splat(1.4249322787e-1f);
  p = p * f + splat(-1.6668057665e-1f);
  p = p * f + splat(2.0000714765e-1f);
  p = p * f + splat(-2.4999993993e-1f);
  p = p * f + splat(3.3333331174e-1f);
  const v8 ef = __builtin_convertvector(e, v8);
  v8 y = p * z * f + ef * splat(-2.12194440e-4f) - splat(0.5f) * z;
  return f + y + ef * splat(0.693359375f);
}

inline v8 gumbel8(v8u counter, uint32_t k0, uint32_t k1) { return -log8(-log8(uniform8(counter, k0, k1))); }

inline float gumbel1(uint32_t counter, uint32_t k0, uint32_t k1) {
  v8 u = splat(uniform1(counter, k0, k1));  // the vector path's arithmetic, so a column's noise is the same
  return (-log8(-log8(u)))[0];
}

// The first maximum of x / T + G (or of x, greedy) over columns [lo, hi) of one row; x points at column lo.
inline void chunk_argmax(const float* x, int64_t lo, int64_t hi, uint32_t base, float inv_t, bool noisy, uint32_t k0,
                         uint32_t k1, float* best_out, int64_t* idx_out) {
  v8 best = splat(-INFINITY);
  v8i best_idx = v8i{0, 0, 0, 0, 0, 0, 0, 0};
  const v8i lane = v8i{0, 1, 2, 3, 4, 5, 6, 7};
  const v8u ulane = v8u{0, 1, 2, 3, 4, 5, 6, 7};
  int64_t c = lo;
  for (; c + 8 <= hi; c += 8) {
    v8 score = load8(x + (c - lo));
    if (noisy) score = score * splat(inv_t) + gumbel8(ulane + (base + static_cast<uint32_t>(c)), k0, k1);
    const v8i better = score > best;  // strict: each lane keeps its first maximum
    best = better ? score : best;
    best_idx = better ? lane + static_cast<int32_t>(c) : best_idx;
  }
  float top = -INFINITY;
  int64_t top_idx = 0;
  for (int i = 0; i < 8; ++i) {  // lanes hold interleaved columns: the largest value, then its smallest column
    if (best[i] > top || (best[i] == top && best_idx[i] < top_idx && top != -INFINITY)) {
      top = best[i];
      top_idx = best_idx[i];
    }
  }
  for (; c < hi; ++c) {  // the tail is after every vector column: strictly greater only
    const float xc = x[c - lo];
    const float score = noisy ? xc * inv_t + gumbel1(base + static_cast<uint32_t>(c), k0, k1) : xc;
    if (score > top) {
      top = score;
      top_idx = c;
    }
  }
  *best_out = top;
  *idx_out = top_idx;
}

template <typename scalar_t>
void gumbel_argmax_impl(const at::Tensor& logits, const at::Tensor& temperature, at::Tensor& out, int64_t seed) {
  // logits: [R, V] (strided rows), temperature: [R] fp32, out: [R] int64
  const int64_t rows = logits.size(0), vocab = logits.size(1), rs = logits.stride(0);
  const int64_t chunks = (vocab + kChunk - 1) / kChunk;
  const scalar_t* lp = logits.data_ptr<scalar_t>();
  const float* tp = temperature.data_ptr<float>();
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t k0 = fmix32<uint32_t>(static_cast<uint32_t>(s) ^ 0x3c6ef372u);
  const uint32_t k1 = fmix32<uint32_t>(static_cast<uint32_t>(s >> 32) ^ 0xa54ff53au);
  std::vector<float> part_val(rows * chunks);
  std::vector<int64_t> part_idx(rows * chunks);
  at::parallel_for(0, rows * chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(std::is_same_v<scalar_t, float> ? 0 : kChunk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / chunks, lo = (task % chunks) * kChunk, hi = std::min(lo + kChunk, vocab);
      const float t = tp[r];
      const bool noisy = t > 0.f;
      const float* x = as_float(lp + r * rs + lo, hi - lo, buf.data());
      chunk_argmax(x, lo, hi, static_cast<uint32_t>(r * vocab), noisy ? 1.f / t : 1.f, noisy, k0, k1,
                   &part_val[task], &part_idx[task]);
    }
  });
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    float top = part_val[r * chunks];
    int64_t idx = part_idx[r * chunks];
    for (int64_t c = 1; c < chunks; ++c) {  // chunks in column order: a later one wins only if strictly greater
      if (part_val[r * chunks + c] > top) {
        top = part_val[r * chunks + c];
        idx = part_idx[r * chunks + c];
      }
    }
    op[r] = idx;
  }
}

}  // namespace

// Checked by the Python wrapper (kernels/cpu_ops.py); errors come back as a message.
std::string gumbel_argmax(const at::Tensor& logits, const at::Tensor& temperature, at::Tensor& out, int64_t seed) {
  const auto dtype = logits.scalar_type();
  if (dtype == at::kFloat) {
    gumbel_argmax_impl<float>(logits, temperature, out, seed);
  } else if (dtype == at::kBFloat16) {
    gumbel_argmax_impl<c10::BFloat16>(logits, temperature, out, seed);
  } else if (dtype == at::kHalf) {
    gumbel_argmax_impl<c10::Half>(logits, temperature, out, seed);
  } else {
    return std::string("unsupported dtype ") + c10::toString(dtype);
  }
  return "";
}

// The uniforms the kernel draws for a [rows, vocab] batch under `seed`, into out [rows, vocab] fp32 (for the tests'
// torch reference).
std::string sample_uniforms(at::Tensor& out, int64_t seed) {
  const int64_t rows = out.size(0), vocab = out.size(1);
  const uint64_t s = static_cast<uint64_t>(seed);
  const uint32_t k0 = fmix32<uint32_t>(static_cast<uint32_t>(s) ^ 0x3c6ef372u);
  const uint32_t k1 = fmix32<uint32_t>(static_cast<uint32_t>(s >> 32) ^ 0xa54ff53au);
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < vocab; ++c) op[r * vocab + c] = uniform1(static_cast<uint32_t>(r * vocab + c), k0, k1);
  return "";
}

}  // namespace pdpool_cpu
