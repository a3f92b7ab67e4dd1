// Eight-float vectors for the CPU kernels: GCC/Clang vector extensions, so one source compiles to the host's
// widest float unit under -march=native (one AVX register, two SSE or NEON ones). Also a vectorized exp and the
// fp32 views of bf16/fp16 rows the kernels compute on.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace pdpool_cpu {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

inline void store8(float* p, v8 x) { __builtin_memcpy(p, &x, sizeof(x)); }

inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }

inline float sum8(v8 x) { return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7])); }

inline float max8(v8 x) {
  float m = x[0];
  for (int i = 1; i < 8; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

inline v8 vmax(v8 a, v8 b) { return a > b ? a : b; }

// Pairwise sums within each 128-bit half, as x86's haddps: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, ...].
inline v8 hadd(v8 a, v8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// The four horizontal sums {sum(a), sum(b), sum(c), sum(d)}, in lanes 0..3.
inline v8 hsum4(v8 a, v8 b, v8 c, v8 d) {
  const v8 h = hadd(hadd(a, b), hadd(c, d));  // [a0123, b0123, c0123, d0123, a4567, b4567, c4567, d4567]
  return h + __builtin_shufflevector(h, h, 4, 5, 6, 7, 0, 1, 2, 3);
}

// exp(x) lane by lane: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for an exact n ln2), exp(r) by its Taylor
// series to r^7 (relative error below 2e-9 there, so the result is within an ulp or two of the rounded value),
// then 2^n through the exponent bits. Lanes below -87.3 (including -inf) give 0; lanes above 88.7 overflow to inf.
inline v8 exp8(v8 x) {
  const v8 lo = splat(-87.3f), hi = splat(88.7f);
  const v8i under = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v8 magic = splat(12582912.f);  // 1.5 * 2^23: adding it rounds to the nearest integer
  const v8 n = (x * splat(1.44269504088896341f) + magic) - magic;
  const v8 r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  v8 p = splat(1.f / 5040.f);
  p = p * r + splat(1.f / 720.f);
  p = p * r + splat(1.f / 120.f);
  p = p * r + splat(1.f / 24.f);
  p = p * r + splat(1.f / 6.f);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.f);
  p = p * r + splat(1.f);
  v8i e = __builtin_convertvector(n, v8i);
  // 2^n for n in [-126, 128): 128 (x near 88.7) would need the inf exponent, so multiply by 2^(n-1) twice there.
  const v8i big = e > 127;
  e = big ? e - 1 : e;
  v8 scale;
  const v8i bits = (e + 127) << 23;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  v8 out = p * scale;
  out = big ? out * splat(2.f) : out;
  return under ? splat(0.f) : out;
}

// A row of n values as fp32: the row itself for fp32, converted into ``buf`` otherwise.
template <typename scalar_t>
inline const float* as_float(const scalar_t* row, int64_t n, float* buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(row[i]);
    return buf;
  }
}

// x rounded to scalar_t and back (the identity for fp32): where torch rounds an intermediate to the model dtype.
template <typename scalar_t>
inline float round_to(float x) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return x;
  } else {
    return static_cast<float>(static_cast<scalar_t>(x));
  }
}

}  // namespace pdpool_cpu
