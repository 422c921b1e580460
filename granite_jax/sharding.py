"""Granite 4.0 over a device mesh (`jax.sharding`): which axis of every parameter and cache array goes over which mesh
axis.

A mesh has up to three named axes: "data" (the batch: the rows of the tokens and of every cache), "model" (tensor
parallelism: attention heads, Mamba heads, FFN and vocabulary columns) and "expert" (the routed experts; without it
they go over "model"). A size-1 axis may be left out. The layout (Megatron-style, Shoeybi et al. 2019) splits a
block's first product by output columns and its second by input rows, so each block ends in one all-reduce:

- attention: q, k, v by heads (rows of (heads * head_dim, H)), o_proj by its input columns; the KV cache by kv head;
- Mamba: in_proj by rows, out_proj by its input columns, the conv, dt_bias, A_log, D and the gated norm's weight by
  channel or head; the SSM state by head, the conv ring by channel. in_proj's rows are [z | x B C | dt]: split in
  contiguous blocks they do not fall on head boundaries, so XLA gathers its output before the mixer (a head-aligned
  row order is the next step);
- FFN: the shared MLP's [gate | up] by rows and its output by columns; the experts by expert over "expert", and each
  expert's columns (then rows) over "model"; without an "expert" axis, the experts over "model";
- the embedding (and the tied head) by vocabulary rows; norms and the router whole.

The arrays are placed with these shardings and XLA's SPMD partitioner (GSPMD) derives the collectives, so every
layout computes the single-device result; the gated norm's statistic over the whole inner width, for one, becomes a
partial sum and an all-reduce. Meshes use Auto axes: the model's code carries no sharding annotations of its own.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import numpy as np
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
    model, expert = _size(mesh, "model"), _size(mesh, "expert") or _size(mesh, "model")
    splits = [("model", model, "vocabulary", cfg.vocab_size)]
    if "attention" in cfg.layer_types:
        splits += [
            ("model", model, "attention heads", cfg.num_attention_heads),
            ("model", model, "key/value heads", cfg.num_key_value_heads),
        ]
    if cfg.has_mamba:
        splits += [
            ("model", model, "Mamba heads", cfg.mamba_n_heads),
            ("model", model, "conv channels", cfg.mamba_conv_dim),
        ]
    splits.append(("model", model, "shared MLP width", cfg.shared_intermediate_size))
    if cfg.num_local_experts:
        splits.append(("expert" if _size(mesh, "expert") else "model", expert, "experts", cfg.num_local_experts))
        if _size(mesh, "expert"):
            splits.append(("model", model, "expert width", cfg.intermediate_size))
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
    """The mesh axis a layout axis lands on: "expert" falls back to "model"; an axis the mesh lacks, to none."""
    if axis == "expert" and "expert" not in mesh.shape:
        axis = "model"
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


def rows_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Arrays whose first axis is the batch (token ids, per-row flags): rows over "data"."""
    return NamedSharding(mesh, P(_mesh_axis("data", mesh), *([None] * (ndim - 1))))


def shard_model(model: Any, mesh: Mesh) -> Any:
    """The model with each parameter placed over `mesh` by its rule (a copy of each array, in its shards)."""
    from flax import nnx

    check_mesh(model.cfg, mesh)
    graphdef, state = nnx.split(model)
    flat = {".".join(map(str, path)): v for path, v in nnx.to_flat_state(state)}
    shardings = parameter_shardings({path: v[...] for path, v in flat.items()}, mesh)
    for path, v in flat.items():
        v.set_value(jax.device_put(v[...], shardings[path]))
    return nnx.merge(graphdef, state)
