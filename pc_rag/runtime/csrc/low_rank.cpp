// A merged splice adapter's low-rank term on a quantized kernel's rows: out + (b @ a) x, rounded once to out's dtype.
//
// out [..., n_out] (bfloat16, a kernel's rows), x [..., in] (bfloat16, the same rows), a [r, in] and b [n_out, r]
// float32. Each row's dot products run in a fixed order of their own (8 lanes, summed pairwise, then the tail),
// so a row gets the same bits alone or beside others, in a step of any row count.
#include "kernels.h"

#include <array>

namespace pc_rag {
namespace {

float dot(const float* u, const float* w, int64_t n) {
  std::array<float, 8> lanes{};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) lanes[l] += u[i + l] * w[i + l];
  float tail = 0.0f;
  for (; i < n; ++i) tail += u[i] * w[i];
  return (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))) + tail;
}

}  // namespace

torch::Tensor low_rank_term(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor b) {
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && x.scalar_type() == torch::kBFloat16,
              "out and x must be bfloat16");
  TORCH_CHECK(a.scalar_type() == torch::kFloat32 && b.scalar_type() == torch::kFloat32 && a.dim() == 2 &&
                  b.dim() == 2 && b.size(1) == a.size(0),
              "a [r, in] and b [out, r] must be float32");
  const int64_t in = a.size(1), rank = a.size(0), width = b.size(0);
  TORCH_CHECK(x.size(-1) == in && out.size(-1) == width && x.numel() / in == out.numel() / width,
              "x [rows, ", in, "] and out [rows, ", width, "] must hold the same rows");
  auto rows = x.reshape({-1, in}).to(torch::kFloat32).contiguous();
  auto base = out.reshape({-1, width}).contiguous();
  auto a_rows = a.contiguous(), b_rows = b.contiguous();
  auto result = torch::empty(base.sizes(), base.options());
  const float* xp = rows.data_ptr<float>();
  const float* ap = a_rows.data_ptr<float>();
  const float* bp = b_rows.data_ptr<float>();
  const at::BFloat16* op = base.data_ptr<at::BFloat16>();
  at::BFloat16* rp = result.data_ptr<at::BFloat16>();
  std::vector<float> low(rank);
  for (int64_t r = 0, count = rows.size(0); r < count; ++r) {
    for (int64_t j = 0; j < rank; ++j) low[j] = dot(xp + r * in, ap + j * in, in);
    for (int64_t o = 0; o < width; ++o)
      rp[r * width + o] = at::BFloat16(static_cast<float>(op[r * width + o]) + dot(bp + o * rank, low.data(), rank));
  }
  return result.view(out.sizes());
}

}  // namespace pc_rag
