// A decode step's decoder layers in one call: decode_step.py's loop (DecodeStep over the attention kernel), with
// the same bits, from C++.
//
// A step of a 135M model on 2 cores ran ~3,000 ATen ops from Python, ~7 us each, for ~8 ms of kernels: the
// interpreter, not the bytes, set its time. Here the kernels (quantized matmuls, norms' statistics, SiLU, the
// attention kernel, low_rank.cpp's adapter term) are the calls the Python loop makes, on the same shapes, and the
// elementwise ops between them (RoPE, the cache writes, the norms' weight, residuals) are loops that round to
// bfloat16 where the ATen ops round; the GIL is released for the call. A row's bits still depend on its own token
// and slot only (tests/runtime/test_native_layers.py compares the two paths bit for bit).
//
// Per layer, tensors in the order of Slot (undefined where absent: no bias, no per-head norm); projections are
// quantized kernel calls, kind 4 (_weight_int4pack_mm_for_cpu, group 32) or 8 (_weight_int8pack_mm), or
// amx_linear.cpp's where the weight is an AMX pack (4 dims), dot_linear.cpp's where it is a dot pack (3 dims).
#include "kernels.h"

namespace pc_rag {
namespace {

enum Slot : size_t {
  kNorm1, kQkvWeight, kQkvScales, kQkvBias, kQNorm, kKNorm, kOWeight, kOScales, kOBias,
  kNorm2, kGateUpWeight, kGateUpScales, kGateUpBias, kDownWeight, kDownScales, kDownBias, kSlots
};
enum Projection : size_t { kQkv, kO, kGateUp, kDown, kProjections };
enum Epsilon : size_t { kEps1, kEps2, kEpsQ, kEpsK, kEpsilons };
constexpr int64_t kInt4Group = 32;  // weights.INT4_GROUP
constexpr size_t kCorrections = 14;  // (a, b) of q, k, v, o, gate, up, down

using Tensors = DecodeLayers::Tensors;

const torch::Tensor& at_slot(const Tensors& tensors, size_t slot) {
  return *tensors[slot];  // checked defined by the constructor where required
}

using BFloat16 = at::BFloat16;

inline float widen(BFloat16 v) { return static_cast<float>(v); }

// Rows of bfloat16 [rows, n] elementwise, one thread: a decode step's rows are a few thousand elements, where an
// ATen call's dispatch and allocation cost more than its arithmetic. Each loop computes in float32 and rounds to
// bfloat16 (nearest even) where the ATen op it replaces rounds, so it gives that op's bits.

// weight * normalized.to(bfloat16): decode_step.rms_norm after its float32 statistics.
torch::Tensor scaled(const torch::Tensor& normalized, const torch::Tensor& weight) {
  auto values = normalized.contiguous();
  auto out = torch::empty(values.sizes(), values.options().dtype(torch::kBFloat16));
  const float* in = values.data_ptr<float>();
  const BFloat16* w = weight.data_ptr<BFloat16>();
  BFloat16* o = out.data_ptr<BFloat16>();
  const int64_t n = weight.numel(), total = values.numel();
  for (int64_t i = 0; i < total; ++i) o[i] = BFloat16(widen(w[i % n]) * widen(BFloat16(in[i])));
  return out;
}

// decode_step.rms_norm: float32 statistics, the weight applied in the input dtype.
torch::Tensor rms_norm(const torch::Tensor& weight, const torch::Tensor& x, double eps) {
  return scaled(at::rms_norm(x.to(torch::kFloat32), {x.size(-1)}, std::nullopt, eps), weight);
}

// x + y, both bfloat16 [rows, n] contiguous: a residual connection.
torch::Tensor plus(const torch::Tensor& x, const torch::Tensor& y) {
  auto other = y.contiguous();
  auto out = torch::empty_like(x);
  const BFloat16* a = x.data_ptr<BFloat16>();
  const BFloat16* b = other.data_ptr<BFloat16>();
  BFloat16* o = out.data_ptr<BFloat16>();
  for (int64_t i = 0, total = x.numel(); i < total; ++i) o[i] = BFloat16(widen(a[i]) + widen(b[i]));
  return out;
}

// weights._kernel_call over [rows, in] bfloat16 rows: the quantized kernel, then its bias.
torch::Tensor kernel_call(int64_t kind, const torch::Tensor& weight, const torch::Tensor& scales,
                          const std::optional<torch::Tensor>& bias, const torch::Tensor& x) {
  auto rows = x.contiguous();
  auto out = weight.dim() == 4 ? amx_linear(rows, weight, scales, kind)  // weights.amx_pack's blocks
             : weight.dim() == 3 ? dot_linear(rows, weight, scales, kind)  // weights.dot_pack's blocks
             : kind == 4         ? at::_weight_int4pack_mm_for_cpu(rows, weight, kInt4Group, scales)
                                 : at::_weight_int8pack_mm(rows, weight, scales);
  return bias ? out + *bias : out;
}

// out plus the low-rank term of module `module` (0..6: q, k, v, o, gate, up, down), where it has one.
torch::Tensor with_term(torch::Tensor out, const torch::Tensor& x, const Tensors& corrections, size_t module) {
  if (corrections.empty() || !corrections[2 * module]) return out;
  return low_rank_term(out, x, *corrections[2 * module], *corrections[2 * module + 1]);
}

// Each part of a fused kernel's output (modules first, first + 1, ...), with its low-rank term.
std::vector<torch::Tensor> corrected(const torch::Tensor& out, const std::vector<int64_t>& splits,
                                     const torch::Tensor& x, const Tensors& corrections, size_t first) {
  auto parts = out.split_with_sizes(splits, -1);
  std::vector<torch::Tensor> result;
  for (size_t i = 0; i < parts.size(); ++i) result.push_back(with_term(parts[i], x, corrections, first + i));
  return result;
}

// transformers' rotate-half RoPE, (t * cos) + (rotate_half(t) * sin), of element d of head row t (bfloat16):
// each product rounds to bfloat16, then their sum, as the three ATen ops do.
inline BFloat16 rotated(const BFloat16* t, int64_t d, int64_t half, float cos, float sin) {
  const float other = d < half ? -widen(t[d + half]) : widen(t[d - half]);
  return BFloat16(widen(BFloat16(widen(t[d]) * cos)) + widen(BFloat16(other * sin)));
}

// Heads [rows, heads, D] (bfloat16, rows and heads strided) of the first `count` rows, rotated; each element
// handed to `put(row, head, d, value)`.
template <typename Put>
void rotate_heads(const torch::Tensor& heads, const torch::Tensor& cos, const torch::Tensor& sin, int64_t count,
                  Put put) {
  TORCH_CHECK(heads.stride(2) == 1, "a head's values must be contiguous");
  const int64_t n = heads.size(1), dim = heads.size(2), half = dim / 2;
  const BFloat16* base = heads.data_ptr<BFloat16>();
  const BFloat16* c = cos.data_ptr<BFloat16>();
  const BFloat16* s = sin.data_ptr<BFloat16>();
  for (int64_t r = 0; r < count; ++r)
    for (int64_t h = 0; h < n; ++h) {
      const BFloat16* t = base + r * heads.stride(0) + h * heads.stride(1);
      for (int64_t d = 0; d < dim; ++d) put(r, h, d, rotated(t, d, half, widen(c[r * dim + d]), widen(s[r * dim + d])));
    }
}

}  // namespace

DecodeLayers::DecodeLayers(std::vector<Tensors> layers, std::vector<std::vector<int64_t>> splits,
                           std::vector<int64_t> kinds, std::vector<double> eps, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, double scale)
    : layers_(std::move(layers)), splits_(std::move(splits)), kinds_(std::move(kinds)), eps_(std::move(eps)),
      heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), scale_(scale) {
  TORCH_CHECK(splits_.size() == 2 && splits_[0].size() == 3 && splits_[1].size() == 2,
              "splits must be [[q, k, v], [gate, up]] output sizes");
  TORCH_CHECK(kinds_.size() == kProjections, "kinds must name qkv, o, gate_up and down's kernels (4 or 8)");
  for (auto kind : kinds_) TORCH_CHECK(kind == 4 || kind == 8, "a kernel kind is 4 or 8, got ", kind);
  TORCH_CHECK(eps_.size() == kEpsilons, "eps must be the two norms' and the per-head norms'");
  TORCH_CHECK(heads_ % kv_heads_ == 0, heads_, " query heads do not group onto ", kv_heads_, " KV heads");
  for (size_t index = 0; index < layers_.size(); ++index) {
    const auto& layer = layers_[index];
    TORCH_CHECK(layer.size() == kSlots, "layer ", index, " has ", layer.size(), " tensors, not ", kSlots);
    for (size_t slot : {kNorm1, kQkvWeight, kQkvScales, kOWeight, kOScales, kNorm2, kGateUpWeight, kGateUpScales,
                        kDownWeight, kDownScales})
      TORCH_CHECK(layer[slot].has_value() && layer[slot]->defined(), "layer ", index, " lacks tensor ", slot);
    TORCH_CHECK(layer[kQNorm].has_value() == layer[kKNorm].has_value(), "layer ", index,
                " has one per-head norm of two");
    for (size_t slot : {kNorm1, kNorm2, kQNorm, kKNorm})
      TORCH_CHECK(!layer[slot] || (layer[slot]->scalar_type() == torch::kBFloat16 && layer[slot]->is_contiguous()),
                  "layer ", index, "'s norm weights must be contiguous bfloat16");
  }
}

torch::Tensor DecodeLayers::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                                    torch::Tensor values, int64_t length, int64_t count, torch::Tensor ends,
                                    Tensors corrections) const {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && x.scalar_type() == torch::kBFloat16,
              "x must be bfloat16 [rows, 1, hidden]");
  const int64_t rows = x.size(0), hidden = x.size(2), dim = head_dim_;
  TORCH_CHECK(count >= 1 && count <= rows, "count must be 1 to ", rows, ", got ", count);
  TORCH_CHECK(keys.dim() == 5 && keys.size(0) == size() && keys.sizes() == values.sizes() &&
                  keys.strides() == values.strides() && keys.scalar_type() == torch::kBFloat16,
              "keys and values must be bfloat16 [layers, 1, kv_heads, capacity, dim] for ", size(), " layers");
  TORCH_CHECK(keys.size(2) == kv_heads_ && keys.size(4) == dim && keys.stride(4) == 1,
              "the cache must have ", kv_heads_, " KV heads of ", dim, " contiguous values");
  TORCH_CHECK(length >= 0 && length + count <= keys.size(3), "slots ", length, "..", length + count,
              " are past the cache's ", keys.size(3));
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == rows * dim && cos.scalar_type() == torch::kBFloat16,
              "cos and sin must be bfloat16 [rows, 1, ", dim, "]");
  TORCH_CHECK(corrections.empty() || corrections.size() == kCorrections * layers_.size(),
              "corrections must be empty or ", kCorrections, " per layer");
  auto cos_rows = cos.contiguous(), sin_rows = sin.contiguous();
  auto state = x.reshape({rows, hidden}).contiguous();  // [rows, hidden], one row per token
  for (size_t index = 0; index < layers_.size(); ++index) {
    const auto& layer = layers_[index];
    Tensors fixes;
    if (!corrections.empty())
      fixes.assign(corrections.begin() + kCorrections * index, corrections.begin() + kCorrections * (index + 1));
    // FusedLayer.project
    auto h = rms_norm(at_slot(layer, kNorm1), state, eps_[kEps1]);
    auto qkv = corrected(kernel_call(kinds_[kQkv], at_slot(layer, kQkvWeight), at_slot(layer, kQkvScales),
                                     layer[kQkvBias], h),
                         splits_[0], h, fixes, 0);
    auto q = qkv[0].view({rows, -1, dim}), k = qkv[1].view({rows, -1, dim}), v = qkv[2].view({rows, -1, dim});
    if (layer[kQNorm]) {
      q = rms_norm(*layer[kQNorm], q, eps_[kEpsQ]);
      k = rms_norm(*layer[kKNorm], k, eps_[kEpsK]);
    }
    // DecodeStep._logits: the step's rotated keys and its values into the buffer, the rotated queries as the
    // attention kernel's float32 [count, H_kv, G, D] (query head h = kv head * G + g)
    const int64_t layer_offset = static_cast<int64_t>(index) * keys.stride(0);
    BFloat16* key_slots = keys.data_ptr<BFloat16>() + layer_offset + length * keys.stride(3);
    BFloat16* value_slots = values.data_ptr<BFloat16>() + layer_offset + length * keys.stride(3);
    const int64_t head_stride = keys.stride(2), slot_stride = keys.stride(3);
    rotate_heads(k, cos_rows, sin_rows, count, [&](int64_t r, int64_t g, int64_t d, BFloat16 value) {
      key_slots[g * head_stride + r * slot_stride + d] = value;
    });
    const BFloat16* v_base = v.data_ptr<BFloat16>();
    for (int64_t r = 0; r < count; ++r)
      for (int64_t g = 0; g < kv_heads_; ++g)
        std::copy_n(v_base + r * v.stride(0) + g * v.stride(1), dim,
                    value_slots + g * head_stride + r * slot_stride);
    auto folded = torch::empty({count, kv_heads_, q.size(1) / kv_heads_, dim}, state.options().dtype(torch::kFloat32));
    float* folded_q = folded.data_ptr<float>();
    const int64_t q_heads = q.size(1);
    rotate_heads(q, cos_rows, sin_rows, count, [&](int64_t r, int64_t h, int64_t d, BFloat16 value) {
      folded_q[(r * q_heads + h) * dim + d] = widen(value);
    });
    auto layer_keys = keys.select(0, static_cast<int64_t>(index)).select(0, 0);  // [H_kv, capacity, D]
    auto layer_values = values.select(0, static_cast<int64_t>(index)).select(0, 0);
    auto out = decode_attention(folded, layer_keys, layer_values, ends, scale_);  // [count, H_kv, G, D]
    auto attended = torch::empty({rows, q_heads * dim}, state.options());  // padding rows repeat row 0
    const float* out_rows = out.data_ptr<float>();
    BFloat16* attended_rows = attended.data_ptr<BFloat16>();
    const int64_t width = q_heads * dim;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < width; ++i) attended_rows[r * width + i] = BFloat16(out_rows[(r < count ? r : 0) * width + i]);
    // FusedLayer.finish
    auto o = kernel_call(kinds_[kO], at_slot(layer, kOWeight), at_slot(layer, kOScales), layer[kOBias], attended);
    state = plus(state, with_term(o, attended, fixes, 3));
    h = rms_norm(at_slot(layer, kNorm2), state, eps_[kEps2]);
    auto gate_up = corrected(kernel_call(kinds_[kGateUp], at_slot(layer, kGateUpWeight),
                                         at_slot(layer, kGateUpScales), layer[kGateUpBias], h),
                             splits_[1], h, fixes, 4);
    auto mixed = at::silu(gate_up[0]) * gate_up[1];
    auto down = kernel_call(kinds_[kDown], at_slot(layer, kDownWeight), at_slot(layer, kDownScales),
                            layer[kDownBias], mixed);
    state = plus(state, with_term(down, mixed, fixes, 6));
  }
  return state.view({rows, 1, hidden});
}

}  // namespace pc_rag
