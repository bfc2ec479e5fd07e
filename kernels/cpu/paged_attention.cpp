// Paged decode attention on the CPU: one query token per sequence, keys and values read
// in place from the paged KV cache (no gather into a padded copy), online softmax.
//
// Work is split over sequences (and over KV heads when there are few sequences) with
// ATen's parallel_for, so it runs on torch's own OpenMP threads. A sequence is walked in
// tiles of about 64 tokens (whole blocks). For each KV head, the tile's key rows are
// scored against all the query heads that share them (GQA) eight dot products at a
// time (eight independent FMA chains: fewer leave the FMA units waiting on latency),
// the running maximum and sum are rescaled once per tile, and the value rows are
// accumulated into 64 output lanes at a time held in registers. Quantized caches are
// converted row by row as the tile is gathered (fp8 e4m3 through a 256-entry table, int8
// as is), with their scale applied; a bf16 cache's rows are read in place and widened
// as they are loaded (exactly, by a shift: it attends as the fp32 cache of its values).
// Where the CPU has AMX and the caller allows it (`tiles`), a bf16 cache multiplies on the
// tile registers instead (attend_amx), its softmax weights rounded to bf16 as SDPA's are.
//
// Layouts (all contiguous unless a stride is given):
//   q        (num_seqs, num_heads, head_dim) fp32, or bf16 over a bf16 cache (a bf16
//            model's), token stride q_stride
//   cache    (2, num_blocks, block_size, num_kv_heads, head_dim) fp32, fp8 bytes, int8 or
//            bf16
//   scales   fp8: (2, num_kv_heads); int8: (2, num_blocks, num_kv_heads); else unused
//   tables   (num_seqs, table_stride) int64 block ids
//   contexts (num_seqs,) int64 tokens cached before this step's one new token (which
//            is already written: each sequence attends to contexts[s] + 1 tokens)
//   out      (num_seqs, num_heads, head_dim) in q's dtype (bf16: rounded once)

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "vec.h"

namespace {

enum CacheKind : int { kFloat32 = 0, kFp8E4M3 = 1, kInt8 = 2, kBf16 = 3 };

using lamina::Bf16;

// The element type the score and value loops read a cache's rows as: fp32 rows in place,
// bf16 rows in place where the loops are vectorized (widened exactly as they are loaded),
// other rows converted to fp32 as a tile is gathered.
template <int Kind>
using RowOf = std::conditional_t<Kind == kBf16 && LAMINA_AVX2, Bf16, float>;
template <int Kind>
constexpr bool kInPlace = Kind == kFloat32 || !std::is_same_v<RowOf<Kind>, float>;

struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 0xF, mantissa = b & 0x7;
      float v;
      if (exponent == 0xF && mantissa == 0x7) {
        v = std::numeric_limits<float>::quiet_NaN();
      } else if (exponent == 0) {
        v = std::ldexp(mantissa / 8.0f, -6);  // subnormal
      } else {
        v = std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      }
      value[b] = (b & 0x80) ? -v : v;
    }
  }
};
const Fp8Table kFp8;

// The tile's key and value rows of KV head h: pointers into the cache where they are read
// in place (kInPlace), else rows converted to fp32, scaled, into `scratch` (2 * tile rows
// of d).
template <int Kind>
inline void tile_rows(const void* cache, const float* scales, const int64_t* table,
                      int64_t first_block, int64_t n, int64_t block_size, int64_t block_stride,
                      int64_t values_offset, int64_t token_stride, int64_t num_blocks,
                      int64_t num_kv_heads, int64_t h, int64_t d, int64_t tile, float* scratch,
                      const RowOf<Kind>** keys, const RowOf<Kind>** values) {
  for (int64_t j0 = 0; j0 < n; j0 += block_size) {  // whole blocks (the last may be partial)
    const int64_t block = table[first_block + j0 / block_size];
    const int64_t block_offset = block * block_stride + h * d;
    float k_scale = 1.0f, v_scale = 1.0f;
    if constexpr (Kind == kFp8E4M3) {
      k_scale = scales[h];
      v_scale = scales[num_kv_heads + h];
    } else if constexpr (Kind == kInt8) {
      k_scale = scales[block * num_kv_heads + h];
      v_scale = scales[(num_blocks + block) * num_kv_heads + h];
    }
    for (int64_t j = j0; j < std::min(n, j0 + block_size); ++j) {
      const int64_t offset = block_offset + (j - j0) * token_stride;
      if constexpr (kInPlace<Kind>) {
        keys[j] = static_cast<const RowOf<Kind>*>(cache) + offset;
        values[j] = static_cast<const RowOf<Kind>*>(cache) + values_offset + offset;
      } else {
        float* k_row = scratch + j * d;
        float* v_row = scratch + (tile + j) * d;
        if constexpr (Kind == kFp8E4M3) {
          const uint8_t* k_src = static_cast<const uint8_t*>(cache) + offset;
          const uint8_t* v_src = k_src + values_offset;
          for (int64_t i = 0; i < d; ++i) {
            k_row[i] = kFp8.value[k_src[i]] * k_scale;
            v_row[i] = kFp8.value[v_src[i]] * v_scale;
          }
        } else if constexpr (Kind == kInt8) {
          const int8_t* k_src = static_cast<const int8_t*>(cache) + offset;
          const int8_t* v_src = k_src + values_offset;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) {
            k_row[i] = static_cast<float>(k_src[i]) * k_scale;
            v_row[i] = static_cast<float>(v_src[i]) * v_scale;
          }
        } else {  // bf16, exactly
          const Bf16* k_src = static_cast<const Bf16*>(cache) + offset;
          const Bf16* v_src = k_src + values_offset;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) {
            k_row[i] = lamina::load(k_src[i]);
            v_row[i] = lamina::load(v_src[i]);
          }
        }
        keys[j] = k_row;
        values[j] = v_row;
      }
    }
  }
}

inline float dot(const float* x, const float* y, int64_t d) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += x[i] * y[i];
  return sum;
}

// A bf16 row's dot as its fp32 widening's (the same sum in the same order: a bf16 cache
// attends exactly as the fp32 cache of its values does).
inline float dot(const float* x, const Bf16* y, int64_t d) {
  thread_local std::vector<float> widened;
  widened.resize(d);
  float* w = widened.data();  // a thread-local read once: each access is a call
  for (int64_t i = 0; i < d; ++i) w[i] = lamina::load(y[i]);
  return dot(x, w, d);
}

#if LAMINA_AVX2
// Rows ahead that the score and value loops pull into L1: the hardware prefetchers do not
// follow a tile's rows (one or two per block, at the pool's stride), and 8-16 ahead was
// 8-14% faster on caches beyond L3 than none (32 ahead: less).
constexpr int64_t kL1Ahead = 8;

template <typename T>
inline void prefetch_row(const T* row, int64_t elements) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < elements * static_cast<int64_t>(sizeof(T)); byte += 64)
    _mm_prefetch(p + byte, _MM_HINT_T0);
}

// Eight elements of a row as fp32 (bf16 widened exactly).
inline __m256 row8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 row8(const Bf16* p) { return lamina::load8(p); }

// Lane j = the sum of a[j]'s eight lanes.
inline __m256 hsum8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// out[g * T + t] = q_g . k_t for G query heads (rows of q) and T key rows, G * T = 8, d a
// multiple of 8.
template <int G, int T, typename R>
inline void dots(const float* q, int64_t d, const R* const* k, float* out) {
  static_assert(G * T == 8, "eight accumulators");
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 kv[T];
    for (int t = 0; t < T; ++t) kv[t] = row8(k[t] + i);
    for (int g = 0; g < G; ++g) {
      const __m256 qv = _mm256_loadu_ps(q + g * d + i);
      for (int t = 0; t < T; ++t) a[g * T + t] = _mm256_fmadd_ps(qv, kv[t], a[g * T + t]);
    }
  }
  _mm256_storeu_ps(out, hsum8(a));
}

// score[g * tile + t] for t < n - n % T (the rest is left to the caller). The first pass
// over the keys also pulls the same tokens' value rows into L1: the value loop reads them
// once the tile's scores are done, long enough after for them to arrive from DRAM.
template <int G, int T, typename R>
inline int64_t tile_dots(const float* qs, int64_t group, const R* const* k, const R* const* v,
                         int64_t n, int64_t d, int64_t tile, float* score) {
  const int64_t done = n - n % T;
  float s[8];
  for (int64_t g0 = 0; g0 < group; g0 += G) {
    for (int64_t t = 0; t < done; t += T) {
      if (g0 == 0) {  // later head groups find the rows in L1
        for (int64_t j = t + kL1Ahead; j < std::min(n, t + kL1Ahead + T); ++j) prefetch_row(k[j], d);
        for (int64_t j = t; j < t + T; ++j) prefetch_row(v[j], d);
      }
      dots<G, T>(qs + g0 * d, d, k + t, s);
      for (int g = 0; g < G; ++g)
        for (int j = 0; j < T; ++j) score[(g0 + g) * tile + t + j] = s[g * T + j];
    }
  }
  return done;
}
#endif

// score[g * tile + t] = q_g . k_t for the tile's n key rows (value rows v: see tile_dots)
// and the group's query heads.
template <typename R>
inline void tile_scores(const float* qs, int64_t group, const R* const* k, const R* const* v,
                        int64_t n, int64_t d, int64_t tile, float* score) {
  int64_t done = 0;
#if LAMINA_AVX2
  if (d % 8 == 0) {
    if (group % 4 == 0) {
      done = tile_dots<4, 2>(qs, group, k, v, n, d, tile, score);
    } else if (group % 2 == 0) {
      done = tile_dots<2, 4>(qs, group, k, v, n, d, tile, score);
    } else {
      done = tile_dots<1, 8>(qs, group, k, v, n, d, tile, score);
    }
  }
#endif
  for (int64_t g = 0; g < group; ++g)
    for (int64_t t = done; t < n; ++t) score[g * tile + t] = dot(qs + g * d, k[t], d);
}

#if LAMINA_AVX2
// acc[0 : 8 * R] += sum_t p[t] * v_t[0 : 8 * R], the accumulators in registers.
template <int R, typename E>
inline void weighted_rows(const float* p, const E* const* v, int64_t n, int64_t offset,
                          float* acc) {
  __m256 r[R];
  for (int j = 0; j < R; ++j) r[j] = _mm256_loadu_ps(acc + 8 * j);
  for (int64_t t = 0; t < n; ++t) {
    if (t + kL1Ahead < n) prefetch_row(v[t + kL1Ahead] + offset, 8 * R);
    const __m256 w = _mm256_set1_ps(p[t]);
    const E* vt = v[t] + offset;
    for (int j = 0; j < R; ++j) r[j] = _mm256_fmadd_ps(w, row8(vt + 8 * j), r[j]);
  }
  for (int j = 0; j < R; ++j) _mm256_storeu_ps(acc + 8 * j, r[j]);
}

// acc_g[i : i + 16] += sum_t p[g * tile + t] * v_t[i : i + 16] for four query heads g at
// once: each value load feeds four FMAs (the one-head loop above loads once per FMA).
template <typename E>
inline void weighted_rows_4x16(const float* p, int64_t tile, const E* const* v, int64_t n,
                               int64_t i, int64_t d, float* acc) {
  __m256 r[8];
  for (int g = 0; g < 4; ++g) {
    r[2 * g] = _mm256_loadu_ps(acc + g * d + i);
    r[2 * g + 1] = _mm256_loadu_ps(acc + g * d + i + 8);
  }
  for (int64_t t = 0; t < n; ++t) {
    if (i == 0 && t + kL1Ahead < n) prefetch_row(v[t + kL1Ahead], d);  // first pass only
    const __m256 v0 = row8(v[t] + i), v1 = row8(v[t] + i + 8);
    for (int g = 0; g < 4; ++g) {
      const __m256 w = _mm256_broadcast_ss(p + g * tile + t);
      r[2 * g] = _mm256_fmadd_ps(w, v0, r[2 * g]);
      r[2 * g + 1] = _mm256_fmadd_ps(w, v1, r[2 * g + 1]);
    }
  }
  for (int g = 0; g < 4; ++g) {
    _mm256_storeu_ps(acc + g * d + i, r[2 * g]);
    _mm256_storeu_ps(acc + g * d + i + 8, r[2 * g + 1]);
  }
}
#endif

// acc_g += sum_t p[g * tile + t] * v_t over the tile's n value rows.
template <typename E>
inline void tile_values(const float* p, int64_t group, const E* const* v, int64_t n,
                        int64_t d, int64_t tile, float* acc) {
  int64_t g = 0;
#if LAMINA_AVX2
  if (d % 16 == 0)
    for (; g + 4 <= group; g += 4)
      for (int64_t i = 0; i < d; i += 16) weighted_rows_4x16(p + g * tile, tile, v, n, i, d, acc + g * d);
#endif
  for (; g < group; ++g) {
    float* ag = acc + g * d;
    const float* pg = p + g * tile;
    int64_t i = 0;
#if LAMINA_AVX2
    for (; i + 64 <= d; i += 64) weighted_rows<8>(pg, v, n, i, ag + i);
    for (; i + 32 <= d; i += 32) weighted_rows<4>(pg, v, n, i, ag + i);
    for (; i + 8 <= d; i += 8) weighted_rows<1>(pg, v, n, i, ag + i);
#endif
    for (int64_t t = 0; t < n; ++t) {
      const E* vt = v[t];
#pragma omp simd
      for (int64_t j = i; j < d; ++j) ag[j] += pg[t] * lamina::load(vt[j]);
    }
  }
}

// x[t] = exp(x[t] - shift) for t < n; returns their sum (the same bits on 16 lanes as on
// 8: each half of a 16-lane exp is added to the 8 lanes' totals in turn).
inline float exp_shifted(float* x, int64_t n, float shift) {
  int64_t t = 0;
  float sum = 0.0f;
#if LAMINA_AVX2
  const __m256 m = _mm256_set1_ps(shift);
  __m256 total = _mm256_setzero_ps();
#if LAMINA_AVX512
  const __m512 m16 = _mm512_set1_ps(shift);
  for (; t + 16 <= n; t += 16) {
    const __m512 e = lamina::exp16(_mm512_sub_ps(_mm512_loadu_ps(x + t), m16));
    _mm512_storeu_ps(x + t, e);
    total = _mm256_add_ps(total, _mm512_castps512_ps256(e));
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1));
    total = _mm256_add_ps(total, high);
  }
#endif
  for (; t + 8 <= n; t += 8) {
    const __m256 e = lamina::exp8(_mm256_sub_ps(_mm256_loadu_ps(x + t), m));
    _mm256_storeu_ps(x + t, e);
    total = _mm256_add_ps(total, e);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, total);
  for (float lane : lanes) sum += lane;
#endif
  for (; t < n; ++t) {
    x[t] = std::exp(x[t] - shift);
    sum += x[t];
  }
  return sum;
}

// The largest of x[t] for t < n (NaNs skipped). In vectors: the compiler leaves the loop
// a chain of scalar maxes (a reduction over floats it may not reorder).
inline float max_of(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if LAMINA_AVX2
  __m256 a = _mm256_set1_ps(m), b = a;
  for (; t + 16 <= n; t += 16) {  // max(x, m) is m where x is NaN
    a = _mm256_max_ps(_mm256_loadu_ps(x + t), a);
    b = _mm256_max_ps(_mm256_loadu_ps(x + t + 8), b);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_max_ps(a, b));
  for (const float lane : lanes) m = std::max(m, lane);
#endif
  for (; t < n; ++t) m = std::max(m, x[t]);
  return m;
}

// Prefetch (into L2) the key and value rows of KV heads h0.. (width floats of each token
// row) for tokens [start, end) of a sequence.
template <int Kind>
inline void prefetch_tokens(const void* cache, const int64_t* table, int64_t start,
                            int64_t end, int64_t block_size, int64_t block_stride,
                            int64_t values_offset, int64_t token_stride, int64_t h0, int64_t d,
                            int64_t width) {
  const int64_t size = Kind == kFloat32 ? 4 : Kind == kBf16 ? 2 : 1;
  const char* base = static_cast<const char*>(cache);
  for (int64_t j0 = start; j0 < end; j0 += block_size) {  // start is a block boundary
    const char* k = base + (table[j0 / block_size] * block_stride + h0 * d) * size;
    for (int64_t t = 0; t < std::min(block_size, end - j0); ++t, k += token_stride * size) {
      for (int64_t byte = 0; byte < width * size; byte += 64) {
        __builtin_prefetch(k + byte, 0, 2);
        __builtin_prefetch(k + values_offset * size + byte, 0, 2);
      }
    }
  }
}

// One work item: query heads of `kv_heads` consecutive KV heads (from `h0`) of sequence s.
template <int Kind, typename Q>
void attend(const Q* q, const void* cache, const float* scales, const int64_t* table,
            int64_t len, int64_t h0, int64_t kv_heads, int64_t num_blocks, int64_t block_size,
            int64_t num_kv_heads, int64_t group, int64_t d, float sm_scale, Q* out,
            std::vector<float>& buf, std::vector<const RowOf<Kind>*>& rows) {
  const int64_t heads = kv_heads * group;  // query heads, consecutive from h0 * group
  const int64_t token_stride = num_kv_heads * d;
  const int64_t block_stride = block_size * token_stride;
  const int64_t values_offset = num_blocks * block_stride;
  const int64_t tile = block_size * std::max<int64_t>(1, 64 / block_size);
  const int64_t scratch_rows = kInPlace<Kind> ? 0 : 2 * tile;
  buf.resize(heads * d * 2 + heads * tile + heads * 2 + scratch_rows * d);
  rows.resize(2 * tile);
  float* qs = buf.data();  // scaled queries
  float* acc = qs + heads * d;
  float* score = acc + heads * d;  // one tile's scores (then weights) per head
  float* run_max = score + heads * tile;
  float* run_sum = run_max + heads;
  float* scratch = run_sum + heads;  // 8-bit caches: the tile's rows in fp32
  const RowOf<Kind>** keys = rows.data();
  const RowOf<Kind>** values = keys + tile;
  for (int64_t i = 0; i < heads * d; ++i) {
    qs[i] = lamina::load(q[i]) * sm_scale;
    acc[i] = 0.0f;
  }
  for (int64_t g = 0; g < heads; ++g) {
    run_max[g] = -std::numeric_limits<float>::infinity();
    run_sum[g] = 0.0f;
  }
  for (int64_t start = 0; start < len; start += tile) {
    const int64_t n = std::min(tile, len - start);
    // Blocks lie anywhere in the pool: fetch the next tile's while working on this one.
    prefetch_tokens<Kind>(cache, table, start + n, std::min(len, start + n + tile), block_size,
                          block_stride, values_offset, token_stride, h0, d, kv_heads * d);
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      tile_rows<Kind>(cache, scales, table, start / block_size, n, block_size, block_stride,
                      values_offset, token_stride, num_blocks, num_kv_heads, h0 + kh, d, tile,
                      scratch, keys, values);
      float* hacc = acc + kh * group * d;
      float* hscore = score + kh * group * tile;
      tile_scores(qs + kh * group * d, group, keys, values, n, d, tile, hscore);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = hscore + g * tile;
        float& m = run_max[kh * group + g];
        const float new_max = std::max(m, max_of(sg, n));
        const float correction = std::exp(m - new_max);  // 0 on the first tile
        run_sum[kh * group + g] = run_sum[kh * group + g] * correction +
                                  exp_shifted(sg, n, new_max);
        m = new_max;
        if (correction != 1.0f) {
          float* ag = hacc + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) ag[i] *= correction;
        }
      }
      tile_values(hscore, group, values, n, d, tile, hacc);
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    const float inv = 1.0f / run_sum[g];
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = lamina::round_to<Q>(acc[g * d + i] * inv);
  }
}

#if LAMINA_AVX512
// A bf16 cache on AMX (where the CPU has it; bf16 queries, a bf16 model's): per sequence,
// two passes over its tokens, each KV head in turn.
//   1. Scores: 16 tokens a tile product, their key rows read in place as the A tile (16
//      rows of 32 dims at the cache's token stride) against the G query heads that share
//      the KV head, pair-interleaved and padded to 16 columns, as B: 16 tokens x 16 scores.
//   2. The softmax of each head's scores in fp32 (their sum too), its weights rounded to
//      bf16, as SDPA's bf16 kernel rounds them; then the output, 32 tokens a step: the G
//      heads' weights as A against the value rows, repacked two tokens to a row, as B, into
//      four accumulator tiles of G x 16 dims, 64 dims a pass.
// The products of bf16 are exact and the tiles sum them in fp32: the scores are the fp32
// path's up to the order of the sums, and the output differs from it by the weights'
// rounding (a bf16 step of each weight at most).
//
// The passes use two tile configurations, so that each has registers to alternate: a tile
// loaded while the product before it still reads that register waits for it.
//   scores (lamina::kFullTiles, 16 x 64 bytes each): 0-1 key rows (32 dims), 2-5 the queries
//           (32 dims each: up to 128; at 64 dims 4-5 hold the next 16 tokens' key rows),
//           6-7 the scores of 16 tokens
//   values (kValueTiles[G]): 0-3 G x 16 fp32 accumulators, 4-5 16 token pairs x 16 dims
//           of values, 6-7 G heads x 32 tokens of weights
constexpr lamina::TileConfig value_tiles(int group) {
  lamina::TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = t == 4 || t == 5 ? 16 : group;
  }
  return c;
}

struct ValueTiles {
  alignas(64) lamina::TileConfig by_group[17];
  constexpr ValueTiles() : by_group{} {
    for (int g = 1; g <= 16; ++g) by_group[g] = value_tiles(g);
  }
};
constexpr ValueTiles kValueTiles;

// Whether the AMX path takes these shapes: whole 16-token tiles inside a block, 64 or 128
// dims (whole passes of the output's four tiles), at most 16 query heads a KV head.
inline bool amx_fits(int64_t block_size, int64_t d, int64_t group) {
  return block_size % 16 == 0 && (d == 64 || d == 128) && group >= 1 && group <= 16;
}

// score_tile_S<Chunks>: 16 tokens' scores from the key rows at k (token stride `stride`
// elements) into tile S, the queries' Chunks x 32 dims in tiles 2.. (loaded), then stored
// at `scores`. (A macro: the tile intrinsics take their register as a literal.)
#define LAMINA_SCORE_TILE(S)                                                   \
  template <int Chunks>                                                        \
  __attribute__((target("amx-tile,amx-bf16"))) inline void score_tile_##S(     \
      const Bf16* k, int64_t stride, float* scores) {                          \
    _tile_zero(S);                                                             \
    _tile_loadd(0, k, stride * 2);                                             \
    _tile_dpbf16ps(S, 0, 2);                                                   \
    _tile_loadd(1, k + 32, stride * 2);                                        \
    _tile_dpbf16ps(S, 1, 3);                                                   \
    if constexpr (Chunks > 2) {                                                \
      _tile_loadd(0, k + 64, stride * 2);                                      \
      _tile_dpbf16ps(S, 0, 4);                                                 \
      _tile_loadd(1, k + 96, stride * 2);                                      \
      _tile_dpbf16ps(S, 1, 5);                                                 \
    }                                                                          \
    _tile_stored(S, scores, 64);                                               \
  }
LAMINA_SCORE_TILE(6)
LAMINA_SCORE_TILE(7)
#undef LAMINA_SCORE_TILE

// scores[t * 16 + g] = q_g . k_t for the n tokens (rounded up to 16; the rows past n are
// of whatever the block holds there, and unused). `q_pairs` holds per 32 dims the tile B:
// 16 rows of 16 heads' pairs (dims 2r, 2r + 1 of each; zero past the group's).
template <int Chunks>
__attribute__((target("amx-tile,amx-bf16")))
void scores_amx(const uint16_t* q_pairs, const Bf16* keys, const int64_t* table, int64_t n,
                int64_t block_size, int64_t block_stride, int64_t stride, float* scores) {
  _tile_loadd(2, q_pairs, 64);
  _tile_loadd(3, q_pairs + 512, 64);
  if constexpr (Chunks > 2) {
    _tile_loadd(4, q_pairs + 1024, 64);
    _tile_loadd(5, q_pairs + 1536, 64);
  }
  auto rows = [&](int64_t t) {
    return keys + table[t / block_size] * block_stride + t % block_size * stride;
  };
  int64_t t0 = 0;
  for (; t0 + 16 < n; t0 += 32) {
    if constexpr (Chunks == 2) {  // tiles 4-5 are free: the two tiles' products overlap
      const Bf16 *k0 = rows(t0), *k1 = rows(t0 + 16);
      _tile_zero(6);
      _tile_zero(7);
      _tile_loadd(0, k0, stride * 2);
      _tile_loadd(4, k1, stride * 2);
      _tile_dpbf16ps(6, 0, 2);
      _tile_dpbf16ps(7, 4, 2);
      _tile_loadd(1, k0 + 32, stride * 2);
      _tile_loadd(5, k1 + 32, stride * 2);
      _tile_dpbf16ps(6, 1, 3);
      _tile_dpbf16ps(7, 5, 3);
      _tile_stored(6, scores + t0 * 16, 64);
      _tile_stored(7, scores + (t0 + 16) * 16, 64);
    } else {
      score_tile_6<Chunks>(rows(t0), stride, scores + t0 * 16);
      score_tile_7<Chunks>(rows(t0 + 16), stride, scores + (t0 + 16) * 16);
    }
  }
  if (t0 < n) score_tile_6<Chunks>(rows(t0), stride, scores + t0 * 16);
}

// Token pairs (t0 + 2r, t0 + 2r + 1) of value rows, dims [c0, c0 + 64), as four B tiles of
// 16 dims (pair r is row r: the two tokens' values of each dim side by side); tokens from
// n on are zeros (the weights there are zero, and a row past the sequence may hold
// anything, NaN included).
inline void pack_values(const Bf16* values, const int64_t* table, int64_t t0, int64_t n,
                        int64_t block_size, int64_t block_stride, int64_t stride, int64_t c0,
                        uint16_t* packed) {
  alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5,
                                                    37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42,
                                                    11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  auto row = [&](int64_t t) {
    return values + table[t / block_size] * block_stride + t % block_size * stride + c0;
  };
  for (int64_t r = 0; r < 16; ++r) {
    const int64_t t = t0 + 2 * r;
    const Bf16* a = t < n ? row(t) : nullptr;
    const Bf16* b = t + 1 < n ? row(t + 1) : nullptr;
    for (int64_t h = 0; h < 2; ++h) {
      const __m512i x = a ? _mm512_loadu_si512(a + 32 * h) : _mm512_setzero_si512();
      const __m512i y = b ? _mm512_loadu_si512(b + 32 * h) : _mm512_setzero_si512();
      _mm512_store_si512(packed + (2 * h) * 512 + r * 32, _mm512_permutex2var_epi16(x, low, y));
      _mm512_store_si512(packed + (2 * h + 1) * 512 + r * 32,
                         _mm512_permutex2var_epi16(x, high, y));
    }
  }
}

// value_step_P: one 32-token step of the output: the weights at w (row stride ld
// elements) into tile P, against the four packed value tiles.
#define LAMINA_VALUE_STEP(P)                                                             \
  __attribute__((target("amx-tile,amx-bf16"))) inline void value_step_##P(               \
      const uint16_t* w, int64_t ld, const uint16_t* tiles) {                            \
    _tile_loadd(P, w, ld * 2);                                                           \
    _tile_loadd(4, tiles, 64);                                                           \
    _tile_dpbf16ps(0, P, 4);                                                             \
    _tile_loadd(5, tiles + 512, 64);                                                     \
    _tile_dpbf16ps(1, P, 5);                                                             \
    _tile_loadd(4, tiles + 1024, 64);                                                    \
    _tile_dpbf16ps(2, P, 4);                                                             \
    _tile_loadd(5, tiles + 1536, 64);                                                    \
    _tile_dpbf16ps(3, P, 5);                                                             \
  }
LAMINA_VALUE_STEP(6)
LAMINA_VALUE_STEP(7)
#undef LAMINA_VALUE_STEP

// acc (group x d, fp32) = weights (group x n32 bf16, zero past n) @ the n value rows. `packed` holds two steps' value tiles (2 x 4 KB): the next step's are
// packed while this step's multiply (a tile loaded right after the vector stores that
// packed it waits for them to reach L1).
__attribute__((target("amx-tile,amx-bf16")))
void values_amx(const uint16_t* weights, int64_t n32, int64_t n, const Bf16* values,
                const int64_t* table, int64_t block_size, int64_t block_stride,
                int64_t stride, int64_t d, uint16_t* packed, float* acc) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    pack_values(values, table, 0, n, block_size, block_stride, stride, c0, packed);
    for (int64_t t0 = 0; t0 < n; t0 += 32) {
      const int64_t step = t0 / 32;
      if (t0 + 32 < n)
        pack_values(values, table, t0 + 32, n, block_size, block_stride, stride, c0,
                    packed + (step + 1) % 2 * 2048);
      if (step % 2)
        value_step_7(weights + t0, n32, packed + 2048);
      else
        value_step_6(weights + t0, n32, packed);
    }
    _tile_stored(0, acc + c0, d * 4);
    _tile_stored(1, acc + c0 + 16, d * 4);
    _tile_stored(2, acc + c0 + 32, d * 4);
    _tile_stored(3, acc + c0 + 48, d * 4);
  }
}

// One work item on AMX: the query heads of `kv_heads` KV heads (from h0) of a sequence of
// len tokens, as attend() computes them but for the weights' rounding (above).
template <typename Q>
void attend_amx(const Q* q, const Bf16* cache, const int64_t* table, int64_t len,
                int64_t h0, int64_t kv_heads, int64_t num_blocks, int64_t block_size,
                int64_t num_kv_heads, int64_t group, int64_t d, float sm_scale, Q* out,
                std::vector<float>& buf) {
  const int64_t stride = num_kv_heads * d;  // between a block's token rows
  const int64_t block_stride = block_size * stride;
  const int64_t n16 = (len + 15) / 16 * 16, n32 = (len + 31) / 32 * 32;
  // In floats: each KV head's scores (n16 x 16), one head's fp32 weights (n32), the
  // output's sums (G x d); then in bf16 two steps' value tiles, the weights (G x n32)
  // and the queries' pairs (d / 32 tiles of 16 x 32).
  const int64_t floats = kv_heads * n16 * 16 + n32 + group * d;
  const int64_t halves = 2 * 2048 + group * n32 + d * 16;
  buf.resize(floats + halves / 2 + 16);
  float* scores = buf.data();
  float* row = scores + kv_heads * n16 * 16;
  float* acc = row + n32;
  const auto aligned = (reinterpret_cast<uintptr_t>(acc + group * d) + 63) & ~uintptr_t{63};
  uint16_t* packed = reinterpret_cast<uint16_t*>(aligned);  // 64-byte aligned tile rows
  uint16_t* weights = packed + 2 * 2048;
  uint16_t* q_pairs = weights + group * n32;
  lamina::load_tiles(&lamina::kFullTiles);
  for (int64_t kh = 0; kh < kv_heads; ++kh) {
    const Q* qh = q + kh * group * d;
    std::fill(q_pairs, q_pairs + d * 16, uint16_t{0});
    if constexpr (std::is_same_v<Q, Bf16>) {  // each pair moves as one 32-bit word
      const uint32_t* from = reinterpret_cast<const uint32_t*>(qh);
      uint32_t* to = reinterpret_cast<uint32_t*>(q_pairs);
      for (int64_t c = 0; c < d / 2; c += 16)
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t g = 0; g < group; ++g) to[c * 16 + r * 16 + g] = from[g * d / 2 + c + r];
    } else {
      for (int64_t c = 0; c < d; c += 32)
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t g = 0; g < group; ++g)
            for (int64_t e = 0; e < 2; ++e)
              q_pairs[c * 16 + r * 32 + 2 * g + e] =
                  lamina::round_to<Bf16>(lamina::load(qh[g * d + c + 2 * r + e])).bits;
    }
    (d == 64 ? scores_amx<2> : scores_amx<4>)(q_pairs, cache + (h0 + kh) * d, table, len, block_size, block_stride,
                        stride, scores + kh * n16 * 16);
  }
  lamina::load_tiles(&kValueTiles.by_group[group]);
  for (int64_t kh = 0; kh < kv_heads; ++kh) {
    const float* hs = scores + kh * n16 * 16;
    float sums[16];
    for (int64_t g = 0; g < group; ++g) {
      for (int64_t t = 0; t < len; ++t) row[t] = hs[t * 16 + g] * sm_scale;
      sums[g] = exp_shifted(row, len, max_of(row, len));
      uint16_t* wg = weights + g * n32;
      int64_t t = 0;
      for (; t + 16 <= len; t += 16)
        lamina::store16(reinterpret_cast<Bf16*>(wg + t), _mm512_loadu_ps(row + t));
      for (; t < len; ++t) wg[t] = lamina::round_to<Bf16>(row[t]).bits;
      for (; t < n32; ++t) wg[t] = 0;
    }
    values_amx(weights, n32, len, cache + num_blocks * block_stride + (h0 + kh) * d, table,
               block_size, block_stride, stride, d, packed, acc);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 inv = _mm512_set1_ps(1.0f / sums[g]);
      Q* o = out + (kh * group + g) * d;
      for (int64_t i = 0; i < d; i += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(acc + g * d + i), inv);
        if constexpr (std::is_same_v<Q, Bf16>)
          lamina::store16(o + i, v);
        else
          _mm512_storeu_ps(o + i, v);
      }
    }
  }
}
#endif

template <int Kind, typename Q>
void decode_attention(const Q* q, int64_t q_stride, const void* cache, const float* scales,
                      const int64_t* tables, int64_t table_stride, const int64_t* contexts,
                      int64_t num_seqs, int64_t num_blocks, int64_t block_size,
                      int64_t num_heads, int64_t num_kv_heads, int64_t d, float sm_scale,
                      Q* out, bool tiles) {
  const int64_t group = num_heads / num_kv_heads;
  // A whole sequence per item reads each block's rows, all heads, as one contiguous run
  // (what the hardware prefetcher streams best); with fewer sequences than threads,
  // split the heads too so every thread has work.
  const int64_t split = num_seqs >= 2 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t kv_heads = num_kv_heads / split;
#if LAMINA_AVX512
  const bool amx = Kind == kBf16 && tiles && amx_fits(block_size, d, group) &&
                   lamina::tiles_permitted();
#else
  (void)tiles;
#endif
  at::parallel_for(0, num_seqs * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
#if LAMINA_AVX512
    if (amx) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t s = item / split, h0 = (item % split) * kv_heads;
        attend_amx(q + s * q_stride + h0 * group * d, static_cast<const Bf16*>(cache),
                   tables + s * table_stride, contexts[s] + 1, h0, kv_heads, num_blocks,
                   block_size, num_kv_heads, group, d, sm_scale,
                   out + (s * num_heads + h0 * group) * d, buf);
      }
      lamina::release_tiles();
      return;
    }
#endif
    std::vector<const RowOf<Kind>*> rows;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / split, h0 = (item % split) * kv_heads;
      attend<Kind, Q>(q + s * q_stride + h0 * group * d, cache, scales,
                   tables + s * table_stride, contexts[s] + 1, h0, kv_heads, num_blocks,
                   block_size, num_kv_heads, group, d, sm_scale,
                   out + (s * num_heads + h0 * group) * d, buf, rows);
    }
  });
}

}  // namespace

// Queries and output are fp32, or bf16 (q_bf16; a bf16 cache's only: a bf16 model's, the
// output rounded once). tiles: whether a bf16 cache may attend on AMX (where the CPU has
// it; see attend_amx).
extern "C" int lamina_paged_decode_attention(
    const void* q, int64_t q_stride, const void* cache, int cache_kind, const float* scales,
    const int64_t* tables, int64_t table_stride, const int64_t* contexts, int64_t num_seqs,
    int64_t num_blocks, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, float sm_scale, void* out, int tiles, int q_bf16) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
  if (cache_kind < kFloat32 || cache_kind > kBf16 || (q_bf16 && cache_kind != kBf16)) return 2;
  if (q_bf16) {
    decode_attention<kBf16>(static_cast<const Bf16*>(q), q_stride, cache, scales, tables,
                            table_stride, contexts, num_seqs, num_blocks, block_size,
                            num_heads, num_kv_heads, head_dim, sm_scale,
                            static_cast<Bf16*>(out), tiles != 0);
    return 0;
  }
  using Run = void (*)(const float*, int64_t, const void*, const float*, const int64_t*,
                       int64_t, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                       int64_t, float, float*, bool);
  constexpr Run kRuns[] = {decode_attention<kFloat32>, decode_attention<kFp8E4M3>,
                           decode_attention<kInt8>, decode_attention<kBf16>};
  kRuns[cache_kind](static_cast<const float*>(q), q_stride, cache, scales, tables,
                    table_stride, contexts, num_seqs, num_blocks, block_size, num_heads,
                    num_kv_heads, head_dim, sm_scale, static_cast<float*>(out), tiles != 0);
  return 0;
}
