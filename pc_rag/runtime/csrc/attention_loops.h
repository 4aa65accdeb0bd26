// The attention kernel's inner loops over one vector width: decode_attention.cpp includes this file once per width,
// inside a namespace that defines Vec (lanes8 for AVX2, lanes16 for AVX-512, compiled for that target). No include
// guard on purpose. dim is a multiple of Vec::lanes; each head's sums are its own chains, in the same order for any
// number N of heads, so a head's bits do not depend on the heads beside it.

// Scores of N query heads q[n] [dim] against count key slots [count, stride]: each key vector is loaded once for
// the N heads. Prefetches (which never fault, so past the cache's end too) bring the keys ahead and the same slots'
// values for weighted_values: a cold cache read at ~10 GB/s without them.
template <int N, typename T>
void scores_of(const float* const* q, const T* keys, int64_t stride, int64_t dim, int64_t count, float scale,
               float* const* out, const T* prefetch_values) {
  constexpr int64_t L = Vec::lanes;
  const int64_t vectors = dim / L;
  int64_t s = 0;
  for (; s + 4 <= count; s += 4) {  // four slots at a time, reduced together
    typename Vec::reg a[N][4];
    for (int n = 0; n < N; ++n)
      for (int t = 0; t < 4; ++t) a[n][t] = Vec::zero();
    for (int t = 0; t < 4; ++t) {  // the keys 16 slots on and these slots' values, into L1 ahead of use
      prefetch_row(keys + (s + 16 + t) * stride, dim);
      prefetch_row(prefetch_values + (s + t) * stride, dim);
    }
    for (int64_t j = 0; j < vectors; ++j) {
      const auto k0 = Vec::load(keys + (s + 0) * stride + L * j), k1 = Vec::load(keys + (s + 1) * stride + L * j);
      const auto k2 = Vec::load(keys + (s + 2) * stride + L * j), k3 = Vec::load(keys + (s + 3) * stride + L * j);
      for (int n = 0; n < N; ++n) {
        const auto qj = Vec::load(q[n] + L * j);
        a[n][0] = Vec::fma(qj, k0, a[n][0]);
        a[n][1] = Vec::fma(qj, k1, a[n][1]);
        a[n][2] = Vec::fma(qj, k2, a[n][2]);
        a[n][3] = Vec::fma(qj, k3, a[n][3]);
      }
    }
    for (int n = 0; n < N; ++n) {
      __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(Vec::half(a[n][0]), Vec::half(a[n][1])),
                                _mm256_hadd_ps(Vec::half(a[n][2]), Vec::half(a[n][3])));
      __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
      _mm_storeu_ps(out[n] + s, _mm_mul_ps(sums, _mm_set1_ps(scale)));
    }
  }
  for (; s < count; ++s) {
    for (int n = 0; n < N; ++n) {
      auto a = Vec::zero();
      for (int64_t j = 0; j < vectors; ++j)
        a = Vec::fma(Vec::load(q[n] + L * j), Vec::load(keys + s * stride + L * j), a);
      out[n][s] = hsum(Vec::half(a)) * scale;
    }
  }
}

// weighted_values over W vectors of dims: W a constant, so the accumulators stay in registers.
template <int N, int W, typename T>
void weighted_block(const float* const* weights, const T* values, int64_t stride, int64_t count, float* const* acc) {
  constexpr int64_t L = Vec::lanes;
  typename Vec::reg o[N][W];
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < W; ++j) o[n][j] = Vec::zero();
  for (int64_t s = 0; s < count; ++s) {
    typename Vec::reg w[N];
    for (int n = 0; n < N; ++n) w[n] = Vec::set1(weights[n][s]);
    for (int j = 0; j < W; ++j) {
      const auto v = Vec::load(values + s * stride + L * j);
      for (int n = 0; n < N; ++n) o[n][j] = Vec::fma(w[n], v, o[n][j]);
    }
  }
  for (int n = 0; n < N; ++n)
    for (int j = 0; j < W; ++j) Vec::store(acc[n] + L * j, o[n][j]);
}

// acc[n] [dim] = sum over count slots of weights[n][s] * values[s]: each value vector loaded once for the N heads,
// WIDTH vectors of dims at a time (up to 6 x 4 accumulators, 6 weights and a value: 31 of AVX-512's 32 registers,
// 3 x 4 + 3 + 1 of AVX2's 16).
template <int N, typename T>
void weighted_values(const float* const* weights, const T* values, int64_t stride, int64_t dim, int64_t count,
                     float* const* acc) {
  constexpr int64_t L = Vec::lanes;
  constexpr int WIDTH = 4;
  for (int64_t d = 0; d < dim; d += L * WIDTH) {
    float* at[N];
    for (int n = 0; n < N; ++n) at[n] = acc[n] + d;
    switch (std::min<int64_t>(WIDTH, (dim - d) / L)) {
      case 4: weighted_block<N, 4, T>(weights, values + d, stride, count, at); break;
      case 3: weighted_block<N, 3, T>(weights, values + d, stride, count, at); break;
      case 2: weighted_block<N, 2, T>(weights, values + d, stride, count, at); break;
      default: weighted_block<N, 1, T>(weights, values + d, stride, count, at); break;
    }
  }
}
