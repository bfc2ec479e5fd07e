// out = x @ weight^T (+ bias) in fp32 on a weight packed once at load: the engine's linears
// on the CPU, from one row (a batch-1 decode step) to thousands (a prefill chunk).
//
// The classic blocked layout (Goto / BLIS). The weight (N x K) is packed into panels of 16
// output columns, each panel k-major ([K][16]), so the 6 x 16 micro-kernel reads it
// strictly in order. Per work item (a block of up to block_rows() rows of x and a range
// of panels) and per kKC-deep slice of K:
//   * the rows' slice of x is packed into 6-row panels, k-major ([kKC][6]): up to half
//     of L2, where it stays while every weight panel of the range passes over it;
//   * each weight panel's slice (kKC x 16, 32 KB) stays in L1 while the micro-kernel
//     walks the 6-row panels of x down it;
//   * the micro-kernel keeps a 6 x 16 block of the output in twelve AVX2 registers:
//     per k two weight loads, six broadcasts of x and twelve FMAs (with AVX-512, fp32 in
//     six registers: one load, six broadcasts and six FMAs; and from 19 rows on, two
//     panels a call, 6 x 32 in twelve registers: two loads, six broadcasts, twelve FMAs).
// The first slice writes the output block (plus bias), later slices add to it. With one
// row the same loops are a single pass over the weight in memory order, as fast as a
// dedicated matrix-vector kernel. Measured against oneDNN's packed matmul and MKL in
// `benchmarks/cpu_linear.py` (numbers in docs/performance.md).
//
// The MLP's gate and up projections run as one gated matmul (lamina_packed_silu_mul): the
// activation is applied to each output block as soon as its two sums are done.
//
// Quantized weights (weight-only: x and out stay fp32) use the same layout with one byte per
// element: int8 with a scale per output column, or fp8 e4m3 with a scale per output column;
// or two bytes: bf16, a scale of 1 (exact: bf16 is fp32's top half);
// or half a byte: int4 codes (GPTQ's and AWQ's), w = (q - zero) * scale with a scale and a
// zero point per column and group of K (a panel's k-row is 8 bytes, byte j holding column j
// in its low nibble and column j + 8 in its high one). Rows of x against int4 sum x * q per
// group and take scale * (sum x q - zero * sum x) once per group (sum x: each row's, per
// group, computed first).
// A byte is widened to fp32 in registers as it is loaded; the column's scale multiplies the
// finished sums (sum_k x_k * q_jk * s_j = s_j * sum_k x_k * q_jk), so decoding reads a
// quarter of the fp32 bytes and does no more arithmetic. With more rows than one
// micro-kernel call takes, each weight panel's slice is widened and scaled once into a
// 32 KB buffer (in L1) and the fp32 micro-kernel walks the rows down it: the widening is
// then paid once per slice, not once per 6 rows. Neither keeps a dequantized copy of the
// weight.
//
// Layouts: x (m, k) with row stride x_stride; packed as lamina_pack_weight (fp32),
// lamina_pack_weight_bytes (int8, fp8) or lamina_pack_weight_halves (bf16) writes it,
// ceil(n / 16) * 16 * k elements, 32-byte aligned; scale (ceil(n / 16) * 16,) for a
// quantized weight; bias (n,) or NULL; out (m, n) contiguous.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "caches.h"
#include "vec.h"

namespace {

constexpr int kMR = 6;         // rows of x per micro-kernel call
constexpr int kNR = 16;        // output columns per weight panel (two AVX2 registers)
constexpr int64_t kKC = 512;   // depth of one slice of K
constexpr int64_t kMinRows = 192;  // fewest rows a thread gets when rows are split
constexpr int64_t kFetchCalls = 3;  // see the panel prefetch in packed_matmul
// kKC: of the sizes tried (256-512, K unrolled by one or four) at 64, 600 and 2048 rows,
// none was faster beyond the noise.

// Rows of x packed at a time: as many as half of a core's L2 holds at kKC deep, 72 to
// 288 (a multiple of kMR). Each block of rows is one more pass over the weight panels of
// a work item, from memory: on the Intel VM (2 MB of L2) 288 rows made the `small`
// model's linears 8-10% faster than 72 at 256-2048 rows (144 no faster than 72); on the
// AMD EPYC (512 KB, so 126 rows) 48-144 measured alike.
int64_t block_rows() {
  static const int64_t rows = [] {
    const int64_t fit = lamina::l2_bytes() / 2 / (kKC * static_cast<int64_t>(sizeof(float)));
    return std::clamp<int64_t>(fit / kMR * kMR, 72, 288);
  }();
  return rows;
}

// The weight's element types. fp8 is e4m3 ("fn": no infinities), the format of torch's
// float8_e4m3fn and of fp8 checkpoints.
struct Fp8 {
  uint8_t bits;
};
// Two int4 codes: a panel's column j (low nibble) and j + 8 (high nibble) at one k.
struct Int4 {
  uint8_t bits;
};
using lamina::Bf16;  // see vec.h
template <typename W>
constexpr bool kQuantized = !std::is_same_v<W, float>;
template <typename W>
constexpr bool kGrouped = std::is_same_v<W, Int4>;
// Elements of W in one k-row of a panel.
template <typename W>
constexpr int64_t kPerK = kGrouped<W> ? kNR / 2 : kNR;

// One element as fp32 (the scalar path; the column's scale is applied by the caller).
inline float widen(float w) { return w; }
inline float widen(int8_t w) { return static_cast<float>(w); }
inline float widen(Bf16 w) { return lamina::load(w); }
inline float widen(Fp8 w) {
  const int exponent = (w.bits >> 3) & 0xF, mantissa = w.bits & 0x7;
  const float magnitude = exponent ? std::ldexp(1.0f + mantissa / 8.0f, exponent - 7)
                                   : std::ldexp(mantissa / 8.0f, -6);  // subnormal
  return (w.bits & 0x80) ? -magnitude : magnitude;
}

// Column j's code in an int4 k-row.
inline float code(const Int4* row, int j) {
  const uint8_t byte = row[j & 7].bits;
  return static_cast<float>(j < 8 ? byte & 0xF : byte >> 4);
}

#if LAMINA_AVX2
// A panel's 16 elements at one k as two registers of 8 floats.
inline void load16(const float* b, __m256& lo, __m256& hi) {
  lo = _mm256_load_ps(b);
  hi = _mm256_load_ps(b + 8);
}
inline void load16(const int8_t* b, __m256& lo, __m256& hi) {
  lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
  hi = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 8))));
}
// e4m3's exponent and mantissa bits moved into fp16's places make the fp16 number 2^-8
// times the fp8 one (the exponent biases are 15 and 7), subnormals included, and F16C
// widens fp16 exactly; kWiden puts the 2^8 back with the column's scale. Sign-extending
// the byte to 16 bits and shifting it left by 7 puts the magnitude in bits 7-13 and the
// sign in bits 14 and 15: the mask keeps bit 15.
inline void load16(const Fp8* b, __m256& lo, __m256& hi) {
  const __m256i h = _mm256_and_si256(
      _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))), 7),
      _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
  hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}
// bf16 widens exactly by moving its 16 bits to the top of 32.
inline __m256 widen8(__m128i halves) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}
inline void load16(const Bf16* b, __m256& lo, __m256& hi) {
  lo = widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
  hi = widen8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 8)));
}
inline void load16(const Int4* b, __m256& lo, __m256& hi) {
  const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(v, nibble)));
  hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), nibble)));
}
#if defined(__AVX512F__)
// The same 16 elements as one register of 16 floats, for the formats whose one-row
// product is bound by widening (int8, fp8, bf16: see micro).
template <typename W>
constexpr bool kWide =
    std::is_same_v<W, int8_t> || std::is_same_v<W, Fp8> || std::is_same_v<W, Bf16>;
inline __m128i bytes16(const void* b) {
  return _mm_loadu_si128(static_cast<const __m128i*>(b));
}
inline __m512 load16(const int8_t* b) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes16(b)));
}
inline __m512 load16(const Fp8* b) {  // as the two-register load16 widens e4m3
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes16(b)), 7),
                                     _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm512_cvtph_ps(h);
}
using lamina::load16;  // bf16's
#endif
#endif

// What the column's scale is multiplied by for the sums load16 makes: 2^8 for fp8 (see
// its load16), else 1.
template <typename W>
constexpr float kWiden = std::is_same_v<W, Fp8> && LAMINA_AVX2 ? 256.0f : 1.0f;

// The first `cols` columns of an M x kNR block of sums into out (row stride ldo): written
// (plus bias) by a K's first slice, added to by the later ones.
template <int M>
inline void write_block(const float (&block)[M][kNR], float* out, int64_t ldo, bool first,
                        const float* bias, int64_t cols) {
  for (int i = 0; i < M; ++i) {
    float* row = out + i * ldo;
    if (first) {
      for (int64_t j = 0; j < cols; ++j) row[j] = block[i][j] + (bias ? bias[j] : 0.0f);
    } else {
      for (int64_t j = 0; j < cols; ++j) row[j] += block[i][j];
    }
  }
}

#if LAMINA_AVX2
// A micro-kernel's finished sums (an M x kNR block as two registers a row) into out, each
// column's sums times its scale first for a quantized weight.
template <typename W, int M>
inline void store(__m256 (&lo)[M], __m256 (&hi)[M], float* out, int64_t ldo, bool first,
                  const float* bias, const float* scale, int64_t cols) {
  if constexpr (kQuantized<W>) {
    const __m256 fix = _mm256_set1_ps(kWiden<W>);
    const __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(scale), fix);
    const __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(scale + 8), fix);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      lo[i] = _mm256_mul_ps(lo[i], s0);
      hi[i] = _mm256_mul_ps(hi[i], s1);
    }
  }
  if (cols == kNR) {  // a whole panel: straight from the registers
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      float* row = out + i * ldo;
      if (!first) {
        lo[i] = _mm256_add_ps(lo[i], _mm256_loadu_ps(row));
        hi[i] = _mm256_add_ps(hi[i], _mm256_loadu_ps(row + 8));
      } else if (bias) {
        lo[i] = _mm256_add_ps(lo[i], _mm256_loadu_ps(bias));
        hi[i] = _mm256_add_ps(hi[i], _mm256_loadu_ps(bias + 8));
      }
      _mm256_storeu_ps(row, lo[i]);
      _mm256_storeu_ps(row + 8, hi[i]);
    }
    return;
  }
  alignas(32) float block[M][kNR];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    _mm256_store_ps(block[i], lo[i]);
    _mm256_store_ps(block[i] + 8, hi[i]);
  }
  write_block<M>(block, out, ldo, first, bias, cols);
}
#endif

// out block (M x cols, row stride ldo) = or += a (kc x M, k-major) * b (kc x kNR), each
// column's sums times its scale for a quantized weight (scale: the panel's 16). With
// Fetch (b then holds all of K), also pulls the next weight panel in, a line per 64 bytes
// of it (at one row only on the AVX-512 path of the byte and bf16 formats).
template <typename W, int M, bool Fetch>
inline void micro(const float* a, const W* b, int64_t kc, float* out, int64_t ldo,
                  bool first, const float* bias, const float* scale, int64_t cols) {
  [[maybe_unused]] const char* next = reinterpret_cast<const char*>(b + kc * kNR);
  constexpr int64_t kRowBytes = kNR * sizeof(W);  // of a panel, at one k
#if LAMINA_AVX2
  __m256 lo[M], hi[M];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
  int64_t k = 0;
#if defined(__AVX512F__)
  if constexpr (M == 1 && kWide<W>) {
    // One row: a panel's 16 columns at one k are one AVX-512 register, so each k is one
    // widening load, one conversion and one FMA instead of two of each (a byte format's
    // row is bound by these instructions, not by its bytes). Four chains keep the FMAs
    // in flight.
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (; k + 4 <= kc; k += 4) {
      if constexpr (Fetch) {  // the next panel's lines for these four k, as the loop below
        // (a one-row bf16 step 1.1-1.6x faster, int8 and fp8 a little; the fp32 one-row
        // loop below was slower with it)
        for (int64_t at = k * kRowBytes; at < (k + 4) * kRowBytes; at += 64)
          __builtin_prefetch(next + at, 0, 3);
      }
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c)
        acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(a[k + c]), load16(b + (k + c) * kNR), acc[c]);
    }
    for (; k < kc; ++k) acc[0] = _mm512_fmadd_ps(_mm512_set1_ps(a[k]), load16(b + k * kNR), acc[0]);
    const __m512 total =
        _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    lo[0] = _mm512_castps512_ps256(total);
    hi[0] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(total), 1));
  } else if constexpr (M > 1 && std::is_same_v<W, float>) {
    // Several rows of an fp32 panel: a panel's 16 columns at one k are one AVX-512
    // register, so each k is one load, M broadcasts and M FMAs, half the FMA instructions
    // of the two-register loop below (1.15-1.18x its speed from 128 rows; summing even
    // and odd k apart for twice the chains gained nothing more).
    __m512 acc[M];
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
    for (; k < kc; ++k) {
      if constexpr (Fetch) {
        if (k * kRowBytes % 64 == 0) __builtin_prefetch(next + kRowBytes * k, 0, 3);
      }
      const __m512 w = _mm512_loadu_ps(b + k * kNR);  // panels are 32-byte aligned
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(a[k * M + i]), w, acc[i]);
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      lo[i] = _mm512_castps512_ps256(acc[i]);
      hi[i] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[i]), 1));
    }
  } else
#endif
  if constexpr (M == 1) {  // one row: two more chains, so that the FMAs do not wait on each
    __m256 lo2 = _mm256_setzero_ps(), hi2 = _mm256_setzero_ps();  // other (hot weights)
    for (; k + 2 <= kc; k += 2) {
      const __m256 x0 = _mm256_broadcast_ss(a + k), x1 = _mm256_broadcast_ss(a + k + 1);
      __m256 b0, b1, b2, b3;
      load16(b + k * kNR, b0, b1);
      load16(b + (k + 1) * kNR, b2, b3);
      lo[0] = _mm256_fmadd_ps(x0, b0, lo[0]);
      hi[0] = _mm256_fmadd_ps(x0, b1, hi[0]);
      lo2 = _mm256_fmadd_ps(x1, b2, lo2);
      hi2 = _mm256_fmadd_ps(x1, b3, hi2);
    }
    lo[0] = _mm256_add_ps(lo[0], lo2);
    hi[0] = _mm256_add_ps(hi[0], hi2);
  }
#pragma GCC unroll 4
  for (; k < kc; ++k) {
    if constexpr (Fetch) {
      if (k * kRowBytes % 64 == 0) __builtin_prefetch(next + kRowBytes * k, 0, 3);
    }
    __m256 b0, b1;
    load16(b + k * kNR, b0, b1);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + k * M + i);
      lo[i] = _mm256_fmadd_ps(x, b0, lo[i]);
      hi[i] = _mm256_fmadd_ps(x, b1, hi[i]);
    }
  }
  store<W, M>(lo, hi, out, ldo, first, bias, scale, cols);
#else
  float block[M][kNR] = {};
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < kNR; ++j) block[i][j] += a[k * M + i] * widen(b[k * kNR + j]);
  if constexpr (kQuantized<W>) {
    for (int i = 0; i < M; ++i)
      for (int j = 0; j < kNR; ++j) block[i][j] *= scale[j];
  }
  write_block<M>(block, out, ldo, first, bias, cols);
#endif
}

template <typename W>
using Micro = void (*)(const float*, const W*, int64_t, float*, int64_t, bool, const float*,
                       const float*, int64_t);
template <typename W>
constexpr Micro<W> kMicro[2][kMR + 1] = {
    {nullptr, micro<W, 1, false>, micro<W, 2, false>, micro<W, 3, false>, micro<W, 4, false>,
     micro<W, 5, false>, micro<W, 6, false>},
    {nullptr, micro<W, 1, true>, micro<W, 2, true>, micro<W, 3, true>, micro<W, 4, true>,
     micro<W, 5, true>, micro<W, 6, true>}};

#if defined(__AVX512F__)
constexpr bool kPairs = true;
// M rows against two adjacent fp32 panels (32 output columns; b the first panel's slice,
// the second's `stride` floats on), both from L1: per k two loads, M broadcasts and 2M
// FMAs, where the one-panel loop above issues M + 1 loads for M FMAs. Each column's sums
// are the one-panel loop's, in the same order.
template <int M>
inline void micro_pair(const float* a, const float* b, int64_t stride, int64_t kc, float* out,
                       int64_t ldo, bool first, const float* bias, int64_t cols,
                       int64_t cols2) {
  __m512 acc[M], acc2[M];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) acc[i] = acc2[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 w = _mm512_loadu_ps(b + k * kNR), w2 = _mm512_loadu_ps(b + stride + k * kNR);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const __m512 x = _mm512_set1_ps(a[k * M + i]);
      acc[i] = _mm512_fmadd_ps(x, w, acc[i]);
      acc2[i] = _mm512_fmadd_ps(x, w2, acc2[i]);
    }
  }
  __m256 lo[M], hi[M];
  const auto halves = [&](const __m512(&sums)[M]) {
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      lo[i] = _mm512_castps512_ps256(sums[i]);
      hi[i] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sums[i]), 1));
    }
  };
  halves(acc);
  store<float, M>(lo, hi, out, ldo, first, bias, nullptr, cols);
  halves(acc2);
  store<float, M>(lo, hi, out + kNR, ldo, first, bias ? bias + kNR : nullptr, nullptr, cols2);
}
using MicroPair = void (*)(const float*, const float*, int64_t, int64_t, float*, int64_t, bool,
                           const float*, int64_t, int64_t);
constexpr MicroPair kMicroPair[kMR + 1] = {nullptr,         micro_pair<1>, micro_pair<2>,
                                           micro_pair<3>, micro_pair<4>, micro_pair<5>,
                                           micro_pair<6>};
#else
constexpr bool kPairs = false;
#endif

// dst (kc x kNR fp32) = a quantized panel's slice b, widened, times its columns' scales.
template <typename W>
inline void widen_panel(const W* b, int64_t kc, const float* scale, float* dst) {
#if LAMINA_AVX2
  const __m256 fix = _mm256_set1_ps(kWiden<W>);
  const __m256 s0 = _mm256_mul_ps(_mm256_loadu_ps(scale), fix);
  const __m256 s1 = _mm256_mul_ps(_mm256_loadu_ps(scale + 8), fix);
  for (int64_t k = 0; k < kc; ++k) {
    __m256 lo, hi;
    load16(b + k * kNR, lo, hi);
    _mm256_store_ps(dst + k * kNR, _mm256_mul_ps(lo, s0));
    _mm256_store_ps(dst + k * kNR + 8, _mm256_mul_ps(hi, s1));
  }
#else
  for (int64_t k = 0; k < kc; ++k)
    for (int j = 0; j < kNR; ++j) dst[k * kNR + j] = widen(b[k * kNR + j]) * scale[j];
#endif
}

// x[0] + ... + x[n - 1].
inline float sum(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.0f;
#if LAMINA_AVX2
  __m256 lanes = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(x + i));
  alignas(32) float parts[8];
  _mm256_store_ps(parts, lanes);
  for (const float part : parts) total += part;
#endif
  for (; i < n; ++i) total += x[i];
  return total;
}

// out (1 x cols) = or += one row of x (all of K) against an int4 panel: per group of K,
// scale * (sum x q - zero * sum x) for each column (scale, zero: the panel's groups x 16).
inline void micro_int4_row(const float* a, const Int4* b, int64_t kc, float* out, bool first,
                           const float* bias, const float* scale, const float* zero,
                           int64_t group, int64_t cols) {
  alignas(32) float block[kNR];
#if LAMINA_AVX2
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t g0 = 0, g = 0; g0 < kc; g0 += group, ++g) {
    const int64_t g1 = std::min(kc, g0 + group);
    __m256 sum_lo = _mm256_setzero_ps(), sum_hi = _mm256_setzero_ps();
    __m256 sum_lo2 = _mm256_setzero_ps(), sum_hi2 = _mm256_setzero_ps();  // a second chain
    const float xs = sum(a + g0, g1 - g0);
    int64_t k = g0;
    for (; k + 2 <= g1; k += 2) {
      __m256 w0, w1, w2, w3;
      load16(b + k * 8, w0, w1);
      load16(b + (k + 1) * 8, w2, w3);
      const __m256 x0 = _mm256_broadcast_ss(a + k), x1 = _mm256_broadcast_ss(a + k + 1);
      sum_lo = _mm256_fmadd_ps(x0, w0, sum_lo);
      sum_hi = _mm256_fmadd_ps(x0, w1, sum_hi);
      sum_lo2 = _mm256_fmadd_ps(x1, w2, sum_lo2);
      sum_hi2 = _mm256_fmadd_ps(x1, w3, sum_hi2);
    }
    for (; k < g1; ++k) {
      __m256 w0, w1;
      load16(b + k * 8, w0, w1);
      const __m256 x0 = _mm256_broadcast_ss(a + k);
      sum_lo = _mm256_fmadd_ps(x0, w0, sum_lo);
      sum_hi = _mm256_fmadd_ps(x0, w1, sum_hi);
    }
    const __m256 x_sum = _mm256_set1_ps(xs);
    const float* s = scale + g * kNR;
    const float* z = zero + g * kNR;
    sum_lo = _mm256_fnmadd_ps(_mm256_loadu_ps(z), x_sum, _mm256_add_ps(sum_lo, sum_lo2));
    sum_hi = _mm256_fnmadd_ps(_mm256_loadu_ps(z + 8), x_sum, _mm256_add_ps(sum_hi, sum_hi2));
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(s), sum_lo, lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(s + 8), sum_hi, hi);
  }
  _mm256_store_ps(block, lo);
  _mm256_store_ps(block + 8, hi);
#else
  for (int j = 0; j < kNR; ++j) block[j] = 0.0f;
  for (int64_t g0 = 0, g = 0; g0 < kc; g0 += group, ++g) {
    const int64_t g1 = std::min(kc, g0 + group);
    float xs = 0.0f, sums[kNR] = {};
    for (int64_t k = g0; k < g1; ++k) {
      xs += a[k];
      for (int j = 0; j < kNR; ++j) sums[j] += a[k] * code(b + k * 8, j);
    }
    for (int j = 0; j < kNR; ++j)
      block[j] += scale[g * kNR + j] * (sums[j] - zero[g * kNR + j] * xs);
  }
#endif
  for (int64_t j = 0; j < cols; ++j)
    out[j] = first ? block[j] + (bias ? bias[j] : 0.0f) : out[j] + block[j];
}

// out block (M x cols, row stride ldo) = M rows of x (a: all of K, k-major [k][M]) against
// an int4 panel, as micro_int4_row does for one row: per group, each row's sums of x * q
// in registers (two per row: the FMA chains are independent), then scale * (sums - zero *
// sum x) added to the block (in L1) once per group. xs: each row's sum of x per group, row
// i's at xs + i * groups. With Fetch, also pulls the next panel (right after this one) in.
template <int M, bool Fetch>
inline void micro_int4(const float* a, const Int4* b, int64_t kc, float* out, int64_t ldo,
                       const float* bias, const float* scale, const float* zero,
                       int64_t group, const float* xs, int64_t groups, int64_t cols) {
  alignas(32) float block[M][kNR] = {};
  [[maybe_unused]] const char* next = reinterpret_cast<const char*>(b + kc * 8);
  for (int64_t g0 = 0, g = 0; g0 < kc; g0 += group, ++g) {
    const int64_t g1 = std::min(kc, g0 + group);
    const float* s = scale + g * kNR;
    const float* z = zero + g * kNR;
#if LAMINA_AVX2
    __m256 lo[M], hi[M];
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int64_t k = g0; k < g1; ++k) {
      if constexpr (Fetch) {
        if (k % 8 == 0) __builtin_prefetch(next + 8 * k, 0, 3);  // a line per 8 k-rows
      }
      __m256 w0, w1;
      load16(b + k * 8, w0, w1);
#pragma GCC unroll 6
      for (int i = 0; i < M; ++i) {
        const __m256 x = _mm256_broadcast_ss(a + k * M + i);
        lo[i] = _mm256_fmadd_ps(x, w0, lo[i]);
        hi[i] = _mm256_fmadd_ps(x, w1, hi[i]);
      }
    }
    const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
    const __m256 z0 = _mm256_loadu_ps(z), z1 = _mm256_loadu_ps(z + 8);
#pragma GCC unroll 6
    for (int i = 0; i < M; ++i) {
      const __m256 x_sum = _mm256_set1_ps(xs[i * groups + g]);
      const __m256 t0 = _mm256_fnmadd_ps(z0, x_sum, lo[i]);
      const __m256 t1 = _mm256_fnmadd_ps(z1, x_sum, hi[i]);
      _mm256_store_ps(block[i], _mm256_fmadd_ps(s0, t0, _mm256_load_ps(block[i])));
      _mm256_store_ps(block[i] + 8, _mm256_fmadd_ps(s1, t1, _mm256_load_ps(block[i] + 8)));
    }
#else
    for (int i = 0; i < M; ++i) {
      float sums[kNR] = {};
      for (int64_t k = g0; k < g1; ++k)
        for (int j = 0; j < kNR; ++j) sums[j] += a[k * M + i] * code(b + k * 8, j);
      for (int j = 0; j < kNR; ++j) block[i][j] += s[j] * (sums[j] - z[j] * xs[i * groups + g]);
    }
#endif
  }
  for (int i = 0; i < M; ++i) {
    float* row = out + i * ldo;
    for (int64_t j = 0; j < cols; ++j) row[j] = block[i][j] + (bias ? bias[j] : 0.0f);
  }
}

using MicroInt4 = void (*)(const float*, const Int4*, int64_t, float*, int64_t, const float*,
                           const float*, const float*, int64_t, const float*, int64_t, int64_t);
// By Fetch and rows (2 to kMR; one row runs micro_int4_row).
constexpr MicroInt4 kMicroInt4[2][kMR + 1] = {
    {nullptr, nullptr, micro_int4<2, false>, micro_int4<3, false>, micro_int4<4, false>,
     micro_int4<5, false>, micro_int4<6, false>},
    {nullptr, nullptr, micro_int4<2, true>, micro_int4<3, true>, micro_int4<4, true>,
     micro_int4<5, true>, micro_int4<6, true>}};

// xs (rows x groups) = each row's sum of x over each group of K.
inline void group_sums(const float* x, int64_t x_stride, int64_t rows, int64_t k,
                       int64_t group, float* xs) {
  const int64_t groups = (k + group - 1) / group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g)
      xs[r * groups + g] = sum(x + r * x_stride + g * group, std::min(group, k - g * group));
}

// dst (kc x kNR fp32) = an int4 panel's slice b (its k-rows depth to depth + kc), as
// (q - zero) * scale of each k's group.
inline void widen_panel(const Int4* b, int64_t kc, int64_t depth, const float* scale,
                        const float* zero, int64_t group, float* dst) {
  for (int64_t k = 0; k < kc; ++k) {
    const int64_t g = (depth + k) / group;
    const float* s = scale + g * kNR;
    const float* z = zero + g * kNR;
#if LAMINA_AVX2
    __m256 lo, hi;
    load16(b + k * 8, lo, hi);
    lo = _mm256_mul_ps(_mm256_sub_ps(lo, _mm256_loadu_ps(z)), _mm256_loadu_ps(s));
    hi = _mm256_mul_ps(_mm256_sub_ps(hi, _mm256_loadu_ps(z + 8)), _mm256_loadu_ps(s + 8));
    _mm256_store_ps(dst + k * kNR, lo);
    _mm256_store_ps(dst + k * kNR + 8, hi);
#else
    for (int j = 0; j < kNR; ++j) dst[k * kNR + j] = (code(b + k * 8, j) - z[j]) * s[j];
#endif
  }
}

// x rows [0, rows) x depth [p, p + kc) into panels of kMR rows, k-major; the last panel
// has the rows that are left (rows % kMR of them, if any).
// A whole panel's rows are written a k at a time, so that its stores are contiguous (a
// row at a time stores one float every kMR).
inline void pack_rows(const float* x, int64_t x_stride, int64_t rows, int64_t p, int64_t kc,
                      float* dst) {
  int64_t r = 0;
  for (; r + kMR <= rows; r += kMR) {
    const float* src = x + r * x_stride + p;
    for (int64_t k = 0; k < kc; ++k) {
#pragma GCC unroll 8
      for (int i = 0; i < kMR; ++i) dst[k * kMR + i] = src[i * x_stride + k];
    }
    dst += kc * kMR;
  }
  const int64_t width = rows - r;
  for (int64_t i = 0; i < width; ++i) {
    const float* src = x + (r + i) * x_stride + p;
    for (int64_t k = 0; k < kc; ++k) dst[k * width + i] = src[k];
  }
}

// This thread's `buffer`, grown to at least `floats` and 32-byte aligned. It only grows, so
// it is allocated once: a fresh one per call cost a page-faulting allocation each time.
inline float* aligned(std::vector<float>& buffer, int64_t floats) {
  if (static_cast<int64_t>(buffer.size()) < floats + 8) buffer.resize(floats + 8);
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 31) &
                                  ~uintptr_t{31});
}
thread_local std::vector<float> packed_rows;  // x's rows, packed (see pack_rows)
thread_local std::vector<float> gated_sums;   // a gated matmul's gate and up sums
thread_local std::vector<float> widened;      // a quantized panel's slice (see widen_panel)
thread_local std::vector<float> x_sums;       // int4: rows' sums of x per group (group_sums)

// out (rows x cols, row stride ldo) = silu(gate) * up; gate and up have row stride ld.
inline void silu_mul_block(const float* gate, const float* up, int64_t ld, int64_t rows,
                           int64_t cols, float* out, int64_t ldo) {
  for (int64_t i = 0; i < rows; ++i)
    lamina::silu_mul_row(gate + i * ld, up + i * ld, out + i * ldo, cols);
}

// out = x @ weight^T (+ bias), or with Gated, out = silu(x @ gate^T) * (x @ up^T) (plus
// their biases): then the packed weight's panels alternate, gate's 16 columns then up's
// same 16, so that both sums of an output block are done one panel apart and are combined
// while in cache; the gate-and-up result (twice the output) is never written out. W is the
// weight's element type; a quantized one comes with its columns' scales (panel order), an
// int4 one also with their zero points, each per group of `group` along K ([panel][group]
// [16]; one group of all of K otherwise).
template <bool Gated, typename W>
void packed_matmul(const float* x, int64_t x_stride, int64_t m, int64_t k, const W* packed,
                   const float* scale, const float* zero, int64_t group, int64_t n,
                   const float* bias, float* out) {
  constexpr int64_t kStep = Gated ? 2 : 1;  // weight panels per 16 output columns
  const int64_t groups = (n + kNR - 1) / kNR;
  const int64_t micro_rows = (m + kMR - 1) / kMR;
  // Split the rows between threads where each gets at least kMinRows of them (every thread
  // then reads the whole weight, from L3); with fewer rows (decoding) split the panels, so
  // each thread reads only its share of the weight.
  const int64_t threads = at::get_num_threads();
  const int64_t row_parts = std::clamp<int64_t>(m / kMinRows, 1, threads);
  const int64_t group_parts = std::min(groups, std::max<int64_t>(1, threads / row_parts));
  at::parallel_for(0, row_parts * group_parts, 1, [&](int64_t begin, int64_t end) {
    // A quantized weight is widened a slice at a time into a buffer that the fp32
    // micro-kernel then reads where the widening would otherwise be repeated for many
    // micro-kernel calls per panel (prefill); with up to kFetchCalls calls each call widens
    // in registers, overlapped with its FMAs (faster at 2-18 rows), int4's with its groups.
    const bool widen_slices = kQuantized<W> && m > kFetchCalls * kMR;
    // A few micro-panels of rows (decoding) take K whole: the weight panels then stream
    // front to back in one pass instead of in slices a panel apart (and micro<M, true>
    // finds the next panel right after its own).
    const int64_t slice = m <= kFetchCalls * kMR ? k : kKC;
    // With more rows than that, on AVX-512, the micro-kernel takes two panels a call
    // (micro_pair): fp32 ones as packed, quantized ones widened into two buffers.
    const bool pairs = kPairs && m > kFetchCalls * kMR;
    const int64_t span = pairs ? 2 : 1;  // panels a pass
    const int64_t mc = block_rows();
    float* a = aligned(packed_rows, std::min(mc, m) * slice);
    const int64_t groups_per_column = (k + group - 1) / group;
    float* xs = kGrouped<W> && !widen_slices && m > 1
                    ? aligned(x_sums, std::min(mc, m) * groups_per_column)
                    : nullptr;
    float* wide = widen_slices ? aligned(widened, span * slice * kNR) : nullptr;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t part = item / group_parts, q = item % group_parts;
      const int64_t first_row = micro_rows * part / row_parts * kMR;
      const int64_t last_row = std::min(m, micro_rows * (part + 1) / row_parts * kMR);
      const int64_t p0 = groups * q / group_parts * kStep;
      const int64_t p1 = groups * (q + 1) / group_parts * kStep;
      // Where the micro-kernel writes: the output itself, or (Gated) this item's gate and
      // up sums for a block of rows, (p1 - p0) panels wide.
      const int64_t ld = Gated ? (p1 - p0) * kNR : n;
      float* sums = Gated ? aligned(gated_sums, std::min(mc, m) * ld) : nullptr;
      for (int64_t r0 = first_row; r0 < last_row; r0 += mc) {
        const int64_t rows = std::min(mc, last_row - r0);
        if (xs) group_sums(x + r0 * x_stride, x_stride, rows, k, group, xs);
        for (int64_t depth = 0; depth < k; depth += slice) {
          const int64_t kc = std::min(slice, k - depth);
          // One row is its own panel: read it in place.
          const float* panels_of_x = rows == 1 ? x + r0 * x_stride + depth : a;
          if (rows > 1) pack_rows(x + r0 * x_stride, x_stride, rows, depth, kc, a);
          // While the micro-kernel walks the rows down one weight panel (from L1 after its
          // first call), the next panel's slice is pulled in; otherwise every panel's first
          // call waits on memory. With up to kFetchCalls calls per panel the first call does
          // it, a line per 64 bytes (against bursts before each call: 8 rows +35%, 16 rows
          // +20%); with more, each call issues its share of the lines up front (3-6% faster
          // at 64 rows than the first way). With one call per panel (2-6 rows) the first
          // call does it too: with only the hardware's prefetch of that one stream, the
          // `small` model's linears at 4 rows took as long in int8 as in fp32, 3.3x what
          // this gives (8.5 ms against 2.6; bf16 11.0 against 4.0; fp32 at 6 rows 9.5
          // against 7.9); and so does one row, where micro has a path for it.
          const int64_t calls = (rows + kMR - 1) / kMR;
          const int64_t lines = (kc * kPerK<W> * static_cast<int64_t>(sizeof(W)) + 63) / 64;
          const int64_t panel_size = k * kPerK<W>;  // elements of one whole packed panel
          for (int64_t panel = p0; panel < p1; panel += span) {
            const int64_t count = std::min(span, p1 - panel);  // panels in this pass
            const int64_t ahead = std::min(span, p1 - panel - count);  // in the next one
            const int64_t share = calls > kFetchCalls || pairs ? -(-lines * ahead / calls) : 0;
            const W* b = packed + (panel * k + depth) * kPerK<W>;
            const int64_t col = panel / kStep * kNR, cols = std::min<int64_t>(kNR, n - col);
            const float* panel_bias = bias ? bias + panel * kNR : nullptr;
            const int64_t panel_groups = panel * groups_per_column * kNR;
            const float* panel_scale = kQuantized<W> ? scale + panel_groups : nullptr;
            const float* panel_zero = kGrouped<W> ? zero + panel_groups : nullptr;
            float* dst = Gated ? sums + (panel - p0) * kNR : out + r0 * n + col;
            const char* next = reinterpret_cast<const char*>(b + count * panel_size);
            const int64_t next_bytes = panel_size * static_cast<int64_t>(sizeof(W));
            if (widen_slices) {
              for (int64_t i = 0; i < count; ++i) {
                const int64_t at = i * groups_per_column * kNR;
                if constexpr (kGrouped<W>)
                  widen_panel(b + i * panel_size, kc, depth, panel_scale + at, panel_zero + at,
                              group, wide + i * kc * kNR);
                else
                  widen_panel(b + i * panel_size, kc, panel_scale + at, wide + i * kc * kNR);
              }
            }
            for (int64_t r = 0; r < rows; r += kMR) {
              if (share) {
                const int64_t line = r / kMR * share;
                const int64_t last = std::min(lines * ahead, line + share);
                for (int64_t l = line; l < last; ++l)
                  __builtin_prefetch(next + l / lines * next_bytes + 64 * (l % lines), 0, 3);
              }
              const bool fetch = ahead && r == 0 && !share && kc == k;
              const int width = static_cast<int>(std::min<int64_t>(kMR, rows - r));
              float* block = dst + r * ld;
#if defined(__AVX512F__)
              if (count == 2) {  // fp32 panels, or quantized ones widened (see pairs)
                const float* both = widen_slices ? wide : reinterpret_cast<const float*>(b);
                const int64_t cols2 = std::min<int64_t>(kNR, n - (panel + 1) / kStep * kNR);
                kMicroPair[width](panels_of_x + r * kc, both,
                                  widen_slices ? kc * kNR : panel_size, kc, block, ld,
                                  depth == 0, panel_bias, cols, cols2);
                continue;
              }
#endif
              if (widen_slices) {
                kMicro<float>[0][width](panels_of_x + r * kc, wide, kc, block, ld, depth == 0,
                                        panel_bias, nullptr, cols);
              } else if constexpr (kGrouped<W>) {  // all of K
                if (width == 1)
                  micro_int4_row(panels_of_x + r * kc, b, kc, block, true, panel_bias,
                                 panel_scale, panel_zero, group, cols);
                else
                  kMicroInt4[fetch][width](panels_of_x + r * kc, b, kc, block, ld, panel_bias,
                                           panel_scale, panel_zero, group,
                                           xs + r * groups_per_column, groups_per_column, cols);
              } else {
                kMicro<W>[fetch][width](panels_of_x + r * kc, b, kc, block, ld, depth == 0,
                                        panel_bias, panel_scale, cols);
              }
            }
            const int64_t last = panel + count - 1;  // the gated sums are done at an up panel
            if (Gated && last % 2 == 1 && depth + kc == k) {
              float* up = dst + (count - 1) * kNR;
              const int64_t up_col = last / kStep * kNR;
              silu_mul_block(up - kNR, up, ld, rows, std::min<int64_t>(kNR, n - up_col),
                             out + r0 * n + up_col, n);
            }
          }
        }
      }
    }
  });
}

// packed (ceil(n / 16) panels of [k][16]) = weight (n, k), zero past row n.
template <typename T>
void pack_weight(const T* weight, int64_t n, int64_t k, T* packed) {
  const int64_t panels = (n + kNR - 1) / kNR;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      T* dst = packed + panel * k * kNR;
      for (int64_t j = 0; j < kNR; ++j) {
        const int64_t col = panel * kNR + j;
        for (int64_t d = 0; d < k; ++d) dst[d * kNR + j] = col < n ? weight[col * k + d] : T{};
      }
    }
  });
}

// The quantized weight formats, as lamina_packed_*_q take them.
enum Format : int { kInt8 = 1, kFp8 = 2, kInt4 = 3, kBf16 = 4 };

template <bool Gated>
void quantized_matmul(const float* x, int64_t x_stride, int64_t m, int64_t k,
                      const void* packed, int format, const float* scale, const float* zero,
                      int64_t group, int64_t n, const float* bias, float* out) {
  if (format == kInt8)
    packed_matmul<Gated>(x, x_stride, m, k, static_cast<const int8_t*>(packed), scale, nullptr,
                         k, n, bias, out);
  else if (format == kFp8)
    packed_matmul<Gated>(x, x_stride, m, k, static_cast<const Fp8*>(packed), scale, nullptr, k,
                         n, bias, out);
  else if (format == kBf16)
    packed_matmul<Gated>(x, x_stride, m, k, static_cast<const Bf16*>(packed), scale, nullptr,
                         k, n, bias, out);
  else
    packed_matmul<Gated>(x, x_stride, m, k, static_cast<const Int4*>(packed), scale, zero,
                         group, n, bias, out);
}

}  // namespace

extern "C" void lamina_pack_weight(const float* weight, int64_t n, int64_t k, float* packed) {
  pack_weight(weight, n, k, packed);
}

// The same packing for a weight of one-byte elements (int8, fp8).
extern "C" void lamina_pack_weight_bytes(const uint8_t* weight, int64_t n, int64_t k,
                                         uint8_t* packed) {
  pack_weight(weight, n, k, packed);
}

// And for a weight of two-byte elements (bf16).
extern "C" void lamina_pack_weight_halves(const uint16_t* weight, int64_t n, int64_t k,
                                          uint16_t* packed) {
  pack_weight(weight, n, k, packed);
}

extern "C" void lamina_packed_linear(const float* x, int64_t x_stride, int64_t m, int64_t k,
                                     const float* packed, int64_t n, const float* bias,
                                     float* out) {
  packed_matmul<false>(x, x_stride, m, k, packed, nullptr, nullptr, k, n, bias, out);
}

// out (m, n) = silu(x @ gate^T + gate_bias) * (x @ up^T + up_bias), on a weight packed by
// lamina_pack_weight from 2 * ceil(n / 16) * 16 rows that alternate 16 of gate's (zero past
// n) and the same 16 of up's; bias (same order, same length) or NULL.
extern "C" void lamina_packed_silu_mul(const float* x, int64_t x_stride, int64_t m, int64_t k,
                                       const float* packed, int64_t n, const float* bias,
                                       float* out) {
  packed_matmul<true>(x, x_stride, m, k, packed, nullptr, nullptr, k, n, bias, out);
}

// An int4 weight (n, k) of codes 0-15, one per byte, packed into panels of 8 bytes per
// k-row (see Int4); zero past row n.
extern "C" void lamina_pack_weight_int4(const uint8_t* codes, int64_t n, int64_t k,
                                        uint8_t* packed) {
  const int64_t panels = (n + kNR - 1) / kNR;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel) {
      uint8_t* dst = packed + panel * k * (kNR / 2);
      for (int64_t d = 0; d < k; ++d)
        for (int64_t j = 0; j < kNR / 2; ++j) {
          const int64_t low = panel * kNR + j, high = low + kNR / 2;
          const uint8_t a = low < n ? codes[low * k + d] & 0xF : 0;
          const uint8_t b = high < n ? codes[high * k + d] & 0xF : 0;
          dst[d * (kNR / 2) + j] = static_cast<uint8_t>(a | (b << 4));
        }
    }
  });
}

// lamina_packed_linear and lamina_packed_silu_mul on a quantized weight: format 1 int8 and
// 2 fp8 e4m3 (packed by lamina_pack_weight_bytes; scale, one per packed row, in panel
// order as the bias), 3 int4 (packed by lamina_pack_weight_int4; scale and zero, one per
// packed row and group of `group` along K, [panel][group][16]; zero is read only for
// int4), 4 bf16 (packed by lamina_pack_weight_halves; scale as int8's, all ones).
extern "C" void lamina_packed_linear_q(const float* x, int64_t x_stride, int64_t m, int64_t k,
                                       const void* packed, int format, const float* scale,
                                       const float* zero, int64_t group, int64_t n,
                                       const float* bias, float* out) {
  quantized_matmul<false>(x, x_stride, m, k, packed, format, scale, zero, group, n, bias, out);
}

extern "C" void lamina_packed_silu_mul_q(const float* x, int64_t x_stride, int64_t m,
                                         int64_t k, const void* packed, int format,
                                         const float* scale, const float* zero, int64_t group,
                                         int64_t n, const float* bias, float* out) {
  quantized_matmul<true>(x, x_stride, m, k, packed, format, scale, zero, group, n, bias, out);
}
