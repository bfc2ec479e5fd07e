// Shared SIMD helpers for the native CPU kernels.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define LAMINA_AVX2 1
#include <immintrin.h>
#else
#define LAMINA_AVX2 0
#endif

#include <cmath>
#include <cstdint>

namespace lamina {

// silu(g) * up = g / (1 + exp(-g)) * up.
inline float silu_mul(float g, float up) { return g / (1.0f + std::exp(-g)) * up; }

#if LAMINA_AVX2
// exp of 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-5
// polynomial, 2^n by exponent bits); within 2 ulp, and 0 below -87.3.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// silu_mul of 8 lanes.
inline __m256 silu_mul8(__m256 g, __m256 up) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), up);
}

#endif

// o[j] = silu(g[j]) * up[j] for j < n: the MLP's activation, wherever it runs.
inline void silu_mul_row(const float* g, const float* up, float* o, int64_t n) {
  int64_t j = 0;
#if LAMINA_AVX2
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(o + j, silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(up + j)));
#endif
  for (; j < n; ++j) o[j] = silu_mul(g[j], up[j]);
}

}  // namespace lamina
