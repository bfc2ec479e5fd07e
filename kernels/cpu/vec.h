// Shared SIMD helpers for the native CPU kernels.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define LAMINA_AVX2 1
#include <immintrin.h>
#else
#define LAMINA_AVX2 0
#endif
#if LAMINA_AVX2 && defined(__AVX512F__)
#define LAMINA_AVX512 1
#else
#define LAMINA_AVX512 0
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

namespace lamina {

// bf16: an fp32 number's top 16 bits (sign, the same 8-bit exponent, 7 mantissa bits).
struct Bf16 {
  uint16_t bits;
};

// An element as fp32 (exact for bf16).
inline float load(float x) { return x; }
inline float load(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// An fp32 result as a T: for bf16 rounded to nearest, ties to even (NaN a quiet NaN), as
// torch rounds the result of every bf16 op, so a kernel that rounds where the reference's
// ops do computes what they compute.
template <typename T>
inline T round_to(float x);
template <>
inline float round_to<float>(float x) {
  return x;
}
template <>
inline Bf16 round_to<Bf16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if (x != x) return Bf16{0x7FC0};
  return Bf16{static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)};
}

// x as a T op of the reference leaves it: rounded to T, and back to fp32.
template <typename T>
inline float rounded(float x) {
  return load(round_to<T>(x));
}

// silu(g) * up = g / (1 + exp(-g)) * up.
inline float silu_mul(float g, float up) { return g / (1.0f + std::exp(-g)) * up; }

#if LAMINA_AVX2
// Cephes' expf, as exp8 and exp16 compute it: x clamped to [kExpLow, kExpHigh], n = round(x
// log2 e), r = x - n ln 2 (ln 2 in two parts), a degree-5 polynomial in r, times 2^n.
constexpr float kExpLow = -87.3f, kExpHigh = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// exp of 8 lanes (within 2 ulp, and 0 below -87.3).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLow)), _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 y = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; i++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExpPoly[i]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// silu of 8 lanes.
inline __m256 silu8(__m256 g) {
  const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// silu_mul of 8 lanes.
inline __m256 silu_mul8(__m256 g, __m256 up) { return _mm256_mul_ps(silu8(g), up); }

// 8 bf16 elements as fp32.
inline __m256 load8(const Bf16* p) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

// 8 lanes rounded as round_to<Bf16> rounds one, in each lane's top 16 bits.
inline __m256i bf16_bits8(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i sum = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(
      _mm256_castsi256_ps(sum), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan));
}

// rounded<Bf16> of 8 lanes.
inline __m256 rounded8(__m256 x) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(bf16_bits8(x), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// 8 lanes stored as bf16 (round_to<Bf16> of each).
inline void store8(Bf16* p, __m256 x) {
  const __m256i top = _mm256_srli_epi32(bf16_bits8(x), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

#endif

#if LAMINA_AVX512
// The same on 16 lanes, instruction for instruction (so lane for lane the same results):
// the activation is arithmetic-bound, and half the instructions a vector is what the
// wider registers buy.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLow)), _mm512_set1_ps(kExpHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; i++) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

inline __m512 silu16(__m512 g) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

inline __m512 load16(const Bf16* p) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

inline __m512i bf16_bits16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i sum = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(sum, nan, _mm512_set1_epi32(0x7FC00000));
}

inline __m512 rounded16(__m512 x) {
  return _mm512_castsi512_ps(
      _mm512_and_si512(bf16_bits16(x), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline void store16(Bf16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_bits16(x), 16)));
}
#endif

// o[j] = silu(g[j]) * up[j] for j < n: the MLP's activation, wherever it runs.
inline void silu_mul_row(const float* g, const float* up, float* o, int64_t n) {
  int64_t j = 0;
#if LAMINA_AVX512
  for (; j + 16 <= n; j += 16)
    _mm512_storeu_ps(o + j,
                     _mm512_mul_ps(silu16(_mm512_loadu_ps(g + j)), _mm512_loadu_ps(up + j)));
#endif
#if LAMINA_AVX2
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(o + j, silu_mul8(_mm256_loadu_ps(g + j), _mm256_loadu_ps(up + j)));
#endif
  for (; j < n; ++j) o[j] = silu_mul(g[j], up[j]);
}

// The same for bf16 rows, rounded where the reference's two bf16 ops round: o[j] =
// bf16(bf16(silu(g[j])) * up[j]).
inline void silu_mul_row(const Bf16* g, const Bf16* up, Bf16* o, int64_t n) {
  int64_t j = 0;
#if LAMINA_AVX512
  for (; j + 16 <= n; j += 16)
    store16(o + j, _mm512_mul_ps(rounded16(silu16(load16(g + j))), load16(up + j)));
#endif
#if LAMINA_AVX2
  for (; j + 8 <= n; j += 8)
    store8(o + j, _mm256_mul_ps(rounded8(silu8(load8(g + j))), load8(up + j)));
#endif
  for (; j < n; ++j) {
    const float x = load(g[j]);
    o[j] = round_to<Bf16>(rounded<Bf16>(x / (1.0f + std::exp(-x))) * load(up[j]));
  }
}

}  // namespace lamina
