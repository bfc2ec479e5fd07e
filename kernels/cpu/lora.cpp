// The batched LoRA product on fp32 rows for the CPU backend (Punica's BGMV): each row t
// whose slot s = slots[t] is not -1 gets out[t] += B_s (A_s x[t]), with A_s the rows
// [s W, (s + 1) W) of a (S W x K) and B_s^T the rows [s W, (s + 1) W) of b (S W x N):
// kernels/lora.py's layout. One call per fused linear however many adapters the step
// mixes, each row multiplied by its own slot only, where the torch forms take three calls
// and multiply every row by every slot up to the highest used.
//
// The rows are grouped by slot into tiles of up to kTile rows, so that each weight value
// read serves a whole tile from registers. Two passes: the shrink (v[t] = A_s x[t], a dot
// product of length K per row and w, split over (tile, w) pairs) into scratch, then the
// expand (out[t] += sum over w of v[t, w] B_s^T[w], along contiguous outputs, split over
// blocks of them).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kTile = 4;
constexpr int64_t kOutputs = 256;  // outputs per expand task (a tile's rows stay in L1)

struct Tile {
  int64_t slot, count, rows[kTile];
};

// sums[r] = w . u[rows[r]] over n values for each of the tile's rows (u's row stride
// u_stride); a short tile repeats its last row, whose sums are dropped.
inline void tile_dots(const float* w, const float* u, int64_t u_stride, const Tile& tile,
                      int64_t n, float* sums) {
  if (tile.count == 1) {
    const float* u0 = u + tile.rows[0] * u_stride;
    float s0 = 0.0f;
#pragma omp simd reduction(+ : s0)
    for (int64_t i = 0; i < n; ++i) s0 += w[i] * u0[i];
    sums[0] = s0;
    return;
  }
  const float* u0 = u + tile.rows[0] * u_stride;
  const float* u1 = u + tile.rows[1] * u_stride;
  const float* u2 = u + tile.rows[std::min<int64_t>(2, tile.count - 1)] * u_stride;
  const float* u3 = u + tile.rows[std::min<int64_t>(3, tile.count - 1)] * u_stride;
  float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < n; ++i) {
    const float v = w[i];
    s0 += v * u0[i];
    s1 += v * u1[i];
    s2 += v * u2[i];
    s3 += v * u3[i];
  }
  sums[0] = s0, sums[1] = s1, sums[2] = s2, sums[3] = s3;
}

// out[rows[r], j] += sum over w of v[rows[r], w] * bt[w, j] for j in [begin, end), for
// a tile's R rows: per chunk of kChunk outputs, the sums stay in registers over every w,
// so each value of bt is read once per tile and each output written once.
constexpr int64_t kChunk = 16;

template <int64_t R>
void expand_rows(const float* bt, int64_t n, const float* v, int64_t width, const Tile& tile,
                 float* out, int64_t out_stride, int64_t begin, int64_t end) {
  const float* vs[R];
  for (int64_t r = 0; r < R; ++r) vs[r] = v + tile.rows[r] * width;
  int64_t j0 = begin;
  for (; j0 + kChunk <= end; j0 += kChunk) {
    float acc[R][kChunk] = {};
    for (int64_t w = 0; w < width; ++w) {
      const float* row = bt + w * n + j0;
      for (int64_t r = 0; r < R; ++r) {
        const float c = vs[r][w];
#pragma omp simd
        for (int64_t j = 0; j < kChunk; ++j) acc[r][j] += c * row[j];
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      float* o = out + tile.rows[r] * out_stride + j0;
#pragma omp simd
      for (int64_t j = 0; j < kChunk; ++j) o[j] += acc[r][j];
    }
  }
  for (int64_t j = j0; j < end; ++j)  // the last chunk's rest
    for (int64_t r = 0; r < R; ++r) {
      float sum = 0.0f;
      for (int64_t w = 0; w < width; ++w) sum += vs[r][w] * bt[w * n + j];
      out[tile.rows[r] * out_stride + j] += sum;
    }
}

inline void tile_expand(const float* bt, int64_t n, const float* v, int64_t width,
                        const Tile& tile, float* out, int64_t out_stride, int64_t begin,
                        int64_t end) {
  switch (tile.count) {
    case 1: return expand_rows<1>(bt, n, v, width, tile, out, out_stride, begin, end);
    case 2: return expand_rows<2>(bt, n, v, width, tile, out, out_stride, begin, end);
    case 3: return expand_rows<3>(bt, n, v, width, tile, out, out_stride, begin, end);
    default: return expand_rows<4>(bt, n, v, width, tile, out, out_stride, begin, end);
  }
}

}  // namespace

extern "C" void lamina_lora_bgmv(float* out, int64_t out_stride, const float* x,
                                 int64_t x_stride, int64_t rows, int64_t k, const float* a,
                                 const float* b, int64_t n, int64_t width,
                                 const int64_t* slots) {
  std::vector<int64_t> order;
  for (int64_t t = 0; t < rows; ++t)
    if (slots[t] >= 0) order.push_back(t);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t l, int64_t r) { return slots[l] < slots[r]; });
  std::vector<Tile> tiles;
  for (size_t i = 0; i < order.size();) {
    Tile tile{slots[order[i]], 0, {}};
    while (i < order.size() && tile.count < kTile && slots[order[i]] == tile.slot)
      tile.rows[tile.count++] = order[i++];
    tiles.push_back(tile);
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size());
  std::vector<float> shrunk(static_cast<size_t>(rows * width));  // v, by row
  at::parallel_for(0, num_tiles * width, std::max<int64_t>(1, 8192 / std::max<int64_t>(k, 1)),
                   [&](int64_t begin, int64_t end) {
                     float sums[kTile];
                     for (int64_t p = begin; p < end; ++p) {
                       const Tile& tile = tiles[p / width];
                       const int64_t w = p % width;
                       tile_dots(a + (tile.slot * width + w) * k, x, x_stride, tile, k, sums);
                       for (int64_t r = 0; r < tile.count; ++r)
                         shrunk[tile.rows[r] * width + w] = sums[r];
                     }
                   });
  // Blocks of at most kOutputs outputs (whole chunks), as many as a multiple of the
  // threads where there are that many, so that no thread takes one block more than another.
  const int64_t threads = at::get_num_threads();
  int64_t blocks = (n + kOutputs - 1) / kOutputs;
  if (blocks >= threads) blocks = (blocks + threads - 1) / threads * threads;
  const int64_t span = ((n + blocks - 1) / blocks + kChunk - 1) / kChunk * kChunk;
  blocks = (n + span - 1) / span;
  const int64_t work = std::max<int64_t>(1, static_cast<int64_t>(order.size()) * width * span);
  at::parallel_for(0, blocks, std::max<int64_t>(1, 32768 / work), [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first = block * span, last = std::min(n, first + span);
      for (const Tile& tile : tiles)
        tile_expand(b + tile.slot * width * n, n, shrunk.data(), width, tile, out, out_stride,
                    first, last);
    }
  });
}
