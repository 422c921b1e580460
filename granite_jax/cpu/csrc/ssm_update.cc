// One decoding step of the Mamba-2 state space model, in place: granite_jax.ssd.ssd_step on CPUs (SsmUpdate), and
// the whole middle of a Mamba-2 mixer's decoding step, the state update included (MambaStep, below).
//
// For every sequence b and head h, with the head's group g = h / (heads / groups):
//   state[b, h, p, :] <- decay[b, h] * state[b, h, p, :] + dtx[b, h, p] * B[b, g, :]
//   y[b, h, p]         = state[b, h, p, :] . C[b, g, :]
// (Dao & Gu 2024, eq. 2 discretized as in transformers' granitemoehybrid torch_forward). XLA runs this as an
// update that reads and writes the state and a product that reads it again; here each (b, h) slab of state is
// read and written once, the (b, h) pairs split between the calling thread and XLA's intra-op pool (parallel.h).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using granite::horizontal_sum;
using granite::load8;
using granite::to_float;

constexpr int LANES = 8;

// The state comes from memory (a decode step's weights pass through the caches between two updates of a layer), in one
// sequential stream per thread, prefetched PREFETCH_BYTES ahead in software (parallel.h): a batch-1 step's updates of
// h-350m take 0.84x the time of the hardware prefetchers' alone.
using granite::PREFETCH_BYTES;

// One (b, h) slab: P rows of N state entries.
void update_slab(float* __restrict state, const float* __restrict dtx, float decay, const float* __restrict B,
                 const float* __restrict C, float* __restrict y, int64_t P, int64_t N) {
  const __m256 d = _mm256_set1_ps(decay);
  for (int64_t p = 0; p < P; ++p, state += N) {
    const __m256 u = _mm256_set1_ps(dtx[p]);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t n = 0;
    for (; n + 16 <= N; n += 16) {  // one cache line of the state per step, prefetched PREFETCH_BYTES ahead
      _mm_prefetch(reinterpret_cast<const char*>(state + n) + PREFETCH_BYTES, _MM_HINT_T0);
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

ffi::Error SsmUpdate(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> state, ffi::Buffer<ffi::F32> decay,
                     ffi::Buffer<ffi::F32> dtx, ffi::Buffer<ffi::F32> B, ffi::Buffer<ffi::F32> C,
                     ffi::ResultBuffer<ffi::F32> new_state, ffi::ResultBuffer<ffi::F32> y) {
  auto s = state.dimensions();
  auto bd = B.dimensions();
  if (s.size() != 4 || bd.size() != 3 || bd[0] != s[0] || bd[2] != s[3] || bd[1] < 1 || s[1] % bd[1] != 0 ||
      C.element_count() != B.element_count() || decay.element_count() != s[0] * s[1] ||
      dtx.element_count() != s[0] * s[1] * s[2]) {
    return ffi::Error::InvalidArgument(
        "ssm_update: expected state (b, h, p, n), decay (b, h), dtx (b, h, p), B and C (b, g, n), g dividing h");
  }
  float* out = new_state->typed_data();  // the state's own buffer: aliased to it by kernels.ssm_update
  const int64_t H = s[1], G = bd[1], P = s[2], N = s[3], slabs = s[0] * s[1];
  if (slabs == 0) return ffi::Error::Success();
  const float *decays = decay.typed_data(), *dtxs = dtx.typed_data(), *Bs = B.typed_data(), *Cs = C.typed_data();
  float* ys = y->typed_data();
  const int64_t chunk = granite::chunk_length(pool, slabs, 1, 4);
  granite::parallel_chunks(pool, (slabs + chunk - 1) / chunk, [=](int64_t c) {
    for (int64_t i = c * chunk, end = std::min(slabs, i + chunk); i < end; ++i) {
      const int64_t group = (i / H) * G + (i % H) / (H / G);  // sequence b = i / H, head h = i % H
      update_slab(out + i * P * N, dtxs + i * P, decays[i], Bs + group * N, Cs + group * N, ys + i * P, P, N);
    }
  });
  return ffi::Error::Success();
}


// exp of eight floats: Cephes' expf (a degree-6 polynomial on r = x - n ln 2, |r| <= ln 2 / 2, times 2^n), within
// ~1 ulp. x is clamped to [-87.3, 88] (2^n stays a normal float; exp(88) = 1.7e38), NaN passes through (max and min
// return their second operand when it is NaN).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.33654f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

inline __m256 silu8(__m256 x) {  // x sigmoid(x)
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

inline float softplus(float x) {  // log(1 + e^x) as jax.nn.softplus computes it: max(x, 0) + log1p(e^-|x|)
  return std::max(x, 0.0f) + std::log1p(std::exp(-std::fabs(x)));
}

// The shapes of one MambaStep: b rows, H heads of P channels, G groups of N state entries, K conv taps.
struct MambaShape {
  int64_t b, H, P, G, N, K;
  int64_t inner() const { return H * P; }             // d_inner: z, x and y
  int64_t conv() const { return H * P + 2 * G * N; }  // conv_dim: x, B, C
  int64_t in() const { return inner() + conv() + H; }  // z, xBC, dt
};

// Row r's conv step (the ring's slot `slot % K` takes its xBC first), SiLU and mask into xbc (conv_dim), and its heads'
// time steps: decay = exp(dt A) with A = -exp(A_log), dtx = dt x.
template <typename T>
void conv_and_time_steps(const MambaShape& s, int64_t r, const float* zxbcdt, float mask, float* ring, int64_t slot,
                         const T* conv_w, const T* conv_b, const T* dt_bias, const T* A_log, float lo, float hi,
                         float* xbc, float* decay, float* dtx) {
  const int64_t C = s.conv(), K = s.K;
  const float* in = zxbcdt + r * s.in();
  float* rows = ring + r * K * C;
  std::copy(in + s.inner(), in + s.inner() + C, rows + (slot % K) * C);
  const float* taps[16];  // K <= 16 (checked): oldest first
  for (int64_t k = 0; k < K; ++k) taps[k] = rows + ((slot + 1 + k) % K) * C;
  const __m256 m = _mm256_set1_ps(mask);
  int64_t c = 0;
  for (; c + LANES <= C; c += LANES) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(taps[0] + c), load8(conv_w + c));
    for (int64_t k = 1; k < K; ++k) acc = _mm256_fmadd_ps(_mm256_loadu_ps(taps[k] + c), load8(conv_w + k * C + c), acc);
    _mm256_storeu_ps(xbc + c, _mm256_mul_ps(silu8(_mm256_add_ps(acc, load8(conv_b + c))), m));
  }
  for (; c < C; ++c) {
    float acc = taps[0][c] * to_float(conv_w[c]);
    for (int64_t k = 1; k < K; ++k) acc += taps[k][c] * to_float(conv_w[k * C + c]);
    xbc[c] = silu(acc + to_float(conv_b[c])) * mask;
  }
  for (int64_t h = 0; h < s.H; ++h) {
    const float dt = std::min(std::max(softplus(in[s.inner() + C + h] + to_float(dt_bias[h])), lo), hi);
    decay[h] = std::exp(dt * -std::exp(to_float(A_log[h])));
    for (int64_t p = 0; p < s.P; ++p) dtx[h * s.P + p] = dt * xbc[h * s.P + p];
  }
}

// Group g of row r: y + D x, gated by SiLU(z), RMS-normalized over the group's channels and scaled by the norm's
// weight (model.GatedRMSNorm), into out. Groups are whole heads (G divides H).
template <typename T>
void gated_norm(const MambaShape& s, int64_t r, int64_t g, const float* zxbcdt, const float* xbc, const float* y,
                const T* D, const T* norm_w, float eps, float* out) {
  const int64_t P = s.P, heads = s.H / s.G, c0 = g * heads * P, width = heads * P;
  const float* z = zxbcdt + r * s.in();
  float* o = out + r * s.inner();
  __m256 squares8 = _mm256_setzero_ps();
  float squares = 0.0f;
  for (int64_t h = g * heads; h < (g + 1) * heads; ++h) {
    const float d = to_float(D[h]);
    const __m256 d8 = _mm256_set1_ps(d);
    int64_t c = h * P;
    for (; c + LANES <= (h + 1) * P; c += LANES) {
      const __m256 skip = _mm256_fmadd_ps(d8, _mm256_loadu_ps(xbc + c), _mm256_loadu_ps(y + c));
      const __m256 gated = _mm256_mul_ps(skip, silu8(_mm256_loadu_ps(z + c)));
      _mm256_storeu_ps(o + c, gated);
      squares8 = _mm256_fmadd_ps(gated, gated, squares8);
    }
    for (; c < (h + 1) * P; ++c) {
      const float gated = (y[c] + d * xbc[c]) * silu(z[c]);
      o[c] = gated;
      squares += gated * gated;
    }
  }
  squares += horizontal_sum(squares8);
  const float scale = 1.0f / std::sqrt(squares / static_cast<float>(width) + eps);
  const __m256 scale8 = _mm256_set1_ps(scale);
  int64_t c = c0;
  for (; c + LANES <= c0 + width; c += LANES) {
    _mm256_storeu_ps(o + c, _mm256_mul_ps(load8(norm_w + c), _mm256_mul_ps(_mm256_loadu_ps(o + c), scale8)));
  }
  for (; c < c0 + width; ++c) o[c] = to_float(norm_w[c]) * (o[c] * scale);
}


// MambaStep: model.MambaMixer's decoding step between its two projections, for b rows of one token each, in one call:
//   the conv:  the ring of each row's last K conv inputs takes xBC at slot % K (in place); xBC <- SiLU(conv + bias),
//              times the row's mask; [x | B | C] = xBC;
//   the time steps: dt = clip(softplus(dt + dt_bias), lo, hi), decay = exp(-dt exp(A_log));
//   the state: SsmUpdate's update with dtx = dt x (in place), y = state C + D x;
//   the norm:  w * rmsnorm(y * SiLU(z)) over each of the G groups of channels.
// XLA ran these as about ten small fusions per layer around the state update (each a few microseconds of work and
// 5-20 of dispatch and thread handoff at batch 8). The conv and the norm go one row (and group) per chunk, the state
// update one (b, h) slab per item, each phase split between the calling thread and XLA's intra-op pool.
ffi::Error MambaStep(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> zxbcdt, ffi::Buffer<ffi::PRED> mask,
                     ffi::Buffer<ffi::F32> ring, ffi::Buffer<ffi::S32> slot, ffi::AnyBuffer conv_w,
                     ffi::AnyBuffer conv_b, ffi::AnyBuffer dt_bias, ffi::AnyBuffer A_log, ffi::AnyBuffer D,
                     ffi::AnyBuffer norm_w, ffi::Buffer<ffi::F32> state, ffi::ResultBuffer<ffi::F32> out,
                     ffi::ResultBuffer<ffi::F32> new_ring, ffi::ResultBuffer<ffi::F32> new_state, float lo, float hi,
                     float eps) {
  auto sd = state.dimensions();
  auto rd = ring.dimensions();
  const char* expected =
      "mamba_step: expected zxbcdt (b, 1, d_inner + conv_dim + h), a boolean mask (b, 1), ring (b, K, conv_dim) "
      "with K <= 16, slot (), conv weight (K, conv_dim), conv bias (conv_dim,), dt_bias, A_log and D (h,), norm "
      "weight (d_inner,) of one dtype, state (b, h, p, n), conv_dim = h p + 2 g n with g dividing h";
  if (sd.size() != 4 || rd.size() != 3 || rd[0] != sd[0] || rd[1] < 1 || rd[1] > 16) {
    return ffi::Error::InvalidArgument(expected);
  }
  MambaShape s{sd[0], sd[1], sd[2], 0, sd[3], rd[1]};
  const int64_t C = rd[2], spare = C - s.H * s.P;
  s.G = s.N > 0 && spare > 0 && spare % (2 * s.N) == 0 ? spare / (2 * s.N) : 0;
  const ffi::DataType wt = conv_w.element_type();
  const bool one_dtype = conv_b.element_type() == wt && dt_bias.element_type() == wt && A_log.element_type() == wt &&
                         D.element_type() == wt && norm_w.element_type() == wt;
  if (s.G == 0 || s.H % s.G != 0 || !one_dtype || zxbcdt.element_count() != s.b * s.in() ||
      mask.element_count() != s.b || slot.element_count() != 1 || conv_w.element_count() != s.K * C ||
      conv_b.element_count() != C || dt_bias.element_count() != s.H || A_log.element_count() != s.H ||
      D.element_count() != s.H || norm_w.element_count() != s.inner() || out->element_count() != s.b * s.inner()) {
    return ffi::Error::InvalidArgument(expected);
  }
  const int64_t at = slot.typed_data()[0];
  if (at < 0) return ffi::Error::InvalidArgument("mamba_step: the slot is negative");
  if (s.b == 0) return ffi::Error::Success();
  // The ring and the state are updated in their own buffers (aliased to them by kernels.mamba_step).
  float *rings = new_ring->typed_data(), *states = new_state->typed_data(), *outs = out->typed_data();
  const float* in = zxbcdt.typed_data();
  const bool* masks = mask.typed_data();
  std::vector<float> scratch(s.b * (C + s.H + 2 * s.inner()));
  float* xbc = scratch.data();              // (b, conv_dim): x, B, C after the conv
  float* decay = xbc + s.b * C;             // (b, h)
  float* dtx = decay + s.b * s.H;           // (b, h, p)
  float* y = dtx + s.b * s.inner();         // (b, h, p): state C
  return granite::with_typed(conv_w, "mamba_step: the weights", [&](const auto* cw) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(cw)>>;
    const T *cb = static_cast<const T*>(conv_b.untyped_data()), *dtb = static_cast<const T*>(dt_bias.untyped_data());
    const T *al = static_cast<const T*>(A_log.untyped_data()), *ds = static_cast<const T*>(D.untyped_data());
    const T* nw = static_cast<const T*>(norm_w.untyped_data());
    granite::parallel_chunks(pool, s.b, [=](int64_t r) {
      const float keep = masks[r] ? 1.0f : 0.0f;
      conv_and_time_steps(s, r, in, keep, rings, at, cw, cb, dtb, al, lo, hi, xbc + r * C, decay + r * s.H,
                          dtx + r * s.inner());
    });
    const int64_t slabs = s.b * s.H, chunk = granite::chunk_length(pool, slabs, 1, 4);
    granite::parallel_chunks(pool, (slabs + chunk - 1) / chunk, [=](int64_t c) {
      for (int64_t i = c * chunk, end = std::min(slabs, i + chunk); i < end; ++i) {
        const int64_t r = i / s.H, group = (i % s.H) / (s.H / s.G);
        const float* B = xbc + r * C + s.inner() + group * s.N;
        update_slab(states + i * s.P * s.N, dtx + i * s.P, decay[i], B, B + s.G * s.N, y + i * s.P, s.P, s.N);
      }
    });
    granite::parallel_chunks(pool, s.b * s.G, [=](int64_t i) {
      gated_norm(s, i / s.G, i % s.G, in, xbc + (i / s.G) * C, y + (i / s.G) * s.inner(), ds, nw, eps, outs);
    });
  });
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(granite_mamba_step, MambaStep,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // zxbcdt
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask
                                  .Arg<ffi::Buffer<ffi::F32>>()  // ring
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slot
                                  .Arg<ffi::AnyBuffer>()         // conv weight
                                  .Arg<ffi::AnyBuffer>()         // conv bias
                                  .Arg<ffi::AnyBuffer>()         // dt_bias
                                  .Arg<ffi::AnyBuffer>()         // A_log
                                  .Arg<ffi::AnyBuffer>()         // D
                                  .Arg<ffi::AnyBuffer>()         // norm weight
                                  .Arg<ffi::Buffer<ffi::F32>>()  // state
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // ring
                                  .Ret<ffi::Buffer<ffi::F32>>()  // state
                                  .Attr<float>("lo")
                                  .Attr<float>("hi")
                                  .Attr<float>("eps"));
