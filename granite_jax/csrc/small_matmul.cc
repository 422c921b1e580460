// y = x W^T in float32 for a few rows of x: the products of decoding (granite_jax/cpu_kernels.py).
//
// x (M, K) and W (N, K) row-major, y (M, N). For M <= 16 this is bound by reading W once, which XLA:CPU's
// library GEMMs do not reach on small M (docs/generation.md). Here W is streamed once, a tile of NB rows at a
// time, each tile multiplied against every row of x (which stays in cache), both operands vectorized along K
// (AVX2 + FMA, eight float32 lanes), with W prefetched four tiles ahead. The N rows are cut into chunks that the
// calling thread and XLA's intra-op thread pool share (parallel.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using granite::horizontal_sum;

constexpr int NB_ROWS = 3;  // rows of W per tile: 4 x 3 accumulators + 3 W + 1 x registers fill AVX2's 16

// y[i, j] = sum_k x[i, k] w[j, k] for MB rows of x and NB rows of w (MB * NB accumulators, NB + 1 live loads).
// While streaming, touch the same K range of the NB rows at `prefetch` (null: none; rows at or past `end` are not
// prefetched). The prefetches are unconditional, one 64-byte line per row every 16 floats: a branch on them in
// the loop made the compiler spill the accumulators.
template <int MB, int NB>
inline void tile(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t K, int64_t N,
                 const char* prefetch, const char* end) {
  const char* ahead[NB];
  for (int j = 0; j < NB; ++j) {
    const char* row = prefetch == nullptr ? nullptr : prefetch + j * K * sizeof(float);
    ahead[j] = row != nullptr && row < end ? row : reinterpret_cast<const char*>(w + j * K);  // else: own row
  }
  __m256 acc[MB][NB];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_ps();
  auto step = [&](int64_t k) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = _mm256_loadu_ps(w + j * K + k);
    for (int i = 0; i < MB; ++i) {
      __m256 xv = _mm256_loadu_ps(x + i * K + k);
      for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  };
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    for (int j = 0; j < NB; ++j) _mm_prefetch(ahead[j] + k * sizeof(float), _MM_HINT_T0);
    step(k);
    step(k + 8);
  }
  for (; k + 8 <= K; k += 8) step(k);
  for (int i = 0; i < MB; ++i) {
    for (int j = 0; j < NB; ++j) {
      float s = horizontal_sum(acc[i][j]);
      for (int64_t r = k; r < K; ++r) s += x[i * K + r] * w[j * K + r];
      y[i * N + j] = s;
    }
  }
}

// Every row of x against NB rows of w, four rows of x at a time; only the first group prefetches.
template <int NB>
void tile_all_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, const char* prefetch,
                   const char* end) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4, prefetch = nullptr) tile<4, NB>(x + m * K, w, y + m * N, K, N, prefetch, end);
  switch (M - m) {
    case 3: tile<3, NB>(x + m * K, w, y + m * N, K, N, prefetch, end); break;
    case 2: tile<2, NB>(x + m * K, w, y + m * N, K, N, prefetch, end); break;
    case 1: tile<1, NB>(x + m * K, w, y + m * N, K, N, prefetch, end); break;
    default: break;
  }
}

// Columns [n0, n1) of y.
template <int NB>
void columns(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const char* end = reinterpret_cast<const char*>(w + n1 * K);
  int64_t n = n0;
  for (; n + NB <= n1; n += NB) {
    const char* prefetch = reinterpret_cast<const char*>(w + (n + 4 * NB) * K);
    tile_all_rows<NB>(x, w + n * K, y + n, M, K, N, prefetch, end);
  }
  for (; n < n1; ++n) tile_all_rows<1>(x, w + n * K, y + n, M, K, N, nullptr, end);
}

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto x_dims = x.dimensions();
  auto w_dims = w.dimensions();
  if (w_dims.size() != 2 || x_dims.size() < 1 || x_dims.back() != w_dims[1]) {
    return ffi::Error::InvalidArgument("small_matmul: expected x (..., K) and w (N, K)");
  }
  const int64_t K = w_dims[1], N = w_dims[0];
  const int64_t M = K == 0 ? 0 : static_cast<int64_t>(x.element_count()) / K;
  float* out = y->typed_data();
  if (K == 0) {
    std::fill(out, out + y->element_count(), 0.0f);
    return ffi::Error::Success();
  }
  if (M == 0 || N == 0) return ffi::Error::Success();

  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per_chunk = std::max<int64_t>(48, (N + 2 * threads - 1) / (2 * threads));  // ~2 chunks a thread
  const int64_t chunk = (per_chunk + NB_ROWS - 1) / NB_ROWS * NB_ROWS;
  granite::parallel_chunks(pool, (N + chunk - 1) / chunk, [=](int64_t c) {
    columns<NB_ROWS>(xs, ws, out, M, K, N, c * chunk, std::min(N, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_small_matmul_f32, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
