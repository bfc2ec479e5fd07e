// out = x @ weight^T (+ bias) for the few rows of x that decoding makes, fp32.
//
// With one to a few rows a linear layer is a pass over its weight: each weight element is
// used once per row of x, so the speed is the rate the weight streams from memory. Here
// each thread takes a contiguous range of weight rows (output features) and reads each
// row front to back once, for all rows of x (which stay in L1/L2), with two partial sums
// per row of x in registers. Reading the weight strictly in order is what lets the
// hardware prefetchers run ahead: interleaving several weight rows was 20% slower.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace {

#if LAMINA_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// out[m * out_stride] = dot(w, x[m]) for the MR rows of x (row stride x_stride); k floats.
template <int MR>
inline void row_dots(const float* w, int64_t k, const float* x, int64_t x_stride, float* out,
                     int64_t out_stride) {
  float sums[MR] = {};
  int64_t i = 0;
#if LAMINA_AVX2
  __m256 a[MR], b[MR];
  for (int m = 0; m < MR; ++m) a[m] = b[m] = _mm256_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m256 w0 = _mm256_loadu_ps(w + i);
    const __m256 w1 = _mm256_loadu_ps(w + i + 8);
    for (int m = 0; m < MR; ++m) {
      a[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + m * x_stride + i), a[m]);
      b[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + m * x_stride + i + 8), b[m]);
    }
  }
  for (int m = 0; m < MR; ++m) sums[m] = hsum(_mm256_add_ps(a[m], b[m]));
#endif
  for (; i < k; ++i)
    for (int m = 0; m < MR; ++m) sums[m] += w[i] * x[m * x_stride + i];
  for (int m = 0; m < MR; ++m) out[m * out_stride] = sums[m];
}

}  // namespace

// out (rows x n, contiguous) = x (rows x k, row stride x_stride) @ weight^T (n x k,
// contiguous) + bias (n, or NULL).
extern "C" void lamina_skinny_linear(const float* x, int64_t x_stride, const float* weight,
                                     const float* bias, int64_t rows, int64_t n, int64_t k,
                                     float* out) {
  // ~64 KiB of weight per task at least: enough to amortise the fork.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const float* w = weight + j * k;
      int64_t m = 0;
      for (; m + 4 <= rows; m += 4)
        row_dots<4>(w, k, x + m * x_stride, x_stride, out + m * n + j, n);
      const float* xm = x + m * x_stride;
      float* om = out + m * n + j;
      switch (rows - m) {
        case 3: row_dots<3>(w, k, xm, x_stride, om, n); break;
        case 2: row_dots<2>(w, k, xm, x_stride, om, n); break;
        case 1: row_dots<1>(w, k, xm, x_stride, om, n); break;
        default: break;
      }
      if (bias != nullptr)
        for (int64_t r = 0; r < rows; ++r) out[r * n + j] += bias[j];
    }
  });
}
