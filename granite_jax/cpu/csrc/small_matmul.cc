// The products of a decoding step for the few rows of x, and of the routed experts (granite_jax/cpu/backend.py):
// three kernels. W is float32 or bfloat16 (each kernel a template over its element type, `load8` widening bfloat16
// to float32 in registers, exactly); x, y and the arithmetic are float32. At the end of this file, two that widen
// bfloat16 weights for XLA: Widen, for its products of many rows, and TakeRows, the embedding lookup.
//
// MatVec, one row of x, W as it is, (N, K) row-major. XLA:CPU walks W a few rows at a time, so at K = 768 it
// starts a new 3 KB stream every few rows and the hardware prefetchers, which learn one stream at a time, lag:
// 21 GB/s where K = 8192 reaches 24-25. Here each thread reads STREAMS far-apart row ranges at once, one row of each
// per step, so every range is one long sequential stream (1.2-1.4x the few-rows-at-a-time order on a chain of the
// decode step's products). Each stream is also prefetched PREFETCH_BYTES ahead in software: the hardware prefetchers
// alone read a chain of h-350m's 3376 x 768 bfloat16 matrices more slowly than float32 ones (24.5 against 29.1 GB/s
// on a 2-core Intel Xeon); prefetched, both stream at the same rate (batch-1 decode on bfloat16 weights 1.15x, on
// float32 1.07x).
//
// ExpertMatvec, rows of x each through its own expert's matrix, W stacked (E, K, N) row-major as in the model
// (`model.MoE`): y[r] = x[r] W[e[r]]. XLA gathers the chosen experts' matrices into a copy first, at a few GB/s, or
// (many rows) runs blocks of rows padded per expert; here the rows are sorted by expert and each chosen expert is read
// in place, once for all its rows: K is cut into chunks that the threads share (as few as keep them all busy). Up to
// three rows of an expert read each chunk's rows of W in order, one at a time (one sequential stream), every load fed
// to two rows, into partials that stay in L1; four or more (prefill) copy 64-row blocks of W into 16-column strips
// and run tiles of four rows against them in registers (`expert_rows`). The partials of K's chunks are summed at the
// end.
//
// SmallMatmul, 2-16 rows of x, W packed in panels:
// x (..., K) row-major, W packed as (P, K, 8): panel p holds rows 8p..8p+7 of the (N, K) matrix interleaved, so that
// p[k, c] = W[8p + c, k] (rows past N are zero), y (..., N). For up to 16 rows of x the product is bound by reading W
// once, which XLA:CPU's library GEMMs do not reach (docs/kernels.md). Each panel is one contiguous stream
// (prefetched PREFETCH_BYTES ahead) multiplied against up to eight rows of x at a time, transposed beforehand to
// (K, 8) so that the eight values of one k share a cache line: per k, one load of W, eight broadcasts of x and eight
// FMAs into eight accumulators of eight outputs each, no horizontal sums. This streams W 1.2-1.6x faster than a
// kernel on the (N, K) layout that tiles three rows of W against four of x. The panels are cut into chunks that the
// calling thread and XLA's intra-op thread pool share (parallel.h). Where the library is built for AVX-512 (build.py
// does so on CPUs that have it), four panels of float32 weights are taken at once, as two 16-lane vectors: a quarter
// of the broadcasts per panel and half the instructions, which at eight rows, where the panel kernel is bound by
// arithmetic, read W 1.1-1.3x faster (AMD Zen 4).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int LANES = 8;                // outputs per panel, and rows of x per group: one AVX2 vector
constexpr int64_t MAX_ROWS = 16;          // rows of x (packing.MAX_ROWS)
constexpr int64_t K_BLOCK = 256;          // 8 KB of a panel: L1-resident while a second group of rows reuses it
constexpr int STREAMS = 4;                // row ranges a thread reads at once in MatVec (4 and 8 measured best)
constexpr int64_t MIN_TILED_ROWS = 4;     // rows of one expert from which ExpertMatvec tiles them in registers

using granite::bf16;
using granite::PREFETCH_BYTES;
using granite::load8;
using granite::to_float;

// y[n] = w[n, :] . x for the rows n = r0 + s * len + i, s < S, i < len: S sequential streams through W, each
// prefetched PREFETCH_BYTES ahead once per cache line (a stream's rows are contiguous, so past a row's end is the
// next row's start).
template <int S, typename T>
void row_streams(const float* __restrict x, const T* __restrict w, float* __restrict y, int64_t K, int64_t r0,
                 int64_t len) {
  constexpr int64_t LINE = 64 / sizeof(T);  // elements per cache line: 2 or 4 vectors
  for (int64_t i = 0; i < len; ++i) {
    const T* row[S];
    __m256 acc[S];
    for (int s = 0; s < S; ++s) {
      row[s] = w + (r0 + s * len + i) * K;
      acc[s] = _mm256_setzero_ps();
    }
    int64_t k = 0;
    for (; k + LINE <= K; k += LINE) {
      for (int s = 0; s < S; ++s) {
        _mm_prefetch(reinterpret_cast<const char*>(row[s] + k) + PREFETCH_BYTES, _MM_HINT_T0);
      }
      for (int64_t v = k; v < k + LINE; v += LANES) {
        const __m256 xv = _mm256_loadu_ps(x + v);
        for (int s = 0; s < S; ++s) acc[s] = _mm256_fmadd_ps(xv, load8(row[s] + v), acc[s]);
      }
    }
    for (; k + LANES <= K; k += LANES) {
      const __m256 xv = _mm256_loadu_ps(x + k);
      for (int s = 0; s < S; ++s) acc[s] = _mm256_fmadd_ps(xv, load8(row[s] + k), acc[s]);
    }
    for (int s = 0; s < S; ++s) {
      float sum = granite::horizontal_sum(acc[s]);
      for (int64_t j = k; j < K; ++j) sum += to_float(row[s][j]) * x[j];
      y[r0 + s * len + i] = sum;
    }
  }
}

// Rows [r0, r1) of y = W x: STREAMS streams of equal length, the rest one row at a time.
template <typename T>
void matvec_rows(const float* x, const T* w, float* y, int64_t K, int64_t r0, int64_t r1) {
  const int64_t len = (r1 - r0) / STREAMS;
  row_streams<STREAMS>(x, w, y, K, r0, len);
  row_streams<1>(x, w, y, K, r0 + STREAMS * len, r1 - r0 - STREAMS * len);
}

// y_j[n0:n1] = x_j[k0:k1] W[k0:k1, n0:n1] for the rows j < RB (RB = 1 or 2) of one (K, N) matrix W: W's rows in
// order, one at a time, each load fed to RB rows, into partials of y that stay in L1. One row of W at a time keeps the
// read one sequential stream. Taking four rows at once (a load and store of the partials per four) left the hardware
// prefetchers four short streams 2-6 KB apart, and read the experts of batch-1 decoding at 0.6-0.7x the speed.
template <int RB, typename T>
void rows_axpy(const float* const* __restrict x, const T* __restrict w, float* const* __restrict y, int64_t N,
               int64_t n0, int64_t n1, int64_t k0, int64_t k1) {
  for (int j = 0; j < RB; ++j) std::fill(y[j] + n0, y[j] + n1, 0.0f);
  for (int64_t k = k0; k < k1; ++k) {
    const T* r = w + k * N;
    __m256 a[RB];
    for (int j = 0; j < RB; ++j) a[j] = _mm256_set1_ps(x[j][k]);
    int64_t n = n0;
    for (; n + LANES <= n1; n += LANES) {
      const __m256 wv = load8(r + n);
      for (int j = 0; j < RB; ++j) _mm256_storeu_ps(y[j] + n, _mm256_fmadd_ps(a[j], wv, _mm256_loadu_ps(y[j] + n)));
    }
    for (; n < n1; ++n) {
      for (int j = 0; j < RB; ++j) y[j][n] += x[j][k] * to_float(r[n]);
    }
  }
}

// Y_j[n0:n0+16] (+)= x_j[k0:k0+rows] S for the MR rows j and one strip S (rows, 16) of W, contiguous: accumulated in
// registers, per k one cache line of S (two vectors) against MR broadcasts of x.
template <int MR>
void register_tile(const float* const* __restrict x, int64_t k0, const float* __restrict strip, int64_t rows,
                   float* const* __restrict y, int64_t n0, bool first) {
  __m256 acc[MR][2];
  for (int j = 0; j < MR; ++j) {
    acc[j][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y[j] + n0);
    acc[j][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y[j] + n0 + LANES);
  }
  for (int64_t k = 0; k < rows; ++k) {
    const __m256 w0 = _mm256_load_ps(strip + k * 2 * LANES), w1 = _mm256_load_ps(strip + k * 2 * LANES + LANES);
    for (int j = 0; j < MR; ++j) {
      const __m256 b = _mm256_broadcast_ss(x[j] + k0 + k);
      acc[j][0] = _mm256_fmadd_ps(b, w0, acc[j][0]);
      acc[j][1] = _mm256_fmadd_ps(b, w1, acc[j][1]);
    }
  }
  for (int j = 0; j < MR; ++j) {
    _mm256_storeu_ps(y[j] + n0, acc[j][0]);
    _mm256_storeu_ps(y[j] + n0 + LANES, acc[j][1]);
  }
}

void register_tiles(const float* const* x, int64_t k0, const float* strip, int64_t rows, float* const* y,
                    int64_t count, int64_t n0, bool first) {
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) register_tile<4>(x + j, k0, strip, rows, y + j, n0, first);
  switch (count - j) {
    case 3: register_tile<3>(x + j, k0, strip, rows, y + j, n0, first); break;
    case 2: register_tile<2>(x + j, k0, strip, rows, y + j, n0, first); break;
    case 1: register_tile<1>(x + j, k0, strip, rows, y + j, n0, first); break;
    default: break;
  }
}

// Y_j = x_j[k0:k1] W[k0:k1, :] for the `count` rows j of one expert's (K, N) matrix W. A few rows are bound by
// reading W: its rows in order, each load fed to two rows of x, into partials that stay in L1 (columns in blocks).
// More are bound by arithmetic: W in blocks of K_ROWS rows, each block read in order and copied into 16-column strips
// (a GEMM's packed panel), every strip then read from cache by each tile of four rows and accumulated in registers;
// the columns past the last whole strip go the first way.
template <typename T>
void expert_rows(const float* const* x, const T* w, float* const* y, int64_t count, int64_t N, int64_t k0,
                 int64_t k1) {
  constexpr int64_t STRIP = 2 * LANES, K_ROWS = 64, L1_FLOATS = 6144;  // 24 KB of partials
  const int64_t strips = count >= MIN_TILED_ROWS ? N / STRIP : 0, strips_end = strips * STRIP;
  const int64_t pitch = (K_ROWS + 1) * STRIP;  // one line more than a strip: strips do not alias in the cache
  struct alignas(32) Vector {
    float v[LANES];
  };
  thread_local std::vector<Vector> buffer;  // 32-byte aligned (C++17's aligned new)
  if (strips > 0 && static_cast<int64_t>(buffer.size()) < strips * pitch / LANES) buffer.resize(strips * pitch / LANES);
  float* packed = reinterpret_cast<float*>(buffer.data());
  for (int64_t kb = k0; strips > 0 && kb < k1; kb += K_ROWS) {
    const int64_t rows = std::min(k1, kb + K_ROWS) - kb;
    for (int64_t k = 0; k < rows; ++k) {
      const T* src = w + (kb + k) * N;
      for (int64_t s = 0; s < strips; ++s) {
        float* dst = packed + s * pitch + k * STRIP;
        _mm256_store_ps(dst, load8(src + s * STRIP));
        _mm256_store_ps(dst + LANES, load8(src + s * STRIP + LANES));
      }
    }
    for (int64_t s = 0; s < strips; ++s) {
      register_tiles(x, kb, packed + s * pitch, rows, y, count, s * STRIP, kb == k0);
    }
  }
  const int64_t width = std::max<int64_t>(8 * LANES, L1_FLOATS / count / LANES * LANES);
  for (int64_t n0 = strips_end; n0 < N; n0 += width) {
    const int64_t n1 = std::min(N, n0 + width);
    int64_t j = 0;
    for (; j + 2 <= count; j += 2) rows_axpy<2>(x + j, w, y + j, N, n0, n1, k0, k1);
    if (j < count) rows_axpy<1>(x + j, w, y + j, N, n0, n1, k0, k1);
  }
}

// acc[i, c] (+)= sum_k xt[k, i] w[k, c] over k in [k0, k1) for the MB rows of one group against one panel; acc holds
// MB x 8 floats, zeroed first when `first`.
template <int MB, typename T>
void panel_group(const float* __restrict xt, const T* __restrict w, float* __restrict acc_io, int64_t k0,
                 int64_t k1, bool first, bool prefetch) {
  __m256 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc_io + i * LANES);
  auto step = [&](int64_t k) {
    const __m256 wv = load8(w + k * LANES);
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

#ifdef __AVX512F__
constexpr int64_t QUAD = 4;  // panels per step of the AVX-512 path: 32 outputs, two 16-lane vectors

// Panels a and b (eight lanes each) as one 16-lane vector.
inline __m512 load16(const float* a, const float* b) {
  const __m512d low = _mm512_castpd256_pd512(_mm256_castps_pd(load8(a)));
  return _mm512_castpd_ps(_mm512_insertf64x4(low, _mm256_castps_pd(load8(b)), 1));
}

// panel_group for the four panels starting at w (each K x 8): acc holds MB x 32 floats, a row's 32 outputs together.
template <int MB>
void quad_group(const float* __restrict xt, const float* __restrict w, int64_t K, float* __restrict acc_io, int64_t k0,
                int64_t k1, bool first, bool prefetch) {
  const float* p[QUAD] = {w, w + K * LANES, w + 2 * K * LANES, w + 3 * K * LANES};
  __m512 lo[MB], hi[MB];
  for (int i = 0; i < MB; ++i) {
    lo[i] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc_io + i * QUAD * LANES);
    hi[i] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc_io + i * QUAD * LANES + 2 * LANES);
  }
  auto step = [&](int64_t k) {
    const int64_t o = k * LANES;
    const __m512 w01 = load16(p[0] + o, p[1] + o), w23 = load16(p[2] + o, p[3] + o);
    for (int i = 0; i < MB; ++i) {
      const __m512 b = _mm512_set1_ps(xt[o + i]);
      lo[i] = _mm512_fmadd_ps(b, w01, lo[i]);
      hi[i] = _mm512_fmadd_ps(b, w23, hi[i]);
    }
  };
  int64_t k = k0;
  if (prefetch) {  // one 64-byte line of each panel per two k (float32)
    for (; k + 2 <= k1; k += 2) {
      for (int q = 0; q < QUAD; ++q) {
        _mm_prefetch(reinterpret_cast<const char*>(p[q] + k * LANES) + PREFETCH_BYTES, _MM_HINT_T0);
      }
      step(k);
      step(k + 1);
    }
  }
  for (; k < k1; ++k) step(k);
  for (int i = 0; i < MB; ++i) {
    _mm512_store_ps(acc_io + i * QUAD * LANES, lo[i]);
    _mm512_store_ps(acc_io + i * QUAD * LANES + 2 * LANES, hi[i]);
  }
}

void quad(int64_t rows, const float* xt, const float* w, int64_t K, float* acc, int64_t k0, int64_t k1, bool first,
          bool prefetch) {
  switch (rows) {
    case 8: quad_group<8>(xt, w, K, acc, k0, k1, first, prefetch); break;
    case 7: quad_group<7>(xt, w, K, acc, k0, k1, first, prefetch); break;
    case 6: quad_group<6>(xt, w, K, acc, k0, k1, first, prefetch); break;
    case 5: quad_group<5>(xt, w, K, acc, k0, k1, first, prefetch); break;
    case 4: quad_group<4>(xt, w, K, acc, k0, k1, first, prefetch); break;
    case 3: quad_group<3>(xt, w, K, acc, k0, k1, first, prefetch); break;
    case 2: quad_group<2>(xt, w, K, acc, k0, k1, first, prefetch); break;
    default: quad_group<1>(xt, w, K, acc, k0, k1, first, prefetch); break;
  }
}

#endif

template <typename T>
void group(int64_t rows, const float* xt, const T* w, float* acc, int64_t k0, int64_t k1, bool first, bool prefetch) {
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

// Panels [p0, p1) against every row of x (M <= MAX_ROWS rows, transposed in groups of eight: xt (G, K, 8)), WIDTH
// panels at a time as far as whole steps go, through run(rows, xt, panel, acc, k0, k1, first, prefetch) (the group
// kernel of that width); returns the first panel left. With more than one group, K is walked in blocks of k_block so
// that every group finds the block of the panels in L1; only the first group prefetches.
template <int64_t WIDTH, typename T, typename Run>
int64_t panel_steps(const float* xt, const T* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1,
                    int64_t k_block, float* acc, Run run) {
  const int64_t block = M > LANES ? k_block : K;
  int64_t p = p0;
  for (; p + WIDTH <= p1; p += WIDTH) {
    const T* panel = w + p * K * LANES;
    for (int64_t k0 = 0; k0 < K; k0 += block) {
      const int64_t k1 = std::min(K, k0 + block);
      for (int64_t m = 0; m < M; m += LANES) {
        run(std::min<int64_t>(LANES, M - m), xt + m * K, panel, acc + m * WIDTH * LANES, k0, k1, k0 == 0, m == 0);
      }
    }
    const int64_t cols = std::min<int64_t>(WIDTH * LANES, N - p * LANES);
    for (int64_t m = 0; m < M; ++m) {
      std::copy(acc + m * WIDTH * LANES, acc + m * WIDTH * LANES + cols, y + m * N + p * LANES);
    }
  }
  return p;
}

// All of panels [p0, p1). Where the library is built for AVX-512, float32 weights go four panels at a time first;
// bfloat16 ones stay one at a time: there the widening shares the FMAs' pipes, and four at once were no faster in
// the products and slower in batch-8 decode (0.77-0.99x, h-350m on bfloat16 weights).
template <typename T>
void panels(const float* xt, const T* w, float* y, int64_t M, int64_t K, int64_t N, int64_t p0, int64_t p1) {
  alignas(64) float acc[MAX_ROWS * 4 * LANES];
  int64_t p = p0;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, float>) {
    auto four = [K](int64_t rows, const float* x, const float* panel, float* a, int64_t k0, int64_t k1, bool first,
                    bool prefetch) { quad(rows, x, panel, K, a, k0, k1, first, prefetch); };
    p = panel_steps<QUAD>(xt, w, y, M, K, N, p, p1, K_BLOCK / 2, acc, four);  // four panels' block: 16 KB
  }
#endif
  panel_steps<1>(xt, w, y, M, K, N, p, p1, K_BLOCK, acc, group<T>);
}

ffi::Error SmallMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
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

  const float* xts = xt.data();
  int64_t chunk = granite::chunk_length(pool, P, 8, 2);
#ifdef __AVX512F__
  chunk = (chunk + QUAD - 1) / QUAD * QUAD;  // whole quads of panels
#endif
  return granite::with_typed(w, "small_matmul: the weights", [&](const auto* ws) {
    granite::parallel_chunks(pool, (P + chunk - 1) / chunk, [=](int64_t c) {
      panels(xts, ws, out, M, K, N, c * chunk, std::min(P, (c + 1) * chunk));
    });
  });
}

ffi::Error MatVec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
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
  const int64_t chunk = granite::chunk_length(pool, N, 8 * STREAMS, 2);
  return granite::with_typed(w, "matvec: the weights", [&](const auto* ws) {
    granite::parallel_chunks(pool, (N + chunk - 1) / chunk, [=](int64_t c) {
      matvec_rows(xs, ws, out, K, c * chunk, std::min(N, (c + 1) * chunk));
    });
  });
}

ffi::Error ExpertMatvec(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> experts,
                        ffi::ResultBuffer<ffi::F32> y) {
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
  // Rows sorted by expert (a counting sort): each chosen expert is one run of rows and is read once per chunk of K.
  std::vector<int64_t> start(E + 1, 0), order(R);
  for (int64_t r = 0; r < R; ++r) ++start[ids[r] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t r = 0; r < R; ++r) order[fill[ids[r]]++] = r;
  std::vector<int64_t> runs;  // experts with rows
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1] > start[e]) runs.push_back(e);
  }
  // Work items (run, chunk of K). K is cut only as far as needed for every thread to get several items (so that the
  // caller can take over the share of a helper that starts late): each chunk past the first adds a partial Y of its
  // run's rows, summed below. Partials sit at the rows' sorted positions; an uncut K writes y directly.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads()), num_runs = static_cast<int64_t>(runs.size());
  const int64_t per_run =
      std::clamp<int64_t>((12 * threads + num_runs - 1) / num_runs, 1, std::max<int64_t>(1, K / 64));
  const int64_t chunk = (K + per_run - 1) / per_run;
  std::vector<float> partial(per_run > 1 ? per_run * R * N : 0);
  std::vector<const float*> xrows(R);
  std::vector<float*> yrows(per_run * R);
  for (int64_t i = 0; i < R; ++i) {
    xrows[i] = x.typed_data() + order[i] * K;
    for (int64_t c = 0; c < per_run; ++c) {
      yrows[c * R + i] = per_run > 1 ? partial.data() + (c * R + i) * N : out + order[i] * N;
    }
  }
  const int64_t* starts = start.data();
  const int64_t* run_experts = runs.data();
  const float* const* xs = xrows.data();
  float* const* ys = yrows.data();
  ffi::Error status = granite::with_typed(w, "expert_matvec: the weights", [&](const auto* ws) {
    granite::parallel_chunks(pool, num_runs * per_run, [=](int64_t item) {
      const int64_t e = run_experts[item / per_run], c = item % per_run;
      const int64_t first = starts[e], count = starts[e + 1] - first;
      const int64_t k0 = std::min(K, c * chunk), k1 = std::min(K, (c + 1) * chunk);
      expert_rows(xs + first, ws + e * K * N, ys + c * R + first, count, N, k0, k1);
    });
  });
  if (status.failure() || per_run == 1) return status;
  for (int64_t i = 0; i < R; ++i) {
    float* dst = out + order[i] * N;
    std::copy(ys[i], ys[i] + N, dst);
    for (int64_t c = 1; c < per_run; ++c) {
      const float* src = ys[c * R + i];
      for (int64_t n = 0; n < N; ++n) dst[n] += src[n];
    }
  }
  return ffi::Error::Success();
}

// Widen: bfloat16 w as float32 (exactly), for XLA's products of many rows (prefill) on bfloat16 weights. `after` is
// not read: it orders the conversion after the activations it multiplies, so that one converted weight at a time is
// alive (XLA converts all of a step's weights at its start otherwise; backend.linear).
ffi::Error Widen(ffi::ThreadPool pool, ffi::AnyBuffer /*after*/, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() != ffi::DataType::BF16 || y->element_count() != w.element_count()) {
    return ffi::Error::InvalidArgument("widen: expected bfloat16 w and a float32 result of its shape");
  }
  const bf16* src = static_cast<const bf16*>(w.untyped_data());
  float* dst = y->typed_data();
  const int64_t n = w.element_count();
  const int64_t chunk = granite::chunk_length(pool, n, 1 << 16, 2) / LANES * LANES;
  granite::parallel_chunks(pool, (n + chunk - 1) / chunk, [=](int64_t c) {
    const int64_t end = std::min(n, (c + 1) * chunk);
    int64_t i = c * chunk;
    for (; i + LANES <= end; i += LANES) _mm256_storeu_ps(dst + i, load8(src + i));
    for (; i < end; ++i) dst[i] = to_float(src[i]);
  });
  return ffi::Error::Success();
}

// TakeRows: y[r] = table[ids[r]] as float32 (bfloat16 widened exactly), a row of NaN where ids[r] is outside [0, V).
// XLA:CPU gathers from a bfloat16 table by widening the whole table to float32 first, fused with the gather in one
// decode step; in a loop of decode steps (generate.DECODE_CHUNK) it hoists that conversion out of the body, a float32
// copy of the table per call (154 MB for h-350m's embedding, 20 ms).
ffi::Error TakeRows(ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer table, ffi::ResultBuffer<ffi::F32> y) {
  auto t_dims = table.dimensions();
  if (t_dims.size() != 2 || y->element_count() != ids.element_count() * t_dims[1]) {
    return ffi::Error::InvalidArgument("take_rows: expected ids (...), a table (V, H) and y (..., H)");
  }
  const int64_t V = t_dims[0], H = t_dims[1], R = static_cast<int64_t>(ids.element_count());
  const int32_t* id = ids.typed_data();
  float* out = y->typed_data();
  return granite::with_typed(table, "take_rows: the table", [&](const auto* rows) {
    for (int64_t r = 0; r < R; ++r) {
      float* dst = out + r * H;
      if (id[r] < 0 || id[r] >= V) {
        std::fill(dst, dst + H, std::numeric_limits<float>::quiet_NaN());
        continue;
      }
      const auto* src = rows + static_cast<int64_t>(id[r]) * H;
      int64_t h = 0;
      for (; h + LANES <= H; h += LANES) _mm256_storeu_ps(dst + h, load8(src + h));
      for (; h < H; ++h) dst[h] = to_float(src[h]);
    }
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_take_rows, TakeRows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether this build takes the AVX-512 path of the panel kernel (for build.panels_use_avx512).
extern "C" int granite_panels_avx512() {
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_widen, Widen,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_expert_matvec, ExpertMatvec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_matvec, MatVec,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_small_matmul, SmallMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
