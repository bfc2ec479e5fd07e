// out = x @ weight^T (+ bias) for bf16 x, weight and out, the sums in fp32: a bf16 model's
// linears on a CPU that multiplies bf16 pairs in hardware (AVX-512 BF16, and AMX where
// there is one), on one weight layout for every batch size.
//
// The weight (N x K) is packed pair-interleaved (lamina_pack_weight_pairs): per panel of 16
// output columns, per block of 32 k, a 1 KB block of 16 rows, row j holding the 16
// columns' weights at k = 2j and 2j + 1, side by side (column c's pair at 2c, 2c + 1).
// That block is AMX's B tile as it is, and its rows are what vdpbf16ps multiplies a
// broadcast pair of x by. N is padded to whole pairs of panels (32 columns) and K to whole
// blocks, with zeros.
//
// From 8 rows on, with AMX: 32 x 32 blocks of the output (two row tiles of 16 by two
// panels) in four accumulator tiles; per k block, two tiles of x (16 rows x 32 k each,
// straight from x where the block has 32 rows and K whole blocks, else from a zero-padded
// copy: from 8 to 31 rows the weights' bytes bound a step, not the tiles' arithmetic)
// and two weight blocks, four tile products; the panel pairs run in groups that fit L2,
// every row block over a group before the next; a gated block's activation runs on the
// vector units during the next block's tile products, and with one block of rows the next
// pair's weights are fetched into L2 meanwhile. Below 8 rows, or without AMX: up to 8
// rows against two panels in sixteen 512-bit accumulators, each weight row loaded once
// for all of them, the next two panels prefetched meanwhile (memory-bound there: more
// streams in flight, 1.15-1.5x at 1-6 rows). The sums are rounded to bf16 once, after
// the bias is added in fp32.
//
// Gated (the MLP's gate and up projections in one weight): the panels alternate 16 of
// gate's columns and the same 16 of up's, so each panel pair's sums are both halves of
// silu(gate) * up for 16 outputs, which are written instead of the sums (rounded as the
// matmul's output and then silu_and_mul's would be), and the (m, 2I) intermediate is never
// made.

#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "caches.h"
#include "vec.h"

using lamina::Bf16;

namespace {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kDepth = 32;  // k per packed block (16 pairs)
constexpr int64_t kBlock = kPanel * kDepth;  // elements per packed block (1 KB)
constexpr int kRows = 8;  // rows per pass of the vdpbf16ps path

int64_t blocks_of(int64_t k) { return (k + kDepth - 1) / kDepth; }
int64_t panels_of(int64_t n) { return (n + 2 * kPanel - 1) / (2 * kPanel) * 2; }

// Where the pair holding (column c, depth kk) sits in its panel (a panel is blocks of
// kBlock, row kk / 2 of a block holds the 16 columns' pairs).
inline int64_t pair_at(int64_t c, int64_t kk) {
  return (kk / kDepth) * kBlock + (kk % kDepth / 2) * 32 + (c % kPanel) * 2 + kk % 2;
}

// The finished sums of a block (rows x cols of out, row stride ldo) plus bias, rounded.
void write_sums(const float* sums, int64_t lds, int64_t rows, int64_t cols, const float* bias,
                Bf16* out, int64_t ldo) {
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++)
      out[i * ldo + j] = lamina::round_to<Bf16>(sums[i * lds + j] + (bias ? bias[j] : 0.0f));
}

// The same for a gated pair of panels: sums' columns [0, 16) are gate's, [16, 32) up's,
// for outputs [0, cols) of out: each sum with its bias rounded to bf16 (the matmul's
// output), then silu(gate) * up as silu_and_mul computes it on those.
void write_gated(const float* sums, int64_t lds, int64_t rows, int64_t cols, const float* bias,
                 Bf16* out, int64_t ldo) {
  Bf16 gate[kPanel], up[kPanel];
  int64_t i = 0;
#if LAMINA_AVX512
  if (cols == kPanel) {  // a whole panel: the same roundings, 16 lanes at a time
    using lamina::rounded16;
    const __m512 gate_bias = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    const __m512 up_bias = bias ? _mm512_loadu_ps(bias + kPanel) : _mm512_setzero_ps();
    for (; i < rows; i++) {
      const float* s = sums + i * lds;
      const __m512 g = rounded16(_mm512_add_ps(_mm512_loadu_ps(s), gate_bias));
      const __m512 u = rounded16(_mm512_add_ps(_mm512_loadu_ps(s + kPanel), up_bias));
      lamina::store16(out + i * ldo, _mm512_mul_ps(rounded16(lamina::silu16(g)), u));
    }
  }
#elif LAMINA_AVX2
  if (cols == kPanel) {  // a whole panel: the same roundings, 8 lanes at a time
    using lamina::rounded8;
    __m256 bias8[4];
    for (int h = 0; h < 4; h++)
      bias8[h] = bias ? _mm256_loadu_ps(bias + 8 * h) : _mm256_setzero_ps();
    for (; i < rows; i++) {
      const float* s = sums + i * lds;
      for (int h = 0; h < 2; h++) {
        const __m256 g = rounded8(_mm256_add_ps(_mm256_loadu_ps(s + 8 * h), bias8[h]));
        const __m256 u =
            rounded8(_mm256_add_ps(_mm256_loadu_ps(s + kPanel + 8 * h), bias8[2 + h]));
        lamina::store8(out + i * ldo + 8 * h, _mm256_mul_ps(rounded8(lamina::silu8(g)), u));
      }
    }
  }
#endif
  for (; i < rows; i++) {
    const float* s = sums + i * lds;
    for (int64_t j = 0; j < cols; j++) {
      gate[j] = lamina::round_to<Bf16>(s[j] + (bias ? bias[j] : 0.0f));
      up[j] = lamina::round_to<Bf16>(s[kPanel + j] + (bias ? bias[kPanel + j] : 0.0f));
    }
    lamina::silu_mul_row(gate, up, out + i * ldo, cols);
  }
}

#if defined(__x86_64__)
// Rows [0, M) of x against two panels, by vdpbf16ps, into sums (M rows of 32).
template <int M>
__attribute__((target("avx512f,avx512bf16")))
void pair_rows(const uint16_t* x, int64_t ldx, int64_t k, const uint16_t* panel0,
               const uint16_t* panel1, float* sums) {
  __m512 acc[M][2];
  for (int i = 0; i < M; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;  // whole pairs of x; an odd last k is taken below
  // The next pair of panels follows these two: fetch it as these are read, so the memory
  // has two panels' streams in flight, not one (past the weight's end: a no-op).
  const int64_t panel = panel1 - panel0;
  const char* next = reinterpret_cast<const char*>(panel1 + panel);
  for (int64_t j = 0; j < pairs; j++) {
    const int64_t at = pair_at(0, 2 * j);
    _mm_prefetch(next + 2 * at, _MM_HINT_T0);  // (each j reads one line of each panel)
    _mm_prefetch(next + 2 * (panel + at), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel0 + at);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel1 + at);
    for (int i = 0; i < M; i++) {
      uint32_t pair;
      std::memcpy(&pair, x + i * ldx + 2 * j, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xb);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xb);
    }
  }
  if (k % 2) {  // the last k alone: its pair's second weight is the packing's zero
    const int64_t j = pairs, at = pair_at(0, 2 * j);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel0 + at);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel1 + at);
    for (int i = 0; i < M; i++) {
      const uint32_t pair = x[i * ldx + 2 * j];
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], w0, xb);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], w1, xb);
    }
  }
  for (int i = 0; i < M; i++) {
    _mm512_storeu_ps(sums + i * 32, acc[i][0]);
    _mm512_storeu_ps(sums + i * 32 + 16, acc[i][1]);
  }
}

using PairRows = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, const uint16_t*,
                          float*);
constexpr PairRows kPairRows[kRows] = {pair_rows<1>, pair_rows<2>, pair_rows<3>, pair_rows<4>,
                                       pair_rows<5>, pair_rows<6>, pair_rows<7>, pair_rows<8>};

// A finished gated AMX block's sums, not yet written: the next block's tile loop writes
// them (rounded, activated, multiplied) a few rows after each k block's products, so the
// vector units do the activation's arithmetic while the tile unit multiplies. Written
// after the loop, with the tiles idle, it cost ~40% on top of the block's products. (A
// plain block's rounding deferred the same way made the plain matmul slower at 128-512
// rows, so those are written at once.)
struct Pending {
  const float* sums = nullptr;
  int64_t rows = 0, cols = 0;
  const float* bias = nullptr;
  Bf16* out = nullptr;
  int64_t ldo = 0;
  void run(int64_t from, int64_t to) const {
    to = std::min(to, rows);
    if (from < to) write_gated(sums + from * 32, 32, to - from, cols, bias, out + from * ldo, ldo);
  }
};

// 32 rows of x (row stride ldx, k padded to whole blocks) against panels p and p + 1, by
// AMX, into sums (32 x 32); with `ahead`, the two panels from there are fetched into L2
// meanwhile (past the weight's end: a no-op), and `pending` is written meanwhile.
__attribute__((target("amx-tile,amx-bf16")))
void tile_block(const uint16_t* x, int64_t ldx, int64_t blocks, const uint16_t* panel0,
                const uint16_t* panel1, float* sums, const uint16_t* ahead,
                const Pending& pending) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t step = (pending.rows + blocks - 1) / blocks;  // pending rows a block
  for (int64_t b = 0; b < blocks; b++) {
    if (ahead) {
      const char* next0 = reinterpret_cast<const char*>(ahead + b * kBlock);
      const char* next1 = next0 + 2 * blocks * kBlock;
      for (int line = 0; line < 2 * kBlock; line += 64) {
        _mm_prefetch(next0 + line, _MM_HINT_T1);
        _mm_prefetch(next1 + line, _MM_HINT_T1);
      }
    }
    _tile_loadd(4, x + b * kDepth, ldx * 2);
    _tile_loadd(5, x + 16 * ldx + b * kDepth, ldx * 2);
    _tile_loadd(6, panel0 + b * kBlock, 64);
    _tile_loadd(7, panel1 + b * kBlock, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    pending.run(b * step, (b + 1) * step);
  }
  _tile_stored(0, sums, 32 * 4);
  _tile_stored(1, sums + 16, 32 * 4);
  _tile_stored(2, sums + 16 * 32, 32 * 4);
  _tile_stored(3, sums + 16 * 32 + 16, 32 * 4);
}

#endif  // __x86_64__

}  // namespace

extern "C" {

// weight (n, k) bf16 into packed (panels_of(n) * blocks_of(k) * 512 bf16, zeroed by the
// caller).
void lamina_pack_weight_pairs(const uint16_t* weight, int64_t n, int64_t k, uint16_t* packed) {
  const int64_t blocks = blocks_of(k);
  for (int64_t c = 0; c < n; c++) {
    uint16_t* panel = packed + (c / kPanel) * blocks * kBlock;
    for (int64_t kk = 0; kk < k; kk++) panel[pair_at(c, kk)] = weight[c * k + kk];
  }
}

// out (m, n) = x (m, k; row stride ldx) @ weight^T (+ bias, fp32 or NULL), all bf16 but the
// bias. tiles: use AMX from 8 rows on (the caller checked the CPU has it; AVX-512 BF16 is
// needed either way). gated: the weight's panels alternate gate's and up's (and the bias
// likewise, 32 a pair), and out (m, n) is silu(gate) * up.
void lamina_bf16_linear(const uint16_t* x, int64_t ldx, int64_t m, int64_t k,
                        const uint16_t* packed, int64_t n, const float* bias, uint16_t* out,
                        int tiles, int gated) {
  const int64_t outs = gated ? kPanel : 2 * kPanel;  // outputs a panel pair writes
#if !defined(__x86_64__)
  // Python runs this kernel only where the CPU has AVX-512 BF16; elsewhere it is this
  // plain loop, correct and slow, over the same packed layout.
  const int64_t blocks = blocks_of(k), pairs = (n + outs - 1) / outs;
  Bf16* y = reinterpret_cast<Bf16*>(out);
  float sums[2 * kPanel];
  for (int64_t i = 0; i < m; i++)
    for (int64_t p = 0; p < pairs; p++) {
      for (int64_t c = 0; c < 2 * kPanel; c++) {
        const uint16_t* panel = packed + (2 * p + c / kPanel) * blocks * kBlock;
        float sum = 0.0f;
        for (int64_t kk = 0; kk < k; kk++)
          sum += lamina::load(Bf16{x[i * ldx + kk]}) * lamina::load(Bf16{panel[pair_at(c, kk)]});
        sums[c] = sum;
      }
      const int64_t cols = std::min(outs, n - p * outs);
      const float* b = bias ? bias + 2 * p * kPanel : nullptr;
      (gated ? write_gated : write_sums)(sums, 0, 1, cols, b, y + i * n + p * outs, 0);
    }
  (void)tiles;
#else
  const int64_t blocks = blocks_of(k), pairs = (n + outs - 1) / outs;
  const bool amx = tiles && m >= kRows && lamina::tiles_permitted();
  const int64_t row_blocks = amx ? (m + 31) / 32 : 1;
  Bf16* y = reinterpret_cast<Bf16*>(out);
  // The tiles read whole blocks of 32 rows and 32 k: rows from `copied` on (the last
  // partial block; every row where K has a partial block) are read from one zero-padded
  // copy, made here once for every panel.
  const int64_t copied = k % kDepth ? 0 : m / 32 * 32, lda = blocks * kDepth;
  std::vector<uint16_t> padded;
  if (amx && copied < m) {
    padded.assign((row_blocks * 32 - copied) * lda, 0);
    for (int64_t i = copied; i < m; i++)
      std::memcpy(padded.data() + (i - copied) * lda, x + i * ldx, k * 2);
  }
  // Items run group by group (panel pairs whose weights fill half of a core's L2), within
  // a group row block by row block, each against every pair of the group: the weights are
  // read from memory once a call and x once a group (at 1,384 rows, gate/up's 4 MB and
  // x's 1.4 MB four times), where groups of row blocks (128 KB of x, each pair over a
  // group's rows) read all the weights once a group: 44 MB for gate/up, 86 MB for down's
  // 2 MB at K = 2,048. A layer's linears took 11-18% longer that way at 40-1,384 rows.
  const int64_t group = std::max<int64_t>(1, lamina::l2_bytes() / 2 / (4 * blocks * kBlock));
  at::parallel_for(0, pairs * row_blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float sums[2][32 * 32];  // this block's, and a gated last one's until written
    Pending pending;
    if (amx) lamina::load_tiles(&lamina::kFullTiles);  // tiles 0-7 of 16 x 64 bytes
    for (int64_t item = begin; item < end; item++) {
      const int64_t first = item / (group * row_blocks) * group;
      const int64_t size = std::min(group, pairs - first), at = item - first * row_blocks;
      const int64_t p = first + at % size, r = at / size * 32;
      const uint16_t* panel0 = packed + 2 * p * blocks * kBlock;
      const uint16_t* panel1 = panel0 + blocks * kBlock;
      const int64_t cols = std::min(outs, n - p * outs);
      const float* b = bias ? bias + 2 * p * kPanel : nullptr;
      Bf16* const at_p = y + p * outs;
      const auto write = gated ? write_gated : write_sums;
      if (amx) {
        const int64_t rows = std::min<int64_t>(32, m - r);
        // With one row block (decoding), the next item's weights (the next pair) are
        // fetched into L2 while this pair's are multiplied: left to the hardware, the
        // weights' tile loads wait on L3. (With more row blocks the weights are reused
        // from L2, and the same fetch slowed 128 rows.)
        const uint16_t* ahead = row_blocks == 1 ? panel1 + blocks * kBlock : nullptr;
        const uint16_t* rows_x = r < copied ? x + r * ldx : padded.data() + (r - copied) * lda;
        float* block = sums[item % 2];
        tile_block(rows_x, r < copied ? ldx : lda, blocks, panel0, panel1, block, ahead, pending);
        if (gated)
          pending = Pending{block, rows, cols, b, at_p + r * n, n};
        else
          write_sums(block, 32, rows, cols, b, at_p + r * n, n);
      } else {
        for (int64_t r0 = 0; r0 < m; r0 += kRows) {
          const int64_t rows = std::min<int64_t>(kRows, m - r0);
          kPairRows[rows - 1](x + r0 * ldx, ldx, k, panel0, panel1, sums[0]);
          write(sums[0], 32, rows, cols, b, at_p + r0 * n, n);
        }
      }
    }
    if (amx) {
      pending.run(0, pending.rows);  // the thread's last gated block
      lamina::release_tiles();
    }
  });
#endif
}

}  // extern "C"
