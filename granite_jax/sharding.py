"""Granite 4.0 over a device mesh (`jax.sharding`): which axis of every parameter and cache array goes over which mesh
axis.

A mesh has up to three named axes: "data" (the batch: the rows of the tokens and of every cache), "model" (tensor
parallelism: attention heads, Mamba heads, FFN, expert and vocabulary columns) and "expert" (the routed experts). A
size-1 axis may be left out. The layout (Megatron-style, Shoeybi et al. 2019) splits a block's first product by
output columns and its second by input rows, so each block ends in one all-reduce:

- attention: q, k, v by heads (rows of (heads * head_dim, H)), o_proj by its input columns; the KV cache by kv head;
- Mamba: in_proj by rows, out_proj by its input columns, the conv, dt_bias, A_log, D and the gated norm's weight by
  channel or head; the SSM state by head, the conv ring by channel. in_proj's rows, transformers' [z | x B C | dt],
  are laid out in one block a device (`MambaMixer.blocks`, `mamba_block_order`): block i holds the z, x and dt rows
  of the device's heads and the B and C rows of the groups they read (Granite's one group is copied into every
  block), so every device runs its heads from its own rows and the mixer needs no collective until the gated norm's
  statistic (one all-reduce of a (b, T, 1) sum) and out_proj's partial sums;
- FFN: the shared MLP's [gate | up] by rows and its output by columns, each expert's likewise over "model" (as
  vLLM's tensor-parallel MoE splits them: every device holds a slice of every expert, so a token's chosen experts are
  read a slice on each device, and every device has the same rows to multiply), and the experts themselves over
  "expert" when the mesh has one;
- the embedding (and the tied head) by vocabulary rows; norms and the router whole.

The arrays are placed with these shardings and XLA's SPMD partitioner (GSPMD) derives the collectives, so every
layout computes the single-device result; the gated norm's statistic over the whole inner width, for one, becomes a
partial sum and an all-reduce. Meshes use Auto axes: the model's code carries no sharding annotations of its own.
Where the partitioner's choice would move weights, the mesh backend at the end of this module (`Runtime.mesh`)
writes the op with `jax.shard_map`: the experts, the embedding lookup, the router's top-k.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from granite_jax.config import ModelConfig
from granite_jax.errors import InputError

AXES = ("data", "model", "expert")
_L = r"layers\.\d+\."
# (NNX parameter path regex, the mesh axis of each dimension: "model", "expert" or None); the first match applies.
PARAMETER_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens\.embedding|lm_head\.weight(_scale)?", ("model", None)),
    (_L + r"self_attn\.[qkv]_proj\.weight", ("model", None)),
    (_L + r"self_attn\.[qkv]_proj\.weight_scale", ("model",)),
    (_L + r"self_attn\.o_proj\.weight", (None, "model")),
    (_L + r"mamba\.in_proj\.weight", ("model", None)),
    (_L + r"mamba\.in_proj\.weight_scale", ("model",)),
    (_L + r"mamba\.out_proj\.weight", (None, "model")),
    (_L + r"mamba\.conv_weight", (None, "model")),
    (_L + r"mamba\.(conv_bias|dt_bias|A_log|D|norm\.weight)", ("model",)),
    (_L + r"shared_mlp\.input_linear\.weight", ("model", None)),
    (_L + r"shared_mlp\.input_linear\.weight_scale", ("model",)),
    (_L + r"shared_mlp\.output_linear\.weight", (None, "model")),
    (_L + r"block_sparse_moe\.input_linear", ("expert", None, "model")),  # (E, H, 2F)
    (_L + r"block_sparse_moe\.input_linear_scale", ("expert", "model")),
    (_L + r"block_sparse_moe\.output_linear", ("expert", "model", None)),  # (E, F, H)
    (_L + r"block_sparse_moe\.output_linear_scale", ("expert", None)),
)


def parse_mesh(text: str, devices: list | None = None) -> Mesh:
    """A mesh from "data=2,model=4" (axes from AXES, each once, sizes >= 1, their product the device count)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, size = part.partition("=")
        if name not in AXES or name in sizes or not size.isdigit() or int(size) < 1:
            raise InputError(
                f"--mesh {text!r}: expected comma-separated AXIS=SIZE with AXIS one of {', '.join(AXES)} (each once) "
                f"and SIZE >= 1, e.g. data=2,model=4; got {part!r}"
            )
        sizes[name] = int(size)
    devices = jax.devices() if devices is None else devices
    if not sizes or math.prod(sizes.values()) != len(devices):
        raise InputError(
            f"--mesh {text!r}: its axes multiply to {math.prod(sizes.values()) if sizes else 0} devices, and there "
            f"are {len(devices)}"
        )
    names = tuple(a for a in AXES if a in sizes)
    shape = tuple(sizes[a] for a in names)
    grid = np.asarray(devices).reshape(shape)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def check_mesh(cfg: ModelConfig, mesh: Mesh) -> None:
    """InputError naming the mesh axis and the sizes when `mesh` does not divide what the layout splits over it."""
    model, expert = _size(mesh, "model"), _size(mesh, "expert")
    splits = [("model", model, "vocabulary", cfg.vocab_size)]
    if "attention" in cfg.layer_types:
        splits += [
            ("model", model, "attention heads", cfg.num_attention_heads),
            ("model", model, "key/value heads", cfg.num_key_value_heads),
        ]
    if cfg.has_mamba:
        splits.append(("model", model, "Mamba heads", cfg.mamba_n_heads))
        g = cfg.mamba_n_groups
        if model and g % model and model % g:
            raise InputError(
                f"mesh axis 'model' of size {model} and the model's {g} Mamba groups: one must divide the other"
            )
    splits.append(("model", model, "shared MLP width", cfg.shared_intermediate_size))
    if cfg.num_local_experts:
        splits.append(("expert", expert, "experts", cfg.num_local_experts))
        splits.append(("model", model, "expert width", cfg.intermediate_size))  # [gate | up] in blocks
    for axis, size, what, count in splits:
        if size and count % size:
            raise InputError(f"mesh axis {axis!r} of size {size} does not divide the model's {count} {what}")


def _size(mesh: Mesh, axis: str) -> int:
    return mesh.shape.get(axis, 0)


def parameter_spec(path: str, ndim: int, mesh: Mesh) -> P:
    """The PartitionSpec of the parameter at NNX path `path` (replicated if no rule names it)."""
    for pattern, axes in PARAMETER_AXES:
        if re.fullmatch(pattern, path):
            assert len(axes) == ndim, (path, axes)
            spec, used = [], set()
            for axis in map(lambda a: _mesh_axis(a, mesh), axes):  # a mesh axis splits one dimension at most
                spec.append(None if axis in used else axis)
                used.add(axis)
            return P(*spec)
    return P()


def _mesh_axis(axis: str | None, mesh: Mesh) -> str | None:
    """The mesh axis a layout axis lands on: none where the mesh lacks it."""
    return axis if axis in mesh.shape else None


def parameter_shardings(flat: dict[str, Any], mesh: Mesh) -> dict[str, NamedSharding]:
    """{NNX path: NamedSharding} for a flat dict of parameters (arrays or shapes)."""
    return {path: NamedSharding(mesh, parameter_spec(path, len(x.shape), mesh)) for path, x in flat.items()}


def cache_shardings(cache: Any, mesh: Mesh) -> Any:
    """The `model.Cache` pytree's shardings: rows over "data"; KV heads, SSM heads and conv channels over "model"."""
    from granite_jax.model import KVState, MambaState

    data, model = _mesh_axis("data", mesh), _mesh_axis("model", mesh)
    named = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    layers = tuple(
        KVState(named(data, model), named(data, model))
        if isinstance(s, KVState)
        else MambaState(named(data, None, model), named(data, model))
        for s in cache.layers
    )
    return type(cache)(layers, named(data), named())


def row_blocks(mesh: Mesh | None) -> int:
    """The Mamba mixers' row blocks over `mesh` (`MambaMixer.blocks`): one a device of its model axis."""
    return 1 if mesh is None else max(_size(mesh, "model"), 1)


def mamba_block_order(cfg: ModelConfig, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """(in_proj rows, conv channels) in `blocks` blocks: the transformers-order index of each row and channel.

    Block i holds the z, x and dt rows of heads [i h/s, (i+1) h/s) and the B and C rows of the groups those heads
    read (head j reads group j g / h): groups split over blocks where they outnumber them, copied otherwise."""
    h, p, g, n, d = (cfg.mamba_n_heads, cfg.mamba_d_head, cfg.mamba_n_groups, cfg.mamba_d_state, cfg.mamba_d_inner)
    hs, gs = h // blocks, max(g // blocks, 1)  # heads and groups a block
    rows, channels = [], []
    for i in range(blocks):
        group = i * hs * g // h  # the first group the block's heads read
        conv = np.concatenate(
            [
                np.arange(i * hs * p, (i + 1) * hs * p),  # x
                d + np.arange(group * n, (group + gs) * n),  # B
                d + g * n + np.arange(group * n, (group + gs) * n),  # C
            ]
        )
        channels.append(conv)
        dt = 2 * d + 2 * g * n + np.arange(i * hs, (i + 1) * hs)
        rows.append(np.concatenate([np.arange(i * hs * p, (i + 1) * hs * p), d + conv, dt]))  # [z | x B C | dt]
    return np.concatenate(rows), np.concatenate(channels)


def gate_up_order(width: int, blocks: int) -> np.ndarray:
    """A fused [gate | up] projection's outputs in `blocks` blocks [gate_i | up_i] (`model.swiglu`)."""
    gate = np.arange(width).reshape(blocks, 1, -1)
    return np.concatenate([gate, gate + width], axis=1).reshape(-1)


_BLOCKED = {  # NNX path -> (the order of `blocks` blocks, given the config, and the axis it indexes)
    r"mamba\.in_proj\.weight(_scale)?": (lambda cfg, s: mamba_block_order(cfg, s)[0], 0),
    r"mamba\.conv_weight": (lambda cfg, s: mamba_block_order(cfg, s)[1], 1),
    r"mamba\.conv_bias": (lambda cfg, s: mamba_block_order(cfg, s)[1], 0),
    r"shared_mlp\.input_linear\.weight(_scale)?": (lambda cfg, s: gate_up_order(cfg.shared_intermediate_size, s), 0),
    r"block_sparse_moe\.input_linear": (lambda cfg, s: gate_up_order(cfg.intermediate_size, s), 2),
    r"block_sparse_moe\.input_linear_scale": (lambda cfg, s: gate_up_order(cfg.intermediate_size, s), 1),
}


def _blocked(path: str, blocks: int) -> tuple[Any, int] | None:
    """(the order of `blocks` blocks given a config, the axis it indexes) of parameter `path`; None if `blocks` blocks
    do not reorder it."""
    if blocks > 1:
        for pattern, found in _BLOCKED.items():
            if re.fullmatch(_L + pattern, path):
                return found
    return None


def relaid(path: str, blocks: int) -> bool:
    """Whether `blocks` blocks reorder parameter `path` (`to_blocks`)."""
    return _blocked(path, blocks) is not None


def transformers_shape(cfg: ModelConfig, blocks: int, path: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """Parameter `path`'s shape in transformers' order, from its `shape` in `blocks` blocks (copied B and C rows
    counted once): what a checkpoint stores."""
    found = _blocked(path, blocks)
    if found is None:
        return tuple(shape)
    order, axis = found
    return tuple(int(order(cfg, blocks).max()) + 1 if i == axis else n for i, n in enumerate(shape))


def relayout_spec(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    """Parameter `path`'s spec as stored, in transformers' order: `parameter_spec`, except that a tensor `to_blocks`
    reorders has the model axis moved off the reordered dimension onto another it divides (None where none), so that
    each device reorders its slice alone and one all-to-all then takes the blocks to their devices (reordering a
    split dimension in place gathers the whole tensor onto every device)."""
    spec = list(parameter_spec(path, len(shape), mesh))
    found, model = _blocked(path, row_blocks(mesh)), _mesh_axis("model", mesh)
    if found is None or model is None or spec[found[1]] != model:
        return P(*spec)
    axis = found[1]
    spec[axis] = None
    free = [i for i, a in enumerate(spec) if a is None and i != axis and shape[i] % mesh.shape[model] == 0]
    if free:
        spec[max(free, key=lambda i: shape[i])] = model
    return P(*spec)


def divides(shape: tuple[int, ...], sharding: NamedSharding) -> bool:
    """Whether `sharding` splits every dimension of `shape` evenly."""
    mesh, spec = sharding.mesh, tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    parts = [math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis or ())) for axis in spec]
    return all(size % n == 0 for size, n in zip(shape, parts))


def to_blocks(cfg: ModelConfig, blocks: int, path: str, x: Any) -> Any:
    """Parameter `path`'s value `x` (transformers' order; a NumPy or JAX array) in the order of `blocks` blocks."""
    found = _blocked(path, blocks)
    return x if found is None else x.take(found[0](cfg, blocks), axis=found[1])


def from_blocks(cfg: ModelConfig, blocks: int, path: str, x: Any) -> Any:
    """`to_blocks`' inverse: each transformers-order row from its first place in the blocks."""
    found = _blocked(path, blocks)
    if found is None:
        return x
    order = found[0](cfg, blocks)
    first = np.full(int(order.max()) + 1, -1)
    first[order[::-1]] = np.arange(len(order))[::-1]  # the last write wins: each index's first place
    return x.take(first, axis=found[1])


def transformers_order(model: Any) -> dict[str, Any]:
    """The model's parameters {NNX path: array} with the Mamba rows in transformers' order (for saving)."""
    return {k: from_blocks(model.cfg, model.row_blocks, k, v[...]) for k, v in _flat_params(model).items()}


def rows_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Arrays whose first axis is the batch (token ids, per-row flags): rows over "data"."""
    return NamedSharding(mesh, P(_mesh_axis("data", mesh), *([None] * (ndim - 1))))


def shard_model(model: Any, mesh: Mesh) -> Any:
    """The model with each parameter placed over `mesh` by its rule, the Mamba rows in the mesh's blocks (a copy of
    each array, in its shards, made one at a time; rows already in those blocks are only placed)."""
    from flax import nnx

    from granite_jax.model import FLOAT8, abstract_model, weight_dtype

    check_mesh(model.cfg, mesh)
    blocks = row_blocks(mesh)
    if model.row_blocks == blocks:
        source, relayout = {k: v[...] for k, v in _flat_params(model).items()}, lambda cfg, blocks, path, x: x
    else:
        source, relayout = transformers_order(model), to_blocks
    stored = weight_dtype(model)  # the parameters' structure: float8 matrices come with scales
    param_dtype = FLOAT8 if stored == "float8" else stored if isinstance(stored, str) else model.dtype
    runtime = model.runtime.replace(mesh=mesh)
    kinds = dict(dtype=model.dtype, param_dtype=param_dtype, runtime=runtime, row_blocks=blocks)
    graphdef, state = nnx.split(abstract_model(model.cfg, **kinds))
    flat = _flat_params(state)
    shardings = parameter_shardings({path: v.get_value() for path, v in flat.items()}, mesh)
    for path, v in flat.items():
        place = functools.partial(relayout, model.cfg, blocks, path)
        v.set_value(jax.jit(place, out_shardings=shardings[path])(source.pop(path)))
    return nnx.merge(graphdef, state)


def _flat_params(tree: Any) -> dict[str, Any]:
    """{"layers.0.mamba.in_proj.weight": its nnx.Param} of a model, or of a model's state."""
    from flax import nnx

    state = tree if isinstance(tree, nnx.State) else nnx.state(tree, nnx.Param)
    return {".".join(map(str, path)): v for path, v in nnx.to_flat_state(state)}


# ---------------------------------------------------------------------------------------------- the mesh backend


def experts_over_mesh(reference, x, experts, w_in, w_out, in_scale, out_scale, *, blocks: int = 1):
    """`model.experts_swiglu` on the devices holding the weights (`jax.shard_map`): each multiplies every token by its
    slice of each of the token's experts (the "model" axis), where it holds that expert (the "expert" axis; the others
    give zeros), and one all-reduce of the (N, k, H) outputs sums the slices and the experts. Left to the partitioner,
    gathering the chosen experts' matrices from their shards all-reduces the gathered weights themselves."""
    mesh = _current_mesh()
    spread, width = _mesh_axis("expert", mesh), _mesh_axis("model", mesh)  # experts, and each expert's columns
    if spread is None and width is None:
        return reference(x, experts, w_in, w_out, in_scale, out_scale, blocks=blocks)
    data = _mesh_axis("data", mesh)
    scale_spec = lambda s, spec: None if s is None else spec  # noqa: E731

    def local(x, experts, w_in, w_out, in_scale, out_scale):
        first = 0 if spread is None else lax.axis_index(spread) * w_in.shape[0]
        mine = (experts >= first) & (experts < first + w_in.shape[0])
        ids = jnp.where(mine, experts - first, 0)
        y = reference(x, ids, w_in, w_out, in_scale, out_scale, blocks=1 if width else blocks)
        return lax.psum(jnp.where(mine[..., None], y, 0).astype(y.dtype), tuple(filter(None, (spread, width))))

    in_specs = (
        P(data, None),
        P(data, None),
        P(spread, None, width),
        P(spread, width, None),
        scale_spec(in_scale, P(spread, width)),
        scale_spec(out_scale, P(spread, None)),
    )
    run = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P(data, None, None), check_vma=False)
    return run(x, experts, w_in, w_out, in_scale, out_scale)


def top_experts_over_mesh(reference, logits, k: int):
    """`model.top_experts` on each device's rows: left to the partitioner, top_k gathers every row's logits over the
    data axis."""
    data = _mesh_axis("data", _current_mesh())
    if data is None:
        return reference(logits, k)
    rows = P(data, None)
    run = jax.shard_map(lambda x: tuple(reference(x, k)), mesh=_current_mesh(), in_specs=rows, out_specs=(rows, rows))
    return run(logits)


def embedding_rows_over_mesh(reference, table, ids):
    """`model.embedding_rows` from a vocabulary-sharded table (Megatron's vocabulary-parallel embedding): each device
    looks up the ids its rows hold, zeros for the others, and one all-reduce sums them. Left to the partitioner, a
    decode step's one-row lookup becomes a dynamic slice, for which XLA's GPU compiler all-gathers the whole table."""
    mesh = _current_mesh()
    vocab, data = _mesh_axis("model", mesh), _mesh_axis("data", mesh)
    if vocab is None:
        return reference(table, ids)

    def local(table, ids):
        first = lax.axis_index(vocab) * table.shape[0]
        mine = (ids >= first) & (ids < first + table.shape[0])
        rows = reference(table, jnp.where(mine, ids - first, 0))
        known = (ids >= 0) & (ids < table.shape[0] * mesh.shape[vocab])  # the others' rows NaN, as one device's
        other = jnp.where(known, 0.0, jnp.nan).astype(rows.dtype)[..., None]
        return lax.psum(jnp.where(mine[..., None], rows, other), vocab)

    ids_spec = P(data, *([None] * (ids.ndim - 1)))
    run = jax.shard_map(
        local, mesh=mesh, in_specs=(P(vocab, None), ids_spec), out_specs=P(*ids_spec, None), check_vma=False
    )
    return run(table, ids)


def _current_mesh() -> Mesh:
    from granite_jax import ops

    return ops.current().mesh


def _register() -> None:
    from granite_jax import model, ops

    ops.register("mesh", model.experts_swiglu, experts_over_mesh)
    ops.register("mesh", model.top_experts, top_experts_over_mesh)
    ops.register("mesh", model.embedding_rows, embedding_rows_over_mesh)


_register()
