// Fused elementwise ops on fp32 rows for the CPU backend: each reads its inputs once and
// writes its outputs once, where the torch reference makes several passes (and
// allocations) per op. Rows are split across torch's OpenMP threads when there are
// enough of them to be worth it.

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {

// Rows per parallel task: enough work (~16K elements) to amortise the fork.
inline int64_t grain(int64_t dim) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1)); }

}  // namespace

// out = rms_norm(x [+ residual]) * weight; with a residual, residual_out = x + residual.
extern "C" void lamina_rms_norm(const float* x, int64_t x_stride, const float* residual,
                                int64_t residual_stride, const float* weight, float eps,
                                int64_t rows, int64_t dim, float* out, float* residual_out) {
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * x_stride;
      float* o = out + r * dim;
      const float* src = xr;
      if (residual != nullptr) {
        const float* rr = residual + r * residual_stride;
        float* sum = residual_out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) sum[i] = xr[i] + rr[i];
        src = sum;
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) squares += src[i] * src[i];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) o[i] = src[i] * inv * weight[i];
    }
  });
}

// out[r, i] = silu(x[r, i]) * x[r, half + i] for x of rows [gate | up].
extern "C" void lamina_silu_and_mul(const float* x, int64_t rows, int64_t half, float* out) {
  at::parallel_for(0, rows, grain(half), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = x + r * 2 * half;
      lamina::silu_mul_row(gate, gate + half, out + r * half, half);
    }
  });
}

// Rotary embedding, half-split layout: for each token t and head h of x (tokens x heads x
// dim, token stride x_stride, heads contiguous), out = [x1 cos - x2 sin | x2 cos + x1 sin]
// with cos/sin (tokens x dim/2) per token.
extern "C" void lamina_rotary(const float* x, int64_t x_stride, const float* cos,
                              const float* sin, int64_t tokens, int64_t heads, int64_t dim,
                              float* out) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const float* x1 = x + t * x_stride + h * dim;
        const float* x2 = x1 + half;
        float* o1 = out + (t * heads + h) * dim;
        float* o2 = o1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          o1[i] = x1[i] * c[i] - x2[i] * s[i];
          o2[i] = x2[i] * c[i] + x1[i] * s[i];
        }
      }
    }
  });
}
