// Decode attention on the CPU: a few query rows over a KV cache read once, each row with bits of its own.
//
// q [R, H_kv, G, D] float32 (G query heads per KV head), keys/values [H_kv, S, D] (bfloat16 or float32, the
// slot axis may be strided), ends [R]: row r attends to slots 0..ends[r]-1. The cache is cut in chunks of
// CHUNK slots; a work item is one (KV head, chunk), read once for every row and query head that sees it:
// scores, their max, exp and the weighted values, kept per chunk and merged by log-sum-exp in chunk order.
// A row's arithmetic depends on its own query and end only, never on the other rows or the thread count, so a
// row gets the same bits alone, beside drafts, or in another step. On a CPU with AVX-512 (unless
// ATEN_CPU_CAPABILITY asks for less) the scores and weighted values run on 16-lane vectors, and where several
// rows see a whole chunk their query heads go six at a time: each key and value vector is widened once for two
// rows (a verify step's rows cost compute, not bytes). Within one CPU a head's sums are the same for any grouping.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

namespace {

constexpr int64_t CHUNK = 256;
constexpr int64_t MAX_D = 256;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// max is exact: any order of the lanes gives the same value
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// exp(x) for x <= 0: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p a degree-6 polynomial (~1 ulp).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.3981999507e-3f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// One slot's dim values into L1, a 64-byte line at a time.
template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t at = 0; at < dim * static_cast<int64_t>(sizeof(T)); at += 64) _mm_prefetch(bytes + at, _MM_HINT_T0);
}

// Whether the 16-lane kernels run: the CPU has AVX-512 (F, BW, DQ, VL) and ATEN_CPU_CAPABILITY, torch's switch
// for its own kernels, does not ask for AVX2 or less.
bool wide_vectors() {
  static const bool wide = [] {
    const char* asked = std::getenv("ATEN_CPU_CAPABILITY");
    if (asked != nullptr && std::strncmp(asked, "avx512", 6) != 0 && std::strncmp(asked, "AVX512", 6) != 0)
      return false;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  }();
  return wide;
}

// The vector widths the loops of attention_loops.h run on: a register type, its lanes, and the operations the
// loops take (a bfloat16 load widens in registers; half() is a 16-lane register's two halves added, which the
// horizontal sums reduce as 8-lane ones).
namespace lanes8 {
struct Vec {
  using reg = __m256;
  static constexpr int64_t lanes = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static reg load(const at::BFloat16* p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static __m256 half(reg v) { return v; }
};
#include "attention_loops.h"
}  // namespace lanes8

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")
#endif
namespace lanes16 {
struct Vec {
  using reg = __m512;
  static constexpr int64_t lanes = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float v) { return _mm512_set1_ps(v); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static reg load(const at::BFloat16* p) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static __m256 half(reg v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
};
#include "attention_loops.h"
}  // namespace lanes16
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// exp(score - max) in place over a row's count scores; returns the max and their sum.
inline std::pair<float, float> softmax_terms(float* row, int64_t count) {
  for (int64_t s = count; s < (count + 7) / 8 * 8; ++s) row[s] = -INFINITY;
  __m256 tops = _mm256_set1_ps(-INFINITY);
  for (int64_t s = 0; s < count; s += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(row + s));
  const float top = hmax(tops);
  __m256 total = _mm256_setzero_ps(), shift = _mm256_set1_ps(top);
  for (int64_t s = 0; s < count; s += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + s), shift));
    if (s + 8 > count) {  // lanes past the row's last slot count nothing
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, e);
      for (int64_t l = count - s; l < 8; ++l) lanes[l] = 0.0f;
      e = _mm256_load_ps(lanes);
    }
    _mm256_storeu_ps(row + s, e);
    total = _mm256_add_ps(total, e);
  }
  return {top, hsum(total)};
}

// N query heads of one row over one chunk: maxes, sums and weighted values of each.
template <int N, bool Wide, typename T>
void heads_pass(const float* const* q, const T* keys, const T* values, int64_t stride, int64_t dim, int64_t count,
                float scale, float* const* rows, float* const* acc, float* maxes, float* sums) {
  if constexpr (Wide) lanes16::scores_of<N, T>(q, keys, stride, dim, count, scale, rows, values);
  else lanes8::scores_of<N, T>(q, keys, stride, dim, count, scale, rows, values);
  for (int n = 0; n < N; ++n) std::tie(maxes[n], sums[n]) = softmax_terms(rows[n], count);
  if constexpr (Wide) lanes16::weighted_values<N, T>(rows, values, stride, dim, count, acc);
  else lanes8::weighted_values<N, T>(rows, values, stride, dim, count, acc);
}

// heads_pass for n (1 to 6; at most 3 unless wide) query heads.
template <typename T>
void heads_pass_of(int n, bool wide, const float* const* q, const T* keys, const T* values, int64_t stride,
                   int64_t dim, int64_t count, float scale, float* const* rows, float* const* acc, float* maxes,
                   float* sums) {
#define PC_RAG_PASS(N, W) heads_pass<N, W, T>(q, keys, values, stride, dim, count, scale, rows, acc, maxes, sums)
  if (wide) {
    switch (n) {
      case 6: PC_RAG_PASS(6, true); break;
      case 5: PC_RAG_PASS(5, true); break;
      case 4: PC_RAG_PASS(4, true); break;
      case 3: PC_RAG_PASS(3, true); break;
      case 2: PC_RAG_PASS(2, true); break;
      default: PC_RAG_PASS(1, true); break;
    }
  } else {
    switch (n) {
      case 3: PC_RAG_PASS(3, false); break;
      case 2: PC_RAG_PASS(2, false); break;
      default: PC_RAG_PASS(1, false); break;
    }
  }
#undef PC_RAG_PASS
}

// One (KV head, chunk): for every (row, query head) pair that sees it, its max score, the sum of exp(score - max)
// and the values weighted by them, over its own slots of the chunk. Pairs that see as many slots (every row, in a
// chunk all of them see whole) go together: three at a time, six with wide vectors.
template <typename T>
void chunk_pass(const float* q, const T* k, const T* v, int64_t slot_stride, const int64_t* ends, int64_t rows,
                int64_t groups, int64_t dim, int64_t start, float scale, bool wide, float* scratch, float* acc,
                float* maxes, float* sums) {
  const T* keys = k + start * slot_stride;
  const T* values = v + start * slot_stride;
  const int64_t pairs = rows * groups;
  const int most = wide ? 6 : 3;
  auto seen = [&](int64_t pair) { return std::min(ends[pair / groups] - start, CHUNK); };
  for (int64_t p = 0; p < pairs;) {
    const int64_t count = seen(p);
    if (count <= 0) {
      ++p;
      continue;
    }
    int n = 1;
    while (n < most && p + n < pairs && seen(p + n) == count) ++n;
    const float* qs[6];
    float* row[6];
    float* out[6];
    for (int i = 0; i < n; ++i) {
      qs[i] = q + (p + i) * dim;
      row[i] = scratch + i * (CHUNK + 8);
      out[i] = acc + (p + i) * dim;
    }
    heads_pass_of<T>(n, wide, qs, keys, values, slot_stride, dim, count, scale, row, out, maxes + p, sums + p);
    p += n;
  }
}

template <typename T>
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                     const torch::Tensor& ends, double scale) {
  const int64_t rows = q.size(0), heads = q.size(1), groups = q.size(2), dim = q.size(3);
  const int64_t* end = ends.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t r = 0; r < rows; ++r) longest = std::max(longest, end[r]);
  const int64_t chunks = (longest + CHUNK - 1) / CHUNK, pairs = rows * groups;
  // per (head, chunk): max and sum per pair [pairs], weighted values [pairs, dim]
  auto maxes = torch::empty({heads, chunks, pairs}, q.options());
  auto sums = torch::empty({heads, chunks, pairs}, q.options());
  auto partial = torch::empty({heads, chunks, pairs, dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const T* kp = keys.data_ptr<T>();
  const T* vp = values.data_ptr<T>();
  const int64_t head_stride = keys.stride(0), slot_stride = keys.stride(1);
  const bool wide = wide_vectors() && dim % 16 == 0;
  at::parallel_for(0, heads * chunks, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scratch(6 * (CHUNK + 8));
    std::vector<float> head_q(pairs * dim);
    for (int64_t item = first; item < last; ++item) {
      const int64_t h = item / chunks, c = item % chunks;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < groups; ++g)
          std::copy_n(qp + ((r * heads + h) * groups + g) * dim, dim, head_q.data() + (r * groups + g) * dim);
      chunk_pass<T>(head_q.data(), kp + h * head_stride, vp + h * head_stride, slot_stride, end, rows, groups, dim,
                    c * CHUNK, static_cast<float>(scale), wide, scratch.data(),
                    partial.data_ptr<float>() + item * pairs * dim, maxes.data_ptr<float>() + item * pairs,
                    sums.data_ptr<float>() + item * pairs);
    }
  });
  auto out = torch::empty({rows, heads, groups, dim}, q.options());
  float* op = out.data_ptr<float>();
  const float* mp = maxes.data_ptr<float>();
  const float* sp = sums.data_ptr<float>();
  const float* pp = partial.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {  // merge a row's chunks in order, by log-sum-exp
    const int64_t own = (end[r] + CHUNK - 1) / CHUNK;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t pair = r * groups + g;
        float top = -INFINITY;
        for (int64_t c = 0; c < own; ++c) top = std::max(top, mp[(h * chunks + c) * pairs + pair]);
        float total = 0.0f;
        float* dst = op + ((r * heads + h) * groups + g) * dim;
        std::fill(dst, dst + dim, 0.0f);
        for (int64_t c = 0; c < own; ++c) {
          const int64_t at = (h * chunks + c) * pairs + pair;
          const float weight = std::exp(mp[at] - top);
          total += sp[at] * weight;
          for (int64_t d = 0; d < dim; ++d) dst[d] += pp[at * dim + d] * weight;
        }
        for (int64_t d = 0; d < dim; ++d) dst[d] /= total;
      }
    }
  }
  return out;
}

}  // namespace

namespace pc_rag {

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor ends,
                               double scale) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q must be a contiguous float32 [rows, kv_heads, groups, dim] tensor");
  TORCH_CHECK(keys.dim() == 3 && values.sizes() == keys.sizes() && values.strides() == keys.strides(),
              "keys and values must be [kv_heads, slots, dim] views of the same shape and strides");
  TORCH_CHECK(keys.size(0) == q.size(1) && keys.size(2) == q.size(3), "q and the cache disagree on heads or dim");
  TORCH_CHECK(keys.stride(2) == 1 && q.size(3) % 8 == 0 && q.size(3) <= MAX_D, "dim must be contiguous, 8k <= 256");
  TORCH_CHECK(ends.scalar_type() == torch::kInt64 && ends.dim() == 1 && ends.size(0) == q.size(0),
              "ends must be int64 [rows]");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "keys and values must share a dtype");
  auto contiguous_ends = ends.contiguous();
  const int64_t* end = contiguous_ends.data_ptr<int64_t>();
  for (int64_t r = 0; r < q.size(0); ++r)
    TORCH_CHECK(end[r] > 0 && end[r] <= keys.size(1), "row ", r, " sees ", end[r], " keys, not 1 to ", keys.size(1));
  if (keys.scalar_type() == torch::kBFloat16) return attend<at::BFloat16>(q, keys, values, contiguous_ends, scale);
  TORCH_CHECK(keys.scalar_type() == torch::kFloat32, "the cache must be bfloat16 or float32");
  return attend<float>(q, keys, values, contiguous_ends, scale);
}

}  // namespace pc_rag
