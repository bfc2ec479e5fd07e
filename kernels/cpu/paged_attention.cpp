// Paged decode attention on the CPU: one query token per sequence, keys and values read
// in place from the paged KV cache (no gather into a padded copy), online softmax.
//
// Work is split over sequences (and over KV heads when there are few sequences) with
// ATen's parallel_for, so it runs on torch's own OpenMP threads. For each KV head, a
// block's key rows are scored against all the query heads that share it (GQA), the
// running maximum and sum are rescaled once per block, and the block's value rows are
// accumulated. Quantized caches are read as
// stored (fp8 e4m3 through a 256-entry table, int8 as is) and their scales are folded
// into the scores and the softmax weights, which is exact up to fp32 rounding.
//
// Layouts (all contiguous unless a stride is given):
//   q        (num_seqs, num_heads, head_dim) fp32, token stride q_stride
//   cache    (2, num_blocks, block_size, num_kv_heads, head_dim) fp32, fp8 bytes or int8
//   scales   fp8: (2, num_kv_heads); int8: (2, num_blocks, num_kv_heads); fp32: unused
//   tables   (num_seqs, table_stride) int64 block ids
//   contexts (num_seqs,) int64 tokens cached before this step's one new token (which
//            is already written: each sequence attends to contexts[s] + 1 tokens)
//   out      (num_seqs, num_heads, head_dim) fp32

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

enum CacheKind : int { kFloat32 = 0, kFp8E4M3 = 1, kInt8 = 2 };

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

// Rows of a block as fp32 (unscaled): the cache itself when it is fp32, else `n` rows
// of `d` converted into `scratch`. Returns the rows and sets `stride` between them.
template <int Kind>
inline const float* block_rows(const void* cache, int64_t offset, int64_t token_stride,
                               int64_t n, int64_t d, float* scratch, int64_t* stride) {
  if constexpr (Kind == kFloat32) {
    *stride = token_stride;
    return static_cast<const float*>(cache) + offset;
  } else {
    for (int64_t t = 0; t < n; ++t) {
      float* row = scratch + t * d;
      if constexpr (Kind == kFp8E4M3) {
        const uint8_t* src = static_cast<const uint8_t*>(cache) + offset + t * token_stride;
        for (int64_t i = 0; i < d; ++i) row[i] = kFp8.value[src[i]];
      } else {
        const int8_t* src = static_cast<const int8_t*>(cache) + offset + t * token_stride;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) row[i] = static_cast<float>(src[i]);
      }
    }
    *stride = d;
    return scratch;
  }
}

inline float dot(const float* x, const float* y, int64_t d) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < d; ++i) sum += x[i] * y[i];
  return sum;
}

#if LAMINA_AVX2
// Four dot products x_j . y_j of length d (a multiple of 8), summed across lanes at once.
inline void dot4(const float* x0, const float* x1, const float* x2, const float* x3,
                 const float* y0, const float* y1, const float* y2, const float* y3,
                 int64_t d, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < d; i += 8) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + i), _mm256_loadu_ps(y0 + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + i), _mm256_loadu_ps(y1 + i), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x2 + i), _mm256_loadu_ps(y2 + i), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x3 + i), _mm256_loadu_ps(y3 + i), a3);
  }
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
#endif

// score[g * bs + t] = q_g . k_t for the block's n tokens and the group's query heads.
inline void block_scores(const float* qs, int64_t group, const float* k, int64_t stride,
                         int64_t n, int64_t d, int64_t bs, float* score) {
  int64_t g_done = 0, t_done = 0;
#if LAMINA_AVX2
  float four[4];
  if (d % 8 == 0 && group >= 4) {  // four query heads against one key row
    g_done = group - group % 4;
    for (int64_t t = 0; t < n; ++t) {
      const float* kt = k + t * stride;
      for (int64_t g = 0; g < g_done; g += 4) {
        const float* q = qs + g * d;
        dot4(q, q + d, q + 2 * d, q + 3 * d, kt, kt, kt, kt, d, four);
        for (int j = 0; j < 4; ++j) score[(g + j) * bs + t] = four[j];
      }
    }
  } else if (d % 8 ==0) {  // one query head against four key rows
    t_done = n - n % 4;
    for (int64_t g = 0; g < group; ++g) {
      const float* q = qs + g * d;
      for (int64_t t = 0; t < t_done; t += 4) {
        const float* kt = k + t * stride;
        dot4(q, q, q, q, kt, kt + stride, kt + 2 * stride, kt + 3 * stride, d, four);
        for (int j = 0; j < 4; ++j) score[g * bs + t + j] = four[j];
      }
    }
  }
#endif
  for (int64_t g = 0; g < group; ++g) {
    const int64_t t_start = g < g_done ? n : t_done;
    for (int64_t t = t_start; t < n; ++t) score[g * bs + t] = dot(qs + g * d, k + t * stride, d);
  }
}

// acc_g += sum_t p[g * bs + t] * v_t over the block's n tokens.
inline void block_values(const float* p, int64_t group, const float* v, int64_t stride,
                         int64_t n, int64_t d, int64_t bs, float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    float* ag = acc + g * d;
    const float* pg = p + g * bs;
    int64_t i = 0;
#if LAMINA_AVX2
    // Accumulators stay in registers across the block; four of them side by side keep
    // four FMA chains in flight (one alone waits out each FMA's latency).
    for (; i + 32 <= d; i += 32) {
      __m256 r0 = _mm256_loadu_ps(ag + i), r1 = _mm256_loadu_ps(ag + i + 8);
      __m256 r2 = _mm256_loadu_ps(ag + i + 16), r3 = _mm256_loadu_ps(ag + i + 24);
      for (int64_t t = 0; t < n; ++t) {
        const float* vt = v + t * stride + i;
        const __m256 w = _mm256_set1_ps(pg[t]);
        r0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt), r0);
        r1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 8), r1);
        r2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 16), r2);
        r3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vt + 24), r3);
      }
      _mm256_storeu_ps(ag + i, r0);
      _mm256_storeu_ps(ag + i + 8, r1);
      _mm256_storeu_ps(ag + i + 16, r2);
      _mm256_storeu_ps(ag + i + 24, r3);
    }
    for (; i + 8 <= d; i += 8) {  // even and odd tokens in two chains
      __m256 r0 = _mm256_loadu_ps(ag + i), r1 = _mm256_setzero_ps();
      int64_t t = 0;
      for (; t + 2 <= n; t += 2) {
        const float* vt = v + t * stride + i;
        r0 = _mm256_fmadd_ps(_mm256_set1_ps(pg[t]), _mm256_loadu_ps(vt), r0);
        r1 = _mm256_fmadd_ps(_mm256_set1_ps(pg[t + 1]), _mm256_loadu_ps(vt + stride), r1);
      }
      if (t < n) r0 = _mm256_fmadd_ps(_mm256_set1_ps(pg[t]), _mm256_loadu_ps(v + t * stride + i), r0);
      _mm256_storeu_ps(ag + i, _mm256_add_ps(r0, r1));
    }
#endif
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = v + t * stride;
#pragma omp simd
      for (int64_t j = i; j < d; ++j) ag[j] += pg[t] * vt[j];
    }
  }
}

// x[t] = exp(x[t] - shift) for t < n; returns their sum.
inline float exp_shifted(float* x, int64_t n, float shift) {
  int64_t t = 0;
  float sum = 0.0f;
#if LAMINA_AVX2
  const __m256 m = _mm256_set1_ps(shift);
  __m256 total = _mm256_setzero_ps();
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

// Prefetch n rows of `width` elements (keys and values) of a block into the cache.
template <int Kind>
inline void prefetch_block(const void* cache, int64_t k_offset, int64_t values_offset,
                           int64_t token_stride, int64_t n, int64_t width) {
  const int64_t size = Kind == kFloat32 ? 4 : 1;
  const char* base = static_cast<const char*>(cache);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t byte = 0; byte < width * size; byte += 64) {
      __builtin_prefetch(base + (k_offset + t * token_stride) * size + byte);
      __builtin_prefetch(base + (values_offset + k_offset + t * token_stride) * size + byte);
    }
  }
}

// One work item: query heads of `kv_heads` consecutive KV heads (from `h0`) of sequence s.
template <int Kind>
void attend(const float* q, const void* cache, const float* scales, const int64_t* table,
            int64_t len, int64_t h0, int64_t kv_heads, int64_t num_blocks, int64_t block_size,
            int64_t num_kv_heads, int64_t group, int64_t d, float sm_scale, float* out,
            std::vector<float>& buf) {
  const int64_t heads = kv_heads * group;  // query heads, consecutive from h0 * group
  const int64_t token_stride = num_kv_heads * d;
  const int64_t block_stride = block_size * token_stride;
  const int64_t values_offset = num_blocks * block_stride;
  const int64_t scratch_rows = Kind == kFloat32 ? 0 : block_size;
  buf.resize(heads * d * 2 + heads * block_size + heads * 2 + scratch_rows * d);
  float* qs = buf.data();  // scaled queries
  float* acc = qs + heads * d;
  float* score = acc + heads * d;  // one block's scores (then weights) per head
  float* run_max = score + heads * block_size;
  float* run_sum = run_max + heads;
  float* scratch = run_sum + heads;  // quantized caches: one block's rows in fp32
  for (int64_t i = 0; i < heads * d; ++i) {
    qs[i] = q[i] * sm_scale;
    acc[i] = 0.0f;
  }
  for (int64_t g = 0; g < heads; ++g) {
    run_max[g] = -std::numeric_limits<float>::infinity();
    run_sum[g] = 0.0f;
  }
  for (int64_t start = 0; start < len; start += block_size) {
    const int64_t n = std::min(block_size, len - start);
    const int64_t block = table[start / block_size];
    if (start + block_size < len) {  // blocks lie anywhere: fetch the next while on this one
      prefetch_block<Kind>(cache, table[start / block_size + 1] * block_stride + h0 * d,
                           values_offset, token_stride, std::min(block_size, len - start - block_size),
                           kv_heads * d);
    }
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      const int64_t h = h0 + kh;
      const int64_t k_offset = block * block_stride + h * d;
      float* hq = qs + kh * group * d;
      float* hacc = acc + kh * group * d;
      float* hscore = score + kh * group * block_size;
      float k_scale = 1.0f, v_scale = 1.0f;
      if constexpr (Kind == kFp8E4M3) {
        k_scale = scales[h];
        v_scale = scales[num_kv_heads + h];
      } else if constexpr (Kind == kInt8) {
        k_scale = scales[block * num_kv_heads + h];
        v_scale = scales[(num_blocks + block) * num_kv_heads + h];
      }
      int64_t stride;
      const float* keys = block_rows<Kind>(cache, k_offset, token_stride, n, d, scratch, &stride);
      block_scores(hq, group, keys, stride, n, d, block_size, hscore);
      for (int64_t g = 0; g < group; ++g) {
        float* sg = hscore + g * block_size;
        float& m = run_max[kh * group + g];
        float block_max = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < n; ++t) {
          sg[t] *= k_scale;
          block_max = std::max(block_max, sg[t]);
        }
        const float new_max = std::max(m, block_max);
        const float correction = std::exp(m - new_max);
        run_sum[kh * group + g] = run_sum[kh * group + g] * correction +
                                  exp_shifted(sg, n, new_max);
        m = new_max;
        if (v_scale != 1.0f) {
          for (int64_t t = 0; t < n; ++t) sg[t] *= v_scale;
        }
        if (correction != 1.0f) {
          float* ag = hacc + g * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) ag[i] *= correction;
        }
      }
      const float* values = block_rows<Kind>(cache, values_offset + k_offset, token_stride, n,
                                             d, scratch, &stride);
      block_values(hscore, group, values, stride, n, d, block_size, hacc);
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    const float inv = 1.0f / run_sum[g];
    for (int64_t i = 0; i < d; ++i) out[g * d + i] = acc[g * d + i] * inv;
  }
}

template <int Kind>
void decode_attention(const float* q, int64_t q_stride, const void* cache, const float* scales,
                      const int64_t* tables, int64_t table_stride, const int64_t* contexts,
                      int64_t num_seqs, int64_t num_blocks, int64_t block_size,
                      int64_t num_heads, int64_t num_kv_heads, int64_t d, float sm_scale,
                      float* out) {
  const int64_t group = num_heads / num_kv_heads;
  // A whole sequence per item reads each block's rows, all heads, as one contiguous run
  // (what the hardware prefetcher streams best); with fewer sequences than threads,
  // split the heads too so every thread has work.
  const int64_t split = num_seqs >= 2 * at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t kv_heads = num_kv_heads / split;
  at::parallel_for(0, num_seqs * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / split, h0 = (item % split) * kv_heads;
      attend<Kind>(q + s * q_stride + h0 * group * d, cache, scales,
                   tables + s * table_stride, contexts[s] + 1, h0, kv_heads, num_blocks,
                   block_size, num_kv_heads, group, d, sm_scale,
                   out + (s * num_heads + h0 * group) * d, buf);
    }
  });
}

}  // namespace

extern "C" int lamina_paged_decode_attention(
    const float* q, int64_t q_stride, const void* cache, int cache_kind, const float* scales,
    const int64_t* tables, int64_t table_stride, const int64_t* contexts, int64_t num_seqs,
    int64_t num_blocks, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, float sm_scale, float* out) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) return 1;
  switch (cache_kind) {
    case kFloat32:
      decode_attention<kFloat32>(q, q_stride, cache, scales, tables, table_stride, contexts,
                                 num_seqs, num_blocks, block_size, num_heads, num_kv_heads,
                                 head_dim, sm_scale, out);
      return 0;
    case kFp8E4M3:
      decode_attention<kFp8E4M3>(q, q_stride, cache, scales, tables, table_stride, contexts,
                                 num_seqs, num_blocks, block_size, num_heads, num_kv_heads,
                                 head_dim, sm_scale, out);
      return 0;
    case kInt8:
      decode_attention<kInt8>(q, q_stride, cache, scales, tables, table_stride, contexts,
                              num_seqs, num_blocks, block_size, num_heads, num_kv_heads,
                              head_dim, sm_scale, out);
      return 0;
    default:
      return 2;
  }
}
