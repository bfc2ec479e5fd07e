// A decode step's forward pass in one native call, for the CPU backend: from the token ids
// to the logits, the same kernels the Python forward calls one by one (the embedding and
// rotary lookups, RMSNorm, the packed matmuls, rotary, the paged decode attention, the
// final norm and the LM head), run back to back on buffers the caller allocated for the
// step. At batch 1 a step's arithmetic is small, and the Python between the kernels (a
// dozen calls per layer, each with its checks, its output allocation and its ctypes
// crossing) cost about as much as the matmuls of an int8 model; here it is gone, and so is
// what the Python around the layers cost (the lookups, the attention metadata, the final
// norm and the head: a tenth of an fp32 step of the 'small' model).
//
// Per layer (the Python forward's order and arithmetic):
//   x, residual = rms_norm(hidden [+ residual])      (layer 0: residual = hidden)
//   qkv = x @ Wqkv^T (+ b);  per-head RMSNorm of q and k (Qwen3);  rotary on q and k
//   the new k and v written to the fp32 paged cache at each sequence's slot
//   attn = paged decode attention of q over the cache
//   x, residual = rms_norm(attn @ Wo^T (+ b) + residual)
//   hidden = silu(x @ Wgate^T) * (x @ Wup^T) @ Wdown^T (+ biases)
// then logits = rms_norm(hidden + residual) @ Whead^T.
//
// Layers come as rows of int64 fields (pointers and sizes), built once at load by
// kernels/cpu/decode.py, which names each field.
//
// With LoRA adapters (a row of LoraLinear fields per layer, and each sequence's slot),
// each fused linear an adapter touches adds its product (lora.cpp's BGMV) to its output,
// where the Python forward adds it: Q/K/V before the head norms and rotary, O before the
// post-attention norm, down into the hidden state, and gate/up before its activation, so
// that one runs the plain matmul on the gated weight (its interleaved panels) and the
// activation after the product is added.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec.h"

extern "C" {
// (elementwise.cpp's; dtype 0: fp32)
void lamina_rms_norm(const void* x, int64_t x_stride, const void* residual,
                     int64_t residual_stride, const void* weight, float eps, int64_t rows,
                     int64_t dim, void* out, void* residual_out, int dtype);
void lamina_rotary(const void* x, int64_t x_stride, const void* cos, const void* sin,
                   int64_t tokens, int64_t heads, int64_t dim, void* out, int dtype);
void lamina_packed_linear(const float* x, int64_t x_stride, int64_t m, int64_t k,
                          const float* packed, int64_t n, const float* bias, float* out);
void lamina_packed_silu_mul(const float* x, int64_t x_stride, int64_t m, int64_t k,
                            const float* packed, int64_t n, const float* bias, float* out);
void lamina_packed_linear_q(const float* x, int64_t x_stride, int64_t m, int64_t k,
                            const void* packed, int format, const float* scale,
                            const float* zero, int64_t group, int64_t n, const float* bias,
                            float* out);
void lamina_packed_silu_mul_q(const float* x, int64_t x_stride, int64_t m, int64_t k,
                              const void* packed, int format, const float* scale,
                              const float* zero, int64_t group, int64_t n, const float* bias,
                              float* out);
void lamina_lora_bgmv(float* out, int64_t out_stride, const float* x, int64_t x_stride,
                      int64_t rows, int64_t k, const float* a, const float* b, int64_t n,
                      int64_t width, const int64_t* slots);
int lamina_paged_decode_attention(const float* q, int64_t q_stride, const void* cache,
                                  int cache_kind, const float* scales, const int64_t* tables,
                                  int64_t table_stride, const int64_t* contexts,
                                  int64_t num_seqs, int64_t num_blocks, int64_t block_size,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  float sm_scale, float* out);
}

namespace {

constexpr int kFp32 = 0;  // the elementwise kernels' dtype argument

// A packed linear as decode.py lays it out: format (0 fp32, else gemm.cpp's Format),
// packed weight, scales (quantized) or 0, zero points (int4) or 0, the group size along K,
// bias or 0, outputs, inputs, and the order its inputs are stored in (act-order GPTQ: the
// weight's input j is x's input order[j]) or 0.
struct Linear {
  int64_t format;
  const void* packed;
  const float* scale;
  const float* zero;
  int64_t group;
  const float* bias;
  int64_t n, k;
  const int64_t* order;
};
static_assert(sizeof(Linear) == 9 * sizeof(int64_t));
constexpr int64_t kLayerFields = 40;  // decode.py's LAYER_FIELDS

struct Layer {
  const float* input_norm;
  Linear qkv;
  const float* qk_norm;  // (Hq + Hkv, D), or null
  Linear o;
  const float* post_norm;
  Linear gate_up;  // gated: n is the intermediate size
  Linear down;
  float* kv_cache;  // (2, num_blocks, block_size, Hkv, D) fp32
};
static_assert(sizeof(Layer) == kLayerFields * sizeof(int64_t));

// One fused linear's adapter slots as decode.py lays them out (lora.py's LoraSlots): the
// slots' stacked A (S W x K), their B transposed (S W x N), and W; a null a: no adapter
// touches this linear.
struct LoraLinear {
  const float* a;
  const float* b;
  int64_t width;
};
constexpr int64_t kLoraFields = 12;  // decode.py's LORA_FIELDS

struct LayerLora {
  LoraLinear qkv, o, gate_up, down;
};
static_assert(sizeof(LayerLora) == kLoraFields * sizeof(int64_t));

constexpr int64_t kPanel = 16;  // output columns per panel of a packed weight (linear.py)

// The model's shapes, as decode.py passes them.
struct Dims {
  int64_t hidden, num_heads, num_kv_heads, head_dim, intermediate, num_blocks, block_size,
      vocab, max_positions;
};

thread_local std::vector<float> gathered;  // x in a linear's stored input order

void linear(const Linear& l, const float* x, int64_t rows, float* out, bool gated) {
  if (l.order) {
    if (static_cast<int64_t>(gathered.size()) < rows * l.k) gathered.resize(rows * l.k);
    float* to = gathered.data();  // a thread-local read once: each access is a call
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < l.k; ++j) to[r * l.k + j] = x[r * l.k + l.order[j]];
    x = to;
  }
  if (l.format == 0) {
    (gated ? lamina_packed_silu_mul : lamina_packed_linear)(
        x, l.k, rows, l.k, static_cast<const float*>(l.packed), l.n, l.bias, out);
  } else {
    (gated ? lamina_packed_silu_mul_q : lamina_packed_linear_q)(x, l.k, rows, l.k, l.packed,
                                                                static_cast<int>(l.format),
                                                                l.scale, l.zero, l.group, l.n,
                                                                l.bias, out);
  }
}

// out (rows x n, row stride out_stride) plus each row's adapter product of x (rows x k).
void add_lora(const LoraLinear& l, const float* x, int64_t k, int64_t rows, float* out,
              int64_t out_stride, int64_t n, const int64_t* slots) {
  if (l.a) lamina_lora_bgmv(out, out_stride, x, k, rows, k, l.a, l.b, n, l.width, slots);
}

thread_local std::vector<float> pre_activation, lora_delta;

// The gated MLP projection with an adapter's product: silu(gate) * up over the plain
// matmul of the gated weight (per panel of kPanel outputs its gate columns, then its up
// columns) plus the product, which comes as [gate | up], added panel by panel in place.
void gated_with_lora(const Linear& l, const LoraLinear& lora, const float* x, int64_t rows,
                     float* out, const int64_t* slots) {
  const int64_t half = l.n, width = 2 * ((half + kPanel - 1) / kPanel) * kPanel;
  Linear plain = l;
  plain.n = width;
  pre_activation.resize(rows * width);
  lora_delta.assign(rows * 2 * half, 0.0f);
  float* pre = pre_activation.data();  // thread-locals read once: each access is a call
  float* delta = lora_delta.data();
  linear(plain, x, rows, pre, false);
  add_lora(lora, x, l.k, rows, delta, 2 * half, 2 * half, slots);
  for (int64_t r = 0; r < rows; ++r) {
    const float* d = delta + r * 2 * half;
    for (int64_t j0 = 0; j0 < half; j0 += kPanel) {
      float* gate = pre + r * width + 2 * j0;
      float* up = gate + kPanel;
      const int64_t count = std::min(kPanel, half - j0);
      for (int64_t i = 0; i < count; ++i) {
        gate[i] += d[j0 + i];
        up[i] += d[half + j0 + i];
      }
      lamina::silu_mul_row(gate, up, out + r * half + j0, count);
    }
  }
}

// Each row of D values of x (rows of `heads` heads, row stride `stride`) normalised and
// scaled by its head's weight row, in place: Qwen3's q_norm / k_norm.
void head_norm(float* x, int64_t stride, int64_t rows, int64_t heads, int64_t dim,
               const float* weight, float eps) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + r * stride + h * dim;
      float squares = 0.0f;
      for (int64_t i = 0; i < dim; ++i) squares += v[i] * v[i];
      const float inv = 1.0f / std::sqrt(squares / static_cast<float>(dim) + eps);
      for (int64_t i = 0; i < dim; ++i) v[i] = v[i] * inv * weight[h * dim + i];
    }
}

// The decoder layers on hidden (S, H), the step's embeddings, which end as the last
// layer's output, with the residual stream in residual (S, H).
int run_layers(const int64_t* layers, int64_t num_layers, const Dims& d, float eps,
               float sm_scale, int64_t seqs, float* hidden, float* residual, const float* cos,
               const float* sin, const int64_t* slots, const int64_t* tables,
               int64_t table_stride, const int64_t* contexts, const int64_t* lora,
               const int64_t* lora_slots, float* work) {
  const int64_t hq = d.num_heads, hkv = d.num_kv_heads, hd = d.head_dim;
  const int64_t q_size = hq * hd, kv_size = hkv * hd, qkv_width = q_size + 2 * kv_size;
  float* x = work;                                // (S, H)
  float* qkv = x + seqs * d.hidden;               // (S, q + 2 kv)
  float* rotated = qkv + seqs * qkv_width;        // (S, Hq + Hkv, D)
  float* attn = rotated + seqs * (hq + hkv) * hd;  // (S, Hq, D)
  float* o = attn + seqs * q_size;                // (S, H)
  float* mlp = o + seqs * d.hidden;               // (S, I)
  const int64_t token_kv = kv_size, cache_half = d.num_blocks * d.block_size * kv_size;
  for (int64_t n = 0; n < num_layers; ++n) {
    Layer layer;
    std::memcpy(&layer, layers + n * kLayerFields, sizeof(layer));
    LayerLora adapters{};
    if (lora) std::memcpy(&adapters, lora + n * kLoraFields, sizeof(adapters));
    if (n == 0) {
      lamina_rms_norm(hidden, d.hidden, nullptr, 0, layer.input_norm, eps, seqs, d.hidden, x,
                      nullptr, kFp32);
      std::memcpy(residual, hidden, sizeof(float) * seqs * d.hidden);
    } else {
      lamina_rms_norm(hidden, d.hidden, residual, d.hidden, layer.input_norm, eps, seqs,
                      d.hidden, x, residual, kFp32);
    }
    linear(layer.qkv, x, seqs, qkv, false);
    add_lora(adapters.qkv, x, d.hidden, seqs, qkv, qkv_width, qkv_width, lora_slots);
    if (layer.qk_norm) head_norm(qkv, qkv_width, seqs, hq + hkv, hd, layer.qk_norm, eps);
    lamina_rotary(qkv, qkv_width, cos, sin, seqs, hq + hkv, hd, rotated, kFp32);
    for (int64_t s = 0; s < seqs; ++s) {
      float* keys = layer.kv_cache + slots[s] * token_kv;
      std::memcpy(keys, rotated + (s * (hq + hkv) + hq) * hd, sizeof(float) * kv_size);
      std::memcpy(keys + cache_half, qkv + s * qkv_width + q_size + kv_size,
                  sizeof(float) * kv_size);
    }
    const int status = lamina_paged_decode_attention(
        rotated, (hq + hkv) * hd, layer.kv_cache, 0, nullptr, tables, table_stride, contexts,
        seqs, d.num_blocks, d.block_size, hq, hkv, hd, sm_scale, attn);
    if (status) return status;
    linear(layer.o, attn, seqs, o, false);
    add_lora(adapters.o, attn, q_size, seqs, o, d.hidden, d.hidden, lora_slots);
    lamina_rms_norm(o, d.hidden, residual, d.hidden, layer.post_norm, eps, seqs, d.hidden, x,
                    residual, kFp32);
    if (adapters.gate_up.a)
      gated_with_lora(layer.gate_up, adapters.gate_up, x, seqs, mlp, lora_slots);
    else
      linear(layer.gate_up, x, seqs, mlp, true);
    linear(layer.down, mlp, seqs, hidden, false);
    add_lora(adapters.down, mlp, d.intermediate, seqs, hidden, d.hidden, d.hidden, lora_slots);
  }
  return 0;
}

}  // namespace

// logits (S, V) for the S sequences' next tokens: ids (S,) their last tokens, positions
// (S,) those tokens' positions; embed (V, H), cos and sin (max_positions, D/2) the rotary
// tables, final_norm (H,), head the LM head as one row of Linear fields (or NULL: logits
// then receives the final norm's output, (S, H), for the caller's head). slots (S,) flat
// cache slots of the new tokens; tables (S, table_stride) block ids; contexts (S,) cached
// tokens before each new one. lora: per layer a row of LoraLinear fields (qkv, o, gate_up,
// down), and lora_slots (S,) each sequence's adapter slot (-1: none); or both NULL.
// work: at least S * (5 H + D + 3 Hq*D + 3 Hkv*D + I) floats.
// Returns 0; the attention kernel's error (1: the query heads do not share the KV heads
// evenly); or 3 for a token id or a position outside the tables (nothing is read then).
extern "C" int lamina_decode_logits(const int64_t* layers, int64_t num_layers,
                                    const int64_t* dims, float eps, float sm_scale, int64_t seqs,
                                    const int64_t* ids, const int64_t* positions,
                                    const float* embed, const float* cos_table,
                                    const float* sin_table, const float* final_norm,
                                    const int64_t* head, const int64_t* slots,
                                    const int64_t* tables, int64_t table_stride,
                                    const int64_t* contexts, const int64_t* lora,
                                    const int64_t* lora_slots, float* work, float* logits) {
  Dims d;
  std::memcpy(&d, dims, sizeof(d));
  const int64_t half = d.head_dim / 2;
  float* hidden = work;                      // (S, H)
  float* residual = hidden + seqs * d.hidden;  // (S, H)
  float* cos = residual + seqs * d.hidden;   // (S, D/2)
  float* sin = cos + seqs * half;            // (S, D/2)
  float* normed = sin + seqs * half;         // (S, H)
  float* layer_work = normed + seqs * d.hidden;
  for (int64_t s = 0; s < seqs; ++s) {
    if (ids[s] < 0 || ids[s] >= d.vocab || positions[s] < 0 || positions[s] >= d.max_positions)
      return 3;
    std::memcpy(hidden + s * d.hidden, embed + ids[s] * d.hidden, sizeof(float) * d.hidden);
    std::memcpy(cos + s * half, cos_table + positions[s] * half, sizeof(float) * half);
    std::memcpy(sin + s * half, sin_table + positions[s] * half, sizeof(float) * half);
  }
  const int status = run_layers(layers, num_layers, d, eps, sm_scale, seqs, hidden, residual, cos,
                                sin, slots, tables, table_stride, contexts, lora, lora_slots,
                                layer_work);
  if (status) return status;
  lamina_rms_norm(hidden, d.hidden, residual, d.hidden, final_norm, eps, seqs, d.hidden,
                  head ? normed : logits, residual, kFp32);
  if (head) {
    Linear lm_head;
    std::memcpy(&lm_head, head, sizeof(lm_head));
    linear(lm_head, normed, seqs, logits, false);
  }
  return 0;
}
