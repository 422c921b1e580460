// Shared by the CPU kernels (small_matmul.cc, ssm_update.cc, decode_attention.cc): AVX2 helpers, bfloat16 widening and
// the split of a kernel's work between the calling thread and XLA's intra-op thread pool.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace granite {

using bf16 = uint16_t;  // bfloat16 values: the upper half of a float32's bits

// How far ahead the kernels prefetch the streams they read from memory (weights, Mamba states): the best of
// 512-4096 bytes on the 2-core development machines (docs/kernels.md).
constexpr int64_t PREFETCH_BYTES = 2048;

// Eight values as float32: loaded, or widened from bfloat16 (exactly: a shift into the upper half).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline float to_float(float v) { return v; }
inline float to_float(bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Calls body(data) with the buffer's data typed (float32 or bfloat16); other dtypes are an error naming `what`.
template <typename Body>
xla::ffi::Error with_typed(const xla::ffi::AnyBuffer& buffer, const char* what, Body body) {
  switch (buffer.element_type()) {
    case xla::ffi::DataType::F32: body(static_cast<const float*>(buffer.untyped_data())); break;
    case xla::ffi::DataType::BF16: body(static_cast<const bf16*>(buffer.untyped_data())); break;
    default: return xla::ffi::Error::InvalidArgument(std::string(what) + " must be float32 or bfloat16");
  }
  return xla::ffi::Error::Success();
}

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Items per chunk of parallel_chunks: about `per_thread` chunks per thread of the pool (so that the caller can take
// over the share of a helper that starts late), and at least `minimum` items.
inline int64_t chunk_length(xla::ffi::ThreadPool& pool, int64_t items, int64_t minimum, int64_t per_thread) {
  const int64_t chunks = per_thread * std::max<int64_t>(1, pool.num_threads());
  return std::max<int64_t>(minimum, (items + chunks - 1) / chunks);
}

// Runs body(c) for every c in [0, chunks): the calling thread and up to pool.num_threads() - 1 helper tasks claim
// chunks from one atomic counter. The caller waits only for chunks a helper has claimed, and a claimed chunk is being
// computed, so there is no deadlock even when every pool thread is busy elsewhere. Helpers that start after the
// caller has finished find no chunk left; body is copied into them, so it must capture by value.
template <typename Body>
void parallel_chunks(xla::ffi::ThreadPool& pool, int64_t chunks, Body body) {
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto run = [counters, chunks, body] {
    for (int64_t c; (c = counters->next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      body(c);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(run)(run));  // a copy each: Schedule takes F&&
  run();
  while (counters->done.load(std::memory_order_acquire) < chunks) _mm_pause();
}

}  // namespace granite
