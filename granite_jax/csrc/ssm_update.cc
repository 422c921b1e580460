// One decoding step of the Mamba-2 state space model, in place: granite_jax.ssd.ssd_step on CPUs.
//
// For every sequence b and head h, with the head's group g = h / (heads / groups):
//   state[b, h, p, :] <- decay[b, h] * state[b, h, p, :] + dtx[b, h, p] * B[b, g, :]
//   y[b, h, p]         = state[b, h, p, :] . C[b, g, :]
// (Dao & Gu 2024, eq. 2 discretized as in transformers' granitemoehybrid torch_forward). XLA runs this as an
// update that reads and writes the state and a product that reads it again; here each (b, h) slab of state is
// read and written once, the (b, h) pairs split between the calling thread and XLA's intra-op pool.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One (b, h) slab: P rows of N state entries.
void update_slab(float* __restrict state, const float* __restrict dtx, float decay, const float* __restrict B,
                 const float* __restrict C, float* __restrict y, int64_t P, int64_t N) {
  const __m256 d = _mm256_set1_ps(decay);
  for (int64_t p = 0; p < P; ++p, state += N) {
    const __m256 u = _mm256_set1_ps(dtx[p]);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t n = 0;
    for (; n + 16 <= N; n += 16) {
      __m256 s0 = _mm256_fmadd_ps(u, _mm256_loadu_ps(B + n), _mm256_mul_ps(d, _mm256_loadu_ps(state + n)));
      __m256 s1 = _mm256_fmadd_ps(u, _mm256_loadu_ps(B + n + 8), _mm256_mul_ps(d, _mm256_loadu_ps(state + n + 8)));
      _mm256_storeu_ps(state + n, s0);
      _mm256_storeu_ps(state + n + 8, s1);
      acc0 = _mm256_fmadd_ps(s0, _mm256_loadu_ps(C + n), acc0);
      acc1 = _mm256_fmadd_ps(s1, _mm256_loadu_ps(C + n + 8), acc1);
    }
    float sum = horizontal_sum(_mm256_add_ps(acc0, acc1));
    for (; n < N; ++n) {
      state[n] = decay * state[n] + dtx[p] * B[n];
      sum += state[n] * C[n];
    }
    y[p] = sum;
  }
}

struct Work {
  float* state;
  const float *decay, *dtx, *B, *C;
  float* y;
  int64_t H, G, P, N, slabs, chunk, chunks;
  std::atomic<int64_t> next{0}, done{0};

  void run() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      for (int64_t i = c * chunk, end = std::min(slabs, i + chunk); i < end; ++i) {
        const int64_t b = i / H, g = (i % H) / (H / G);
        update_slab(state + i * P * N, dtx + i * P, decay[i], B + (b * G + g) * N, C + (b * G + g) * N, y + i * P, P,
                    N);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error SsmUpdate(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> state, ffi::Buffer<ffi::F32> decay,
                     ffi::Buffer<ffi::F32> dtx, ffi::Buffer<ffi::F32> B, ffi::Buffer<ffi::F32> C,
                     ffi::ResultBuffer<ffi::F32> new_state, ffi::ResultBuffer<ffi::F32> y) {
  auto s = state.dimensions();
  auto bd = B.dimensions();
  if (s.size() != 4 || bd.size() != 3 || bd[0] != s[0] || bd[2] != s[3] || bd[1] < 1 || s[1] % bd[1] != 0 ||
      C.element_count() != B.element_count() || decay.element_count() != s[0] * s[1] || dtx.element_count() != s[0] * s[1] * s[2]) {
    return ffi::Error::InvalidArgument(
        "ssm_update: expected state (b, h, p, n), decay (b, h), dtx (b, h, p), B and C (b, g, n), g dividing h");
  }
  auto work = std::make_shared<Work>();
  float* out = new_state->typed_data();
  if (out != state.typed_data()) std::copy_n(state.typed_data(), state.element_count(), out);
  work->state = out;
  work->decay = decay.typed_data();
  work->dtx = dtx.typed_data();
  work->B = B.typed_data();
  work->C = C.typed_data();
  work->y = y->typed_data();
  work->H = s[1];
  work->G = bd[1];
  work->P = s[2];
  work->N = s[3];
  work->slabs = s[0] * s[1];
  if (work->slabs == 0) return ffi::Error::Success();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  work->chunk = std::max<int64_t>(1, (work->slabs + 4 * threads - 1) / (4 * threads));  // ~4 chunks a thread
  work->chunks = (work->slabs + work->chunk - 1) / work->chunk;
  const int64_t helpers = std::min(threads, work->chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->run(); });
  work->run();
  while (work->done.load(std::memory_order_acquire) < work->chunks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_ssm_update_f32, SsmUpdate,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
