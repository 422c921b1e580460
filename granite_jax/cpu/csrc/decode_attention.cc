// Attention of one query token per row over a KV cache: granite_jax.model.attend_cache of a decode step on CPUs.
//
// For every row b and KV head g, the rep query heads of the group attend the keys in slots [pad[b], slot]:
//   out[b, g, r] = sum_s softmax_s(scale * q[b, g, r] . k[b, g, s]) v[b, g, s]
// in float32, by the online softmax of flash attention (Dao et al. 2022, Alg. 1): BLOCK keys at a time, a running
// max and normalizer per query, the partial output rescaled by exp(m_old - m_new) as each block arrives. Each (b, g)
// reads its keys and values once, in order, for all rep queries. XLA:CPU runs model.py's blocks as a loop of small
// fusions, its reductions split into reduce-windows: this kernel is 1.2-2.4x faster at 256 to 32K filled slots
// (granite_jax/cpu/benchmarks/kernels.py --parts attention). It reads the cache below the memory bandwidth
// (13-26 GB/s), yet the plainest loops measured fastest: scoring eight keys at a time (their sums by one transpose)
// ran at about half the speed, with or without the partial outputs kept in registers; prefetching the keys and values
// eight rows ahead, and independent accumulators for two keys and every query, did not help. The (b, g) pairs are
// split between the calling thread and XLA's pool (parallel.h). k and v are float32 or bfloat16 (widened in
// registers, exactly).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int LANES = 8;
constexpr int64_t BLOCK = 64;  // keys per online-softmax step: their scores stay in L1

using granite::load8;
using granite::to_float;

template <typename T>
float dot(const float* __restrict q, const T* __restrict k, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  float sum = granite::horizontal_sum(acc);
  for (; d < D; ++d) sum += q[d] * to_float(k[d]);
  return sum;
}

// acc[0:D] += p * v[0:D]
template <typename T>
void axpy(float p, const T* __restrict v, float* __restrict acc, int64_t D) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES) {
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(acc + d)));
  }
  for (; d < D; ++d) acc[d] += p * to_float(v[d]);
}

// One (row, KV head): q (R, D) -> out (R, D) over keys and values (S, D), slots [lo, hi]. Key and value rows are read
// in order, each once for all R queries (the partial outputs stay in L1).
template <typename T>
void attend_group(const float* q, const T* k, const T* v, float* out, int64_t R, int64_t D, int64_t lo, int64_t hi,
                  float scale) {
  std::vector<float> m(R, -std::numeric_limits<float>::infinity()), norm(R, 0.0f), p(R * BLOCK);
  std::fill(out, out + R * D, 0.0f);  // the running output
  for (int64_t s0 = lo; s0 <= hi; s0 += BLOCK) {
    const int64_t n = std::min(BLOCK, hi + 1 - s0);
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t r = 0; r < R; ++r) p[r * BLOCK + j] = scale * dot(q + r * D, k + (s0 + j) * D, D);
    }
    for (int64_t r = 0; r < R; ++r) {  // the scores become exp(score - running max)
      float* s = p.data() + r * BLOCK;
      const float m_new = std::max(m[r], *std::max_element(s, s + n));
      const float rescale = std::exp(m[r] - m_new);  // 0 for the first block (m = -inf)
      float sum = 0.0f;
      for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - m_new));
      norm[r] = norm[r] * rescale + sum;
      m[r] = m_new;
      for (int64_t d = 0; d < D; ++d) out[r * D + d] *= rescale;
    }
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t r = 0; r < R; ++r) axpy(p[r * BLOCK + j], v + (s0 + j) * D, out + r * D, D);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inverse = norm[r] > 0.0f ? 1.0f / norm[r] : 0.0f;  // no key (lo > hi): zeros
    for (int64_t d = 0; d < D; ++d) out[r * D + d] *= inverse;
  }
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::S32> pad, ffi::Buffer<ffi::S32> slot, ffi::ResultBuffer<ffi::F32> out,
                           float scale) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || v.dimensions().size() != 4 || k.element_type() != v.element_type() ||
      kd[0] != qd[0] || kd[1] != qd[1] || kd[3] != qd[3] || !std::equal(kd.begin(), kd.end(), v.dimensions().begin()) ||
      pad.element_count() != qd[0] || slot.element_count() != 1 || out->element_count() != q.element_count()) {
    return ffi::Error::InvalidArgument(
        "decode_attention: expected q (b, kv, rep, d), k and v (b, kv, S, d) of one dtype, pad (b,) and slot ()");
  }
  const int64_t B = qd[0], G = qd[1], R = qd[2], D = qd[3], S = kd[2];
  const int64_t hi = std::min<int64_t>(slot.typed_data()[0], S - 1);
  const int32_t* pads = pad.typed_data();
  const float* qs = q.typed_data();
  float* os = out->typed_data();
  return granite::with_typed(k, "decode_attention: k and v", [&](const auto* ks) {
    const auto* vs = static_cast<decltype(ks)>(v.untyped_data());  // of k's dtype (checked above)
    granite::parallel_chunks(pool, B * G, [=](int64_t i) {
      const int64_t lo = std::max<int64_t>(pads[i / G], 0);
      attend_group(qs + i * R * D, ks + i * S * D, vs + i * S * D, os + i * R * D, R, D, lo, hi, scale);
    });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_decode_attention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
