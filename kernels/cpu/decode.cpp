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
// In fp32 or bf16 (the model's dtype): a bf16 model's step runs its linears (the gated one
// with its activation) on bf16_linear.cpp's matmul and its norms and rotary on
// elementwise.cpp's bf16 kernels, rounding where its Python forward's ops round (the
// attention takes the bf16 queries and rounds its output once, as attention.py's call
// does), so both compute the same logits. A bf16 step takes no adapters and no per-head
// norms (decode.py refuses them; the Python forward runs those).
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
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
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
void lamina_bf16_linear(const uint16_t* x, int64_t ldx, int64_t m, int64_t k,
                        const uint16_t* packed, int64_t n, const float* bias, uint16_t* out,
                        int tiles, int gated);
void lamina_lora_bgmv(float* out, int64_t out_stride, const float* x, int64_t x_stride,
                      int64_t rows, int64_t k, const float* a, const float* b, int64_t n,
                      int64_t width, const int64_t* slots);
int lamina_paged_decode_attention(const void* q, int64_t q_stride, const void* cache,
                                  int cache_kind, const float* scales, const int64_t* tables,
                                  int64_t table_stride, const int64_t* contexts,
                                  int64_t num_seqs, int64_t num_blocks, int64_t block_size,
                                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                  float sm_scale, void* out, int tiles, int q_bf16);
}

namespace {

using lamina::Bf16;

// The elementwise kernels' dtype argument, and the attention kernel's cache kind, for T.
template <typename T>
constexpr int kDtype = std::is_same_v<T, Bf16> ? 1 : 0;
template <typename T>
constexpr int kCacheKind = std::is_same_v<T, Bf16> ? 3 : 0;

constexpr int64_t kBf16Pairs = 16;  // a bf16 model's Linear format (bf16_linear.cpp's layout)

// A packed linear as decode.py lays it out: format (0 fp32, kBf16Pairs, else gemm.cpp's
// Format), packed weight, scales (quantized) or 0, zero points (int4) or 0, the group size
// along K (quantized; for kBf16Pairs whether AMX tiles may run), bias or 0, outputs,
// inputs, and the order its inputs are stored in (act-order GPTQ: the weight's input j is
// x's input order[j]) or 0.
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
  const void* input_norm;  // the norms in the model's dtype
  Linear qkv;
  const float* qk_norm;  // (Hq + Hkv, D), or null (fp32 only)
  Linear o;
  const void* post_norm;
  Linear gate_up;  // gated: n is the intermediate size
  Linear down;
  void* kv_cache;  // (2, num_blocks, block_size, Hkv, D) in the model's dtype
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

// A bf16 model's linear on bf16_linear.cpp's matmul (gated: its panels alternate gate's
// and up's, and n is the intermediate size).
void linear(const Linear& l, const Bf16* x, int64_t rows, Bf16* out, bool gated) {
  lamina_bf16_linear(reinterpret_cast<const uint16_t*>(x), l.k, rows, l.k,
                     static_cast<const uint16_t*>(l.packed), l.n, l.bias,
                     reinterpret_cast<uint16_t*>(out), static_cast<int>(l.group), gated);
}

// The step's work buffers in the model's dtype T, carved from one allocation.
template <typename T>
struct Work {
  static constexpr int kBuffers = 11;

  T* hidden;         // (S, H)
  T* residual;       // (S, H)
  T* cos;            // (S, D/2)
  T* sin;            // (S, D/2)
  T* normed;         // (S, H) the final norm's output
  T* x;              // (S, H)
  T* qkv;            // (S, Hq*D + 2 Hkv*D)
  T* rotated;        // (S, Hq + Hkv, D)
  T* attn;           // (S, Hq, D)
  T* o;              // (S, H)
  T* mlp;            // (S, I)

  // Per sequence: each buffer's elements, in order.
  static std::array<int64_t, kBuffers> sizes(const Dims& d) {
    const int64_t q = d.num_heads * d.head_dim, kv = d.num_kv_heads * d.head_dim;
    return {d.hidden, d.hidden, d.head_dim / 2, d.head_dim / 2, d.hidden,
            d.hidden, q + 2 * kv, q + kv, q, d.hidden, d.intermediate};
  }
  static int64_t bytes(int64_t seqs, const Dims& d) {
    int64_t elements = 0;
    for (const int64_t size : sizes(d)) elements += size;
    return seqs * elements * static_cast<int64_t>(sizeof(T));
  }

  Work(void* base, int64_t seqs, const Dims& d) {
    T* t = static_cast<T*>(base);
    T** regions[kBuffers] = {&hidden, &residual, &cos, &sin, &normed, &x,
                             &qkv,    &rotated,  &attn, &o,  &mlp};
    const auto each = sizes(d);
    for (int i = 0; i < kBuffers; ++i) {
      *regions[i] = t;
      t += seqs * each[i];
    }
  }
};

// The decoder layers on w.hidden (S, H), the step's embeddings, which end as the last
// layer's output, with the residual stream in w.residual (S, H).
template <typename T>
int run_layers(const int64_t* layers, int64_t num_layers, const Dims& d, float eps,
               float sm_scale, int64_t seqs, const Work<T>& w, const int64_t* slots,
               const int64_t* tables, int64_t table_stride, const int64_t* contexts,
               const int64_t* lora, const int64_t* lora_slots) {
  constexpr bool kHalf = std::is_same_v<T, Bf16>;
  constexpr int dtype = kDtype<T>;
  const int64_t hq = d.num_heads, hkv = d.num_kv_heads, hd = d.head_dim;
  const int64_t q_size = hq * hd, kv_size = hkv * hd, qkv_width = q_size + 2 * kv_size;
  const int64_t token_kv = kv_size, cache_half = d.num_blocks * d.block_size * kv_size;
  for (int64_t n = 0; n < num_layers; ++n) {
    Layer layer;
    std::memcpy(&layer, layers + n * kLayerFields, sizeof(layer));
    LayerLora adapters{};
    if (lora) std::memcpy(&adapters, lora + n * kLoraFields, sizeof(adapters));
    if (n == 0) {
      lamina_rms_norm(w.hidden, d.hidden, nullptr, 0, layer.input_norm, eps, seqs, d.hidden,
                      w.x, nullptr, dtype);
      std::memcpy(w.residual, w.hidden, sizeof(T) * seqs * d.hidden);
    } else {
      lamina_rms_norm(w.hidden, d.hidden, w.residual, d.hidden, layer.input_norm, eps, seqs,
                      d.hidden, w.x, w.residual, dtype);
    }
    linear(layer.qkv, w.x, seqs, w.qkv, false);
    if constexpr (!kHalf) {
      add_lora(adapters.qkv, w.x, d.hidden, seqs, w.qkv, qkv_width, qkv_width, lora_slots);
      if (layer.qk_norm) head_norm(w.qkv, qkv_width, seqs, hq + hkv, hd, layer.qk_norm, eps);
    }
    lamina_rotary(w.qkv, qkv_width, w.cos, w.sin, seqs, hq + hkv, hd, w.rotated, dtype);
    T* cache = static_cast<T*>(layer.kv_cache);
    for (int64_t s = 0; s < seqs; ++s) {
      T* keys = cache + slots[s] * token_kv;
      std::memcpy(keys, w.rotated + (s * (hq + hkv) + hq) * hd, sizeof(T) * kv_size);
      std::memcpy(keys + cache_half, w.qkv + s * qkv_width + q_size + kv_size,
                  sizeof(T) * kv_size);
    }
    const int status = lamina_paged_decode_attention(
        w.rotated, (hq + hkv) * hd, cache, kCacheKind<T>, nullptr, tables, table_stride,
        contexts, seqs, d.num_blocks, d.block_size, hq, hkv, hd, sm_scale, w.attn,
        kHalf ? static_cast<int>(layer.qkv.group) : 0, kHalf);
    if (status) return status;
    linear(layer.o, w.attn, seqs, w.o, false);
    if constexpr (!kHalf)
      add_lora(adapters.o, w.attn, q_size, seqs, w.o, d.hidden, d.hidden, lora_slots);
    lamina_rms_norm(w.o, d.hidden, w.residual, d.hidden, layer.post_norm, eps, seqs, d.hidden,
                    w.x, w.residual, dtype);
    if constexpr (!kHalf) {
      if (adapters.gate_up.a)
        gated_with_lora(layer.gate_up, adapters.gate_up, w.x, seqs, w.mlp, lora_slots);
      else
        linear(layer.gate_up, w.x, seqs, w.mlp, true);
    } else {
      linear(layer.gate_up, w.x, seqs, w.mlp, true);
    }
    linear(layer.down, w.mlp, seqs, w.hidden, false);
    if constexpr (!kHalf)
      add_lora(adapters.down, w.mlp, d.intermediate, seqs, w.hidden, d.hidden, d.hidden,
               lora_slots);
  }
  return 0;
}

template <typename T>
int decode_logits(const int64_t* layers, int64_t num_layers, const Dims& d, float eps,
                  float sm_scale, int64_t seqs, const int64_t* ids, const int64_t* positions,
                  const T* embed, const T* cos_table, const T* sin_table, const T* final_norm,
                  const int64_t* head, const int64_t* slots, const int64_t* tables,
                  int64_t table_stride, const int64_t* contexts, const int64_t* lora,
                  const int64_t* lora_slots, void* work, T* logits) {
  const int64_t half = d.head_dim / 2;
  const Work<T> w(work, seqs, d);
  for (int64_t s = 0; s < seqs; ++s) {
    if (ids[s] < 0 || ids[s] >= d.vocab || positions[s] < 0 || positions[s] >= d.max_positions)
      return 3;
    std::memcpy(w.hidden + s * d.hidden, embed + ids[s] * d.hidden, sizeof(T) * d.hidden);
    std::memcpy(w.cos + s * half, cos_table + positions[s] * half, sizeof(T) * half);
    std::memcpy(w.sin + s * half, sin_table + positions[s] * half, sizeof(T) * half);
  }
  const int status = run_layers<T>(layers, num_layers, d, eps, sm_scale, seqs, w, slots,
                                   tables, table_stride, contexts, lora, lora_slots);
  if (status) return status;
  lamina_rms_norm(w.hidden, d.hidden, w.residual, d.hidden, final_norm, eps, seqs, d.hidden,
                  head ? w.normed : logits, w.residual, kDtype<T>);
  if (head) {
    Linear lm_head;
    std::memcpy(&lm_head, head, sizeof(lm_head));
    linear(lm_head, w.normed, seqs, logits, false);
  }
  return 0;
}

}  // namespace

// logits (S, V) for the S sequences' next tokens, in the model's dtype (dtype: 0 fp32, 1
// bf16, as every table and buffer here is): ids (S,) their last tokens, positions (S,)
// those tokens' positions; embed (V, H), cos and sin (max_positions, D/2) the rotary
// tables, final_norm (H,), head the LM head as one row of Linear fields (or NULL: logits
// then receives the final norm's output, (S, H), for the caller's head). slots (S,) flat
// cache slots of the new tokens; tables (S, table_stride) block ids; contexts (S,) cached
// tokens before each new one. lora (fp32 only): per layer a row of LoraLinear fields (qkv,
// o, gate_up, down), and lora_slots (S,) each sequence's adapter slot (-1: none); or both
// NULL. work: lamina_decode_work_bytes(S, dims, dtype) bytes.
// Returns 0; the attention kernel's error (1: the query heads do not share the KV heads
// evenly); 3 for a token id or a position outside the tables (nothing is read then); or 4
// for a linear not in the dtype's format (kBf16Pairs in bf16, no other), or adapters or
// per-head norms in a bf16 step (nothing is run then).
extern "C" int lamina_decode_logits(const int64_t* layers, int64_t num_layers,
                                    const int64_t* dims, int dtype, float eps, float sm_scale,
                                    int64_t seqs, const int64_t* ids, const int64_t* positions,
                                    const void* embed, const void* cos_table,
                                    const void* sin_table, const void* final_norm,
                                    const int64_t* head, const int64_t* slots,
                                    const int64_t* tables, int64_t table_stride,
                                    const int64_t* contexts, const int64_t* lora,
                                    const int64_t* lora_slots, void* work, void* logits) {
  Dims d;
  std::memcpy(&d, dims, sizeof(d));
  const bool half = dtype == 1;
  auto fits = [&](const Linear& l) { return (l.format == kBf16Pairs) == half; };
  for (int64_t n = 0; n < num_layers; ++n) {  // each linear in the dtype's format
    Layer layer;
    std::memcpy(&layer, layers + n * kLayerFields, sizeof(layer));
    if (!(fits(layer.qkv) && fits(layer.o) && fits(layer.gate_up) && fits(layer.down)))
      return 4;
    if (half && layer.qk_norm) return 4;
  }
  if (head) {
    Linear lm_head;
    std::memcpy(&lm_head, head, sizeof(lm_head));
    if (!fits(lm_head)) return 4;
  }
  if (!half)
    return decode_logits<float>(layers, num_layers, d, eps, sm_scale, seqs, ids, positions,
                                static_cast<const float*>(embed),
                                static_cast<const float*>(cos_table),
                                static_cast<const float*>(sin_table),
                                static_cast<const float*>(final_norm), head, slots, tables,
                                table_stride, contexts, lora, lora_slots, work,
                                static_cast<float*>(logits));
  if (lora) return 4;
  return decode_logits<Bf16>(layers, num_layers, d, eps, sm_scale, seqs, ids, positions,
                             static_cast<const Bf16*>(embed), static_cast<const Bf16*>(cos_table),
                             static_cast<const Bf16*>(sin_table),
                             static_cast<const Bf16*>(final_norm), head, slots, tables,
                             table_stride, contexts, nullptr, nullptr, work,
                             static_cast<Bf16*>(logits));
}

// Bytes of the work buffer lamina_decode_logits needs for S sequences of the model dims
// describes, in dtype (0 fp32, 1 bf16).
extern "C" int64_t lamina_decode_work_bytes(int64_t seqs, const int64_t* dims, int dtype) {
  Dims d;
  std::memcpy(&d, dims, sizeof(d));
  return dtype == 1 ? Work<Bf16>::bytes(seqs, d) : Work<float>::bytes(seqs, d);
}
