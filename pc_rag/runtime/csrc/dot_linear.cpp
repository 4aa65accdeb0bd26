// Quantized linear layers for a few bfloat16 rows on AVX-512 BF16 dot products (VDPBF16PS): Zen 4, Intel Cooper
// Lake and later.
//
// ATen's fused kernels (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) turn every weight into a float32 and run
// one float32 FMA per weight per row: on SmolLM2 in int4 a one-row step spent 5.8 of its 10 ms there (2-core
// Zen 4), and each row of a verify step ~1.2 ms more. Here a weight never becomes a float32: an int4 q - 8 is a
// bfloat16 integer by table lookup (VPERMW), an int8 q by one conversion, and VDPBF16PS multiplies two of them
// per lane with a row's two inputs (bfloat16 products, exact in float32, float32 sums). A group's scale and zero
// apply once per group and output:
//   int4: y = sum_g [ scale_g * sum_{k in g} x_k (q_k - 8) + zero_g * sum_{k in g} x_k ]   (groups of 32)
//   int8: y = scale * sum_k x_k q_k
// the weights ATen's kernels multiply, with float32 roundings in another order; y rounds once to bfloat16.
//
// Each (row, output) is one fixed chain of instructions (even and odd input pairs in two accumulators, groups in
// order), whatever the number of rows or the threads: a row's bits are its own.
//
// Layout (weights.dot_pack), per block of 16 outputs and group of 32 inputs: int4 is 8 chunks of 32 bytes, chunk
// j's byte e holding element e of input pair 2j (low nibble) and of pair 2j + 1 (high nibble); int8 is 16 lines
// of 32 bytes, line p the elements of pair p. Element e of a pair p is output e / 2's input 2p + e % 2 (a
// VDPBF16PS operand). int4 scales are [blocks, groups, 32] bfloat16: the block's 16 scales, then its 16 zeros.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 11) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10))
#define PC_RAG_DOT_COMPILES 1
#endif

namespace {

constexpr int64_t kOutputs = 16;  // outputs per block: one float32 vector
constexpr int64_t kGroup = 32;    // inputs per group (weights.INT4_GROUP) and per int8 block
constexpr int64_t kMaxRows = 4;   // rows per pass (the accumulators of 4 rows fit the registers)

#ifdef PC_RAG_DOT_COMPILES
// Whether the kernel runs here: AVX-512 BF16 and BW, and ATEN_CPU_CAPABILITY (torch's switch for its own kernels)
// not asking for less than AVX-512.
bool dot_usable() {
  static const bool usable = [] {
    const char* asked = std::getenv("ATEN_CPU_CAPABILITY");
    if (asked != nullptr && std::strncmp(asked, "avx512", 6) != 0 && std::strncmp(asked, "AVX512", 6) != 0)
      return false;
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512f");
  }();
  return usable;
}
#endif

}  // namespace

#ifdef PC_RAG_DOT_COMPILES
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")
#endif
namespace {

using BFloat16 = at::BFloat16;

inline __m512 widen(const BFloat16* values) {  // 16 bfloat16 -> float32
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512bh pair_of(const BFloat16* row, int64_t pair) {  // inputs 2p, 2p + 1 in every lane
  int32_t bits;
  std::memcpy(&bits, row + 2 * pair, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(bits);
}

inline void store_row(BFloat16* out, __m512 values) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(values));
}

// bfloat16 q - 8 for VPERMW indices 0..31 (it reads an index's low 5 bits: a low nibble's byte may carry bit 4)
__m512i centered_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) {
    const float value = static_cast<float>(i % 16 - 8);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    table[i] = static_cast<uint16_t>(bits >> 16);  // small integers are exact in bfloat16
  }
  return _mm512_load_si512(table);
}

struct Int4Weights {
  const uint8_t* chunks;   // [blocks, groups, 256]
  const BFloat16* scales;  // [blocks, groups, 32]
  int64_t groups, N;
  __m512i table;  // centered_table(), made once a call
};

// Rows 0..R-1 of x times block `block` (R compile-time: the accumulators stay in registers).
template <int R>
void int4_pass(const Int4Weights& w, const BFloat16* x, const float* sums, BFloat16* out, int64_t K, int64_t block) {
  const __m512i table = w.table;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < w.groups; ++g) {
    const uint8_t* chunks = w.chunks + (block * w.groups + g) * 256;
    __m512 even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int64_t j = 0; j < 8; ++j) {
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunks + j * 32)));
      const __m512bh low = (__m512bh)_mm512_permutexvar_epi16(bytes, table);
      const __m512bh high = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
      for (int r = 0; r < R; ++r) {
        const BFloat16* row = x + r * K + g * kGroup;
        even[r] = _mm512_dpbf16_ps(even[r], low, pair_of(row, 2 * j));
        odd[r] = _mm512_dpbf16_ps(odd[r], high, pair_of(row, 2 * j + 1));
      }
    }
    const BFloat16* scale = w.scales + (block * w.groups + g) * 32;
    const __m512 s = widen(scale), z = widen(scale + 16);
    for (int r = 0; r < R; ++r) {
      total[r] = _mm512_fmadd_ps(_mm512_add_ps(even[r], odd[r]), s, total[r]);
      total[r] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * w.groups + g]), z, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_row(out + r * w.N + block * kOutputs, total[r]);
}

struct Int8Weights {
  const int8_t* lines;     // [blocks, K / 32, 512]
  const BFloat16* scales;  // [N]
  int64_t steps, N;
};

inline __m512bh int8_line(const int8_t* line) {  // 32 int8 -> bfloat16, exact
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
  const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
  return _mm512_cvtne2ps_pbh(second, first);
}

template <int R>
void int8_pass(const Int8Weights& w, const BFloat16* x, BFloat16* out, int64_t K, int64_t block) {
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  for (int64_t step = 0; step < w.steps; ++step) {
    const int8_t* lines = w.lines + (block * w.steps + step) * 512;
#pragma GCC unroll 8
    for (int64_t p = 0; p < kGroup / 2; p += 2) {
      const __m512bh first = int8_line(lines + p * 32), second = int8_line(lines + (p + 1) * 32);
      for (int r = 0; r < R; ++r) {
        const BFloat16* row = x + r * K + step * kGroup;
        even[r] = _mm512_dpbf16_ps(even[r], first, pair_of(row, p));
        odd[r] = _mm512_dpbf16_ps(odd[r], second, pair_of(row, p + 1));
      }
    }
  }
  const __m512 s = widen(w.scales + block * kOutputs);
  for (int r = 0; r < R; ++r) store_row(out + r * w.N + block * kOutputs, _mm512_mul_ps(_mm512_add_ps(even[r], odd[r]), s));
}

// Every block for `rows` rows in passes of up to kMaxRows (a row's chain is the same in any pass), the blocks
// split over torch's threads. One block a pass: passes over 2 or 4 blocks ran slower (more streams to prefetch).
template <typename Pass>
void run_rows(int64_t rows, int64_t blocks, Pass pass) {
  at::parallel_for(0, blocks, 16, [&](int64_t first, int64_t last) {
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows)
      for (int64_t block = first; block < last; ++block) {
        switch (std::min(kMaxRows, rows - r0)) {
          case 1: pass(std::integral_constant<int, 1>{}, r0, block); break;
          case 2: pass(std::integral_constant<int, 2>{}, r0, block); break;
          case 3: pass(std::integral_constant<int, 3>{}, r0, block); break;
          default: pass(std::integral_constant<int, 4>{}, r0, block); break;
        }
      }
  });
}

// Each row's sum of every group of 32 inputs, in float32 (one fixed order per group).
std::vector<float> group_sums(const BFloat16* x, int64_t rows, int64_t K) {
  const int64_t groups = K / kGroup;
  std::vector<float> sums(rows * groups);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const BFloat16* values = x + r * K + g * kGroup;
      sums[r * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(widen(values), widen(values + 16)));
    }
  return sums;
}

torch::Tensor int4_dot(const torch::Tensor& x, const torch::Tensor& chunks, const torch::Tensor& scales) {
  const int64_t rows = x.size(0), K = x.size(1), blocks = chunks.size(0), N = blocks * kOutputs;
  auto result = torch::empty({rows, N}, x.options());
  const BFloat16* in = x.data_ptr<BFloat16>();
  BFloat16* out = result.data_ptr<BFloat16>();
  const Int4Weights w{chunks.data_ptr<uint8_t>(), scales.data_ptr<BFloat16>(), K / kGroup, N, centered_table()};
  const std::vector<float> sums = group_sums(in, rows, K);
  run_rows(rows, blocks, [&](auto R, int64_t r0, int64_t block) {
    int4_pass<decltype(R)::value>(w, in + r0 * K, sums.data() + r0 * w.groups, out + r0 * N, K, block);
  });
  return result;
}

torch::Tensor int8_dot(const torch::Tensor& x, const torch::Tensor& lines, const torch::Tensor& scales) {
  const int64_t rows = x.size(0), K = x.size(1), blocks = lines.size(0), N = blocks * kOutputs;
  auto result = torch::empty({rows, N}, x.options());
  const BFloat16* in = x.data_ptr<BFloat16>();
  BFloat16* out = result.data_ptr<BFloat16>();
  const Int8Weights w{lines.data_ptr<int8_t>(), scales.data_ptr<BFloat16>(), K / kGroup, N};
  run_rows(rows, blocks, [&](auto R, int64_t r0, int64_t block) {
    int8_pass<decltype(R)::value>(w, in + r0 * K, out + r0 * N, K, block);
  });
  return result;
}

}  // namespace
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // PC_RAG_DOT_COMPILES

namespace pc_rag {

#ifdef PC_RAG_DOT_COMPILES
bool dot_available() { return dot_usable(); }
#else
bool dot_available() { return false; }
#endif

torch::Tensor dot_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t bits) {
  TORCH_CHECK(dot_available(), "dot_linear: this CPU has no AVX-512 BF16 (or ATEN_CPU_CAPABILITY asks for less)");
  check_rows_and_scales("dot_linear", x, scales, bits);
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(1) * kGroup == x.size(1) &&
                  packed.size(2) == (bits == 4 ? 256 : 512),
              "dot_linear: int", bits, " blocks of ", packed.size(1) * kGroup, " inputs for rows of ", x.size(1));
  if (bits == 4) {
    TORCH_CHECK(packed.scalar_type() == torch::kUInt8, "dot_linear: int4 blocks are uint8");
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == packed.size(0) && scales.size(1) == packed.size(1) &&
                    scales.size(2) == 32,
                "dot_linear: int4 scales must be [out / 16, in / 32, 32]");
#ifdef PC_RAG_DOT_COMPILES
    return int4_dot(x, packed, scales);
#endif
  }
  TORCH_CHECK(packed.scalar_type() == torch::kInt8, "dot_linear: int8 blocks are int8");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == packed.size(0) * kOutputs, "dot_linear: int8 scales [out]");
#ifdef PC_RAG_DOT_COMPILES
  return int8_dot(x, packed, scales);
#else
  TORCH_CHECK(false, "dot_linear: built without AVX-512 BF16");
#endif
}

}  // namespace pc_rag
