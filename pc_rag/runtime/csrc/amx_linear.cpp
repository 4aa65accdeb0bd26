// Quantized linear layers on AMX tiles: a few bfloat16 rows times int4 or int8 weights dequantized to bfloat16.
//
// The fused int4/int8 kernels of ATen (_weight_int4pack_mm_for_cpu, _weight_int8pack_mm) dequantize a weight
// block to float32 and run one FMA per weight per row: a verify step's every extra row costs another pass of
// FMAs over every weight (on SmolLM2 in int4, +17% of a one-row step per row at 1K tokens). Here a block of
// weights (16 outputs x 32 inputs) is dequantized once to bfloat16 and multiplied on AMX (TDPBF16PS: up to 16
// rows, products exact in float32, float32 sums), so rows up to 16 cost about what one row costs: the dequant.
//
// The dequantized weight is the one the dense path holds (weights.QuantizedLinear.weight): int4
// (q - 8) * scale + zero in one float32 rounding (an FMA), int8 q * scale, each then rounded to bfloat16. So a
// decode step multiplies by the weights prefill uses. A row's bits depend on that row only (each output is the
// same chain of TDPBF16PS over its own row), never on the other rows or their number.
//
// Layout (weights.amx_pack): per block of 16 outputs and 32 inputs, 16 lines (one per input pair p); a line
// dequantizes to a TDPBF16PS B row, whose element e is output e / 2's input 2p + e % 2. int4 lines are 16 bytes,
// byte t holding elements t (low nibble) and t + 16 (high); int8 lines are the 32 elements.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

// Linux on x86-64 with a compiler that knows the AMX intrinsics (GCC 11, Clang 12); elsewhere amx_available()
// is false.
#if defined(__linux__) && defined(__x86_64__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define PC_RAG_AMX_COMPILES 1
#endif

namespace {

constexpr int64_t kOutputs = 16;  // outputs per block: a C tile's 16 float32 columns
constexpr int64_t kInputs = 32;   // inputs per block: a tile row of 32 bfloat16 (one int4 group)
constexpr int64_t kRows = 16;     // rows per tile
constexpr long kReqPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
constexpr long kTileData = 18;           // XFEATURE_XTILEDATA

// Whether AMX runs here: the CPU has AMX-BF16 and AVX-512 BF16, Linux lets this process use tile data, and
// ATEN_CPU_CAPABILITY (torch's switch for its own kernels) does not ask for less than AVX-512.
#ifdef PC_RAG_AMX_COMPILES
bool amx_usable() {
  static const bool usable = [] {
    const char* asked = std::getenv("ATEN_CPU_CAPABILITY");
    if (asked != nullptr && std::strncmp(asked, "avx512", 6) != 0 && std::strncmp(asked, "AVX512", 6) != 0)
      return false;
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-bf16") ||
        !__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512bw"))
      return false;
    return syscall(SYS_arch_prctl, kReqPermission, kTileData) == 0;
  }();
  return usable;
}
#endif

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

#ifdef PC_RAG_AMX_COMPILES
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile,amx-bf16")
#endif
namespace {

// tile registers (the tile intrinsics take literal numbers)
#define PC_RAG_TILE_C 0
#define PC_RAG_TILE_A 1
#define PC_RAG_TILE_B 2
constexpr int kC = PC_RAG_TILE_C, kA = PC_RAG_TILE_A, kB = PC_RAG_TILE_B;

// Tiles for m (1..16) rows: C [m, 16] float32, A [m, 32] bfloat16, B [16, 32] bfloat16 (16 pairs x 16 outputs).
void configure(int64_t m) {
  TileConfig config;
  config.rows[kC] = static_cast<uint8_t>(m);
  config.bytes_per_row[kC] = kOutputs * 4;
  config.rows[kA] = static_cast<uint8_t>(m);
  config.bytes_per_row[kA] = kInputs * 2;
  config.rows[kB] = kInputs / 2;
  config.bytes_per_row[kB] = kOutputs * 4;
  _tile_loadconfig(&config);
}

// The float32 vectors of one block's 16 outputs, each twice (a B row's lanes): scales and zeros of elements
// 0..15 (outputs 0..7) and 16..31 (outputs 8..15).
struct BlockScales {
  __m512 scale_low, scale_high, zero_low, zero_high;
};

inline __m512 widen(__m256i bf16) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16)); }

// pairs: 16 (scale, zero) bfloat16 pairs of consecutive outputs.
inline BlockScales block_scales(const at::BFloat16* pairs) {
  const __m512i all = _mm512_loadu_si512(pairs);
  const __m512 first = widen(_mm512_castsi512_si256(all));        // s0 z0 .. s7 z7
  const __m512 second = widen(_mm512_extracti64x4_epi64(all, 1)); // s8 z8 .. s15 z15
  const __m512i scale_index = _mm512_set_epi32(14, 14, 12, 12, 10, 10, 8, 8, 6, 6, 4, 4, 2, 2, 0, 0);
  const __m512i zero_index = _mm512_set_epi32(15, 15, 13, 13, 11, 11, 9, 9, 7, 7, 5, 5, 3, 3, 1, 1);
  return {_mm512_permutexvar_ps(scale_index, first), _mm512_permutexvar_ps(scale_index, second),
          _mm512_permutexvar_ps(zero_index, first), _mm512_permutexvar_ps(zero_index, second)};
}

constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// One int4 block (16 lines of 16 bytes) into a B tile's 16 rows of 32 bfloat16: a line's low nibbles are the
// row's elements 0..15, its high nibbles 16..31. A nibble becomes q - 8 by table lookup (vpermps reads an
// index's low 4 bits), then (q - 8) * scale + zero in one FMA (one rounding to float32).
inline void dequant_int4(const uint8_t* lines, const BlockScales& s, at::BFloat16* tile) {
  const __m512 centered = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
  for (int64_t p = 0; p < kInputs / 2; ++p) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lines + p * 16)));
    const __m512 q0 = _mm512_permutexvar_ps(bytes, centered);
    const __m512 q1 = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), centered);
    const __m512 w0 = _mm512_fmadd_round_ps(q0, s.scale_low, s.zero_low, kRound);
    const __m512 w1 = _mm512_fmadd_round_ps(q1, s.scale_high, s.zero_high, kRound);
    _mm512_storeu_si512(tile + p * 32, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
  }
}

// One int8 block (16 lines of 32 bytes) into a B tile, each output's weights q * scale.
inline void dequant_int8(const int8_t* lines, __m512 scale_low, __m512 scale_high, at::BFloat16* tile) {
  for (int64_t p = 0; p < kInputs / 2; ++p) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lines + p * 32));
    const __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
    const __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
    const __m512 w0 = _mm512_mul_round_ps(q0, scale_low, kRound);
    const __m512 w1 = _mm512_mul_round_ps(q1, scale_high, kRound);
    _mm512_storeu_si512(tile + p * 32, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
  }
}

// C [m, 16] float32 rounded into out's m rows (row stride `stride`), columns n0..n0+15.
inline void store_rows(at::BFloat16* out, int64_t stride, int64_t m) {
  alignas(64) float c[kRows * kOutputs];
  _tile_stored(PC_RAG_TILE_C, c, kOutputs * 4);
  for (int64_t r = 0; r < m; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * stride),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c + r * kOutputs)));
}

// x[rows, K] times the blocks' weights: [rows, N]; `dequant(block, kb, tile)` fills a B tile.
template <typename Dequant>
torch::Tensor amx_matmul(const torch::Tensor& x, int64_t N, Dequant dequant) {
  const int64_t rows = x.size(0), K = x.size(1), blocks = N / kOutputs, steps = K / kInputs;
  auto result = torch::empty({rows, N}, x.options());
  const at::BFloat16* in = x.data_ptr<at::BFloat16>();
  at::BFloat16* out = result.data_ptr<at::BFloat16>();
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    alignas(64) at::BFloat16 tile[kInputs * kOutputs];
    for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
      const int64_t m = std::min(kRows, rows - r0);
      configure(m);
      for (int64_t block = first; block < last; ++block) {
        _tile_zero(PC_RAG_TILE_C);
        for (int64_t kb = 0; kb < steps; ++kb) {
          dequant(block, kb, tile);
          _tile_loadd(PC_RAG_TILE_B, tile, kOutputs * 4);
          _tile_loadd(PC_RAG_TILE_A, in + r0 * K + kb * kInputs, K * 2);
          _tile_dpbf16ps(PC_RAG_TILE_C, PC_RAG_TILE_A, PC_RAG_TILE_B);
        }
        store_rows(out + r0 * N + block * kOutputs, N, m);
      }
      _tile_release();
    }
  });
  return result;
}

torch::Tensor int4_on_tiles(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales_and_zeros) {
  const int64_t N = scales_and_zeros.size(1), steps = packed.size(1);
  const uint8_t* lines = packed.data_ptr<uint8_t>();
  const at::BFloat16* pairs = scales_and_zeros.data_ptr<at::BFloat16>();
  return amx_matmul(x, N, [&](int64_t block, int64_t kb, at::BFloat16* tile) {
    dequant_int4(lines + (block * steps + kb) * 256, block_scales(pairs + (kb * N + block * kOutputs) * 2), tile);
  });
}

torch::Tensor int8_on_tiles(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  const int64_t N = scales.size(0), steps = packed.size(1);
  const int8_t* lines = packed.data_ptr<int8_t>();
  const at::BFloat16* scale = scales.data_ptr<at::BFloat16>();
  const __m512i low = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // outputs 0..7, each twice
  const __m512i high = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  return amx_matmul(x, N, [&](int64_t block, int64_t kb, at::BFloat16* tile) {
    const __m512 s = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + block * kOutputs)));
    dequant_int8(lines + (block * steps + kb) * 512, _mm512_permutexvar_ps(low, s), _mm512_permutexvar_ps(high, s),
                 tile);
  });
}

}  // namespace
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // PC_RAG_AMX_COMPILES

namespace pc_rag {

#ifdef PC_RAG_AMX_COMPILES
bool amx_available() { return amx_usable(); }
#else
bool amx_available() { return false; }
#endif

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, int64_t bits) {
  TORCH_CHECK(amx_available(), "amx_linear: AMX is not usable on this CPU or process");
  check_rows_and_scales("amx_linear", x, scales, bits);
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(1) * kInputs == x.size(1),
              "amx_linear: packed weights of ", packed.size(1) * kInputs, " inputs for rows of ", x.size(1));
  if (bits == 4) {
    TORCH_CHECK(scales.dim() == 3 && scales.size(0) == packed.size(1) && scales.size(1) == packed.size(0) * kOutputs &&
                    scales.size(2) == 2,
                "amx_linear: int4 scales_and_zeros must be [in / 32, out, 2]");
#ifdef PC_RAG_AMX_COMPILES
    return int4_on_tiles(x, packed, scales);
#endif
  }
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == packed.size(0) * kOutputs, "amx_linear: int8 scales [out]");
#ifdef PC_RAG_AMX_COMPILES
  return int8_on_tiles(x, packed, scales);
#else
  TORCH_CHECK(false, "amx_linear: built without AMX");
#endif
}

}  // namespace pc_rag
