// Fused elementwise ops on fp32 or bf16 rows for the CPU backend: each reads its inputs
// once and writes its outputs once, where the torch reference makes several passes (and
// allocations) per op. Rows are split across torch's OpenMP threads when there are
// enough of them to be worth it.

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace {

// Rows per parallel task: enough work (~16K elements) to amortise the fork.
inline int64_t grain(int64_t dim) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(dim, 1)); }

using lamina::load;

template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* residual, int64_t residual_stride,
              const T* weight, float eps, int64_t rows, int64_t dim, T* out, T* residual_out) {
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* o = out + r * dim;
      const T* src = xr;
      if (residual != nullptr) {
        const T* rr = residual + r * residual_stride;
        T* sum = residual_out + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) sum[i] = lamina::round_to<T>(load(xr[i]) + load(rr[i]));
        src = sum;
      }
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < dim; ++i) squares += load(src[i]) * load(src[i]);
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i)
        o[i] = lamina::round_to<T>(lamina::rounded<T>(load(src[i]) * inv) * load(weight[i]));
    }
  });
}

template <typename T>
void silu_and_mul(const T* x, int64_t rows, int64_t half, T* out) {
  at::parallel_for(0, rows, grain(half), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * half;
      lamina::silu_mul_row(gate, gate + half, out + r * half, half);
    }
  });
}

template <typename T>
void rotary(const T* x, int64_t x_stride, const T* cos, const T* sin, int64_t tokens,
            int64_t heads, int64_t dim, T* out) {
  using lamina::rounded;
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * half;
      const T* s = sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x1 = x + t * x_stride + h * dim;
        const T* x2 = x1 + half;
        T* o1 = out + (t * heads + h) * dim;
        T* o2 = o1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = load(x1[i]), b = load(x2[i]), ci = load(c[i]), si = load(s[i]);
          o1[i] = lamina::round_to<T>(rounded<T>(a * ci) - rounded<T>(b * si));
          o2[i] = lamina::round_to<T>(rounded<T>(b * ci) + rounded<T>(a * si));
        }
      }
    }
  });
}

// f(T{}) for the element type `dtype` names: 0 fp32, 1 bf16.
template <typename F>
void by_dtype(int dtype, F f) {
  if (dtype == 1)
    f(lamina::Bf16{});
  else
    f(float{});
}

}  // namespace

// out = rms_norm(x [+ residual]) * weight; with a residual, residual_out = x + residual.
// In bf16 every step is rounded where the reference's bf16 ops round: the sum, the
// normalized row, its product with the weight (the mean square is taken in fp32).
extern "C" void lamina_rms_norm(const void* x, int64_t x_stride, const void* residual,
                                int64_t residual_stride, const void* weight, float eps,
                                int64_t rows, int64_t dim, void* out, void* residual_out,
                                int dtype) {
  by_dtype(dtype, [&](auto element) {
    using T = decltype(element);
    rms_norm(static_cast<const T*>(x), x_stride, static_cast<const T*>(residual),
             residual_stride, static_cast<const T*>(weight), eps, rows, dim,
             static_cast<T*>(out), static_cast<T*>(residual_out));
  });
}

// out[r, i] = silu(x[r, i]) * x[r, half + i] for x of rows [gate | up].
extern "C" void lamina_silu_and_mul(const void* x, int64_t rows, int64_t half, void* out,
                                    int dtype) {
  by_dtype(dtype, [&](auto element) {
    using T = decltype(element);
    silu_and_mul(static_cast<const T*>(x), rows, half, static_cast<T*>(out));
  });
}

// Rotary embedding, half-split layout: for each token t and head h of x (tokens x heads x
// dim, token stride x_stride, heads contiguous), out = [x1 cos - x2 sin | x2 cos + x1 sin]
// with cos/sin (tokens x dim/2) per token; in bf16 each product and sum rounded.
extern "C" void lamina_rotary(const void* x, int64_t x_stride, const void* cos,
                              const void* sin, int64_t tokens, int64_t heads, int64_t dim,
                              void* out, int dtype) {
  by_dtype(dtype, [&](auto element) {
    using T = decltype(element);
    rotary(static_cast<const T*>(x), x_stride, static_cast<const T*>(cos),
           static_cast<const T*>(sin), tokens, heads, dim, static_cast<T*>(out));
  });
}
