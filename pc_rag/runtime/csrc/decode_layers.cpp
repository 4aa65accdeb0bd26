// A decode step's decoder layers in one call: the ATen ops of decode_step.py (DecodeStep over the attention
// kernel), in the same order, shapes and dtypes, called from C++.
//
// A step of a 135M model on 2 cores ran ~3,000 ATen ops from Python, ~7 us each, for ~8 ms of kernels: the
// interpreter, not the bytes, set its time. The same calls made here skip Python and the GIL (released for the
// call), and give the same bits: each op is the kernel Python reaches, on the same shapes, so a row's bits still
// depend on its own token and slot only (tests/runtime/test_native_step.py compares the two paths bit for bit).
//
// Per layer, tensors in the order of Slot (undefined where absent: no bias, no per-head norm); projections are
// quantized kernel calls, kind 4 (_weight_int4pack_mm_for_cpu, group 32) or 8 (_weight_int8pack_mm).
#include "kernels.h"

namespace pc_rag {
namespace {

enum Slot : size_t {
  kNorm1, kQkvWeight, kQkvScales, kQkvBias, kQNorm, kKNorm, kOWeight, kOScales, kOBias,
  kNorm2, kGateUpWeight, kGateUpScales, kGateUpBias, kDownWeight, kDownScales, kDownBias, kSlots
};
enum Projection : size_t { kQkv, kO, kGateUp, kDown, kProjections };
enum Epsilon : size_t { kEps1, kEps2, kEpsQ, kEpsK, kEpsilons };
constexpr int64_t kKernelRows = 4;  // weights.KERNEL_ROWS
constexpr int64_t kInt4Group = 32;  // weights.INT4_GROUP
constexpr size_t kCorrections = 14;  // (a, b) of q, k, v, o, gate, up, down

using Tensors = DecodeLayers::Tensors;

const torch::Tensor& at_slot(const Tensors& tensors, size_t slot) {
  return *tensors[slot];  // checked defined by the constructor where required
}

// decode_step.rms_norm: float32 statistics, the weight applied in the input dtype.
torch::Tensor rms_norm(const torch::Tensor& weight, const torch::Tensor& x, double eps) {
  auto normalized = at::rms_norm(x.to(torch::kFloat32), {x.size(-1)}, std::nullopt, eps);
  return weight * normalized.to(x.scalar_type());
}

// weights._kernel_call: the quantized kernel over x's rows, its bias, the input's leading shape.
torch::Tensor kernel_call(int64_t kind, const torch::Tensor& weight, const torch::Tensor& scales,
                          const std::optional<torch::Tensor>& bias, const torch::Tensor& x) {
  auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  auto out = kind == 4 ? at::_weight_int4pack_mm_for_cpu(rows, weight, kInt4Group, scales)
                       : at::_weight_int8pack_mm(rows, weight, scales);
  if (bias) out = out + *bias;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.push_back(-1);
  return out.reshape(shape);
}

// rag.adapter.kernel_plus_low_rank: out plus (b @ a) x, over KERNEL_ROWS rows whatever the row count.
torch::Tensor plus_low_rank(const torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& a,
                            const torch::Tensor& b) {
  auto rows = x.reshape({-1, x.size(-1)}).to(torch::kFloat32);
  auto padded = at::constant_pad_nd(rows, {0, 0, 0, kKernelRows - rows.size(0)}, 0);
  auto low = (padded.unsqueeze(1) * a).sum(-1);
  auto term = (low.unsqueeze(1) * b).sum(-1).narrow(0, 0, rows.size(0));
  return (out.to(torch::kFloat32) + term.view(out.sizes())).to(out.scalar_type());
}

// Each part of a fused kernel's output, with the low-rank term of the modules that have one.
std::vector<torch::Tensor> corrected(torch::Tensor out, const std::vector<int64_t>& splits, const torch::Tensor& x,
                                     const Tensors& corrections, size_t first) {
  auto parts = out.split_with_sizes(splits, -1);
  std::vector<torch::Tensor> result(parts.begin(), parts.end());
  if (corrections.empty()) return result;
  for (size_t i = 0; i < result.size(); ++i) {
    const auto& a = corrections[2 * (first + i)];
    if (a) result[i] = plus_low_rank(result[i], x, *a, *corrections[2 * (first + i) + 1]);
  }
  return result;
}

// transformers' rotate-half RoPE: (t * cos) + (rotate_half(t) * sin).
torch::Tensor rotate(const torch::Tensor& t, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t half = t.size(-1) / 2;
  auto rotated = at::cat({-t.narrow(-1, half, t.size(-1) - half), t.narrow(-1, 0, half)}, -1);
  return (t * cos) + (rotated * sin);
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
  }
}

torch::Tensor DecodeLayers::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                                    torch::Tensor values, int64_t length, int64_t count, torch::Tensor ends,
                                    Tensors corrections) const {
  const int64_t rows = x.size(0), steps = x.size(1);
  TORCH_CHECK(x.dim() == 3 && steps == 1, "x must be [rows, 1, hidden]");
  TORCH_CHECK(count >= 1 && count <= rows, "count must be 1 to ", rows, ", got ", count);
  TORCH_CHECK(keys.dim() == 5 && keys.size(0) == size() && keys.sizes() == values.sizes(),
              "keys and values must be [layers, 1, kv_heads, capacity, dim] for ", size(), " layers");
  TORCH_CHECK(length >= 0 && length + count <= keys.size(3), "slots ", length, "..", length + count,
              " are past the cache's ", keys.size(3));
  TORCH_CHECK(corrections.empty() || corrections.size() == kCorrections * layers_.size(),
              "corrections must be empty or ", kCorrections, " per layer");
  auto cos_heads = cos.unsqueeze(1), sin_heads = sin.unsqueeze(1);  // [rows, 1, 1, D]
  for (size_t index = 0; index < layers_.size(); ++index) {
    const auto& layer = layers_[index];
    Tensors fixes;
    if (!corrections.empty())
      fixes.assign(corrections.begin() + kCorrections * index, corrections.begin() + kCorrections * (index + 1));
    // FusedLayer.project
    auto h = rms_norm(at_slot(layer, kNorm1), x, eps_[kEps1]);
    auto qkv = corrected(kernel_call(kinds_[kQkv], at_slot(layer, kQkvWeight), at_slot(layer, kQkvScales),
                                     layer[kQkvBias], h),
                         splits_[0], h, fixes, 0);
    auto q = qkv[0].view({rows, steps, -1, head_dim_}), k = qkv[1].view({rows, steps, -1, head_dim_});
    if (layer[kQNorm]) {
      q = rms_norm(*layer[kQNorm], q, eps_[kEpsQ]);
      k = rms_norm(*layer[kKNorm], k, eps_[kEpsK]);
    }
    q = rotate(q.transpose(1, 2), cos_heads, sin_heads);  // [rows, H, 1, D]
    k = rotate(k.transpose(1, 2), cos_heads, sin_heads);
    auto v = qkv[2].view({rows, steps, -1, head_dim_}).transpose(1, 2);
    // DecodeStep._logits: the step's keys and values into the buffer, then RowsAttention over the kernel
    auto layer_keys = keys.select(0, static_cast<int64_t>(index)).select(0, 0);  // [H_kv, capacity, D]
    auto layer_values = values.select(0, static_cast<int64_t>(index)).select(0, 0);
    layer_keys.narrow(1, length, count).copy_(k.narrow(0, 0, count).select(2, 0).transpose(0, 1));
    layer_values.narrow(1, length, count).copy_(v.narrow(0, 0, count).select(2, 0).transpose(0, 1));
    auto folded = q.narrow(0, 0, count).reshape({count, kv_heads_, -1, head_dim_}).to(torch::kFloat32).contiguous();
    auto attended =
        decode_attention(folded, layer_keys, layer_values, ends, scale_).to(q.scalar_type()).reshape({count, 1, -1});
    if (rows > count) attended = at::cat({attended, attended.narrow(0, 0, 1).expand({rows - count, -1, -1})});
    // FusedLayer.finish
    auto o = kernel_call(kinds_[kO], at_slot(layer, kOWeight), at_slot(layer, kOScales), layer[kOBias], attended);
    if (!fixes.empty() && fixes[6]) o = plus_low_rank(o, attended, *fixes[6], *fixes[7]);
    x = x + o;
    h = rms_norm(at_slot(layer, kNorm2), x, eps_[kEps2]);
    auto gate_up = corrected(kernel_call(kinds_[kGateUp], at_slot(layer, kGateUpWeight),
                                         at_slot(layer, kGateUpScales), layer[kGateUpBias], h),
                             splits_[1], h, fixes, 4);
    auto mixed = at::silu(gate_up[0]) * gate_up[1];
    auto down = kernel_call(kinds_[kDown], at_slot(layer, kDownWeight), at_slot(layer, kDownScales),
                            layer[kDownBias], mixed);
    if (!fixes.empty() && fixes[12]) down = plus_low_rank(down, mixed, *fixes[12], *fixes[13]);
    x = x + down;
  }
  return x;
}

}  // namespace pc_rag
