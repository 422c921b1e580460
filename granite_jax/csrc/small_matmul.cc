// The products of a decoding step in float32 for the few rows of x (granite_jax/cpu_kernels.py): three kernels.
//
// MatVec, one row of x, W as it is, (N, K) row-major. XLA:CPU walks W a few rows at a time, so at K = 768 it
// starts a new 3 KB stream every few rows and the hardware prefetchers, which learn one stream at a time, lag:
// 21 GB/s where K = 8192 reaches 24-25. Here each thread reads STREAMS far-apart row ranges at once, one row of each
// per step, so every range is one long sequential stream (24-34 GB/s on a chain of the decode step's products on
// this repository's 2-core test VM, 1.2-1.4x the few-rows-at-a-time order in the same run).
//
// ExpertMatvec, a few rows of x each through its own expert's matrix, W stacked (E, K, N) row-major as in the model
// (`model.MoE`): y[r] = x[r] W[e[r]]. XLA gathers the chosen experts' matrices into a copy first, at a few GB/s;
// here each row reads its expert in place, K split into chunks that the threads share, each chunk's rows of W read
// as one sequential stream and accumulated into a partial y (N floats, L1-resident) four rows of W at a time; the
// partials are summed at the end.
//
// SmallMatmul, 2-16 rows of x, W packed in panels:
// x (..., K) row-major, W packed as (P, K, 8): panel p holds rows 8p..8p+7 of the (N, K) matrix interleaved, so that
// p[k, c] = W[8p + c, k] (rows past N are zero), y (..., N). For up to 16 rows of x the product is bound by reading W
// once, which XLA:CPU's library GEMMs do not reach (docs/generation.md). Each panel is one contiguous stream
// (prefetched PREFETCH_BYTES ahead) multiplied against up to eight rows of x at a time, transposed beforehand to
// (K, 8) so that the eight values of one k share a cache line: per k, one load of W, eight broadcasts of x and eight
// FMAs into eight accumulators of eight outputs each, no horizontal sums. On this repository's 2-core test VM this
// streams W 1.2-1.6x faster than a kernel on the (N, K) layout that tiles three rows of W against four of x. The
// panels are cut into chunks that the calling thread and XLA's intra-op thread pool share (parallel.h).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int LANES = 8;                // outputs per panel, and rows of x per group: one AVX2 vector
constexpr int64_t MAX_ROWS = 16;          // rows of x (cpu_kernels.MAX_ROWS)
constexpr int64_t PREFETCH_BYTES = 2048;  // measured best of 512-4096 on the test VM
constexpr int64_t K_BLOCK = 256;          // 8 KB of a panel: L1-resident while a second group of rows reuses it
constexpr int STREAMS = 4;                // row ranges a thread reads at once in MatVec (4 and 8 measured best)

// y[n] = w[n, :] . x for the rows n = r0 + s * len + i, s < S, i < len: S sequential streams through W.
template <int S>
void row_streams(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t K, int64_t r0,
                 int64_t len) {
  for (int64_t i = 0; i < len; ++i) {
    const float* row[S];
    __m256 acc[S];
    for (int s = 0; s < S; ++s) {
      row[s] = w + (r0 + s * len + i) * K;
      acc[s] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + LANES <= K; k += LANES) {
      const __m256 xv = _mm256_loadu_ps(x + k);
      for (int s = 0; s < S; ++s) acc[s] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(row[s] + k), acc[s]);
    }
    for (int s = 0; s < S; ++s) {
      float sum = granite::horizontal_sum(acc[s]);
      for (int64_t j = k; j < K; ++j) sum += row[s][j] * x[j];
      y[r0 + s * len + i] = sum;
    }
  }
}

// Rows [r0, r1) of y = W x: STREAMS streams of equal length, the rest one row at a time.
void matvec_rows(const float* x, const float* w, float* y, int64_t K, int64_t r0, int64_t r1) {
  const int64_t len = (r1 - r0) / STREAMS;
  row_streams<STREAMS>(x, w, y, K, r0, len);
  row_streams<1>(x, w, y, K, r0 + STREAMS * len, r1 - r0 - STREAMS * len);
}

// y[:N] = x[k0:k1] W[k0:k1, :] for one row of x and one (K, N) matrix W: rows of W in order, four at a time.
void rows_axpy(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t N, int64_t k0,
               int64_t k1) {
  std::fill(y, y + N, 0.0f);
  int64_t k = k0;
  for (; k + 4 <= k1; k += 4) {
    const float* r = w + k * N;
    const __m256 a0 = _mm256_set1_ps(x[k]), a1 = _mm256_set1_ps(x[k + 1]);
    const __m256 a2 = _mm256_set1_ps(x[k + 2]), a3 = _mm256_set1_ps(x[k + 3]);
    int64_t n = 0;
    for (; n + LANES <= N; n += LANES) {
      __m256 acc = _mm256_loadu_ps(y + n);
      acc = _mm256_fmadd_ps(a0, _mm256_loadu_ps(r + n), acc);
      acc = _mm256_fmadd_ps(a1, _mm256_loadu_ps(r + N + n), acc);
      acc = _mm256_fmadd_ps(a2, _mm256_loadu_ps(r + 2 * N + n), acc);
      acc = _mm256_fmadd_ps(a3, _mm256_loadu_ps(r + 3 * N + n), acc);
      _mm256_storeu_ps(y + n, acc);
    }
    for (; n < N; ++n) y[n] += x[k] * r[n] + x[k + 1] * r[N + n] + x[k + 2] * r[2 * N + n] + x[k + 3] * r[3 * N + n];
  }
  for (; k < k1; ++k) {
    const float* r = w + k * N;
    for (int64_t n = 0; n < N; ++n) y[n] += x[k] * r[n];
  }
}

// acc[i, c] (+)= sum_k xt[k, i] w[k, c] over k in [k0, k1) for the MB rows of one group against one panel; acc holds
// MB x 8 floats, zeroed first when `first`.
template <int MB>
void panel_group(const float* __restrict xt, const float* __restrict w, float* __restrict acc_io, int64_t k0,
                 int64_t k1, bool first, bool prefetch) {
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc_io + i * LANES);
  auto step = [&](int64_t k) {
    const __m256 wv = _mm256_loadu_ps(w + k * LANES);
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(xt + k * LANES + i), wv, acc[i]);
  };
  int64_t k = k0;
  if (prefetch) {  // one 64-byte line of W per two k
    for (; k + 2 <= k1; k += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(w + k * LANES) + PREFETCH_BYTES, _MM_HINT_T0);
      step(k);
      step(k + 1);
    }
  }
  for (; k < k1; ++k) step(k);
  for (int i = 0; i < MB; ++i) _mm256_store_ps(acc_io + i * LANES, acc[i]);
}

void group(int64_t rows, const float* xt, const float* w, float* acc, int64_t k0, int64_t k1, bool first,
           bool prefetch) {
  switch (rows) {
    case 8: panel_group<8>(xt, w, acc, k0, k1, first, prefetch); break;
    case 7: panel_group<7>(xt, w, acc, k0, k1, first, prefetch); break;
    case 6: panel_group<6>(xt, w, acc, k0, k1, first, prefetch); break;
    case 5: panel_group<5>(xt, w, acc, k0, k1, first, prefetch); break;
    case 4: panel_group<4>(xt, w, acc, k0, k1, first, prefetch); break;
    case 3: panel_group<3>(xt, w, acc, k0, k1, first, prefetch); break;
    case 2: panel_group<2>(xt, w, acc, k0, k1, first, prefetch); break;
    default: panel_group<1>(xt, w, acc, k0, k1, first, prefetch); break;
  }
}

// Panels [p0, p1) against every row of x (M <= MAX_ROWS rows, transposed in groups of eight: xt (G, K, 8)). With
// more than one group, K is walked in blocks of K_BLOCK so that every group finds the block of the panel in L1;
// only the first group prefetches.
void panels(const float* xt, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  alignas(32) float acc[MAX_ROWS * LANES];
  const int64_t block = M > LANES ? K_BLOCK : K;
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = w + p * K * LANES;
    for (int64_t k0 = 0; k0 < K; k0 += block) {
      const int64_t k1 = std::min(K, k0 + block);
      for (int64_t m = 0; m < M; m += LANES) {
        group(std::min<int64_t>(LANES, M - m), xt + m * K, panel, acc + m * LANES, k0, k1, k0 == 0, m == 0);
      }
    }
    const int64_t cols = std::min<int64_t>(LANES, N - p * LANES);
    for (int64_t m = 0; m < M; ++m) std::copy(acc + m * LANES, acc + m * LANES + cols, y + m * N + p * LANES);
  }
}

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto x_dims = x.dimensions();
  auto w_dims = w.dimensions();
  auto y_dims = y->dimensions();
  if (w_dims.size() != 3 || w_dims[2] != LANES || x_dims.size() < 1 || x_dims.back() != w_dims[1] ||
      y_dims.size() != x_dims.size() || y_dims.back() > w_dims[0] * LANES || y_dims.back() <= (w_dims[0] - 1) * LANES) {
    return ffi::Error::InvalidArgument("small_matmul: expected x (..., K), w (ceil(N / 8), K, 8) and y (..., N)");
  }
  const int64_t K = w_dims[1], N = y_dims.back(), P = w_dims[0];
  const int64_t M = K == 0 ? 0 : static_cast<int64_t>(x.element_count()) / K;
  float* out = y->typed_data();
  if (K == 0) {
    std::fill(out, out + y->element_count(), 0.0f);
    return ffi::Error::Success();
  }
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (M > MAX_ROWS) return ffi::Error::InvalidArgument("small_matmul: more than 16 rows of x");

  // x transposed in groups of eight rows: xt[g, k, i] = x[8g + i, k] (zero past M).
  const int64_t groups = (M + LANES - 1) / LANES;
  std::vector<float> xt(groups * K * LANES, 0.0f);
  const float* xs = x.typed_data();
  for (int64_t m = 0; m < M; ++m) {
    float* dst = xt.data() + (m / LANES) * K * LANES + m % LANES;
    for (int64_t k = 0; k < K; ++k) dst[k * LANES] = xs[m * K + k];
  }

  const float* ws = w.typed_data();
  const float* xts = xt.data();
  const int64_t chunk = granite::chunk_length(pool, P, 8, 2);
  granite::parallel_chunks(pool, (P + chunk - 1) / chunk, [=](int64_t c) {
    panels(xts, ws, out, M, K, N, c * chunk, std::min(P, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

ffi::Error MatVec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  auto x_dims = x.dimensions();
  auto w_dims = w.dimensions();
  if (w_dims.size() != 2 || x_dims.size() < 1 || x_dims.back() != w_dims[1] || x.element_count() != w_dims[1] ||
      y->element_count() != w_dims[0]) {
    return ffi::Error::InvalidArgument("matvec: expected x (..., K) with one row, w (N, K) and y (..., N)");
  }
  const int64_t N = w_dims[0], K = w_dims[1];
  float* out = y->typed_data();
  if (K == 0) {
    std::fill(out, out + N, 0.0f);
    return ffi::Error::Success();
  }
  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  const int64_t chunk = granite::chunk_length(pool, N, 8 * STREAMS, 2);
  granite::parallel_chunks(pool, (N + chunk - 1) / chunk, [=](int64_t c) {
    matvec_rows(xs, ws, out, K, c * chunk, std::min(N, (c + 1) * chunk));
  });
  return ffi::Error::Success();
}

ffi::Error ExpertMatvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::Buffer<ffi::S32> experts, ffi::ResultBuffer<ffi::F32> y) {
  auto x_dims = x.dimensions();
  auto w_dims = w.dimensions();
  auto y_dims = y->dimensions();
  if (w_dims.size() != 3 || x_dims.size() != 2 || x_dims[1] != w_dims[1] || experts.element_count() != x_dims[0] ||
      y_dims.size() != 2 || y_dims[0] != x_dims[0] || y_dims[1] != w_dims[2]) {
    return ffi::Error::InvalidArgument("expert_matvec: expected x (R, K), w (E, K, N), experts (R,) and y (R, N)");
  }
  const int64_t R = x_dims[0], K = w_dims[1], N = w_dims[2], E = w_dims[0];
  const int32_t* ids = experts.typed_data();
  for (int64_t r = 0; r < R; ++r) {
    if (ids[r] < 0 || ids[r] >= E) return ffi::Error::InvalidArgument("expert_matvec: an expert index is out of range");
  }
  float* out = y->typed_data();
  if (R == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(out, out + R * N, 0.0f);
    return ffi::Error::Success();
  }
  // Work items (row, chunk of K); each writes its partial y, summed below.
  const int64_t chunk = granite::chunk_length(pool, K, 64, 2);
  const int64_t per_row = (K + chunk - 1) / chunk;
  std::vector<float> partial(R * per_row * N);
  const float* xs = x.typed_data();
  const float* ws = w.typed_data();
  float* parts = partial.data();
  granite::parallel_chunks(pool, R * per_row, [=](int64_t item) {
    const int64_t r = item / per_row, c = item % per_row;
    const int64_t k0 = c * chunk, k1 = std::min(K, k0 + chunk);
    rows_axpy(xs + r * K, ws + ids[r] * K * N, parts + item * N, N, k0, k1);
  });
  for (int64_t r = 0; r < R; ++r) {
    float* dst = out + r * N;
    std::copy(parts + r * per_row * N, parts + (r * per_row + 1) * N, dst);
    for (int64_t c = 1; c < per_row; ++c) {
      const float* src = parts + (r * per_row + c) * N;
      for (int64_t n = 0; n < N; ++n) dst[n] += src[n];
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_expert_matvec_f32, ExpertMatvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_matvec_f32, MatVec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_small_matmul_f32, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
