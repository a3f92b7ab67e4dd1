// Paged decode attention on the CPU: one query token per request attends over its context, read in place from
// the paged KV cache through the block table (no gather copy), in ONE pass with an online softmax:
//
//   for each block b of the request (its K and V rows: [block_size, Hkv, D] each, next to each other in the node's
//   layout), for each KV head h and the G query heads that share it:
//     s[g, t]  = scale * <q_g, k_t>                                  (K rows of the block, in L1 from here on)
//     m'       = max(m, max_t s[g, t]);   c = exp(m - m')
//     p[g, t]  = exp(s[g, t] - m')                                   (vectorized exp)
//     l        = c * l + sum_t p[g, t];    acc_g = c * acc_g + sum_t p[g, t] v_t
//   out_g = acc_g / l
//
// Each K and V byte is read once, with no score array over the context. A tile (whole blocks, at least kTile
// tokens) is one softmax pass; the next tile's lines are prefetched a few at a time while this one is computed.
// Rows are handed to threads one at a time, longest first (lengths differ, a static split leaves a thread idle).
// Arithmetic is fp32 whatever the cache dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <string>
#include <vector>
#include <cstring>

#include "cpu_vec.h"

namespace pdpool_cpu {
namespace {

constexpr int64_t kMaxBlock = 256;
constexpr int64_t kTile = 16;  // tokens per softmax pass: whole blocks, at least one

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(c + i, 0, 3);
}

// The next tile's cache lines, a few at a time between the current tile's loads. Block tables jump, so the hardware
// prefetcher cannot guess the next block; and a burst of hundreds of prefetches (the whole next block at once) fills
// the core's miss buffers and stalls it until they land, so that reads and arithmetic took turns instead of
// overlapping (3.5 -> 2.2 ms per layer on bench_cpu_decode.py's shapes, docs/performance.md).
struct Prefetcher {
  static constexpr int kMaxRanges = 2 * kTile;  // a K and a V range per block of the tile
  const char* begin[kMaxRanges];
  int64_t lines[kMaxRanges];
  int n = 0, at = 0;
  int64_t line = 0, total = 0;
  void reset() { n = at = 0; line = total = 0; }
  void add(const void* p, int64_t bytes) {
    if (n < kMaxRanges) {
      begin[n] = static_cast<const char*>(p);
      lines[n++] = (bytes + 63) / 64;
      total += (bytes + 63) / 64;
    }
  }
  inline void issue(int64_t count) {
    while (count-- > 0 && at < n) {
      __builtin_prefetch(begin[at] + 64 * line, 0, 3);
      if (++line == lines[at]) {
        line = 0;
        ++at;
      }
    }
  }
};

// Query heads that share one KV head, handled together so that each K and V row is read once for all of them.
// SG is a compile-time group (a larger or odd group runs as several of these), so that the accumulators below
// stay in registers: TB tokens at a time for the scores, CB chunks of 8 floats at a time for V.
template <int SG>
struct Group {
  static constexpr int TB = SG <= 3 ? 4 : (SG <= 6 ? 2 : 1);
  static constexpr int CB = SG <= 1 ? 8 : (SG <= 3 ? 4 : (SG <= 6 ? 2 : 1));

  // s[g * kMaxBlock + t] = <q_g, k_t> for t < m; q: [SG, D] (scaled), k[t]: a row of D floats.
  static void scores(const float* q, const float* const* k, int64_t m, int64_t chunks, float* s, Prefetcher& pf,
                     int64_t per_step) {
    const int64_t d = chunks * 8;
    for (int64_t t0 = 0; t0 < m; t0 += TB) {
      pf.issue(per_step);
      const float* kr[TB];
      for (int i = 0; i < TB; ++i) kr[i] = k[std::min<int64_t>(t0 + i, m - 1)];  // past m: any valid row, dropped
      v8 acc[TB][SG];
      for (int i = 0; i < TB; ++i)
        for (int g = 0; g < SG; ++g) acc[i][g] = v8{};
      for (int64_t c = 0; c < chunks; ++c) {
        for (int i = 0; i < TB; ++i) {
          const v8 kc = load8(kr[i] + 8 * c);
          for (int g = 0; g < SG; ++g) acc[i][g] += load8(q + g * d + 8 * c) * kc;
        }
      }
      for (int g = 0; g < SG; ++g) {
        float out[TB];
        if constexpr (TB == 4) {
          const v8 h = hsum4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]);
          for (int i = 0; i < 4; ++i) out[i] = h[i];
        } else {
          for (int i = 0; i < TB; ++i) out[i] = sum8(acc[i][g]);
        }
        for (int i = 0; i < TB && t0 + i < m; ++i) s[g * kMaxBlock + t0 + i] = out[i];
      }
    }
  }

  // acc[g, 8c0 : 8(c0+NC)] += sum_t p[g, t] v_t[8c0 : 8(c0+NC)]
  template <int NC>
  static void weighted_sum(float* acc, const float* p, const float* const* v, int64_t m, int64_t c0, int64_t d) {
    v8 a[SG][NC];
    for (int g = 0; g < SG; ++g)
      for (int c = 0; c < NC; ++c) a[g][c] = load8(acc + g * d + 8 * (c0 + c));
    for (int64_t t = 0; t < m; ++t) {
      for (int c = 0; c < NC; ++c) {
        const v8 vc = load8(v[t] + 8 * (c0 + c));
        for (int g = 0; g < SG; ++g) a[g][c] += p[g * kMaxBlock + t] * vc;
      }
    }
    for (int g = 0; g < SG; ++g)
      for (int c = 0; c < NC; ++c) store8(acc + g * d + 8 * (c0 + c), a[g][c]);
  }

  // One block (m <= kMaxBlock tokens) into the running state of SG query heads: mx, l: [SG]; acc: [SG, D].
  template <typename scalar_t>
  static void block(const float* q, const float* const* k, const float* const* v, int64_t m, int64_t chunks,
                    float* mx, float* l, float* acc, float* s, Prefetcher& pf, int64_t calls) {
    const int64_t d = chunks * 8;
    // this call's share of the next tile's lines, spread over its score steps
    const int64_t steps = (m + TB - 1) / TB;
    scores(q, k, m, chunks, s, pf, (pf.total + calls * steps - 1) / (calls * steps));
    const int64_t padded = (m + 7) / 8 * 8;
    for (int g = 0; g < SG; ++g) {
      float* sg = s + g * kMaxBlock;
      for (int64_t t = m; t < padded; ++t) sg[t] = -std::numeric_limits<float>::infinity();
      v8 bm = load8(sg);
      for (int64_t t = 8; t < padded; t += 8) bm = vmax(bm, load8(sg + t));
      const float m_new = std::max(mx[g], max8(bm));
      const float correction = std::exp(mx[g] - m_new);  // 0 for the first block (mx = -inf)
      v8 sum = v8{};
      for (int64_t t = 0; t < padded; t += 8) {
        const v8 pt = exp8(load8(sg + t) - m_new);
        sum += pt;
        store8(sg + t, pt);
      }
      if constexpr (!std::is_same_v<scalar_t, float>) {
        // the weight as it multiplies V, rounded to the cache dtype as torch's flash attention does (l keeps fp32)
        for (int64_t t = 0; t < m; ++t) sg[t] = round_to<scalar_t>(sg[t]);
      }
      l[g] = l[g] * correction + sum8(sum);
      mx[g] = m_new;
      if (correction != 1.f) {
        float* ag = acc + g * d;
        for (int64_t c = 0; c < chunks; ++c) store8(ag + 8 * c, load8(ag + 8 * c) * correction);
      }
    }
    int64_t c0 = 0;
    for (; c0 + CB <= chunks; c0 += CB) weighted_sum<CB>(acc, s, v, m, c0, d);
    if constexpr (CB > 2) {
      for (; c0 + 2 <= chunks; c0 += 2) weighted_sum<2>(acc, s, v, m, c0, d);
    }
    for (; c0 < chunks; ++c0) weighted_sum<1>(acc, s, v, m, c0, d);
  }
};

template <typename scalar_t, int SG>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, at::Tensor& out,
                 const at::Tensor& tokens, const at::Tensor& tables, const at::Tensor& lens, double scale) {
  const int64_t rows = tokens.size(0), width = tables.size(1);
  const int64_t hq = q.size(1), hkv = k_cache.size(2), d = q.size(2), block_size = k_cache.size(1);
  const int64_t group = hq / hkv, chunks = d / 8;
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
  const int64_t k_bytes = ((block_size - 1) * ks1 + (hkv - 1) * ks2 + d) * static_cast<int64_t>(sizeof(scalar_t));
  const int64_t v_bytes = ((block_size - 1) * vs1 + (hkv - 1) * vs2 + d) * static_cast<int64_t>(sizeof(scalar_t));

  std::vector<int64_t> order(rows);  // longest first, handed out one at a time
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len[a] > len[b]; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows));

  // Tokens per softmax pass: whole blocks, up to kTile tokens (one block where a block is larger), so that the
  // per-pass work (the max, the rescale, the exp of the scores) is paid once per tile, not once per block.
  const int64_t tile_blocks = std::max<int64_t>(1, kTile / block_size), tile = tile_blocks * block_size;
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> qf(hq * d), acc(hq * d), mx(hq), l(hq);
    std::vector<float> s(SG * kMaxBlock), kbuf, vbuf;
    if constexpr (!std::is_same_v<scalar_t, float>) {
      kbuf.resize(tile * hkv * d);
      vbuf.resize(tile * hkv * d);
    }
    std::vector<const float*> krows(hkv * tile), vrows(hkv * tile);  // [Hkv][tile]
    Prefetcher pf;
    for (int64_t i; (i = next.fetch_add(1)) < rows;) {
      const int64_t r = order[i], n = len[r];
      const int64_t* blocks = tab + r * width;
      for (int64_t j = 0; j < hq; ++j) {
        const scalar_t* src = qp + tok[r] * qs0 + j * qs1;
        for (int64_t e = 0; e < d; ++e) qf[j * d + e] = static_cast<float>(src[e]) * fscale;
        mx[j] = -std::numeric_limits<float>::infinity();
        l[j] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t num_blocks = (n + block_size - 1) / block_size;
      for (int64_t b = 0; b < std::min(tile_blocks, num_blocks); ++b) {  // the first tile: nothing to overlap
        prefetch(kp + blocks[b] * ks0, k_bytes);
        prefetch(vp + blocks[b] * vs0, v_bytes);
      }
      for (int64_t b0 = 0; b0 < num_blocks; b0 += tile_blocks) {
        const int64_t b1 = std::min(num_blocks, b0 + tile_blocks);
        pf.reset();  // the next tile's blocks, issued while this tile is computed
        for (int64_t b = b1; b < std::min(num_blocks, b1 + tile_blocks); ++b) {
          pf.add(kp + blocks[b] * ks0, k_bytes);
          pf.add(vp + blocks[b] * vs0, v_bytes);
        }
        int64_t m = 0;
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t mb = std::min(block_size, n - b * block_size);
          const scalar_t* kb = kp + blocks[b] * ks0;
          const scalar_t* vb = vp + blocks[b] * vs0;
          for (int64_t t = 0; t < mb; ++t, ++m) {
            for (int64_t h = 0; h < hkv; ++h) {
              if constexpr (std::is_same_v<scalar_t, float>) {
                krows[h * tile + m] = kb + t * ks1 + h * ks2;
                vrows[h * tile + m] = vb + t * vs1 + h * vs2;
              } else {
                float* kd = kbuf.data() + (m * hkv + h) * d;
                float* vd = vbuf.data() + (m * hkv + h) * d;
                krows[h * tile + m] = as_float(kb + t * ks1 + h * ks2, d, kd);
                vrows[h * tile + m] = as_float(vb + t * vs1 + h * vs2, d, vd);
              }
            }
          }
        }
        const int64_t calls = hkv * ((group + SG - 1) / SG);
        for (int64_t h = 0; h < hkv; ++h) {
          for (int64_t g0 = 0; g0 < group; g0 += SG) {
            const int64_t j = h * group + g0;  // first query head of this subgroup
            Group<SG>::template block<scalar_t>(qf.data() + j * d, krows.data() + h * tile,
                                                vrows.data() + h * tile, m, chunks, mx.data() + j,
                                                l.data() + j, acc.data() + j * d, s.data(), pf, calls);
          }
        }
      }
      for (int64_t j = 0; j < hq; ++j) {
        scalar_t* dst = op + tok[r] * os0 + j * os1;
        const float inv = 1.f / l[j];
        for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<scalar_t>(acc[j * d + e] * inv);
      }
    }
  });
}

// The compile-time subgroup for a GQA group: the group itself up to 8, else its largest divisor up to 8.
int64_t subgroup(int64_t group) {
  for (int64_t sg = std::min<int64_t>(group, 8); sg > 1; --sg) {
    if (group % sg == 0) return sg;
  }
  return 1;
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
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t num_blocks = k_cache.size(0);
  for (int64_t r = 0; r < lens.size(0); ++r) {
    for (int64_t b = 0; b < (len[r] + k_cache.size(1) - 1) / k_cache.size(1); ++b) {
      const int64_t id = tab[r * tables.size(1) + b];
      if (id < 0 || id >= num_blocks) {
        return "block id " + std::to_string(id) + " outside [0, " + std::to_string(num_blocks) + ")";
      }
    }
  }
  if (q.size(2) % 8 != 0 || k_cache.size(1) > kMaxBlock) {
    return "unsupported shape: head dim must be a multiple of 8, block size <= " + std::to_string(kMaxBlock);
  }
  const auto dtype = q.scalar_type();
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    switch (subgroup(q.size(1) / k_cache.size(2))) {
      case 1: return decode_impl<scalar_t, 1>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 2: return decode_impl<scalar_t, 2>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 3: return decode_impl<scalar_t, 3>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 4: return decode_impl<scalar_t, 4>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 5: return decode_impl<scalar_t, 5>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 6: return decode_impl<scalar_t, 6>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      case 7: return decode_impl<scalar_t, 7>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
      default: return decode_impl<scalar_t, 8>(q, k_cache, v_cache, out, tokens, tables, lens, scale);
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

// k_cache[slot / block_size, slot % block_size] = k (and v): the step's new K and V rows into the paged cache,
// one row copy each (torch's index_put_ on the strided cache views went through advanced indexing, per element).
// k, v: [T, Hkv, D] (strided rows); slots: [T] int64, -1 = padding (skipped); caches as for paged_decode.
std::string store_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                     const at::Tensor& slots) {
  const int64_t t_rows = k.size(0), hkv = k.size(1), d = k.size(2), block_size = k_cache.size(1);
  const int64_t limit = k_cache.size(0) * block_size;
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < t_rows; ++t) {
    if (sp[t] < -1 || sp[t] >= limit) {
      return "slot " + std::to_string(sp[t]) + " outside [-1, " + std::to_string(limit) + ")";
    }
  }
  const int64_t bytes = d * static_cast<int64_t>(k.element_size());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t es = k.element_size();
  at::parallel_for(0, t_rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = sp[t];
      if (slot < 0) continue;
      const int64_t b = slot / block_size, o = slot % block_size;
      for (int64_t h = 0; h < hkv; ++h) {
        std::memcpy(kc + (b * k_cache.stride(0) + o * k_cache.stride(1) + h * k_cache.stride(2)) * es,
                    kp + (t * k.stride(0) + h * k.stride(1)) * es, bytes);
        std::memcpy(vc + (b * v_cache.stride(0) + o * v_cache.stride(1) + h * v_cache.stride(2)) * es,
                    vp + (t * v.stride(0) + h * v.stride(1)) * es, bytes);
      }
    }
  });
  return "";
}

}  // namespace pdpool_cpu
