// What the CPU kernels' sources share: each file one kernel, bindings.cpp the Python module.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace pc_rag {

// decode_attention.cpp: rows of queries over a KV cache, each row with bits of its own.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor ends,
                               double scale);

// low_rank.cpp: out + (b @ a) x over a quantized kernel's rows, each row in an order of its own.
torch::Tensor low_rank_term(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor b);

// What amx_linear and dot_linear check of their rows x [rows, in] and scales, naming `kernel` in the errors.
inline void check_rows_and_scales(const char* kernel, const torch::Tensor& x, const torch::Tensor& scales,
                                  int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, kernel, ": bits must be 4 or 8, got ", bits);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), kernel,
              ": x must be contiguous bfloat16 [rows, in]");
  TORCH_CHECK(scales.scalar_type() == torch::kBFloat16 && scales.is_contiguous(), kernel, ": bfloat16 scales");
}

// amx_linear.cpp: bfloat16 rows times int4 / int8 weights (weights.amx_pack), dequantized onto AMX tiles.
bool amx_available();
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t bits);

// dot_linear.cpp: bfloat16 rows times int4 / int8 weights (weights.dot_pack) on AVX-512 BF16 dot products.
bool dot_available();
torch::Tensor dot_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t bits);

// decode_layers.cpp: a decode step's decoder layers, the ATen calls of decode_step.py made from C++.
class DecodeLayers {
 public:
  using Tensors = std::vector<std::optional<torch::Tensor>>;

  DecodeLayers(std::vector<Tensors> layers, std::vector<std::vector<int64_t>> splits, std::vector<int64_t> kinds,
               std::vector<double> eps, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale);

  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                        torch::Tensor values, int64_t length, int64_t count, torch::Tensor ends,
                        Tensors corrections) const;

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<Tensors> layers_;
  std::vector<std::vector<int64_t>> splits_;
  std::vector<int64_t> kinds_;
  std::vector<double> eps_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_;
};

}  // namespace pc_rag
