"""Pallas GPU kernels (Triton lowering) for Granite's hybrid layers: the Mamba-2 SSD's chunked prefill and one-token
update, a Mamba mixer's whole decode step, decode attention over the KV cache, RMSNorm, the router and the routed
experts.

Public API (the contracts of `granite_jax.ssd.ssd_chunked` and `granite_jax.ssd.ssd_step` for Mamba's inputs, A <= 0
and processed dt >= 0; other values are not checked and give wrong results, as every exponent is clamped to <= 0):

- `ssd_prefill(x, dt, A, B, C, D, *, chunk_size=256, initial_state=None, dt_bias=None, dt_softplus=False,
  dt_limit=(0, inf), out_dtype=float32, config=None) -> (y (b, L, h, p), final_state (b, h, p, n) float32)`
- `ssd_decode(state, x, dt, A, B, C, D, *, dt_bias=None, dt_softplus=False, dt_limit=(0, inf), config=None)
  -> (y (b, h, p) float32, new_state (b, h, p, n) float32)`, the state updated in place (`input_output_aliases`).
- `mamba_step(zxbcdt, ring, slot, conv_weight, conv_bias, dt_bias, A_log, D, state, *, groups, dt_limit=(0, inf),
  token_mask=None, config=None) -> (gated (b, d_inner) float32, new ring, new state)`: a Mamba-2 mixer's whole decode
  step between its projections but the norm (the contract of `granite_jax.model.MambaMixer.mix`), the conv ring and
  the state updated in place; `takes_mamba_step(head_dim, state_dim)` says which dims it runs.
- `decode_attention(q, k, v, pad, slot, scale, *, new_kv=None, config=None) -> (out (b, kv, rep, hd), k, v)`: one
  query per row over a KV cache, split over the keys (flash-decoding), the token's key and value (`new_kv`) written
  into the cache in place first (the contract of `granite_jax.model.cache_and_attend` for one query);
  `takes_decode_attention(head_dim, cache_len)` says which dims it runs.
- `rms_norm(x, weight, eps, *, groups=1, dtype=None) -> (R, D)`: RMSNorm of rows in one launch (the contract of
  `granite_jax.model.rms_norm`); `takes_rms_norm(dim, groups)` says which dims it runs. `residual_rms_norm(x, update,
  multiplier, weight, eps) -> (x + update * multiplier, its norm)`: with the residual add before it.
- `top_k(logits, k) -> (values (N, k) float32, indices (N, k) int32)`: the MoE router's top-k in one launch (the
  contract of `granite_jax.model.top_experts`, `lax.top_k`); `takes_top_k(experts)` says which it runs.
  `route(x, w, k)`: with the router's product x @ w^T before it (`granite_jax.model.route`; `takes_route`).
- `experts_up(x, w_in, experts) -> (R, F)`, `experts_down(h, w_out, experts) -> (R, H)`: decoding's routed experts,
  each row's expert read in place, the SwiGLU in the first (`granite_jax.model.experts_swiglu`; `takes_experts`).
- `PrefillConfig`, `DecodeConfig` (the one-token update and the Mamba step), `AttentionConfig`: tiling and launch
  parameters.

Forward only (no differentiation rules): differentiate through `ssd_impl="xla"`.

Where they run. On an NVIDIA GPU (A100, H100, H200). Anywhere else a call raises `PallasUnavailableError`
("ssd_impl='pallas' needs an NVIDIA GPU; use 'xla' on CPU"); nothing runs interpreted behind the caller's back.
Tests opt in explicitly, around the code that traces the kernels (including a model forward):

    with pallas_kernels.interpret_mode():          # run interpreted on CPU, every kernel output poisoned with NaN
        y, state = pallas_kernels.ssd_prefill(...)

    with pallas_kernels.cuda_lowering():           # trace for CUDA without a GPU, to check the Triton lowering
        jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))

`pallas_kernels.aot` goes one step further where the `jax-cuda12-pjrt` plugin is installed: it compiles the lowered
kernels through XLA's GPU compiler and Triton for an H100/H200 target without a GPU (catching, e.g., shared memory
overflows), and `pallas_kernels.executable` reads what such a program launches: kernels, CUDA graphs, bytes and FLOPs
(`benchmarks/gpu_report.py`). See docs/kernels.md for the design, numerics and the GPU benchmark.
"""

from pallas_kernels._call import PallasUnavailableError, check_available, cuda_lowering, interpret_mode
from pallas_kernels.attention import AttentionConfig, decode_attention, takes_decode_attention
from pallas_kernels.decode import DecodeConfig, ssd_decode
from pallas_kernels.experts import experts_down, experts_up, takes_experts
from pallas_kernels.mamba_step import mamba_step, takes_mamba_step
from pallas_kernels.norm import residual_rms_norm, rms_norm, takes_rms_norm
from pallas_kernels.prefill import PrefillConfig, kernel_chunk, ssd_prefill
from pallas_kernels.routing import route, takes_route, takes_top_k, top_k

__all__ = [
    "AttentionConfig",
    "DecodeConfig",
    "PallasUnavailableError",
    "PrefillConfig",
    "check_available",
    "cuda_lowering",
    "decode_attention",
    "experts_down",
    "experts_up",
    "interpret_mode",
    "kernel_chunk",
    "mamba_step",
    "residual_rms_norm",
    "rms_norm",
    "route",
    "ssd_decode",
    "ssd_prefill",
    "takes_decode_attention",
    "takes_experts",
    "takes_mamba_step",
    "takes_rms_norm",
    "takes_route",
    "takes_top_k",
    "top_k",
]
