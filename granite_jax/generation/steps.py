"""The compiled steps of generation: prefill a prompt segment, decode a chunk of tokens, allocate a cache.

Each step is a pure function of (weights, prepared, cache, ...) `jax.jit`-ed once, compiled by jit per argument shape,
with the cache donated so that the KV cache and the Mamba states are updated in place. The weights travel as a flat
list (flattening the model's nnx State costs ~2 ms a call, a list ~0.3 ms), and `prepared` holds what the runtime's
kernel backends derived from them (`ops.prepare`: the CPU kernels' packed panels for batched decoding). Sampling runs
inside the step, so only the chosen ids (b,) reach the host.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh

from granite_jax import ops, sharding
from granite_jax.config import ModelConfig
from granite_jax.gpu import COMPILER_OPTIONS
from granite_jax.model import Cache, Granite, abstract_model
from granite_jax.ops import Runtime
from granite_jax.sampling import SamplerParams, SamplingConfig, sample_tokens

DEVICE_STOPS = 16  # stop token ids a decode call checks on device (with more, the host alone stops the rows)


def _logits_and_tokens(model: Granite, prepared, cache: Cache, tokens, params: SamplerParams, step, last_only: bool):
    with ops.using(model.runtime), ops.bound(model, prepared):
        logits, cache, _ = model.forward(tokens, cache=cache, last_only=last_only)
        logits = logits[:, -1].astype(jnp.float32)
        return logits, sample_tokens(logits, params, step), cache


def prefill_segment(graphdef, treedef, weights, prepared, cache: Cache, tokens, params: SamplerParams, step):
    """Forward one prompt segment (b, T) from the cache; sample from the last position's logits.
    Returns (logits (b, V), tokens (b,), cache)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
    return _logits_and_tokens(model, prepared, cache, tokens, params, step, last_only=True)


def decode_step(graphdef, treedef, weights, prepared, cache: Cache, tokens, params: SamplerParams, step):
    """Forward one token per row (b,) and sample the next ones: (logits (b, V), tokens (b,), cache)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights))
    return _logits_and_tokens(model, prepared, cache, tokens[:, None], params, step, last_only=False)


def decode_steps(
    graphdef,
    treedef,
    weights,
    prepared,
    cache: Cache,
    tokens,
    live,
    params: SamplerParams,
    stops,
    step,
    count,
    *,
    chunk,
):
    """Up to `count` (<= chunk) decode steps from `tokens` (b,) at token index `step`, while some row is `live` (b,):
    a row stops being live once it samples one of `stops` (-1: none). Returns the ids (chunk, b) (zero past the steps
    run), the number of steps run, the last ids, `live` after them and the cache. Each step is `decode_step` with its
    own index, so sampling draws as one call per token does."""

    def running(carry):
        i, live = carry[0], carry[3]
        return (i < count) & jnp.any(live)

    def body(carry):
        i, cache, tokens, live, out = carry
        _, tokens, cache = decode_step(graphdef, treedef, weights, prepared, cache, tokens, params, step + i)
        live = live & ~jnp.any(tokens[:, None] == stops[None, :], axis=-1)
        return i + 1, cache, tokens, live, out.at[i].set(tokens)

    out = jnp.zeros((chunk, tokens.shape[0]), jnp.int32)
    ran, cache, tokens, live, out = lax.while_loop(running, body, (jnp.int32(0), cache, tokens, live, out))
    return out, ran, tokens, live, cache


def device_stops(stop_ids) -> np.ndarray:
    """The stop ids a decode call checks, padded with -1 to DEVICE_STOPS (none if there are more)."""
    ids = sorted(stop_ids) if len(stop_ids) <= DEVICE_STOPS else []
    return np.asarray(ids + [-1] * (DEVICE_STOPS - len(ids)), np.int32)


class Steps:
    """The jitted steps of one model. Call them with (prepared, cache, ...): the weights are bound, the cache donated.
    `abstract(...)` gives shape-only arguments for `lower(...)` (compiling ahead of time fills jit's own cache)."""

    def __init__(self, model: Granite):
        self.model, self.cfg = model, model.cfg
        graphdef, state = nnx.split(model)
        self.weights, treedef = jax.tree.flatten(state)
        self.jitted = _jitted_steps(graphdef, treedef, tuple(compiler_options(model.runtime).items()))
        self._cache = _jitted_cache_init(model.cfg, model.dtype, model.row_blocks, model.runtime.mesh)

    def prefill(self, prepared, cache: Cache, tokens, params: SamplerParams, step):
        return self.jitted["prefill"](self.weights, prepared, cache, tokens, params, step)

    def decode(self, prepared, cache: Cache, tokens, params: SamplerParams, step):
        return self.jitted["decode"](self.weights, prepared, cache, tokens, params, step)

    def decode_chunk(self, prepared, cache: Cache, tokens, live, params, stops, step, count, *, chunk: int):
        return self.jitted["decode_chunk"](
            self.weights, prepared, cache, tokens, live, params, stops, step, count, chunk=chunk
        )

    def cache(self, batch: int, cache_len: int, pad) -> Cache:
        """A zeroed cache for rows with `pad` padding slots each (compiled: no eager dispatch per array)."""
        return self._cache(self.cfg, batch, cache_len, self.model.dtype, pad)

    def abstract_cache(self, batch: int, cache_len: int) -> Cache:
        pad = jax.ShapeDtypeStruct((batch,), jnp.int32)
        return self._cache.eval_shape(self.cfg, batch, cache_len, self.model.dtype, pad)

    def compile(self, kind: str, prepared, batch: int, cache_len: int, *, tokens: int = 1, chunk: int | None = None):
        """Compile step `kind` for these shapes ahead of its first call (jit's cache keeps the executable, which is
        also returned, for reading)."""
        args = _abstract_arguments(kind, batch, tokens, self.abstract_cache(batch, cache_len))
        extra = {} if chunk is None else {"chunk": chunk}
        compiled = self.jitted[kind].lower(self.weights, prepared, *args, **extra).compile()
        if kind == "prefill":
            pad = jax.ShapeDtypeStruct((batch,), jnp.int32)
            self._cache.lower(self.cfg, batch, cache_len, self.model.dtype, pad).compile()
        return compiled


def compiler_options(runtime: Runtime) -> dict[str, Any]:
    """XLA's options for the steps of a model run under `runtime`: on a GPU `granite_jax.gpu.COMPILER_OPTIONS` (every
    kernel inside CUDA graphs), none elsewhere."""
    return dict(COMPILER_OPTIONS) if (runtime.platform or jax.default_backend()) == "gpu" else {}


# Keyed by the model's structure (its graphdef: config, dtypes, runtime, mesh), not by the model: every Generator of
# the same architecture shares one set of jitted steps, so a second one (another checkpoint, another run in the same
# process) neither traces nor compiles again. Bounded: each entry holds its executables.
@functools.lru_cache(maxsize=8)
def _jitted_steps(graphdef: nnx.GraphDef, treedef, options: tuple = ()) -> dict[str, Any]:
    """options: XLA's compiler options, as (name, value) pairs (on a GPU: `granite_jax.gpu.COMPILER_OPTIONS`)."""
    donate = dict(donate_argnums=(2,), compiler_options=dict(options) or None)  # (weights, prepared, cache, ...)
    return {
        "prefill": jax.jit(functools.partial(prefill_segment, graphdef, treedef), **donate),
        "decode": jax.jit(functools.partial(decode_step, graphdef, treedef), **donate),
        "decode_chunk": jax.jit(
            functools.partial(decode_steps, graphdef, treedef), static_argnames=("chunk",), **donate
        ),
    }


@functools.lru_cache(maxsize=8)
def _jitted_cache_init(cfg: ModelConfig, dtype: Any, row_blocks: int, mesh: Mesh | None):
    """Cache.init, jitted. Over a mesh the cache is made in its shards (the weights arrive placed by
    `sharding.shard_model`), and XLA partitions each step from them."""
    init = functools.partial(Cache.init, row_blocks=row_blocks)
    layout = {}
    if mesh is not None:
        abstract = jax.eval_shape(lambda: init(cfg, 1, 1, dtype))
        layout = dict(out_shardings=sharding.cache_shardings(abstract, mesh))
    return jax.jit(init, static_argnums=(0, 1, 2, 3), **layout)


def _abstract_arguments(kind: str, batch: int, tokens: int, cache: Cache) -> tuple:
    S = jax.ShapeDtypeStruct
    step, params = S((), jnp.int32), jax.eval_shape(SamplingConfig().device_params)
    if kind == "prefill":
        return cache, S((batch, tokens), jnp.int32), params, step
    if kind == "decode":
        return cache, S((batch,), jnp.int32), params, step
    ids, live, stops = S((batch,), jnp.int32), S((batch,), jnp.bool_), S((DEVICE_STOPS,), jnp.int32)
    return cache, ids, live, params, stops, step, step


def abstract_steps(
    cfg: ModelConfig,
    *,
    batch: int,
    prompt_len: int,
    cache_len: int,
    dtype: Any,
    weight_dtype: Any,
    runtime: Runtime | None = None,
    sampling: SamplingConfig | None = None,
    mesh: Mesh | None = None,
) -> dict[str, tuple[Callable, tuple]]:
    """The prefill and decode steps of the model `cfg` with shape-only weights and arguments: {"prefill": (fn, args),
    "decode": (fn, args)}, the cache being args[2], for compiling without running (deviceless GPU compiles, kernel
    counts). Nothing is prepared: the kernel backends of another platform than the one compiled for do not run.
    mesh: the arguments placed over it as the Generator places them (`granite_jax.sharding`), the runtime's mesh set."""
    blocks = sharding.row_blocks(mesh)
    if mesh is not None:
        sharding.check_mesh(cfg, mesh)
        runtime = (runtime or Runtime()).replace(mesh=mesh)
    model = abstract_model(cfg, dtype=dtype, param_dtype=weight_dtype, runtime=runtime, row_blocks=blocks)
    graphdef, state = nnx.split(model)
    cache = jax.eval_shape(lambda: Cache.init(cfg, batch, cache_len, dtype, row_blocks=blocks))
    params = jax.eval_shape((sampling or SamplingConfig()).device_params)
    S = jax.ShapeDtypeStruct
    step, prompt, token = S((), jnp.int32), S((batch, prompt_len), jnp.int32), S((batch,), jnp.int32)
    if mesh is not None:
        flat = {".".join(map(str, path)): v for path, v in nnx.to_flat_state(state)}
        placed = sharding.parameter_shardings({k: v.get_value() for k, v in flat.items()}, mesh)
        for k, v in flat.items():
            v.set_value(S(v.shape, v.dtype, sharding=placed[k]))
        cache = jax.tree.map(lambda x, s: S(x.shape, x.dtype, sharding=s), cache, sharding.cache_shardings(cache, mesh))
        prompt, token = (S(x.shape, x.dtype, sharding=sharding.rows_sharding(mesh, x.ndim)) for x in (prompt, token))
        whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        params, step = jax.tree.map(lambda x: S(x.shape, x.dtype, sharding=whole), (params, step))
    weights, treedef = jax.tree.flatten(state)
    return dict(
        prefill=(functools.partial(prefill_segment, graphdef, treedef), (weights, {}, cache, prompt, params, step)),
        decode=(functools.partial(decode_step, graphdef, treedef), (weights, {}, cache, token, params, step)),
    )
